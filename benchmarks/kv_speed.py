"""What does each KV setting cost in time? Decode and prefill through the engine, settings interleaved.

For every round, every setting runs the same workload on a fresh `LLM` (the shipped model unless
`--model`): `--requests` prompts of `--prompt-len` random tokens, all submitted at once, each
generating `--new-tokens` tokens greedily. Reported per setting, median over rounds: the median
inter-token latency of the decode steps (ms), the prefill throughput (prompt tokens / time to the last
first token) and the ratio of both to the 16-bit engine measured in the same round.

    python benchmarks/kv_speed.py --settings 16 8 4 window@1024 --rounds 3

Settings: 16, 8, 4 (`kv_format` dense, int8, int4), window@N (`full_window=N`, prefix caching off).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from gptoss_lite.checkpoint import default_model_source, load_model
from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.engine.request import percentile
from gptoss_lite.kvspec import kv_format


def engine_kwargs(setting: str) -> dict:
    if setting.startswith("window@"):
        return {"full_window": int(setting.split("@", 1)[1]), "enable_prefix_caching": False}
    return {"kv_format": kv_format(int(setting))}


def run_once(model, setting: str, prompts: list[list[int]], new_tokens: int) -> dict:
    llm = LLM(model, **engine_kwargs(setting))
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    t0 = time.monotonic()
    outs = llm.generate(prompts, params)
    wall = time.monotonic() - t0
    itl = [x for o in outs for x in o.metrics.itl]
    last_first = max(o.metrics.first_token_time for o in outs) - min(o.metrics.arrival_time for o in outs)
    return {
        "itl_p50_ms": 1000 * percentile(itl, 50),
        "prefill_tok_s": sum(len(p) for p in prompts) / last_first,
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory or preset (default: the shipped model)")
    ap.add_argument("--settings", nargs="+", default=["16", "8", "4", "window@1024"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for s in args.settings:
        engine_kwargs(s)  # fail before loading
    torch.set_num_threads(args.threads)
    model = load_model(args.model or default_model_source())
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    runs: dict[str, list[dict]] = {s: [] for s in args.settings}
    for r in range(args.rounds):
        for s in args.settings:
            runs[s].append(run_once(model, s, prompts, args.new_tokens))
            print(f"round {r + 1}/{args.rounds} {s:>12}: {runs[s][-1]}", flush=True)
    base = args.settings[0]
    summary = {}
    for s in args.settings:
        summary[s] = {
            key: statistics.median(run[key] for run in runs[s]) for key in ("itl_p50_ms", "prefill_tok_s", "wall_s")
        }
        summary[s]["itl_vs_first"] = statistics.median(
            a["itl_p50_ms"] / b["itl_p50_ms"] for a, b in zip(runs[s], runs[base])
        )
        summary[s]["prefill_vs_first"] = statistics.median(
            a["prefill_tok_s"] / b["prefill_tok_s"] for a, b in zip(runs[s], runs[base])
        )
    meta = {k: getattr(args, k) for k in ("requests", "prompt_len", "new_tokens", "rounds", "threads")}
    if args.json:
        print(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=2))
        return 0
    print(
        f"{args.requests} requests x {args.prompt_len} prompt tokens x {args.new_tokens} new, "
        f"{args.threads} thread(s), median of {args.rounds} interleaved rounds"
    )
    print(f"{'setting':>12}  {'decode ITL p50 ms':>18}  {'vs ' + base:>8}  {'prefill tok/s':>14}  {'vs ' + base:>8}")
    for s, row in summary.items():
        print(
            f"{s:>12}  {row['itl_p50_ms']:18.2f}  {row['itl_vs_first']:7.2f}x  "
            f"{row['prefill_tok_s']:14,.0f}  {row['prefill_vs_first']:7.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
