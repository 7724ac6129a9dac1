"""Prefill attention, three paths on the same queries, interleaved: the prefill kernel
(`kernels/prefill.c`, AVX-512 CPUs), PyTorch's fused flash kernel (what every other CPU runs) and the
tensor-op blocked online softmax.

    python benchmarks/prefill_attention.py [--threads 2] [--rounds 5]

For each shape (502M / gpt-oss geometry H = 64, K = 8, D = 64 and the 20M / shipped geometry H = 8,
K = 2, D = 32; full and 128-token windowed layers; fp32 and bf16) the paths run in turn on the same
2,048 queries, each round in the same order, and the median of the rounds is printed with the ratios
(docs/model.md#attention-with-sinks). Where the kernel is not built its column says so.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from gptoss_lite.kernels import prefill
from gptoss_lite.model.attention import attention_fast

SHAPES = [  # (T, K, G, D, window, dtype)
    (2048, 8, 8, 64, None, torch.float32),
    (2048, 8, 8, 64, 128, torch.float32),
    (2048, 8, 8, 64, None, torch.bfloat16),
    (2048, 2, 4, 32, None, torch.float32),
    (2048, 2, 4, 32, 128, torch.float32),
    (2048, 2, 4, 32, None, torch.bfloat16),
    (2048, 2, 4, 32, 128, torch.bfloat16),
]


def _timed(inputs: tuple, **kw) -> float:
    t = time.perf_counter()
    attention_fast(*inputs, **kw)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kernel = prefill.available()
    print(f"prefill kernel: {'built' if kernel else 'not built on this CPU'}; threads {args.threads}")
    for T, K, G, D, window, dtype in SHAPES:
        q = torch.randn(1, K * G, T, D).to(dtype)
        k, v = torch.randn(1, K, T, D).to(dtype), torch.randn(1, K, T, D).to(dtype)
        sinks = torch.randn(K * G)
        times: dict[str, list[float]] = {"kernel": [], "flash": [], "blocked": []}
        inputs = (q, k, v, sinks, 0, window)
        with torch.inference_mode():
            for _ in range(args.rounds):
                if kernel:
                    times["kernel"].append(_timed(inputs))
                with mock.patch.object(prefill, "applies", lambda *a: False):
                    times["flash"].append(_timed(inputs))
                times["blocked"].append(_timed(inputs, q_block=max(1, 2048 // G)))  # forced: the online softmax
        med = {name: 1000 * statistics.median(ts) for name, ts in times.items() if ts}
        shape = f"T={T} H={K * G} K={K} D={D} window={window} {str(dtype).removeprefix('torch.')}"
        parts = [f"flash {med['flash']:.1f} ms", f"blocked {med['blocked']:.1f} ms"]
        if kernel:
            parts.insert(0, f"kernel {med['kernel']:.1f} ms")
            parts.append(f"kernel/flash {med['flash'] / med['kernel']:.2f}x")
        print(f"{shape}: " + ", ".join(parts) + f", flash/blocked {med['blocked'] / med['flash']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
