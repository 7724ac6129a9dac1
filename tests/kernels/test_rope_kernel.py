"""The one-pass rotary embedding (`kernels/rope.c`) against PyTorch's four ops, bit for bit: this
machine's build, builds for other CPUs, and what stays with PyTorch."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import build_kernel_for
from gptoss_lite.kernels import rope as rope_kernel
from gptoss_lite.model.rope import apply_rotary, apply_rotary_tables, rotary_tables

needs_kernel = pytest.mark.skipif(rope_kernel._library() is None, reason="no C compiler: PyTorch's ops rotate")


def _torch_ops(x, cos_full, sin_signed):
    """`apply_rotary_tables`'s PyTorch path, written out (the function itself now takes the kernel)."""
    xf = x.float()
    out = xf * cos_full + xf.roll(x.shape[-1] // 2, dims=-1) * sin_signed
    return out.to(x.dtype)


def _inputs(B, T, H, D, dtype, seed):
    """Queries as the layer has them: (B, H, T, D), a transposed view of (B, T, H + 2, D) rows (q beside
    k and v in one product), and full-width tables of random angles."""
    g = torch.Generator().manual_seed(seed)
    rows = (3 * torch.randn(B, T, H + 2, D, generator=g)).to(dtype)
    x = rows.transpose(1, 2)[:, :H]
    angles = 100 * torch.rand(T, D // 2, generator=g)
    return x, *rotary_tables(angles.cos(), angles.sin())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, H, D", [(1, 2048, 8, 32), (3, 7, 2, 64), (1, 1, 4, 6), (2, 33, 1, 2)])
def test_bit_identical_to_pytorch(B, T, H, D, dtype):
    x, cos_full, sin_signed = _inputs(B, T, H, D, dtype, seed=T + D)
    got = rope_kernel.rotate(x, cos_full, sin_signed)
    want = _torch_ops(x, cos_full, sin_signed)
    assert got is not None and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want)
    half = D // 2  # and the readable form, on the half tables
    assert torch.equal(got, apply_rotary(x, cos_full[:, :half], sin_signed[:, half:]))


@needs_kernel
def test_leaves_other_inputs_to_pytorch():
    x, c, s = _inputs(1, 16, 2, 32, torch.float32, seed=0)
    assert rope_kernel.rotate(x, c[:8], s[:8]) is None  # tables for other positions
    assert rope_kernel.rotate(x.half(), c, s) is None  # fp16
    assert rope_kernel.rotate(x[..., ::2], c[:, ::2], s[:, ::2]) is None  # D along a stride
    assert rope_kernel.rotate(x[0], c, s) is None  # not (B, H, T, D)
    y = x.clone().requires_grad_()
    assert rope_kernel.rotate(y, c, s) is None  # training: PyTorch's ops, which have a backward
    out = apply_rotary_tables(y, c, s)
    assert out.requires_grad and torch.equal(out.detach(), _torch_ops(x, c, s))


@pytest.mark.parametrize("arch", ["x86-64", "haswell"])
def test_other_cpus_builds(tmp_path, arch):
    """Built for a CPU without AVX-512 (plain x86-64, AVX2) the kernel gives the same bits."""
    lib = build_kernel_for("rope", arch, tmp_path)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gl_rotary.argtypes = [ptr, ctypes.c_int, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr]
    for dtype in (torch.float32, torch.bfloat16):
        x, c, s = _inputs(2, 40, 3, 64, dtype, seed=1)
        out = torch.empty(x.shape, dtype=dtype)
        B, H, T, D = x.shape
        args = (B, H, T, D, x.stride(0), x.stride(1), x.stride(2), c.data_ptr(), s.data_ptr(), out.data_ptr())
        assert lib.gl_rotary(x.data_ptr(), int(dtype == torch.bfloat16), *args) == 0
        assert torch.equal(out, _torch_ops(x, c, s))
    assert lib.gl_rotary(x.data_ptr(), 1, B, H, T, 5, *args[4:]) == -1  # an odd head size


def test_without_kernels_pytorch_rotates(without_kernels):
    without_kernels(
        "import torch; from gptoss_lite.kernels import rope; from gptoss_lite.model.rope import apply_rotary_tables; "
        "x = torch.randn(1, 4, 16, 32); c = torch.randn(16, 32); s = torch.randn(16, 32); "
        "assert rope.rotate(x, c, s) is None; xf = x.float(); "
        "assert torch.equal(apply_rotary_tables(x, c, s), xf * c + xf.roll(16, dims=-1) * s)"
    )
