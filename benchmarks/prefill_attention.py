"""Prefill attention: the fused flash-kernel path against the tensor-op blocked kernel, interleaved.

    python benchmarks/prefill_attention.py [--threads 1] [--rounds 3]

For each shape (502M geometry H = 64, K = 8, D = 64 and the shipped model's H = 8, K = 2, D = 32; full
and 128-token windowed layers; fp32 and bf16) both kernels run on the same 2,048 queries, alternating,
and the median of the rounds is printed with the ratio (docs/model.md#attention-with-sinks).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gptoss_lite.model.attention import attention_fast

SHAPES = [  # (T, K, G, D, window, dtype)
    (2048, 8, 8, 64, None, torch.float32),
    (2048, 8, 8, 64, 128, torch.float32),
    (2048, 8, 8, 64, None, torch.bfloat16),
    (2048, 2, 4, 32, None, torch.float32),
    (2048, 2, 4, 32, 128, torch.float32),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for T, K, G, D, window, dtype in SHAPES:
        q = torch.randn(1, K * G, T, D).to(dtype)
        k, v = torch.randn(1, K, T, D).to(dtype), torch.randn(1, K, T, D).to(dtype)
        sinks = torch.randn(K * G)
        flash, blocked = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            attention_fast(q, k, v, sinks, 0, window)
            flash.append(time.perf_counter() - t)
            t = time.perf_counter()
            attention_fast(q, k, v, sinks, 0, window, q_block=max(1, 2048 // G))  # forced: online softmax
            blocked.append(time.perf_counter() - t)
        f, b = statistics.median(flash), statistics.median(blocked)
        print(
            f"T={T} H={K * G} K={K} D={D} window={window} {str(dtype).removeprefix('torch.')}: "
            f"flash {1000 * f:.1f} ms, blocked {1000 * b:.1f} ms, {b / f:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
