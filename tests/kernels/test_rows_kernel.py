"""The fp32 rows kernel (`kernels/rows.c`, `gptoss_lite::rows_mm`) against F.linear, its builds for
other CPUs, its place in the compiled decode step's `decode_linear`, and the fallback without it; the
rows' argmax (`gl_rows_argmax`, `sampling.greedy`'s fp32 path) against torch.argmax."""

from __future__ import annotations

import ctypes
import itertools
import os
import platform

import pytest
import torch
import torch.nn.functional as F

from conftest import build_kernel_for
from gptoss_lite.kernels import rows
from gptoss_lite.kernels.build import cpu_flags
from gptoss_lite.model import matmul


def _has_avx2() -> bool:
    flags = cpu_flags() or ""
    return " avx2" in flags and " fma" in flags


needs_kernel = pytest.mark.skipif(not rows.available(), reason="the rows kernel needs AVX2 + FMA and a C compiler")


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """got is F.linear(x, w, b) up to the order of the fp32 sums: each entry within 1e-6 of the size of
    its terms, sum |x| |w| + |b| (the output's scale can hide a sum that cancels)."""
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    assert got.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous()
    assert ((got.double() - want).abs() <= 1e-6 * scale.clamp_min(1e-30) + 1e-30).all()


def test_kernel_is_built_here():
    # gcc is on every machine this project runs its tests on, and its CPUs have AVX2 at least; a silent
    # fallback to F.linear would hide a build break.
    if platform.machine() != "x86_64" or not _has_avx2():
        pytest.skip("the vector paths are for x86-64 CPUs with AVX2")
    if os.environ.get("GPTOSS_LITE_NO_KERNELS") == "1":
        pytest.skip("GPTOSS_LITE_NO_KERNELS=1: the kernels are off on purpose (the suite's fallback run)")
    assert rows.available() and rows._library().isa in ("AVX2", "AVX-512")


@needs_kernel
@pytest.mark.parametrize("K", [8, 31, 256, 300])
def test_equals_f_linear_for_many_shapes(K):
    g = torch.Generator().manual_seed(K)
    for R in (1, 7, 384, 1000):
        w, b = torch.randn(R, K, generator=g), torch.randn(R, generator=g)
        for M in range(1, 71):
            x = torch.randn(M, K, generator=g)
            _check(rows.rows_mm(x, w, b), x, w, b)
            if M % 5 == 1:
                _check(rows.rows_mm(x, w, None), x, w, None)


@needs_kernel
@pytest.mark.parametrize("M, R, K", [(16, 64, 2880), (3, 33, 600), (5, 9, 257), (4, 4, 0), (0, 8, 16), (2, 0, 16)])
def test_long_rows_and_empty_shapes(M, R, K):
    """K past one chunk of the kernel's pieces (256 columns) is summed chunk by chunk; K = 0 gives the
    bias; no rows or no outputs give an empty result."""
    g = torch.Generator().manual_seed(M * R + K)
    x, w, b = torch.randn(M, K, generator=g), torch.randn(R, K, generator=g), torch.randn(R, generator=g)
    _check(rows.rows_mm(x, w, b), x, w, b)


@needs_kernel
def test_strided_inputs():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    for x in (torch.randn(96, 6, generator=g).T, torch.randn(6, 192, generator=g)[:, ::2]):
        assert not x.is_contiguous() and rows.traceable(x, w)
        _check(rows.rows_mm(x, w, b), x, w, b)
    x = torch.randn(6, 96, generator=g)
    _check(rows.rows_mm(x, w, b.bfloat16()), x, w, b.bfloat16().float())  # a bias in another dtype is widened
    assert not rows.traceable(x, w.T.contiguous().T)  # a weight that is not out-major stays with F.linear
    with pytest.raises(ValueError, match="rows_mm"):
        rows.rows_mm(x, w.T.contiguous().T, b)
    with pytest.raises(ValueError, match="rows_mm"):
        rows.rows_mm(x, w[:, :48], b)
    with pytest.raises(ValueError, match="rows_mm"):
        rows.rows_mm(x, w, b[:7])


def test_traceable_asks_for_fp32_cpu_tensors_without_autograd():
    x, w = torch.randn(4, 64), torch.randn(rows.MIN_WEIGHT // 64, 64)
    assert rows.traceable(x, w) == rows.available()
    assert not rows.traceable(x, w[:-1])  # a small weight (the router's) is faster through F.linear
    assert not rows.traceable(x.bfloat16(), w.bfloat16())
    assert not rows.traceable(x, w.bfloat16())
    assert not rows.traceable(x[None], w)
    assert not rows.traceable(x, w.requires_grad_(True))
    with torch.no_grad():
        assert rows.traceable(x, w) == rows.available()


@needs_kernel
def test_decode_linear_uses_the_kernel_for_fp32_rows(monkeypatch):
    calls = []
    real = rows.rows_mm

    def spy(x, w, b):
        calls.append(tuple(x.shape))
        return real(x, w, b)

    monkeypatch.setattr(matmul.rows_kernel, "rows_mm", spy)
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(520, 32, generator=g), torch.randn(520, generator=g)
    for M in (1, 2, 16):
        x = torch.randn(M, 32, generator=g)
        _check(matmul.decode_linear(x, w, b), x, w, b)
    matmul.decode_linear(torch.randn(3, 32).bfloat16(), w.bfloat16())  # bf16 rows: not this kernel
    matmul.decode_linear(torch.randn(3, 32), w[:8])  # a small weight: F.linear
    assert calls == [(2, 32), (16, 32)]  # one row stays a `gemv` reduction


@needs_kernel
def test_inside_torch_compile_with_a_dynamic_batch():
    """One graph (dynamic rows) calls the op for every M and gives F.linear's result. (The engine's
    own compiled step, with inductor's C++ wrapper, is tests/engine/test_compiled_engine.py.)"""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(540, 31, generator=g), torch.randn(540, generator=g)
    graphs = []

    def recorder(gm, example_inputs):  # the traced graph, before inductor
        graphs.append(gm.code)
        return gm.forward

    def step(x):
        return matmul.decode_linear(torch.relu(x), w, b) * 2

    for backend, options in ((recorder, None), ("inductor", None)):
        compiled = torch.compile(step, dynamic=True, fullgraph=True, backend=backend, options=options)
        with torch.inference_mode():
            for M in (2, 5, 17, 64, 3):
                x = torch.randn(M, 31, generator=g)
                got = compiled(x)
                torch.testing.assert_close(got, F.linear(torch.relu(x), w, b) * 2, rtol=1e-5, atol=1e-5)
    assert len(graphs) == 1 and "gptoss_lite.rows_mm" in graphs[0]
    torch._dynamo.reset()


def _argmax_cases(g: torch.Generator) -> list[torch.Tensor]:
    """Rows that tell argmax rules apart: ties (the first wins), NaN (the first NaN wins), ±inf, -0 and
    +0 (equal), a maximum in the last element of a tail, widths around the 16-lane vectors."""
    cases = []
    for V in (1, 5, 15, 16, 17, 31, 32, 33, 64, 65, 1000, 12_288):
        x = torch.randint(-3, 3, (9, V), generator=g).float()  # many ties
        x[1, V // 2] = float("nan")
        x[2] = float("-inf")
        x[3, -1] = float("inf")
        x[4] = 0.0
        x[4, V // 3] = -0.0
        x[5] = -0.0
        x[5, -1] = 0.0
        x[6, [V - 1, 0]] = float("nan")
        x[7] = torch.randn(V, generator=g)
        cases.append(x)
    return cases


@needs_kernel
def test_argmax_is_torch_argmax():
    g = torch.Generator().manual_seed(5)
    for x in _argmax_cases(g):
        assert torch.equal(rows.argmax(x), x.argmax(-1)), x.shape
        wide = torch.randn(x.shape[0], x.shape[1] + 7, generator=g)
        wide[:, 3 : 3 + x.shape[1]] = x
        view = wide[:, 3 : 3 + x.shape[1]]  # rows further apart than their width
        assert torch.equal(rows.argmax(view), x.argmax(-1))


def test_argmax_declines_what_it_does_not_serve():
    """None (torch.argmax's turn) for other dtypes, shapes and strides, an empty row, or autograd."""
    assert rows.argmax(torch.randn(4, 8, dtype=torch.float64)) is None
    assert rows.argmax(torch.randn(2, 4, 8)) is None
    assert rows.argmax(torch.randn(8, 4).t()) is None  # columns, not rows, are contiguous
    assert rows.argmax(torch.empty(3, 0)) is None
    assert rows.argmax(torch.randn(4, 8, requires_grad=True)) is None


def test_greedy_is_argmax_on_every_path():
    """`sampling.greedy` picks the same tokens through the kernel, through torch, for 16-bit and for
    1-d logits."""
    from gptoss_lite.sampling import greedy

    g = torch.Generator().manual_seed(6)
    for x in _argmax_cases(g):
        assert torch.equal(greedy(x), x.argmax(-1))
        assert torch.equal(greedy(x[0]), x[0].argmax(-1))
        assert torch.equal(greedy(x.bfloat16()), x.bfloat16().float().argmax(-1))


@pytest.mark.parametrize("arch, isa", [("x86-64", 0), ("haswell", 1)])
def test_other_cpus_builds_agree(tmp_path, arch, isa):
    """The C source as built for a CPU without AVX2 (the plain-C path) and for an AVX2-only CPU (no
    AVX-512) agrees with F.linear, so machines unlike this one get a correct kernel too."""
    lib = build_kernel_for("rows", arch, tmp_path)
    assert lib.gl_rows_isa() == isa
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gl_rows_mm.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr]
    g = torch.Generator().manual_seed(4)
    for M, R, K in itertools.product((1, 2, 3, 5, 16), (1, 7, 130), (7, 8, 31, 300)):
        x, w, b = torch.randn(M, K, generator=g), torch.randn(R, K, generator=g), torch.randn(R, generator=g)
        for bias in (b, None):
            out = torch.empty(M, R)
            lib.gl_rows_mm(
                x.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(), M, R, K, out.data_ptr()
            )
            _check(out, x, w, bias)
    lib.gl_rows_argmax.argtypes = [ptr, i64, i64, i64, ptr]
    for x in _argmax_cases(g):
        out = torch.empty(x.shape[0], dtype=torch.long)
        lib.gl_rows_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.shape[1], out.data_ptr())
        assert torch.equal(out, x.argmax(-1)), (arch, x.shape)


def test_fallback_without_kernels_agrees(without_kernels):
    script = (
        "import torch, torch.nn.functional as F; from gptoss_lite.kernels import rows; "
        "from gptoss_lite.model.matmul import decode_linear; "
        "assert not rows.available(); x, w, b = torch.randn(5, 40), torch.randn(420, 40), torch.randn(420); "
        "assert not rows.traceable(x, w); "
        "assert torch.equal(decode_linear(x, w, b), F.linear(x, w, b)); "
        "assert torch.equal(rows.rows_mm(x, w, b), F.linear(x, w, b)); "
        "from gptoss_lite.sampling import greedy; y = torch.randn(16, 1000); "
        "assert rows.argmax(y) is None and torch.equal(greedy(y), y.argmax(-1))"
    )
    without_kernels(script)
