"""The bf16 GEMV kernel (`kernels/bf16.c`) of another commit against this checkout's, in one process.

    python benchmarks/bf16_gemv_ab.py --base 1ddfc8f [--calls 30] [--engine MODEL_DIR --rounds 10] [--out F]
    python benchmarks/bf16_gemv_ab.py --base torch [--engine MODEL_DIR]

Both sources are built with the project's flags (`kernels.build.FLAGS`) into a temporary folder. Per
shape (rows x weight rows x K): the median time of each build over `--calls` calls alternating, each
after a 64 MB write that evicts the weight from the caches (as a decode step's other weights do), and
the largest difference between their fp32 outputs. With `--engine`, also the peers' batch cell through
`LLM` on that model in bf16 (16 × 256 random prompt tokens × 128 new, greedy, the compiled step, which
calls the kernel for every projection and the head): the library the op calls swapped between runs,
the order alternating by round; wall seconds, medians, and how many requests kept the same tokens
(bf16 sums in another order round differently, so near-ties may part on random weights).
`--base torch` compares the kernel with what the compiled step runs where it is not built (inductor's
reduction for one row by a weight over `FUSED_ROW_BYTES`, fp32 products for several rows; both through
`torch.compile` of `decode_linear`, the switch `kernels.bf16.traceable` off and on), and the engine's
cell with each graph: how the kernel's AVX2 path was measured on an AVX2-only CPU's paths
(`GPTOSS_LITE_CPU=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`). Needs a CPU where bf16.c
builds a path (AVX2 and FMA, or AVX-512 BF16); a base revision's build may be a stub (before AVX2 had
a path) and is refused.
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from functools import partial
from pathlib import Path

from kernel_versions import ab_parser, alternate, base_and_here, engine_batch, evicting, save, switched

SHAPES = [
    (16, 12288, 256), (16, 384, 256), (8, 12288, 256), (4, 12288, 256), (2, 12288, 256), (1, 12288, 256),
    (16, 5760, 2880), (4, 5760, 2880),
    (1, 5120, 2880), (1, 2880, 4096), (1, 201088, 2880),  # gpt-oss-20b's decode token: qkv, o, the head
]  # fmt: skip


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gl_bf16_gemv.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr]
    lib.gl_bf16_gemv.restype = None
    lib.usable, lib._typed = bool(lib.gl_has_bf16_gemv()), True
    return lib


def library_calls(libs):
    """Per shape, the two builds' calls into their own outputs: (calls, outputs)."""

    def calls(x, w, b):
        import torch

        M, K = x.shape
        R = w.shape[0]
        outs = [torch.empty(M, R) for _ in libs]
        return [
            partial(lib.gl_bf16_gemv, x.data_ptr(), w.data_ptr(), b.data_ptr(), M, R, K, out.data_ptr())
            for lib, out in zip(libs, outs)
        ], outs

    return calls


def graph_calls(use):
    """Per shape, `decode_linear` compiled (one graph per setting of the switch): without the kernel, then
    with it; each call keeps its output."""
    import torch

    from gptoss_lite.model.matmul import decode_linear

    step = torch.compile(decode_linear, dynamic=False)

    def calls(x, w, b):
        torch._dynamo.reset()  # two graphs a shape, more than dynamo's recompile limit over all shapes
        b = b.bfloat16()  # as the model's biases
        outs: list = [None, None]

        def call(i: int) -> None:
            use(bool(i))
            outs[i] = step(x, w, b)

        for i in (0, 1):
            call(i)  # compiles each graph, untimed
        return [partial(call, 0), partial(call, 1)], outs

    return calls


def shapes(calls_for, calls: int) -> list[dict]:
    import torch

    flush = evicting()
    rows = []
    g = torch.Generator().manual_seed(0)
    for M, R, K in SHAPES:
        x, w = torch.randn(M, K, generator=g).bfloat16(), torch.randn(R, K, generator=g).bfloat16()
        b = torch.randn(R, generator=g)
        builds, outs = calls_for(x, w, b)
        base, here = (s * 1e6 for s in alternate(calls, builds, flush))
        diff = (outs[0] - outs[1]).abs().max().item()
        rows.append({"rows": M, "out": R, "k": K, "base_us": base, "this_us": here, "max_abs_diff": diff})
        print(f"| {M} x {R} x {K} | {base:.0f} | {here:.0f} | {base / here:.2f} | {diff:.1e} |")
    return rows


def engine(libs, model_dir: str, rounds: int) -> dict:
    from gptoss_lite.kernels import bf16

    def use(i: int) -> None:
        bf16._library = lambda lib=libs[i]: lib

    return engine_batch(use, model_dir, "bfloat16", rounds)


def against_torch(args) -> dict:
    """`--base torch`: the compiled step's product without the kernel and with it, per shape and (with
    --engine) in the engine's cell."""
    from gptoss_lite.kernels import bf16

    if not bf16.available():
        print("bf16.c builds no path on this CPU (it needs AVX2 and FMA)", file=sys.stderr)
        raise SystemExit(2)
    result = {"base": "torch", "threads": args.threads, "path": bf16._library().gl_has_bf16_gemv()}
    with switched(bf16, "traceable") as use:
        print(f"bf16 GEMV against the compiled step without it, {args.threads} threads, cold weights")
        print("| rows x weight rows x K | torch µs | this µs | torch / this | max abs diff |")
        print("|---|---:|---:|---:|---:|")
        result["shapes"] = shapes(graph_calls(use), args.calls)
        if args.engine:
            result["engine"] = engine_batch(lambda i: use(bool(i)), args.engine, "bfloat16", args.rounds)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = ab_parser(__doc__, "bf16", calls=30)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    if args.base == "torch":
        save(against_torch(args), args.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        libs = [typed(lib) for lib in base_and_here(args.base, "bf16", Path(tmp))]
        if not all(lib.usable for lib in libs):
            print("bf16.c is a stub in one of the builds (no AVX2, or a base before its AVX2 path)", file=sys.stderr)
            return 2
        print(f"bf16 GEMV, {args.threads} threads, cold weights, {args.calls} calls each, alternating")
        print("| rows x weight rows x K | base µs | this µs | base / this | max abs diff |")
        print("|---|---:|---:|---:|---:|")
        result = {"base": args.base, "threads": args.threads, "shapes": shapes(library_calls(libs), args.calls)}
        if args.engine:
            result["engine"] = engine(libs, args.engine, args.rounds)
    save(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
