"""benchmarks/bench_vs_peers.py's llama.cpp builds: engines `llama:NAME[+fa]` name a `--llama-builds` build
and its mode, and anything else is refused before a worker starts."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _module():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_vs_peers", BENCH / "bench_vs_peers.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_llama_engines_run_their_build_in_their_mode(tmp_path):
    bench = _module()
    native, avx2, gguf = (tmp_path / n for n in ("native-python", "avx2-python", "m.gguf"))
    for f in (native, avx2, gguf):
        f.write_text("")
    args = argparse.Namespace(
        llama_builds=bench.builds_map([f"native={native}", f"avx2={avx2}"]),
        llama_python=None,
        llama_flash_attn=False,
        llama_gguf={"float32": str(gguf)},
        lengths=[256, 2048],
        new_tokens=128,
    )
    cmd, _ = bench.llama_command(args, "llama:avx2+fa", "float32", 2)
    assert cmd[0] == str(avx2) and cmd[-1] == "--flash-attn" and "--threads" in cmd
    cmd, _ = bench.llama_command(args, "llama:native", "float32", 2)
    assert cmd[0] == str(native) and "--flash-attn" not in cmd
    assert bench.label("llama:avx2+fa") == "llama.cpp (avx2, flash-attn)"
    assert bench.label("llama:native") == "llama.cpp (native)" and bench.label("compiled") == bench.NAMES["compiled"]
    assert bench.is_peer("llama:avx2") and bench.is_peer("vllm") and not bench.is_peer("compiled")
    assert not bench.is_peer("ours-compiled") and "ours-compiled" in bench.OURS


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--engines", "compiled", "llama:avx2"], "llama:NAME[+fa] of --llama-builds"),
        (["--engines", "compiled", "fast"], "engine 'fast'"),
        (["--engines", "compiled", "--llama-builds", "avx2"], "expected NAME=PYTHON"),
    ],
)
def test_unknown_engines_and_builds_are_refused(tmp_path, capsys, argv, said):
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    with pytest.raises(SystemExit) as stop:
        _module().main([str(tmp_path), *argv])
    assert said in (str(stop.value.code) + capsys.readouterr().err)
