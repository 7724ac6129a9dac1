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

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from block_attention import SHAPES
from kernel_versions import base_and_here, engine_batch


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """lib's two entry points typed as this checkout's own build types them (`kernels.blocks`)."""
    from gptoss_lite.kernels import blocks

    own = blocks._library()
    for name in ("gl_block_attention", "gl_block_attention_quant"):
        fn, ref = getattr(lib, name), getattr(own, name)
        fn.argtypes, fn.restype = ref.argtypes, ref.restype
    return lib


def shapes(libs, calls: int) -> list[dict]:
    import torch

    flush = torch.zeros(16 << 20)
    rows_out = []
    for label, R, K, G, D, S, window in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            bs, nb = 16, S // 16
            N = 4 * R * nb  # the pools hold more blocks than these groups use
            g = torch.Generator().manual_seed(0)
            keys = torch.randn(K, N, bs, D, generator=g).to(dtype)
            values = torch.randn(K, N, bs, D, generator=g).to(dtype)
            table = torch.randperm(N, generator=g)[: R * nb].view(R, nb).contiguous()
            distance = (S - 1 - torch.arange(S))[None, None, :].expand(R, 1, S).contiguous()
            rows = torch.randn(R, K, G, D, generator=g)
            sinks = torch.randn(K, G, generator=g)
            outs = [torch.empty(R, K, G, D) for _ in libs]
            bf16 = int(dtype == torch.bfloat16)
            times: list[list[float]] = [[], []]
            for r in range(calls):
                for i in (0, 1) if r % 2 == 0 else (1, 0):
                    flush.add_(1.0)
                    t0 = time.perf_counter()
                    code = libs[i].gl_block_attention(
                        rows.data_ptr(), R, K, G, D, keys.data_ptr(), values.data_ptr(), bf16, N, bs,
                        table.data_ptr(), nb, distance.data_ptr(), R, 1, window, sinks.data_ptr(), G, D**-0.5,
                        bf16, outs[i].data_ptr(),
                    )  # fmt: skip
                    times[i].append(time.perf_counter() - t0)
                    assert code == 0
            base, here = (statistics.median(t) * 1e6 for t in times)
            diff = (outs[0] - outs[1]).abs().max().item()
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision whose blocks.c is the baseline")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", metavar="MODEL_DIR", help="also time the engine's batch cell on this model")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the engine's dtype")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--kv-bits", type=int, choices=[16, 8, 4], default=16, help="the engine's KV format")
    ap.add_argument("--march", default="native", help="build both for this CPU (haswell: the AVX2-only path)")
    ap.add_argument("--out", type=Path)
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
    result["lscpu"] = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = args.out.with_suffix(".tmp")
        tmp_out.write_text(json.dumps(result, indent=1))
        tmp_out.replace(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
