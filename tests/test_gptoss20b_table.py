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


def test_decode_shares_use_the_read_rate_measured_around_each_decode():
    bench = _bench()
    result = bench.load_results(SITTING)
    assert bench.decode_efficiency(result, "ours-engine", 512) == []  # this sitting had no probes
    assert "over the read rate around it" not in bench.table(result)
    for i, s in enumerate(result["samples"]):  # probes as a later sitting records them
        s["cells"][512]["read_gb_s_around_decode"] = [40.0 + i, 44.0 + i]
    b = result["decode_bytes"][512]["total"]
    by_round = {(s["round"], s["engine"]): (i, s["cells"][512]) for i, s in enumerate(result["samples"])}
    ours, llama = (bench.decode_efficiency(result, e, 512) for e in ("ours-engine", "llama.cpp"))
    for r in range(5):
        i, cell = by_round[(r, "ours-engine")]
        assert ours[r] == cell["decode_tok_s"] * b / 1e9 / (42.0 + i)
    text = bench.table(result)
    relative = [a / c for a, c in zip(ours, llama)]
    assert f"ours-engine / llama.cpp of those shares, per round: {', '.join(f'{x:.2f}' for x in relative)}" in text
    assert f"(median {statistics.median(relative):.2f})" in text
