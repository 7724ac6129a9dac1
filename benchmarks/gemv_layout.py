"""Why GPTOSS.pack_for_decode stores fp32 weights input-major and 16-bit ones out-major: one-token
GEMV time by weight layout and dtype.

A decode step multiplies a single (1, in) row by every weight matrix, and on a model whose weights
do not fit in the last-level cache each GEMV streams its weight from DRAM. This script times, with
the cache flushed before every run (a 96 MiB buffer is rewritten), one thread, in `--dtype`
(fp32 by default; bf16 and fp16 pick the other layout, `decode_pack.input_major_for`):

- row-major: the nn.Linear layout (out, in) contiguous, called as F.linear(x, W);
- input-major: the same values stored as W.t().contiguous(), called as x @ W.t() (what F.linear
  does for a weight whose storage is transposed);
- packed: gate and up of an expert side by side in one (in, 2·out) input-major buffer, one GEMV
  instead of two.

Shapes are those of the ~20M benchmark model (hidden 256, vocab 12,288, 8 experts). Figures are
medians of --repeats runs; ratios are row-major time / other time (> 1: faster than nn.Linear's layout).

    python benchmarks/gemv_layout.py
    python benchmarks/gemv_layout.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=21, help="timed runs per figure (median; default 21)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=12_288)
    ap.add_argument("--experts", type=int, default=48, help="expert matrices per run (default 48: 8 layers x 6)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = ap.parse_args(argv)
    dt = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    C = args.hidden
    flush = torch.ones(96 * 1024 * 1024 // 4)
    x = torch.randn(1, C, dtype=dt)

    def cold(fn) -> float:
        times = []
        for _ in range(args.repeats):
            flush.add_(1.0)  # evict the weights from every cache level
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    head = torch.randn(args.vocab, C, dtype=dt)
    head_in = head.t().contiguous().t()  # same values and shape, input-major storage
    mats = [torch.randn(C, C, dtype=dt) for _ in range(args.experts)]
    mats_in = [w.t().contiguous().t() for w in mats]
    pairs = [torch.randn(C, 2 * C, dtype=dt) for _ in range(args.experts // 2)]  # (in, 2·out): gate | up

    def run_all(ws):
        def fn():
            for w in ws:
                F.linear(x, w)

        return fn

    def run_packed():
        for w in pairs:
            torch.mm(x, w)

    rows = [
        (f"output head {args.vocab}x{C}", cold(lambda: F.linear(x, head)), cold(lambda: F.linear(x, head_in)), None),
        (f"{args.experts} matrices {C}x{C}", cold(run_all(mats)), cold(run_all(mats_in)), cold(run_packed)),
    ]
    print(f"one-token GEMV, {args.dtype}, 1 thread, cold cache; median of {args.repeats} runs (microseconds)")
    print(
        f"{'weights':>24} | {'row-major':>9} | {'input-major':>11} {'ratio':>6} | {'gate|up packed':>14} {'ratio':>6}"
    )
    for name, row, inm, packed in rows:
        tail = f"{packed:>14.0f} {row / packed:>5.2f}x" if packed is not None else f"{'-':>14} {'':>6}"
        print(f"{name:>24} | {row:>9.0f} | {inm:>11.0f} {row / inm:>5.2f}x | {tail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
