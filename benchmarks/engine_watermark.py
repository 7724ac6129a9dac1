"""The admission watermark (decode_reserve) on a workload that preempts: fewer preemptions, no slower?

32 requests of 32–128 prompt tokens and --max-tokens new tokens each (1,024 by default), all at once,
on a pool that holds about --residents requests at their full length (8), lite-tiny, greedy. Two
engines, alternating rounds: decode_reserve 0 (admission on prompts alone) and --reserve (256). Each
round reports the wall time and the preemptions; the summary gives the medians and their ratios, and
checks that both engines generated the same tokens.

    python benchmarks/engine_watermark.py --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import warnings

import torch

from gptoss_lite.checkpoint import load_model
from gptoss_lite.engine import LLM, SamplingParams


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--residents", type=int, default=8)
    ap.add_argument("--reserve", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*RANDOM weights.*")
    model = load_model("lite-tiny")
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(32, 128))] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    bs = 16
    blocks = args.residents * -(-(128 + args.max_tokens) // bs)
    runs: dict[int, list[tuple[float, int]]] = {0: [], args.reserve: []}
    tokens: dict[int, list[list[int]]] = {}
    for r in range(args.rounds):
        for reserve in runs:
            llm = LLM(model, kv_blocks=blocks, block_size=bs, max_running=args.requests, max_batch_tokens=256,
                      decode_reserve=reserve, compile_decode=False)  # fmt: skip
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - t0
            runs[reserve].append((seconds, llm.stats().preemptions))
            tokens[reserve] = [o.token_ids for o in outs]
            print(f"  round {r + 1} reserve {reserve:5d}: {seconds:6.2f} s, {runs[reserve][-1][1]} preemptions",
                  file=sys.stderr)  # fmt: skip
    same = tokens[0] == tokens[args.reserve]
    summary = {
        reserve: {
            "wall_s": round(statistics.median(s for s, _ in rs), 2),
            "preemptions": statistics.median(p for _, p in rs),
        }
        for reserve, rs in runs.items()
    }
    base, watermark = summary[0], summary[args.reserve]
    result = {
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "kv_blocks": blocks,
        "threads": args.threads,
        "runs": {str(k): v for k, v in runs.items()},
        "summary": {str(k): v for k, v in summary.items()},
        "time_ratio": round(watermark["wall_s"] / base["wall_s"], 3),
        "preemption_ratio": round(base["preemptions"] / max(watermark["preemptions"], 1), 2),
        "same_tokens": same,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    setup = f"lite-tiny, {args.threads} thread(s), median of {args.rounds}"
    print(f"{args.requests} requests x {args.max_tokens} new tokens, {blocks} blocks of {bs} (about "
          f"{args.residents} at full length), {setup}")  # fmt: skip
    for reserve, s in summary.items():
        print(f"  decode_reserve {reserve:5d}: {s['wall_s']:7.2f} s, {s['preemptions']:5.0f} preemptions")
    print(f"  watermark / none: {result['time_ratio']:.2f}x the time, {result['preemption_ratio']:.1f}x fewer "
          f"preemptions, same tokens: {same}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
