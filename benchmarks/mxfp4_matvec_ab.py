"""The MXFP4 expert kernel (`kernels/mxfp4.c`, the exact `gl_mxfp4_matvec`) of another commit against this
checkout's, in one process, at gpt-oss-20b's decode shapes.

    python benchmarks/mxfp4_matvec_ab.py --base 3fe89fe [--calls 30] [--march haswell] [--out F]

Both sources are built with the project's flags into a temporary folder. Per shape (rows routed to one
expert each, weight rows, K, the input's dtype): 32 experts of random codes and scales, as the 20b's
layers hold them; the median time of each build over `--calls` calls alternating, each after a 64 MB
write that evicts the codes from the caches (as the rest of a decode step does); GB/s of codes and
scales read; and whether the two builds' fp32 outputs are the same bits. `--march haswell` builds both
for an AVX2-only CPU (the bf16-input shapes, which need AVX-512 BF16, are left out there).
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from functools import partial
from pathlib import Path

from kernel_versions import ab_parser, alternate, base_and_here, evicting, save

# (rows, weight rows, K, bf16 input): a decode token's gate|up and down products, one row per routed
# expert (four of 32), and two tokens of a batch sharing one expert
SHAPES = [
    (4, 5760, 2880, True), (4, 2880, 2880, True), (4, 5760, 2880, False), (8, 5760, 2880, True), (8, 5760, 2880, False),
]  # fmt: skip


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gl_mxfp4_matvec.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]
    lib.gl_mxfp4_matvec.restype = None
    return lib


def shapes(libs, calls: int) -> list[dict]:
    import torch

    flush = evicting()
    rows = []
    g = torch.Generator().manual_seed(0)
    E = 32
    for M, R, K, bf16 in SHAPES:
        if bf16 and not all(lib.gl_has_bf16_dot() for lib in libs):
            continue  # a build without AVX-512 BF16 takes fp32 inputs only
        G = K // 32
        blocks = torch.randint(0, 256, (E, R, G, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 130, (E, R, G), dtype=torch.uint8, generator=g)
        x = torch.randn(M, K, generator=g)
        x = x.bfloat16() if bf16 else x
        experts = torch.arange(M, dtype=torch.int64) * 7 % E if M <= 4 else torch.arange(M) // 2 * 7 % E
        bias = torch.randn(E, R, generator=g)
        outs = [torch.empty(M, R) for _ in libs]

        args = (x.data_ptr(), int(bf16), blocks.data_ptr(), scales.data_ptr(), experts.data_ptr(), bias.data_ptr())
        builds = [partial(lib.gl_mxfp4_matvec, *args, M, E, R, G, out.data_ptr()) for lib, out in zip(libs, outs)]
        base, here = alternate(calls, builds, flush)
        read = len(set(experts.tolist())) * R * G * 17  # codes and scales of each expert used
        same = torch.equal(outs[0], outs[1])
        rows.append(
            {"rows": M, "out": R, "k": K, "bf16": bf16, "base_us": base * 1e6, "this_us": here * 1e6,
             "base_gb_s": read / base / 1e9, "this_gb_s": read / here / 1e9, "same_bits": same}
        )  # fmt: skip
        kind = "bf16" if bf16 else "fp32"
        print(
            f"| {M} x {R} x {K}, {kind} | {base * 1e6:.0f} ({read / base / 1e9:.1f} GB/s) | "
            f"{here * 1e6:.0f} ({read / here / 1e9:.1f} GB/s) | {base / here:.2f} | {same} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = ab_parser(__doc__, "mxfp4", calls=30)
    ap.add_argument("--march", default="native", help="the CPU both builds are for (haswell: AVX2 only)")
    args = ap.parse_args(argv)
    if args.engine:
        ap.error("--engine: the MXFP4 kernel serves gpt-oss-20b's experts; time it with gptoss20b_cpu.py run")

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [typed(lib) for lib in base_and_here(args.base, "mxfp4", Path(tmp), args.march)]
        print(f"MXFP4 expert products, {args.threads} threads, cold codes, {args.calls} calls each, alternating")
        print("| rows x weight rows x K, input | base µs | this µs | base / this | same bits |")
        print("|---|---:|---:|---:|---:|")
        result = {"base": args.base, "threads": args.threads, "march": args.march, "shapes": shapes(libs, args.calls)}
    save(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
