"""Decode speed of a preset at one context length beside the memory-bandwidth roofline of this machine.

    python benchmarks/decode_roofline.py --preset gptoss-lite-502m --dtype bfloat16 --context 2048 \\
        --threads 2 --out benchmarks/results/decode_roofline_502m_bf16.json

A decode step of batch 1 must read every active weight once (attention, the router, the top-k routed
experts and the shared experts of every layer, the output head; `plan.presets.weights_from_model_config`)
and the keys and values it attends to (the whole context on global layers, one window on sliding
layers). The roofline is those bytes divided by the memory bandwidth measured here, in the same
process and thread count: the best of several `sum()` passes over a tensor far larger than the caches
(read bandwidth, what a decode step needs), beside numpy's copy bandwidth (read + write, the planner's
figure); the same sum over the weights' dtype is reported beside it. The step is timed eager
(`GPTOSS.forward` through the mixed cache) and compiled (`prepare_for_inference(compile_decode=True)`);
the compile time is reported apart. Weights are random (a preset), which changes no timing: the router
still selects top_k experts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from gptoss_lite.checkpoint import load_model
from gptoss_lite.kv.mixed import MixedKVCache
from gptoss_lite.plan.presets import geometry_from_model_config, measure_this_machine, weights_from_model_config


def read_bandwidth(dtype: torch.dtype = torch.float32, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` sums over `gib` GiB of `dtype` (only reads)."""
    x = torch.ones(int(gib * 2**30) // (torch.finfo(dtype).bits // 8), dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * x.element_size() / best


def bytes_per_step(cfg, context: int, element_size: int) -> dict[str, int]:
    """Weight and KV bytes one batch-1 decode step at `context` tokens reads (the planner's counts)."""
    weights = weights_from_model_config(cfg, element_size).streamed_weight_bytes
    kv = geometry_from_model_config(cfg, element_size).sequence_bytes(context)
    return {"weights": weights, "kv": kv, "total": weights + kv}


def time_steps(step, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gptoss-lite-502m")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    read_bw = read_bandwidth()
    read_bw_dtype = read_bandwidth(dtype)  # the same sum over the weights' dtype, for comparison
    copy_bw = measure_this_machine().bandwidth_bytes_per_second
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the preset's "RANDOM weights" warning: intended here
        eager = load_model(args.preset, dtype=dtype)
    cfg = eager.config
    need = bytes_per_step(cfg, args.context, eager.embed.weight.element_size())
    ids = torch.randint(0, cfg.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    result: dict = {
        "preset": args.preset,
        "dtype": args.dtype,
        "context": args.context,
        "threads": args.threads,
        "torch": torch.__version__,
        "read_bandwidth_gb_s": read_bw / 1e9,
        f"read_bandwidth_{args.dtype}_gb_s": read_bw_dtype / 1e9,
        "copy_bandwidth_gb_s": copy_bw / 1e9,
        "bytes_per_step": need,
        "roofline_tok_s": read_bw / need["total"],
    }
    with torch.inference_mode():
        cache = MixedKVCache(cfg, rollback_tokens=args.steps)  # the eager steps are taken back afterwards
        t0 = time.perf_counter()
        logits = eager.prefill(ids, cache, 2048)
        result["prefill_s"] = time.perf_counter() - t0
        token = logits[:, -1].argmax(-1)
        pos = [args.context]

        def eager_step() -> None:
            eager(token[:, None], cache=cache, start_pos=pos[0], last_only=True)
            pos[0] += 1

        eager_times = time_steps(eager_step, args.steps)
        cache.truncate(args.context)
        cache.reserve(args.context + args.steps + 1)  # full layers hold every compiled step's token
        eager.prepare_for_inference(compile_decode=True)  # the same weights, re-packed out-major
        decoder = eager.compiled_decoder

        def compiled_step() -> None:
            decoder.step(cache.static_decode(), token)  # writes into the cache's own storage
            cache.advance(1)

        compiled_step()  # compiles (or loads the cached graph)
        result["compile_s"] = decoder.compile_seconds
        compiled_times = time_steps(compiled_step, args.steps)
    for name, times in (("eager", eager_times), ("compiled", compiled_times)):
        med = statistics.median(times)
        result[name] = {
            "median_step_ms": med * 1e3,
            "tok_s": 1 / med,
            "fraction_of_roofline": (1 / med) / result["roofline_tok_s"],
            "steps_ms": [t * 1e3 for t in times],
        }
    gb = need["total"] / 1e9
    print(
        f"{args.preset} {args.dtype}, batch 1, context {args.context}, {args.threads} threads: "
        f"{gb:.3f} GB per step ({need['weights'] / 1e9:.3f} weights + {need['kv'] / 1e9:.3f} KV); "
        f"read bandwidth {read_bw / 1e9:.1f} GB/s (of {args.dtype}: {read_bw_dtype / 1e9:.1f}; copy "
        f"{copy_bw / 1e9:.1f} GB/s) -> roofline "
        f"{result['roofline_tok_s']:.1f} tok/s"
    )
    for name in ("eager", "compiled"):
        r = result[name]
        print(
            f"  {name:8s} {r['tok_s']:6.1f} tok/s ({r['median_step_ms']:.1f} ms/step) = "
            f"{100 * r['fraction_of_roofline']:.0f}% of the roofline"
        )
    print(f"  compile (first compiled step): {result['compile_s']:.1f} s", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
