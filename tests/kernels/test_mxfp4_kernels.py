"""The MXFP4 kernels (C and PyTorch fallback) against the table-lookup reference."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import build_kernel_for
from gptoss_lite.kernels import mxfp4


def codes(E: int, R: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, R, K // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (E, R, K // 32), dtype=torch.uint8, generator=g)
    scales[0, 0, 0] = 0  # the smallest scale: 2^-127, a subnormal factor
    return blocks, scales


def test_reference_table():
    # byte 0x9F: low nibble 15 (-6) is element 0, high nibble 9 (-0.5) element 1; scale 128 = 2^1
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[..., 0] = 0x9F
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)
    w = mxfp4.reference_rows(blocks, scales)
    assert w[0, 0, :3].tolist() == [-12.0, -1.0, 0.0]


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 11])
# blocks per row: 2, 4, 5, 6, 7, 9 (quads of blocks and each rest: none, a single block, a pair, both)
@pytest.mark.parametrize("k", [64, 128, 160, 192, 224, 288])
def test_matvec_matches_reference(rows, k):
    blocks, scales = codes(5, 72, k)
    w = mxfp4.reference_rows(blocks, scales)  # (E, R, K)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    experts = torch.randint(0, 5, (rows,), generator=g)
    bias = torch.randn(5, 72, generator=g)
    want = torch.einsum("mrk,mk->mr", w[experts].double(), x.double()) + bias[experts].double()
    got = mxfp4.matvec(x, blocks, scales, experts, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 72)
    assert ((got.double() - want).abs() / want.abs().max()).max().item() < 1e-6
    nobias = mxfp4.matvec(x.bfloat16(), blocks, scales, experts, None)
    want_nb = torch.einsum("mrk,mk->mr", w[experts].double(), x.bfloat16().double())
    assert ((nobias.double() - want_nb).abs() / want_nb.abs().max()).max().item() < 1e-6


@pytest.mark.parametrize("k", [64, 160])  # the block with scale 0 decoded alone, or in a quad of blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matvec_smallest_scale_is_exact(k, dtype):
    # scale 0 is 2^-127, the one factor that is subnormal in fp32: a kernel that builds factors from the
    # scale's bits must not make it 0
    blocks = torch.zeros(1, 1, k // 32, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x02  # element 0 is code 2 (1.0), the rest 0
    scales = torch.full((1, 1, k // 32), 127, dtype=torch.uint8)
    scales[0, 0, 0] = 0
    got = mxfp4.matvec(torch.ones(1, k, dtype=dtype), blocks, scales, torch.zeros(1, dtype=torch.int64), None)
    assert got.item() == 2.0**-127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_rows_is_exact(dtype):
    blocks, scales = codes(2, 40, 96, seed=3)
    assert torch.equal(
        mxfp4.dequantize_rows(blocks[1], scales[1], dtype), mxfp4.reference_rows(blocks[1], scales[1]).to(dtype)
    )


def test_quantize_round_trip_and_shape_errors():
    w = mxfp4.reference_rows(*codes(2, 8, 64, seed=4)).transpose(1, 2)  # (E, in, out) HF layout
    blocks, scales = mxfp4.quantize_mxfp4(w)
    assert torch.equal(mxfp4.reference_rows(blocks, scales).transpose(1, 2), w)
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.reference_rows(blocks.int(), scales)
    with pytest.raises(ValueError, match="MXFP4 shapes"):
        mxfp4.reference_rows(blocks, scales[..., :1])


def test_native_kernel_is_built_here():
    # gcc is on every machine this project runs its tests on; a silent fallback would hide a build break.
    if os.environ.get("GPTOSS_LITE_NO_KERNELS") == "1":
        pytest.skip("GPTOSS_LITE_NO_KERNELS=1: the kernels are off on purpose (the suite's fallback run)")
    assert mxfp4.native_available()


def test_fallback_without_kernels_agrees(without_kernels):
    script = (
        "import torch; from gptoss_lite.kernels import mxfp4 as m; "
        "assert not m.native_available(); "
        "g = torch.Generator().manual_seed(0); "
        "b = torch.randint(0, 256, (3, 16, 2, 16), dtype=torch.uint8, generator=g); "
        "s = torch.randint(120, 130, (3, 16, 2), dtype=torch.uint8, generator=g); "
        "x = torch.randn(4, 64, generator=g); e = torch.tensor([2, 0, 2, 1]); "
        "w = m.reference_rows(b, s); ref = torch.einsum('mrk,mk->mr', w[e], x); "
        "assert (m.matvec(x, b, s, e, None) - ref).abs().max() < 1e-4; "
        # the int8 path's fallback: the same rounding, then the products
        "q, d = m.quantize_activations(x); xd = (q.double().view(4, 2, 32) * d.double()[..., None]).view(4, 64); "
        "ref8 = torch.einsum('mrk,mk->mr', w.double()[e], xd); "
        "assert (m.matvec_int8(x, b, s, e, None).double() - ref8).abs().max() < 1e-4 < (ref8 - ref).abs().max()"
    )
    without_kernels(script)


@pytest.mark.parametrize("rows, out, k", [(1, 100, 2880), (3, 77, 4096), (1, 33, 50), (4, 9, 31)])
def test_bf16_gemv_equals_f_linear(rows, out, k):
    from gptoss_lite.kernels import bf16

    if not bf16.available():
        pytest.skip("no bf16 GEMV built here (it needs AVX2 and FMA): linear keeps F.linear")
    g = torch.Generator().manual_seed(rows * out)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((rows, k), (out, k), (out,)))
    assert bf16.applies(x, w) and not bf16.applies(torch.cat([x] * 5), w)
    got = bf16.gemv(x, w, b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() / want.abs().max()).max().item() < 8e-3  # one bf16 rounding
    assert (
        got.float() - torch.nn.functional.linear(x, w, b).float()
    ).abs().max().item() <= 2 * 2**-7 * want.abs().max()


@pytest.mark.parametrize("rows, out, k", [(16, 12288, 256), (16, 77, 2880), (7, 33, 50), (6, 9, 31), (2, 5, 64)])
def test_bf16_gemv_of_many_rows_equals_f_linear(rows, out, k):
    """The compiled step's op over more rows than one weight load serves (register tiles of 4 weight
    rows by up to 4 rows, edges of both included): F.linear's fp32 sums, to fp32 rounding."""
    from gptoss_lite.kernels import bf16

    if not bf16.available():
        pytest.skip("no bf16 GEMV built here (it needs AVX2 and FMA): linear keeps F.linear")
    g = torch.Generator().manual_seed(rows * out + k)
    x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((rows, k), (out, k), (out,)))
    got = bf16.gemv_fp32(x, w, b)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    assert (got.double() - want).abs().max().item() < 1e-5 * k**0.5 * want.abs().max().item()


@pytest.mark.parametrize("arch, path", [("x86-64", 0), ("haswell", 1), ("skylake-avx512", 1)])
def test_bf16_gemv_of_other_cpus_builds(tmp_path, arch, path):
    """bf16.c as built for a CPU without AVX2 (no GEMV: the op stays unbound), an AVX2-only one and an
    AVX-512 one without BF16 (the AVX2 path: each 16 weights widened by a shift and a mask against x's
    even and odd columns): the fp32 sums of the exact products, to fp32 rounding, for 1 to 9 rows (one
    to four a weight load, then the next four), K with and without a tail past its 16-column steps,
    an odd number of them, and a bias or none."""
    import ctypes

    lib = build_kernel_for("bf16", arch, tmp_path)
    assert lib.gl_has_bf16_gemv() == path
    if not path:
        return
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gl_bf16_gemv.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr]
    for rows, out, k in [(1, 70, 2880), (2, 33, 48), (3, 5, 31), (4, 40, 16), (5, 9, 7), (9, 37, 100), (1, 3, 272)]:
        g = torch.Generator().manual_seed(rows * out + k)
        x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(out, k, generator=g).bfloat16()
        b = torch.randn(out, generator=g) if rows % 2 else None
        got = torch.full((rows, out), float("nan"))
        lib.gl_bf16_gemv(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), rows, out, k, got.data_ptr())
        want = x.double() @ w.double().T + (0 if b is None else b.double())
        assert (got.double() - want).abs().max().item() < 1e-6 * k**0.5 * want.abs().max().item(), (rows, out, k)


@pytest.mark.parametrize("arch", ["x86-64", "haswell"])
def test_other_cpus_builds_agree(tmp_path, arch):
    """The C source as built for a CPU without AVX2 (the scalar path) and for an AVX2-only CPU (no
    AVX-512): both agree with the reference, so machines unlike this one get correct kernels too."""
    import ctypes

    lib = build_kernel_for("mxfp4", arch, tmp_path)
    assert lib.gl_has_avx2() == (arch == "haswell") and lib.gl_has_bf16_dot() == 0
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gl_mxfp4_matvec.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]
    lib.gl_mxfp4_dequant.argtypes = [ptr, ptr, i64, i64, ptr, ctypes.c_int]
    blocks, scales = codes(5, 72, 160, seed=7)
    g = torch.Generator().manual_seed(7)
    x, experts, bias = torch.randn(7, 160, generator=g), torch.randint(0, 5, (7,), generator=g), torch.randn(5, 72)
    out = torch.empty(7, 72)
    lib.gl_mxfp4_matvec(
        x.data_ptr(),
        0,
        blocks.data_ptr(),
        scales.data_ptr(),
        experts.data_ptr(),
        bias.data_ptr(),
        7,
        5,
        72,
        5,
        out.data_ptr(),
    )
    w = mxfp4.reference_rows(blocks, scales)
    want = torch.einsum("mrk,mk->mr", w[experts].double(), x.double()) + bias[experts].double()
    assert ((out.double() - want).abs() / want.abs().max()).max().item() < 1e-6
    dense = torch.empty(72, 160, dtype=torch.bfloat16)
    lib.gl_mxfp4_dequant(blocks[1].data_ptr(), scales[1].data_ptr(), 72, 5, dense.data_ptr(), 1)
    assert torch.equal(dense, w[1].bfloat16())
    # the int8-activation path of that build (AVX2: vpmaddubsw; plain C: scalar), fp32 and bf16 inputs
    lib.gl_mxfp4_matvec_q8.argtypes = lib.gl_mxfp4_matvec.argtypes
    for xx in (x, x.bfloat16()):
        got = torch.empty(7, 72)
        args = (blocks.data_ptr(), scales.data_ptr(), experts.data_ptr(), bias.data_ptr(), 7, 5, 72, 5, got.data_ptr())
        lib.gl_mxfp4_matvec_q8(xx.data_ptr(), int(xx.dtype == torch.bfloat16), *args)
        want = int8_reference(xx, w, experts) + bias[experts].double()
        assert ((got.double() - want).abs() / want.abs().max()).max().item() < 1e-6
    # a block at the smallest scale after ordinary ones, as `test_matvec_int8_smallest_scale` asks of this
    # CPU's build: the AVX2 path had rounded each block's four partial sums (large, of both signs) one by
    # one, which left 0.0 here, where each block's sum must be exact before it is scaled
    tiny, tiny_scales = small_scale_case()
    ones, first, got = torch.ones(1, 17 * 32), torch.zeros(1, dtype=torch.int64), torch.empty(1, 1)
    lib.gl_mxfp4_matvec_q8(
        ones.data_ptr(), 0, tiny.data_ptr(), tiny_scales.data_ptr(), first.data_ptr(), None, 1, 1, 1, 17, got.data_ptr()
    )
    assert got.item() == 2.0**-127


def int8_reference(x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """What `matvec_int8` computes, in float64: x rounded by `quantize_activations`, times the exact weights."""
    M, K = x.shape
    q, d = mxfp4.quantize_activations(x)
    xd = (q.double().view(M, K // 32, 32) * d.double()[..., None]).view(M, K)
    return torch.einsum("mrk,mk->mr", w[experts].double(), xd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rounding_of_the_kernel_is_the_reference(dtype):
    if not mxfp4.native_available():
        pytest.skip("the kernels are off")
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 320, generator=g) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
    x[2, 32:64] = 0  # an all-zero block: step 0, codes 0
    x[3, :32] = torch.linspace(-1, 1, 32)  # exact ties after scaling round to even
    q, d = mxfp4.quantize_activations(x)
    nq, nd = mxfp4.native_quantize_activations(x)
    assert torch.equal(q, nq) and torch.equal(d, nd)
    assert q.abs().max() == 127 and torch.equal(q[2, 32:64], torch.zeros(32, dtype=torch.int8)) and d[2, 1] == 0
    err = (q.float().view(6, 10, 32) * d[..., None] - x.float().view(6, 10, 32)).abs()
    assert (err <= d[..., None] / 2 * (1 + 1e-6)).all()  # each input moves by at most half a step


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("k", [32, 160, 512, 544, 2880])  # blocks per row: 1, 5, 16, 17, 90 (whole sets and the rest)
def test_matvec_int8_matches_its_reference(rows, k):
    blocks, scales = codes(4, 40, k, seed=k)
    w = mxfp4.reference_rows(blocks, scales)
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=g)
    experts = torch.randint(0, 4, (rows,), generator=g)
    bias = torch.randn(4, 40, generator=g)
    for xx in (x, x.bfloat16()):
        want = int8_reference(xx, w, experts) + bias[experts].double()
        got = mxfp4.matvec_int8(xx, blocks, scales, experts, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, 40)
        assert ((got.double() - want).abs() / want.abs().max()).max().item() < 1e-6
        # and its distance from the exact products is the inputs' rounding: at most half a step per input
        exact = torch.einsum("mrk,mk->mr", w[experts].double(), xx.double()) + bias[experts].double()
        _, d = mxfp4.quantize_activations(xx)
        bound = torch.einsum("mrg,mg->mr", w[experts].abs().double().view(rows, 40, -1, 32).sum(-1), d.double() / 2)
        assert ((got.double() - exact).abs() <= bound * 1.0001 + 1e-6).all()
        assert (got.double() - exact).abs().max() > 0  # it is not the exact path


def small_scale_case() -> tuple[torch.Tensor, torch.Tensor]:
    """One row of 17 blocks: the 17th (the second set's first) holds one code 2 (1.0) at scale 0, the rest
    zero codes at scale 127. Times ones, the product is 1.0 * 2^-127."""
    blocks = torch.zeros(1, 1, 17, 16, dtype=torch.uint8)
    blocks[0, 0, 16, 0] = 0x02
    scales = torch.full((1, 1, 17), 127, dtype=torch.uint8)
    scales[0, 0, 16] = 0
    return blocks, scales


def test_matvec_int8_smallest_scale():
    blocks, scales = small_scale_case()
    x = torch.ones(1, 17 * 32)
    got = mxfp4.matvec_int8(x, blocks, scales, torch.zeros(1, dtype=torch.int64), None)
    assert got.item() == 2.0**-127  # 1.0 * 2^-127, x = 1 exactly (127 codes of step 1/127)


def test_matvec_refuses_what_would_read_out_of_bounds():
    blocks, scales = codes(3, 8, 64)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 3\)"):
        mxfp4.matvec(x, blocks, scales, torch.tensor([0, 3]), None)
    with pytest.raises(ValueError, match="do not fit"):
        mxfp4.matvec(torch.randn(2, 96), blocks, scales, torch.tensor([0, 1]), None)
    with pytest.raises(ValueError, match=r"bias \[3, 7\] must be"):
        mxfp4.matvec(x, blocks, scales, torch.tensor([0, 1]), torch.zeros(3, 7))


needs_gate_up_act = pytest.mark.skipif(
    not mxfp4.gate_up_act_available(), reason="the one-pass gate|up activation is built with AVX-512 only"
)


def _gate_up_case(rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """codes of 5 experts with I = 36 (R = 72: four tasks of 16 rows and one of 8, i.e. of 4 pairs), k = 96,
    weights up to 12 so that gates fall on both sides of the clamp at 7; rows share experts beyond the 4
    that share a decoded block, and a block has the smallest scale"""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (5, 72, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 129, (5, 72, 3), dtype=torch.uint8, generator=g)
    scales[2, 1, 0] = 0
    x = torch.randn(rows, 96, generator=g)
    experts = torch.tensor([2, 2, 4, 2, 0, 2, 2, 1, 2, 3, 4][:rows])
    return blocks, scales, x, experts, torch.randn(5, 72, generator=g) * 3


@needs_gate_up_act
@pytest.mark.parametrize("rows", [1, 4, 11])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("swiglu", [True, False])
@pytest.mark.parametrize("int8", [False, True])
def test_gate_up_act_equals_its_reference(rows, dtype, swiglu, int8):
    from gptoss_lite.model.moe import activate

    blocks, scales, x, experts, bias = _gate_up_case(rows, rows)
    x = x.to(dtype)
    for b in (None, bias, bias.to(dtype)):
        got = mxfp4.gate_up_act(x, blocks, scales, experts, b, swiglu, 7.0, int8)
        assert got.dtype == dtype and got.shape == (rows, 36)
        # the steps one by one: the same sums, rounded alike, then the model's activation in fp32 (`exact`,
        # before the one rounding) and rounded (`want`)
        sums = mxfp4.matvec_int8 if int8 else mxfp4.matvec
        gate_up = sums(x, blocks, scales, experts, b).to(dtype).float()
        exact = activate(gate_up[:, 0::2], gate_up[:, 1::2], "swiglu" if swiglu else "gptoss", 7.0)
        want = exact.to(dtype)
        if dtype == torch.float32:  # e^x is the kernel's own (vec.h) and PyTorch's: they differ by ulps
            torch.testing.assert_close(got, want, atol=1e-30, rtol=1e-5)
        else:  # both round the same fp32 value once: a bf16 step apart at most, and rarely
            for value in (got, want):
                assert ((value.float() - exact).abs() <= 2**-8 * exact.abs() + 1e-30).all()
            assert (got == want).float().mean() >= 0.95
        assert (exact.abs() > 1).any() and (exact == 0).sum() < exact.numel() // 4  # a test with values in it


@needs_gate_up_act
def test_gate_up_act_refuses_what_it_cannot_do():
    blocks, scales, x, experts, bias = _gate_up_case(4, 0)
    with pytest.raises(ValueError, match="gate_up_act"):  # rows that are not (gate, up) pairs
        mxfp4.gate_up_act(x, blocks[:, :71], scales[:, :71], experts, None, True, 7.0, False)
    with pytest.raises(ValueError, match="gate_up_act"):
        mxfp4.gate_up_act(x.half(), blocks, scales, experts, None, True, 7.0, False)
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 5\)"):
        mxfp4.gate_up_act(x, blocks, scales, experts + 1, None, True, 7.0, False)
    with pytest.raises(ValueError, match="bias"):
        mxfp4.gate_up_act(x, blocks, scales, experts, bias[:, :70], True, 7.0, False)
    with pytest.raises(ValueError, match="on the CPU"):
        mxfp4.gate_up_act._init_fn(x.to("meta"), blocks, scales, experts, None, True, 7.0, False)


def test_gate_up_act_says_where_it_is_not_built(without_kernels):
    without_kernels(
        "import pytest, torch; from gptoss_lite.kernels import mxfp4 as m; assert not m.gate_up_act_available(); "
        "b, s = torch.zeros(2, 4, 1, 16, dtype=torch.uint8), torch.zeros(2, 4, 1, dtype=torch.uint8); "
        "pytest.raises(RuntimeError, m.gate_up_act, torch.ones(1, 32), b, s, torch.zeros(1, dtype=torch.long), "
        "None, True, 7.0, False)"
    )
