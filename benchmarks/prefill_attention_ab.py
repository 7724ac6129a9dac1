"""The prefill attention kernel (`kernels/prefill.c`) of another commit against this checkout's, in
one process, calls alternating.

    python benchmarks/prefill_attention_ab.py --base 5baf8c0 [--calls 60] [--tokens 2048]

Both sources are built with the project's flags (`kernels.build.FLAGS`) into a temporary folder and
called through ctypes on the same fp32 inputs: 8 query heads over 2 KV heads of size 32 (the 20M
model's), sinks, T queries over T keys, full causal and a 128-token window. Per case: the median
time of each build over `--calls` calls, the base's time over this checkout's, and the largest
difference between their outputs.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from functools import partial
from pathlib import Path

from kernel_versions import alternate, base_and_here


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gl_prefill_attention.argtypes = [ptr, ptr, ptr, ctypes.c_int, *[i64] * 17, ptr, ctypes.c_float, ptr]
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision whose prefill.c is the baseline")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [typed(lib) for lib in base_and_here(args.base, "prefill", Path(tmp))]
        g = torch.Generator().manual_seed(0)
        B, H, K, T, D = 1, 8, 2, args.tokens, 32
        q, k, v = (torch.randn(B, n, T, D, generator=g) for n in (H, K, K))
        sinks = torch.randn(H, generator=g)
        print(f"prefill attention, fp32, {T} queries, 8 heads over 2 KV heads of 32, {args.threads} threads")
        print("| case | base ms | this ms | base / this | max abs diff |")
        print("|---|---:|---:|---:|---:|")
        for window in (-1, 128):
            outs = [torch.empty(B, T, H, D) for _ in libs]

            def call(i: int, window: int = window, outs: list = outs) -> None:
                libs[i].gl_prefill_attention(
                    q.data_ptr(), k.data_ptr(), v.data_ptr(), 0, B, K, H // K, T, T, D, *q.stride()[:3],
                    *k.stride()[:3], *v.stride()[:3], 0, window, sinks.data_ptr(), D**-0.5, outs[i].data_ptr(),
                )  # fmt: skip

            a, b = (s * 1e3 for s in alternate(args.calls, [partial(call, 0), partial(call, 1)]))
            case = "causal" if window < 0 else f"window {window}"
            diff = (outs[0] - outs[1]).abs().max().item()
            print(f"| {case} | {a:.2f} | {b:.2f} | {a / b:.3f}x | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
