"""The batched engine with and without the grouped-expert kernel (`kernels/moe.c`), in one process.

Two engines over two copies of the same checkpoint, both with the compiled decode step: in one the
routed experts of a batched step go to `gptoss_lite::moe_experts` (the default where it is built), in
the other to the step's gathered reduction (one read of each selected expert per row). They take
turns (A B, B A, ...) on the peers' batch cell: 16 requests × 256-token prompts × 128 new tokens,
greedy. Printed: generated tok/s of every run, the medians, the per-round ratio kernel / reduction,
and how many requests got the same tokens from both.

    PYTHONPATH=src python benchmarks/engine_grouped_experts.py MODEL_DIR --dtype float32 --rounds 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from gptoss_lite.checkpoint import load_model
from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.model import moe


class _Reduction(moe.Experts):
    """Experts whose weighted sum is always the reduction (what the step did before the kernel)."""

    def weighted_sum(self, h, top_idx, weights):
        return (self.decode_step(h, top_idx) * weights[..., None]).sum(dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--json", help="write the samples here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    engines = {}
    for name in ("kernel", "reduction"):
        model = load_model(args.model, dtype=dtype)
        if name == "reduction":
            for module in model.modules():
                if type(module) is moe.Experts:
                    module.__class__ = _Reduction
        model.prepare_for_inference(compile_decode=True)
        engines[name] = LLM(model, enable_prefix_caching=False)
    vocab = model.config.vocab_size
    prompts = [
        [int(t) for t in np.random.default_rng(10_000 + i).integers(1, vocab, 256)] for i in range(args.requests)
    ]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    for llm in engines.values():  # warm-up: compiles (or loads) both steps
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    samples: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {}
    for r in range(args.rounds):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            t0 = time.perf_counter()
            outs = engines[name].generate(prompts, params)
            samples[name].append(args.requests * 128 / (time.perf_counter() - t0))
            tokens[name] = [o.token_ids for o in outs]
    ratios = [a / b for a, b in zip(samples["kernel"], samples["reduction"])]
    same = sum(a == b for a, b in zip(tokens["kernel"], tokens["reduction"]))
    print(f"{args.dtype}, {args.threads} threads, {args.rounds} rounds; generated tok/s per run:")
    for name, values in samples.items():
        print(f"  {name:9s} {' '.join(f'{v:6.0f}' for v in values)}   median {statistics.median(values):6.0f}")
    print(f"kernel / reduction per round: median {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}); same tokens for {same}/{args.requests} requests")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "threads": args.threads, "samples": samples, "ratios": ratios,
                       "same_tokens": same}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
