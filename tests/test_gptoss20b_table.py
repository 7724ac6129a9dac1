"""benchmarks/gptoss20b_cpu.py's summary, from a results file of a real sitting (no model, no run):
the medians over rounds, and each round's ratio to llama.cpp with their median."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SITTING = REPO / "benchmarks" / "results" / "gptoss20b_cpu_512_zen5_s5.json"


def _bench():
    spec = importlib.util.spec_from_file_location("gptoss20b_cpu", REPO / "benchmarks" / "gptoss20b_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_per_round_ratios_pair_each_round_with_llama_cpp():
    bench = _bench()
    result = bench.load_results(SITTING)
    samples = {(s["round"], s["engine"]): s["cells"][512]["decode_tok_s"] for s in result["samples"]}
    ratios = bench.per_round_ratios(result, "ours-engine", "decode_tok_s", 512)
    assert len(ratios) == result["rounds"] == 5
    assert ratios == [samples[(r, "ours-engine")] / samples[(r, "llama.cpp")] for r in range(5)]
    text = bench.table(result)
    assert f"decode at 512, ours-engine / llama.cpp per round: {', '.join(f'{x:.2f}' for x in ratios)}" in text
    assert f"(median {statistics.median(ratios):.2f})" in text
    # the table's first rows: medians over rounds, then their ratio
    engine, llama = (statistics.median(samples[(r, e)] for r in range(5)) for e in ("ours-engine", "llama.cpp"))
    assert f"{engine:.2f} | {llama:.2f} |" in text and f"{engine / llama:.2f}× |" in text
