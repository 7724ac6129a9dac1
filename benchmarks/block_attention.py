"""The engine's decode attention over block tables (`kernels/blocks.c`): this machine's build against
the same source built for an AVX2-only CPU (`-march=haswell`, the path that machine takes), called
alternately in one process through ctypes on the same inputs.

Shapes: the 20M benchmark model at 16 rows (2 KV heads of 4 query heads, head size 32) over a sliding
layer's 144 slots and a full layer's 384, and gpt-oss heads (8 KV heads of 8, head size 64) over 1,024
slots (4 rows); 16-slot blocks in a shuffled table. The table gives each build's median µs per call and the
ratio haswell / native (above 1: the native build is faster).

    PYTHONPATH=src python benchmarks/block_attention.py [--threads 2] [--reps 200]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from gptoss_lite.kernels import blocks
from gptoss_lite.kernels.build import _HERE

SHAPES = [  # (label, R, K, G, D, S, window)
    ("20M sliding", 16, 2, 4, 32, 144, 128),
    ("20M full", 16, 2, 4, 32, 384, -1),
    ("gpt-oss full", 4, 8, 8, 64, 1024, -1),
]


def _haswell_build(folder: Path) -> ctypes.CDLL:
    lib = folder / "blocks-haswell.so"
    cmd = ["gcc", "-O3", "-march=haswell", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
    subprocess.run([*cmd, str(_HERE / "blocks.c"), "-o", str(lib), "-lm"], check=True)
    return ctypes.CDLL(str(lib))


def case(R: int, K: int, G: int, D: int, S: int, window: int, dtype: torch.dtype, N: int) -> tuple[tuple, list]:
    """One call's C arguments for gl_block_attention (16-slot blocks scattered over a storage of N, seed
    0) and the tensors they point into, the output last (keep them while calling)."""
    bs, nb = 16, S // 16
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(K, N, bs, D, generator=g).to(dtype)
    values = torch.randn(K, N, bs, D, generator=g).to(dtype)
    table = torch.randperm(N, generator=g)[: R * nb].view(R, nb).contiguous()
    distance = (S - 1 - torch.arange(S))[None, None, :].expand(R, 1, S).contiguous()
    rows = torch.randn(R, K, G, D, generator=g)
    sinks = torch.randn(K, G, generator=g)
    out = torch.empty(R, K, G, D)
    bf16 = int(dtype == torch.bfloat16)
    c_args = (
        rows.data_ptr(), R, K, G, D, keys.data_ptr(), values.data_ptr(), bf16, N, bs, table.data_ptr(),
        nb, distance.data_ptr(), R, 1, window, sinks.data_ptr(), G, D**-0.5, bf16, out.data_ptr(),
    )  # fmt: skip
    return c_args, [keys, values, table, distance, rows, sinks, out]


def _timed(lib: ctypes.CDLL, c_args: tuple, reps: int) -> float:
    """µs per call of lib's block attention on these arguments."""
    t = time.perf_counter()
    for _ in range(reps):
        lib.gl_block_attention(*c_args)
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = blocks._library()
    with tempfile.TemporaryDirectory() as tmp:
        haswell = _haswell_build(Path(tmp))
        haswell.gl_block_attention.argtypes = native.gl_block_attention.argtypes
        haswell.gl_block_attention.restype = ctypes.c_int
        print(f"{args.threads} threads, {args.reps} calls per sample, 9 alternating samples; µs per call")
        print(f"{'shape':14s} {'dtype':9s} {'native':>8s} {'haswell':>8s} {'ratio':>6s}")
        for label, R, K, G, D, S, window in SHAPES:
            for dtype in (torch.float32, torch.bfloat16):
                c_args, _held = case(R, K, G, D, S, window, dtype, R * (S // 16) + 8)
                call = functools.partial(_timed, c_args=c_args, reps=args.reps)
                call(native), call(haswell)
                a, b = [], []
                for _ in range(9):
                    a.append(call(native))
                    b.append(call(haswell))
                na, nb_ = statistics.median(a), statistics.median(b)
                print(f"{label:14s} {str(dtype)[6:]:9s} {na:8.1f} {nb_:8.1f} {nb_ / na:5.2f}x")


if __name__ == "__main__":
    main()
