"""The engine's decode attention over block tables (`kernels/blocks.c`) of another commit against this
checkout's, in one process.

    python benchmarks/block_attention_ab.py --base 4c5e688 [--calls 40]
        [--engine MODEL_DIR --dtype D --rounds 10] [--out F]

Both sources are built with the project's flags (`kernels.build.FLAGS`) into a temporary folder. Per
shape of `block_attention.py` (the 20M model's sliding and full layers at 16 rows, gpt-oss heads at 4)
and dtype: 16-slot blocks scattered over the storage as an engine's pools scatter them, each build's
median µs per call over `--calls` calls alternating, each after a 64 MB write that evicts the blocks
from the caches (as a decode step's weights do), and the largest difference between their outputs.
`--march haswell` builds both for an AVX2-only CPU (the generic path such a machine takes). With
`--engine`, also the peers' batch cell through `LLM` on that model (`kernel_versions.engine_batch`),
the `gptoss_lite::block_attention` op bound to one build, then the other (`cpp_ops.rebind`); with
`--kv-bits 8` or `4`, over int8 or int4 blocks (`gl_block_attention_quant`).
"""

from __future__ import annotations

import ctypes
import tempfile
from functools import partial
from pathlib import Path

from block_attention import SHAPES, case
from kernel_versions import ab_parser, alternate, base_and_here, engine_batch, evicting, save


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib's two entry points typed as this checkout's own build types them (`kernels.blocks`)."""
    from gptoss_lite.kernels import blocks

    own = blocks._library()
    for name in ("gl_block_attention", "gl_block_attention_quant"):
        fn, ref = getattr(lib, name), getattr(own, name)
        fn.argtypes, fn.restype = ref.argtypes, ref.restype
    return lib


def succeeds(fn, *args) -> None:
    """fn(*args), which must return 0 (the kernel took the call)."""
    assert fn(*args) == 0


def shapes(libs, calls: int) -> list[dict]:
    import torch

    flush = evicting()
    rows_out = []
    for label, R, K, G, D, S, window in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            # one case per build (the same inputs), the pools holding more blocks than these groups use
            cases = [case(R, K, G, D, S, window, dtype, 4 * R * (S // 16)) for _ in libs]

            builds = [partial(succeeds, lib.gl_block_attention, *c[0]) for lib, c in zip(libs, cases)]
            base, here = (s * 1e6 for s in alternate(calls, builds, flush))
            diff = (cases[0][1][-1] - cases[1][1][-1]).abs().max().item()
            name = str(dtype).removeprefix("torch.")
            rows_out.append({"shape": label, "dtype": name, "base_us": base, "this_us": here, "max_abs_diff": diff})
            print(f"| {label} | {name} | {base:.0f} | {here:.0f} | {base / here:.2f} | {diff:.1e} |")
    return rows_out


def engine(libs, model_dir: str, dtype: str, rounds: int, kv_bits: int) -> dict:
    from gptoss_lite.kernels import blocks, cpp_ops
    from gptoss_lite.kvspec import kv_format

    def use(i: int) -> None:
        # the ops' Python implementations (the quantised one always, the plain one where C++ is not built)
        blocks._library = lambda lib=libs[i]: lib
        cpp_ops.rebind("block_attention", libs[i].gl_block_attention)

    kwargs = {} if kv_bits == 16 else {"kv_format": kv_format(kv_bits)}
    return engine_batch(use, model_dir, dtype, rounds, kwargs) | {"kv_bits": kv_bits}


def main(argv: list[str] | None = None) -> int:
    ap = ab_parser(__doc__, "blocks", calls=40)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the engine's dtype")
    ap.add_argument("--kv-bits", type=int, choices=[16, 8, 4], default=16, help="the engine's KV format")
    ap.add_argument("--march", default="native", help="build both for this CPU (haswell: the AVX2-only path)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = [typed(lib) for lib in base_and_here(args.base, "blocks", Path(tmp), args.march)]
        print(
            f"block attention, -march={args.march}, {args.threads} threads, cold blocks, "
            f"{args.calls} calls each, alternating"
        )
        print("| shape | dtype | base µs | this µs | base / this | max abs diff |")
        print("|---|---|---:|---:|---:|---:|")
        result = {"base": args.base, "march": args.march, "threads": args.threads, "shapes": shapes(libs, args.calls)}
        if args.engine:
            result["engine"] = engine(libs, args.engine, args.dtype, args.rounds, args.kv_bits)
    save(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
