"""Native kernels built on first use with the machine's C compiler (docs/mxfp4.md).

`mxfp4` holds the MXFP4 matrix-vector product and dequantisation the packed experts run on, each
with a PyTorch fallback where no compiler is found. `bf16` (a few bf16 rows, AVX2 or AVX-512 BF16) and
`rows` (a few fp32 rows, AVX2 or AVX-512: docs/model.md#the-compiled-decode-step) serve the compiled
decode step's products; where they are not built, the step keeps F.linear. `blocks` is the
compiled step's attention over the engine's block tables, read in place (where it is not built, the
layer gathers the blocks and calls `masked_decode`). `prefill` (AVX-512 CPUs) is the attention of a
prompt over dense keys; where it is not built, `blocks.attend` keeps PyTorch's fused flash kernel.
`moe` (AVX-512 CPUs) runs the routed experts of a batched decode step grouped by expert; where it is
not built, the step keeps its gathered reduction. `norm` and `rope` are a prompt's RMSNorm and rotary
embedding. `vec.h` holds what the C sources share. `report()` (and `python -m gptoss_lite.kernels`) says
which path each takes on this machine.
"""

from __future__ import annotations


def report() -> dict[str, str]:
    """Which path each native kernel takes in this process, as its build says (the path follows what the
    compiler knew of the CPU: docs/kernels.md), with the CPU it was built for and PyTorch's own choices:
    `python -m gptoss_lite.kernels` prints it, and the benchmarks keep it beside their figures. Building a
    kernel that is not built yet takes about a second."""
    import os

    import torch

    from gptoss_lite.kernels import bf16, blocks, build, cpp_ops, moe, mxfp4, norm, prefill, rope, rows

    off = "off: GPTOSS_LITE_NO_KERNELS=1" if os.environ.get("GPTOSS_LITE_NO_KERNELS") == "1" else "not built"
    march = next(f for f in build.kernel_flags() if f.startswith("-march="))
    out = {
        "built for": f"{march} (GPTOSS_LITE_CPU={build.imitated()})",
        "PyTorch": f"ATen {torch.backends.cpu.get_cpu_capability()}, "
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA') or 'unset'}",
    }
    lib = mxfp4._library()
    if lib is None:
        out["mxfp4"] = f"{off} (PyTorch dequantises each expert)"
    else:
        vector = "AVX2 + FMA" if lib.gl_has_avx2() else "plain C"
        out["mxfp4"] = f"AVX-512 BF16 for bf16 inputs, {vector} for fp32" if lib.bf16_dot else vector
        out["mxfp4"] += "; gate|up activation in the same pass (AVX-512)" if lib.gate_up_act else ""
    lib = bf16._library()
    paths = ("a stub (no AVX2)", "AVX2 + FMA", "AVX-512 BF16")
    out["bf16"] = off if lib is None else paths[lib.gl_has_bf16_gemv()]
    lib = rows._library()
    out["rows"] = off if lib is None else lib.isa + ("" if rows.available() else " (too slow: unused)")
    lib = blocks._library()
    paths = ("plain C", "AVX2 + FMA", "AVX-512 (head size 32, 64), AVX2 + FMA otherwise")
    out["blocks"] = off if lib is None else paths[lib.gl_blocks_isa()]
    out["prefill"] = "AVX-512" if prefill.available() else off if prefill._library() is None else "a stub (no AVX-512)"
    lib = moe._library()
    grouped = ("none", "AVX-512, fp32", "AVX-512, fp32 and bf16")
    out["moe"] = off if lib is None else f"grouped experts: {grouped[lib.isa]}; top-k and grouping: plain C"
    for name, module in (("norm", norm), ("rope", rope)):
        out[name] = off if module._library() is None else f"plain C vectorised for {march}"
    out["C++ ops"] = ", ".join(sorted(cpp_ops.bound())) or "none (the ops' Python implementations)"
    return out
