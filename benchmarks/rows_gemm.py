"""F.linear (MKL sgemm) against `kernels.rows.rows_mm` for the batched decode step's fp32 products:
x (M, K) · w (R, K)ᵀ + b at the toy model's shapes (head 12,288 x 256, qkv 384 x 256, o 256 x 256,
router 8 x 256) and gpt-oss-20b's qkv (5,120 x 2,880).

The two are timed alternately in one process (A, B, A, B, ...), so a neighbour's load falls on both;
the table gives each one's median and the ratio F.linear / kernel (above 1: the kernel is faster).
Eager calls (the default) include each op's dispatch; `--compiled` times each product as the decode
step makes it instead: a `torch.compile`d function (dynamic rows, inductor's C++ wrapper, inference
mode) of F.linear, of rows_mm and, for M = 1, of `model.matmul.gemv` (the one-row reduction).

    PYTHONPATH=src python benchmarks/rows_gemm.py [--threads 2] [--reps 41] [--rows 2,4,8,16,32,64]
    PYTHONPATH=src python benchmarks/rows_gemm.py --compiled --rows 1,2,16,64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from gptoss_lite.kernels import rows
from gptoss_lite.model.matmul import gemv

SHAPES = ((12288, 256, "head"), (384, 256, "qkv"), (256, 256, "o_proj"), (8, 256, "router"), (5120, 2880, "20b qkv"))


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def contenders(ws: list[torch.Tensor], bs: list[torch.Tensor], compiled: bool):
    """(F.linear, rows_mm, gemv or None): functions of x giving the products with the first weight
    (eager), or, compiled as the decode step compiles (dynamic rows, inductor's C++ wrapper; gemv for
    one row only), the sum of the products with every weight in `ws`: several calls in one graph, as in
    the step, so that a compiled call's own cost (its guards, the wrapper) is shared out."""
    if not compiled:
        w, b = ws[0], bs[0]
        return (lambda x: F.linear(x, w, b)), (lambda x: rows.rows_mm(x, w, b)), None

    def summed(op):
        return lambda x: sum(op(x, w, b) for w, b in zip(ws, bs))

    opts = {"cpp_wrapper": True}
    return (
        torch.compile(summed(F.linear), dynamic=True, fullgraph=True, options=opts),
        torch.compile(summed(rows.rows_mm), dynamic=True, fullgraph=True, options=opts),
        torch.compile(summed(gemv), dynamic=False, fullgraph=True, options=opts),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=41, help="timings of each per shape (odd: a true median)")
    ap.add_argument("--rows", default="2,4,8,16,32,64", help="values of M")
    ap.add_argument("--compiled", action="store_true", help="time compiled calls (see above), not eager ones")
    args = ap.parse_args()
    if not rows.available():
        raise SystemExit("the rows kernel is not built here (no compiler, or GPTOSS_LITE_NO_KERNELS=1)")
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 1024  # one lambda's code object, compiled per shape
    ms = [int(m) for m in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    how = "compiled (cpp_wrapper)" if args.compiled else "eager"
    print(f"{torch.get_num_threads()} threads, kernel path {rows._library().isa}, {how}, {args.reps} timings each\n")
    extra = (" gemv µs |", "---:|") if args.compiled else ("", "")
    print(f"| shape (R x K) | M | F.linear µs | rows_mm µs | ratio | rows_mm GFLOP/s |{extra[0]}")
    print(f"|---|---:|---:|---:|---:|---:|{extra[1]}")
    for R, K, name in SHAPES:
        # compiled: copies of the weight (up to 64 MiB in all, so that each call reads its own from L3 or
        # memory, not the last call's from L2), one call each in the graph
        n = max(1, min(16, (64 << 20) // (4 * R * K))) if args.compiled else 1
        ws, bs = [torch.randn(R, K, generator=g) for _ in range(n)], [torch.randn(R, generator=g) for _ in range(n)]
        reps = args.reps if R * K < 2**22 else max(5, args.reps // 4) | 1
        base, kernel, one_row = contenders(ws, bs, args.compiled)
        for M in ms:
            x = torch.randn(M, K, generator=g)
            with torch.inference_mode():
                want = base(x)
                assert (kernel(x) - want).abs().max().item() <= 1e-4 * want.abs().max().item()
                a, k, o = [], [], []
                for _ in range(3):  # warm each (and the weight into cache where it fits)
                    base(x), kernel(x), one_row and M == 1 and one_row(x)
                for _ in range(reps):
                    a.append(timed(base, x))
                    k.append(timed(kernel, x))
                    if one_row is not None and M == 1:
                        o.append(timed(one_row, x))
            ta, tk = statistics.median(a) / n, statistics.median(k) / n
            gemv_col = f" {statistics.median(o) / n * 1e6:.1f} |" if o else " |" if args.compiled else ""
            print(
                f"| {name} {R} x {K} | {M} | {ta * 1e6:.1f} | {tk * 1e6:.1f} | {ta / tk:.2f} | "
                f"{2 * M * R * K / tk / 1e9:.0f} |{gemv_col}"
            )


if __name__ == "__main__":
    main()
