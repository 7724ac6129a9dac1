"""`gptoss-lite bench-serve`: a small workload's report, the sequential ratio and the head-of-line run."""

from __future__ import annotations

import json

import pytest

from gptoss_lite.cli import main


def run_json(capsys, *argv: str, compile_decode: bool = False) -> dict:
    """bench-serve's report; eager unless `compile_decode` (compiling is the subject of one test only,
    and costs each run tens of seconds on an empty inductor cache)."""
    flags = [] if compile_decode else ["--no-compile"]
    assert main(["bench-serve", "--model", "lite-tiny", "--threads", "1", "--json", *flags, *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_workload_report_counts_what_ran(capsys):
    # one request at a time, so every later prompt finds the shared 32 tokens (2 blocks) cached
    out = run_json(
        capsys,
        "--requests",
        "6",
        "--prompt-len",
        "8:40",
        "--max-tokens",
        "4",
        "--shared-prefix",
        "32",
        "--max-running",
        "1",
    )
    engine = out["engine"]
    assert engine["requests"] == 6 and engine["generated_tok_s"] > 0
    assert engine["steps"] >= 4  # at least max_tokens steps
    assert engine["prefix_hit_rate"] > 0.3
    assert 0 < engine["kv_blocks_peak"] <= engine["kv_blocks_total"]
    assert engine["ttft_p50_ms"] <= engine["ttft_p99_ms"]
    assert out["planner"]["max_resident_requests"] > 0


def test_sequential_ratio(capsys):
    out = run_json(capsys, "--requests", "4", "--prompt-len", "8", "--max-tokens", "3", "--sequential")
    assert out["sequential"]["generated_tok_s"] > 0
    ratio = out["engine"]["generated_tok_s"] / out["sequential"]["generated_tok_s"]
    assert out["speedup_vs_sequential"] == pytest.approx(ratio, rel=0.02)


def test_head_of_line_run(capsys):
    out = run_json(capsys, "--long-prompt", "300", "--decoders", "2", "--max-batch-tokens", "64")
    assert out["chunks"] >= 300 // 64
    assert out["chunk_prefill_ms_max"] > 0 and "itl_p99_rise_ms" in out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--prompt-len", "0:4"], "LO <= HI"),
        (["--prompt-len", "a"], "expected N or LO:HI"),
        (["--rate", "0"], "--rate"),
    ],
)
def test_bad_flags(capsys, argv, match):
    with pytest.raises(SystemExit) if argv[0] == "--prompt-len" else pytest.raises(AssertionError):
        run_json(capsys, *argv)
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,expect",
    [
        (["--kv-format", "int8"], ("int8", None)),
        (["--kv-bits", "4"], ("int4", None)),
        (["--full-window", "40", "--no-prefix-caching"], ("dense", 40)),
    ],
)
def test_kv_flags_reach_the_engine(capsys, flags, expect):
    out = run_json(capsys, "--requests", "3", "--prompt-len", "8:60", "--max-tokens", "4", *flags)
    assert (out["kv_format"], out["full_window"]) == expect
    assert out["engine"]["requests"] == 3


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--full-window", "64"], "--no-prefix-caching"),
        (["--full-window", "64", "--no-prefix-caching", "--kv-format", "int4"], "give one of them"),
        (["--full-window", "0", "--no-prefix-caching"], "--full-window"),
        (["--kv-bits", "3"], "invalid choice"),
        (["--kv-format", "fp7"], "invalid choice"),
    ],
)
def test_bad_kv_flags_are_refused_before_loading(capsys, flags, message):
    try:
        code = main(["bench-serve", "--model", "/nonexistent/model", *flags])
    except SystemExit as exc:  # argparse's own checks
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_decode_is_compiled_by_default_and_no_compile_keeps_eager(capsys):
    """The report carries the compile time of the engine's decode step; --no-compile compiles nothing.
    The seeded workload is scheduled the same way on both paths."""
    compiled = run_json(capsys, "--requests", "3", "--prompt-len", "8:40", "--max-tokens", "6", compile_decode=True)
    eager = run_json(capsys, "--requests", "3", "--prompt-len", "8:40", "--max-tokens", "6")
    assert compiled["compile_decode"] and compiled["compile_s"] > 0
    assert not eager["compile_decode"] and eager["compile_s"] is None
    assert compiled["engine"]["steps"] == eager["engine"]["steps"]


@pytest.mark.parametrize("mode,label", [("lookup", "lookup k=3"), ("draft:lite-tiny", "draft model lite-tiny k=3")])
def test_engine_speculation_flags(capsys, mode, label):
    """--speculate lookup and --speculate draft:PATH run the engine's speculation and report it."""
    out = run_json(
        capsys,
        "--requests",
        "3",
        "--prompt-len",
        "8:24",
        "--max-tokens",
        "12",
        "--speculate",
        mode,
        "--draft-tokens",
        "3",
    )
    assert out["speculate"] == label
    spec = out["speculation"]
    assert spec["drafted"] >= spec["accepted"] >= 0 and 0 <= spec["acceptance_rate"] <= 1


def test_engine_draft_model_of_another_vocabulary_is_an_error(capsys):
    code = main(["bench-serve", "--model", "lite-tiny", "--requests", "1", "--speculate", "draft:gpt-oss-bench-20m"])
    assert code != 0
    assert "vocab_size" in capsys.readouterr().err
