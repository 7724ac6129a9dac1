"""The engine's batch against its step budget (`max_batch_tokens`), in one process.

    python benchmarks/engine_step_budget.py MODEL_DIR --dtype float32 --rounds 5 --budgets 512 1024 2048

One model (compiled decode step), one engine per budget (`LLM`, prefix caching off), the batch-16 cell
of the peers harness: 16 random 256-token prompts (`numpy.random.default_rng(1)`), 128 new tokens each,
greedy, EOS ignored. The engines take turns, the order reversed every other round; generated tokens over
wall time, medians over rounds, and every engine's tokens checked equal to the first's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model directory (HF gpt-oss or native layout)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--out", type=Path, default=None, help="write every sample as JSON")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from gptoss_lite.checkpoint import load_model
    from gptoss_lite.engine import LLM, SamplingParams

    model = load_model(args.model, dtype=getattr(torch, args.dtype))
    model.prepare_for_inference(compile_decode=True)
    engines = {n: LLM(model, enable_prefix_caching=False, max_batch_tokens=n) for n in args.budgets}
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.config.vocab_size, 256).tolist() for _ in range(16)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    tokens = {n: [o.token_ids for o in llm.generate(prompts, params)] for n, llm in engines.items()}  # warm-up
    first = tokens[args.budgets[0]]
    same = {n: sum(a == b for a, b in zip(t, first)) for n, t in tokens.items()}
    samples: dict[int, list[float]] = {n: [] for n in engines}
    for r in range(args.rounds):
        order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
        for n, llm in order:
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            samples[n].append(16 * 128 / (time.perf_counter() - t0))
        print(f"round {r + 1}: " + ", ".join(f"{n}: {samples[n][-1]:,.0f}" for n in engines), file=sys.stderr)
    base = args.budgets[0]
    print(f"# Engine batch-16 by step budget, {args.dtype}, {args.threads} threads, {args.rounds} rounds\n")
    print(f"| max_batch_tokens | gen tok/s (median) | / {base} (median of rounds) | same tokens as {base} |")
    print("|---:|---:|---:|---:|")
    for n in engines:
        ratio = statistics.median(a / b for a, b in zip(samples[n], samples[base]))
        print(f"| {n} | {statistics.median(samples[n]):,.0f} | {ratio:.2f} | {same[n]}/16 |")
    if args.out:
        args.out.write_text(json.dumps({"dtype": args.dtype, "rounds": args.rounds, "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
