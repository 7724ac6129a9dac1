"""The engine's batched throughput by KV format and decode path, interleaved in one sitting.

    python benchmarks/engine_decode.py MODEL_DIR --dtype float32 --threads 2 --rounds 3 \\
        --out benchmarks/results/engine_decode.json

Workload: the batch of `serve_vs_vllm.py` (16 requests of 256 random prompt tokens, 128 new tokens
each, greedy, EOS ignored, all submitted at once; prompt i is
`numpy.random.default_rng(10_000 + i).integers(1, V, 256)`), through `gptoss_lite.engine.LLM` with
max_running 16, max_batch_tokens 2048 and prefix caching off, for each configuration:

- `16-bit eager`: the model's dtype in the blocks, every step eager;
- `16-bit compiled`: all-decode steps compiled (`LLM(compile_decode=True)`);
- `16-bit compiled, dynamo each step`: the same, every step through dynamo's frame (the decoder's
  `replay` off: no step runs the graph the step before ran straight, `model/compiled_decode.py`);
- `int8 eager`, `int4 eager`: full-layer blocks as int8 / int4 codes, every step eager;
- `int8 compiled`, `int4 compiled`, `fp8 compiled`: those codes with all-decode steps compiled (the
  block kernel reads the codes in place).

Every engine is built once (compile and warm-up batch untimed); then each round runs every
configuration once, in an order that alternates between rounds. Figure: generated tok/s = 16 · 128 /
wall seconds of one `generate` call (prefill included); the table gives the median of the rounds and
each configuration's ratio to `16-bit eager` and to `16-bit compiled`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

CONFIGS = {
    "16-bit eager": {"kv_format": "dense", "compile_decode": False},
    "16-bit compiled": {"kv_format": "dense", "compile_decode": True},
    "16-bit compiled, dynamo each step": {"kv_format": "dense", "compile_decode": True, "replay": False},
    "int8 eager": {"kv_format": "int8", "compile_decode": False},
    "int8 compiled": {"kv_format": "int8", "compile_decode": True},
    "int4 eager": {"kv_format": "int4", "compile_decode": False},
    "int4 compiled": {"kv_format": "int4", "compile_decode": True},
    "fp8 compiled": {"kv_format": "fp8", "compile_decode": True},
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model directory (HF gpt-oss or native layout)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", type=Path, default=None, help="write every sample as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from gptoss_lite.engine import LLM, SamplingParams

    engines = {}
    for name in args.configs:
        t0 = time.perf_counter()
        options = dict(CONFIGS[name])
        replay = options.pop("replay", True)
        engines[name] = LLM(
            args.model,
            dtype=getattr(torch, args.dtype),
            max_batch_tokens=2048,
            max_running=16,
            max_model_len=384,
            enable_prefix_caching=False,
            **options,
        )
        if not replay:
            engines[name].runner.decoder.replay = False
        print(f"[engine_decode] {name}: built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    vocab = next(iter(engines.values())).config.vocab_size
    prompts = [np.random.default_rng(10_000 + i).integers(1, vocab, 256).tolist() for i in range(16)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for llm in engines.values():  # warm-up batch, untimed
        llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    samples: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            t0 = time.perf_counter()
            outs = engines[name].generate(prompts, params)
            wall = time.perf_counter() - t0
            samples[name].append(16 * 128 / wall)
            tokens.setdefault(name, [list(o.token_ids) for o in outs])
        print(
            f"[engine_decode] round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {samples[n][-1]:.0f}" for n in order)
            + " tok/s",
            file=sys.stderr,
        )
    med = {name: statistics.median(v) for name, v in samples.items()}
    print(f"# Engine throughput by KV format, {args.dtype}, {args.threads} threads, median of {args.rounds} rounds\n")
    print("| configuration | tok/s | / 16-bit eager | / 16-bit compiled | rounds |")
    print("|---|---:|---:|---:|---|")
    for name, value in med.items():
        eager = value / med["16-bit eager"] if "16-bit eager" in med else float("nan")
        compiled = value / med["16-bit compiled"] if "16-bit compiled" in med else float("nan")
        rounds = " / ".join(f"{v:.0f}" for v in samples[name])
        print(f"| {name} | {value:,.0f} | {eager:.2f} | {compiled:.2f} | {rounds} |")
    if args.out is not None:
        info = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "rounds": args.rounds}
        compile_s = {name: llm.compile_seconds for name, llm in engines.items()}
        data = {**info, "samples": samples, "median": med, "compile_s": compile_s, "tokens": tokens}
        args.out.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
