"""--kv-format (and its older spelling --kv-bits) / --kv-budget / --kv-policy on `generate` and `passkey`."""

import json

import pytest

from gptoss_lite.cli import main

PROMPT = "abcabcabcabc the cat sat on the mat. abcabcabcabc the cat sat on the"


def _generate_json(capsys, *extra):
    argv = ["generate", PROMPT, "--model", "lite-tiny", "--max-new-tokens", "12", "--temperature", "0", "--json"]
    assert main([*argv, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_kv_formats_report_fewer_bytes(capsys):
    """--kv-format int8 and int4 generate, label their setting, and hold fewer payload bytes than dense
    once tokens have left the residual window (a long prompt); --kv-bits 4 is int4 by its older name."""
    long_prompt = PROMPT * 4
    out = {}
    for bits, flags in (("16", ["--kv-format", "dense"]), ("8", ["--kv-format", "int8"]), ("4", ["--kv-bits", "4"])):
        argv = ["generate", long_prompt, "--model", "lite-tiny", "--max-new-tokens", "4", "--temperature", "0"]
        assert main([*argv, "--json", *flags]) == 0
        out[bits] = json.loads(capsys.readouterr().out)
    assert [out[b]["kv_setting"] for b in ("16", "8", "4")] == ["16-bit", "int8", "int4"]
    assert out["16"]["kv_payload_bytes"] > out["8"]["kv_payload_bytes"] > out["4"]["kv_payload_bytes"]


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_generate_budget_covering_the_prompt_equals_plain(capsys, policy):
    """A --kv-budget larger than prompt + new tokens changes nothing in the text."""
    plain = _generate_json(capsys)
    evict = _generate_json(capsys, "--kv-budget", "512", "--kv-policy", policy)
    assert evict["text"] == plain["text"] and evict["kv_setting"] == f"{policy}@512"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--kv-format", "int8", "--kv-budget", "64"], "give one of them"),
        (["--kv-budget", "64", "--speculate", "lookup"], "cannot be combined"),
        (["--kv-policy", "h2o"], "need --kv-budget"),
        (["--kv-budget", "4", "--kv-sinks", "4"], "sink_tokens=4"),
    ],
)
def test_bad_kv_flags_are_refused_before_the_model_loads(capsys, extra, match):
    """Contradictory --kv-* flags are a one-line error, exit 2, before the (nonexistent) model is loaded."""
    assert main(["generate", PROMPT, "--model", "/nonexistent", *extra]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and match in err and "/nonexistent" not in err


def test_passkey_accepts_kv_flags(capsys):
    """passkey runs under --kv-bits 4 and under a streaming budget and prints its table."""
    for extra in (["--kv-format", "int4"], ["--kv-budget", "32"]):
        argv = ["passkey", "--model", "lite-tiny", "--lengths", "128", "--trials", "1", "--no-progress", "--json"]
        assert main([*argv, *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["lengths"] == [128]
