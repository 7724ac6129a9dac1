"""The one-pass RMSNorm (`kernels/norm.c`) against `F.rms_norm` in fp32, its place in
`model.transformer.RMSNorm`, the inputs it leaves to PyTorch, the builds for other CPUs, and the
machines without it (GPTOSS_LITE_NO_KERNELS=1)."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from conftest import build_kernel_for
from gptoss_lite.kernels import norm as norm_kernel
from gptoss_lite.model.transformer import RMSNorm

needs_kernel = pytest.mark.skipif(norm_kernel._library() is None, reason="the norm kernel needs a C compiler")


def _reference(x, weight, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def _inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    return x, w


def _close(got, want):
    if got.dtype == torch.float32:  # the sum of squares is added in another order
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # the same fp32 value to float rounding, rounded once: at most one bf16 step apart
        assert ((got.float() - want.float()).abs() <= 2**-7 * want.float().abs() + 1e-30).all()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2048, 256), (3, 17, 2880), (16, 64)])
def test_equals_f_rms_norm(shape, dtype):
    x, w = _inputs(shape, dtype, seed=shape[-1])
    assert norm_kernel.applies(x, w)
    got = norm_kernel.rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    _close(got, _reference(x, w, 1e-5))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_module_takes_it_for_a_prompt_and_not_for_a_step(dtype, monkeypatch):
    module = RMSNorm(256, 1e-5).to(dtype)
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)
    calls = []
    real = norm_kernel.rms_norm
    monkeypatch.setattr(norm_kernel, "rms_norm", lambda *a: calls.append(a) or real(*a))
    x, _ = _inputs((1, 300, 256), dtype, seed=1)
    with torch.no_grad():
        _close(module(x), _reference(x, module.weight, 1e-5))
        assert len(calls) == 1
        step = x[:, :1]  # one row: F.rms_norm, bit for bit
        assert torch.equal(module(step), _reference(step, module.weight, 1e-5)) and len(calls) == 1
    y = module(x.requires_grad_())  # training: F.rms_norm, which has a backward
    assert y.requires_grad and len(calls) == 1


@needs_kernel
def test_leaves_other_inputs_to_pytorch():
    x, w = _inputs((1, 64, 256), torch.float32, seed=2)
    assert norm_kernel.applies(x, w)
    assert not norm_kernel.applies(x[:, :8], w)  # a few rows
    assert not norm_kernel.applies(x.half(), w)  # fp16
    assert not norm_kernel.applies(x[..., :40], w[:40])  # a width that is not a multiple of 16
    assert not norm_kernel.applies(x, w[:128])  # a weight of another width


@pytest.mark.parametrize("arch", ["x86-64", "haswell"])
def test_other_cpus_builds(tmp_path, arch):
    """Built for a CPU without AVX-512 (plain x86-64, AVX2) the kernel gives the same values."""
    lib = build_kernel_for("norm", arch, tmp_path)
    lib.gl_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_float, ctypes.c_void_p]  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        x, w = _inputs((40, 256), dtype, seed=3)
        out = torch.empty_like(x)
        wf = w.float()
        code = lib.gl_rms_norm(x.data_ptr(), int(dtype == torch.bfloat16), 40, 256, wf.data_ptr(), 1e-5, out.data_ptr())
        assert code == 0
        _close(out, _reference(x, w, 1e-5))
    assert lib.gl_rms_norm(x.data_ptr(), 1, 40, 8200, wf.data_ptr(), 1e-5, out.data_ptr()) == -1  # too wide


def test_without_kernels_the_module_uses_f_rms_norm(without_kernels):
    without_kernels(
        "import torch, torch.nn.functional as F; from gptoss_lite.kernels import norm; "
        "from gptoss_lite.model.transformer import RMSNorm; m = RMSNorm(256, 1e-5); x = torch.randn(1, 64, 256); "
        "assert not norm.applies(x, m.weight); torch.no_grad().__enter__(); "
        "assert torch.equal(m(x), F.rms_norm(x, (256,), m.weight, 1e-5))"
    )
