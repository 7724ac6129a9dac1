"""--speculate / --draft-tokens on `generate` and `passkey`."""

import json

import pytest

from gptoss_lite.cli import main

PROMPT = "abcabcabcabc the cat sat. abcabcabcabc the cat"


def _generate_json(capsys, *extra):
    assert (
        main(
            [
                "generate",
                PROMPT,
                "--model",
                "lite-tiny",
                "--max-new-tokens",
                "24",
                "--temperature",
                "0",
                "--json",
                *extra,
            ]
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("mode", ["lookup", "draft:lite-tiny"])
def test_generate_speculative_text_equals_plain_and_reports_acceptance(mode, capsys):
    """Greedy text with --speculate equals plain greedy; the JSON carries acceptance and tokens/forward."""
    plain = _generate_json(capsys)
    spec = _generate_json(capsys, "--speculate", mode, "--draft-tokens", "3")
    assert spec["text"] == plain["text"] and plain["speculation"] is None
    s = spec["speculation"]
    assert s["mode"] == mode and s["draft_tokens"] == 3 and s["new_tokens"] == 24
    assert 0.0 <= s["acceptance_rate"] <= 1.0 and s["tokens_per_forward"] >= 1.0


def test_generate_stats_prints_the_speculation_line(capsys):
    """--stats adds one line with the acceptance rate and tokens per target forward."""
    assert (
        main(
            [
                "generate",
                PROMPT,
                "--model",
                "lite-tiny",
                "--max-new-tokens",
                "8",
                "--temperature",
                "0",
                "--stats",
                "--speculate",
                "lookup",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "speculation: " in err and "tokens per target forward" in err and "--draft-tokens 8" in err


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--speculate", "magic"], "use none, lookup or draft:PATH"),
        (["--speculate", "draft:"], "use none, lookup or draft:PATH"),
        (["--speculate", "lookup", "--draft-tokens", "0"], "--draft-tokens 0: must be >= 1"),
        (["--draft-tokens", "4"], "--draft-tokens needs --speculate"),
    ],
)
def test_bad_speculation_flags_exit_2(extra, match, capsys):
    """Bad --speculate / --draft-tokens values exit 2 with one clear error line."""
    assert main(["generate", "x", "--model", "lite-tiny", *extra]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and match in err


def test_passkey_speculative_json_has_the_same_accuracy_and_the_counters(capsys):
    """`passkey --speculate lookup --json`: same accuracy as plain, plus the speculation counters."""
    base = [
        "passkey",
        "--model",
        "lite-tiny",
        "--lengths",
        "300",
        "--depths",
        "0.5",
        "--trials",
        "2",
        "--json",
        "--no-progress",
    ]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--speculate", "lookup", "--draft-tokens", "4"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["accuracy"] == plain["accuracy"] and plain["speculation"] is None
    assert spec["speculation"]["new_tokens"] > 0 and "acceptance_rate" in spec["speculation"]
    assert main(base[:-2] + ["--no-progress", "--speculate", "lookup"]) == 0
    assert "tokens per target forward" in capsys.readouterr().out
