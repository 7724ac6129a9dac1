"""The grouped-expert kernel (`kernels/moe.c`, `gptoss_lite::moe_experts`) against the reduction it
replaces (`Experts.decode_step`, weighted and summed), its place in `MoE.decode_step` and the compiled
step, the inputs it refuses, and the machines without it (builds without AVX-512 report no path;
GPTOSS_LITE_NO_KERNELS=1 keeps the reduction)."""

from __future__ import annotations

import ctypes
import os
import platform

import pytest
import torch

from conftest import build_kernel_for, make_model
from gptoss_lite.kernels import moe as moe_kernel
from gptoss_lite.kernels.build import cpu_flags
from gptoss_lite.model.moe import Experts, activate_halves_reference, combine_reference

needs_kernel = pytest.mark.skipif(not moe_kernel.dtypes(), reason="the grouped-expert kernel needs AVX-512")
needs_bf16 = pytest.mark.skipif("bfloat16" not in moe_kernel.dtypes(), reason="bf16 tiles need AVX-512 BF16")


def _flags() -> str:
    return cpu_flags() or ""


def _experts(E, C, I, activation, bias, dtype, seed, scale=0.5):
    torch.manual_seed(seed)
    ex = Experts(E, C, I, activation, 7.0, bias)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, scale)
    ex = ex.to(dtype)
    ex.pack_for_decode(input_major=False)  # the compiled step's layout
    return ex


def _routing(B, A, E, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(B)])
    weights = torch.softmax(torch.randn(B, A, generator=g), dim=-1).to(dtype).float()
    return idx, weights


def _reduction(ex, h, idx, weights):
    """What the kernel replaces: each row's experts by `decode_step` (one product per (row, expert)),
    weighted and summed in fp32, and the size of the terms, Σ_a |w| |out|."""
    outs = ex.decode_step(h, idx)  # (B, A, C)
    return (outs * weights[..., None]).sum(dim=1), (outs.abs() * weights.abs()[..., None]).sum(dim=1)


def _close_fp32(got, want):
    """Equal up to the order of fp32 sums: within 1e-6 of the largest output (an error in a product,
    an expert or a weight moves outputs by far more)."""
    assert ((got - want).abs() <= 1e-6 * want.abs().max() + 1e-6).all(), (got - want).abs().max()


def test_kernel_is_built_here():
    if platform.machine() != "x86_64" or " avx512f" not in _flags():
        pytest.skip("the kernel is built for x86-64 CPUs with AVX-512")
    if os.environ.get("GPTOSS_LITE_NO_KERNELS") == "1":
        pytest.skip("GPTOSS_LITE_NO_KERNELS=1: the kernels are off on purpose (the suite's fallback run)")
    want = ("float32", "bfloat16") if " avx512_bf16" in _flags() else ("float32",)
    assert moe_kernel.dtypes() == want


# (E, C, I, B, A): the 20M model's layer at 16 rows; widths off every vector size; experts with no
# rows (2 rows of 8 experts); a row count above 4 per expert; one expert a row; 64 rows
SHAPES = [(8, 256, 256, 16, 2), (5, 40, 24, 3, 3), (8, 33, 17, 2, 2), (3, 64, 96, 21, 2), (4, 48, 32, 6, 1),
          (8, 128, 64, 64, 4)]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("activation", ["swiglu", "gptoss"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_equals_the_reduction(shape, activation, bias):
    E, C, I, B, A = shape
    ex = _experts(E, C, I, activation, bias, torch.float32, seed=B + C)
    h = torch.randn(B, C, generator=torch.Generator().manual_seed(1))
    idx, weights = _routing(B, A, E, torch.float32, seed=2)
    with torch.no_grad():
        got = moe_kernel.experts(h, idx, weights, ex._gate_up[0], ex._gate_up[1], ex.down_proj, ex.down_bias,
                                 activation == "swiglu", 7.0)  # fmt: skip
        want, _ = _reduction(ex, h, idx, weights)
    assert got.dtype == torch.float32 and got.shape == (B, C)
    # fp32 sums in another order, and exp within a few ulp, through two products
    _close_fp32(got, want)


@needs_bf16
@pytest.mark.parametrize("activation", ["swiglu", "gptoss"])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_rounds_where_the_reduction_rounds(shape, activation):
    """Each expert's gate_up sums, activation and output are rounded to bf16 as the reduction rounds
    them; the order of the fp32 sums differs, which flips a rounding now and then. So: within 2^-7 of
    the terms everywhere (two bf16 roundings that went the other way), and exactly equal in most places."""
    E, C, I, B, A = shape
    ex = _experts(E, C, I, activation, True, torch.bfloat16, seed=B + C)
    h = torch.randn(B, C, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    idx, weights = _routing(B, A, E, torch.bfloat16, seed=2)
    with torch.no_grad():
        got = ex.weighted_sum(h, idx, weights)  # B >= 2: the kernel
        want, size = _reduction(ex, h, idx, weights)
    assert ((got - want).abs() <= 2**-7 * size + 1e-6).all(), (got - want).abs().max()
    assert (got == want).float().mean() >= 0.5


@needs_kernel
def test_weighted_sum_takes_the_kernel_for_two_rows_or_more(monkeypatch):
    calls = []
    real = moe_kernel.experts
    monkeypatch.setattr(moe_kernel, "experts", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    ex = _experts(4, 32, 16, "gptoss", True, torch.float32, seed=0)
    with torch.no_grad():
        for B in (1, 2, 5):
            idx, weights = _routing(B, 2, 4, torch.float32, seed=B)
            ex.weighted_sum(torch.randn(B, 32), idx, weights)
        ex.pack_for_decode(input_major=True)  # the eager layout: not the kernel's
        ex.weighted_sum(torch.randn(3, 32), *_routing(3, 2, 4, torch.float32, seed=3))
    assert calls == [2, 5]
    with torch.enable_grad():  # training keeps the differentiable reduction
        assert not moe_kernel.serves(torch.randn(3, 32, requires_grad=True), ex._gate_up[0], ex.down_proj)


@needs_kernel
def test_bad_inputs_are_refused():
    ex = _experts(4, 32, 16, "swiglu", True, torch.float32, seed=0)
    gu, gb, dn, db = ex._gate_up[0], ex._gate_up[1], ex.down_proj, ex.down_bias
    h = torch.randn(3, 32)
    idx, weights = _routing(3, 2, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="outside"):
        moe_kernel.experts(h, idx + 4, weights, gu, gb, dn, db, True, 7.0)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_kernel.experts(h, idx, weights[:, :1], gu, gb, dn, db, True, 7.0)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_kernel.experts(h.double(), idx, weights, gu, gb, dn, db, True, 7.0)
    with pytest.raises(ValueError, match="moe_experts"):
        moe_kernel.experts(h, idx, weights, gu, gb[:, :8], dn, db, True, 7.0)


@needs_kernel
@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny"])  # shared expert and swiglu; biases, clamped
def test_compiled_batched_step_calls_the_kernel_and_matches_eager(preset):
    from gptoss_lite.kv.mixed import MixedKVCache

    eager = make_model(preset)
    compiled = make_model(preset).prepare_for_inference(compile_decode=True)
    prompt = torch.randint(0, eager.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        cache, side = MixedKVCache(eager.config, batch_size=3), MixedKVCache(compiled.config, batch_size=3, capacity=20)
        logits = eager.prefill(prompt, cache, 2048)
        compiled.prefill(prompt, side, 2048)
        for i in range(4):
            token = logits[:, -1].argmax(-1)
            logits = eager(token[:, None], cache=cache, start_pos=11 + i, last_only=True).logits
            fast = compiled.compiled_decoder.step(side.static_decode(), token)
            side.advance(1)
            torch.testing.assert_close(fast, logits[:, -1], atol=1e-4, rtol=0)
        assert any("moe_experts" in g for g in _traced_graphs(compiled, side))


def _traced_graphs(model, cache):
    """The FX graphs dynamo captures for the model's step over `cache` (through a recording backend,
    which compiles nothing)."""
    graphs = []

    def record(gm, _inputs):
        graphs.append(gm.code)
        return gm.forward

    step = torch.compile(model.decode_step, backend=record, fullgraph=True, dynamic=False)
    step(torch.zeros(cache.batch_size, dtype=torch.long), cache.static_decode())
    torch._dynamo.reset()
    return graphs


def _group_agrees(lib: ctypes.CDLL) -> None:
    """lib's gl_moe_group against MoE.forward's PyTorch grouping (stable argsort, index_select, scatter)."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.gl_moe_group.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr]
    g = torch.Generator().manual_seed(7)
    x, idx = torch.randn(50, 24, generator=g), torch.randint(0, 6, (50, 2), generator=g)
    counts, at, out = torch.empty(6, dtype=torch.long), torch.empty(50, 2, dtype=torch.long), torch.empty(100, 24)
    code = lib.gl_moe_group(x.data_ptr(), 4, idx.data_ptr(), 50, 2, 24, 6, counts.data_ptr(), at.data_ptr(),
                            out.data_ptr())  # fmt: skip
    order = torch.argsort(idx.reshape(-1), stable=True)
    want_at = torch.empty_like(order)
    want_at[order] = torch.arange(100)
    assert code == 0 and torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=6))
    assert torch.equal(at.view(-1), want_at) and torch.equal(out, x.index_select(0, order // 2))
    lib.gl_moe_topk.argtypes = [ptr, ctypes.c_int, i64, i64, i64, ptr, ptr, ptr]
    lib.gl_moe_topk.restype = i64
    logits, vals, top = torch.randn(50, 8, generator=g), torch.empty(50, 2), torch.empty(50, 2, dtype=torch.long)
    tied = torch.empty(50, dtype=torch.uint8)
    assert lib.gl_moe_topk(logits.data_ptr(), 0, 50, 8, 2, vals.data_ptr(), top.data_ptr(), tied.data_ptr()) == 0
    want = logits.topk(2, dim=-1)
    assert torch.equal(vals, want.values) and torch.equal(top, want.indices)


@pytest.mark.parametrize("arch, isa", [("x86-64", 0), ("haswell", 0), ("skylake-avx512", 1)])
def test_other_cpus_builds(tmp_path, arch, isa):
    """Built for a CPU without AVX-512 the library compiles, reports no path, and refuses a call
    (nothing written); built for AVX-512 without BF16 it serves fp32 only, and agrees with the
    reduction where this CPU can run it. Prefill's grouping, plain C, agrees in every build."""
    lib = build_kernel_for("moe", arch, tmp_path, run=False)  # only called below where this CPU runs it
    assert lib.gl_moe_isa() == isa
    if isa and " avx512f" not in _flags():
        return
    if arch != "haswell" or " avx2" in _flags():
        _group_agrees(lib)  # plain C in every build
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.gl_moe_experts.argtypes = [ptr, i32, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i32,
                                   ctypes.c_float, ptr]  # fmt: skip
    ex = _experts(4, 40, 24, "gptoss", True, torch.float32, seed=0)
    h = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    idx, weights = _routing(5, 2, 4, torch.float32, seed=0)
    out = torch.full((5, 40), 7.0)
    args = (idx.data_ptr(), weights.data_ptr(), 5, 2, ex._gate_up[0].data_ptr(), ex._gate_up[1].data_ptr(),
            ex.down_proj.data_ptr(), ex.down_bias.data_ptr(), 4, 40, 24, 0, 7.0, out.data_ptr())  # fmt: skip
    code = lib.gl_moe_experts(h.data_ptr(), 0, *args)
    if isa == 0:
        assert code == -1 and (out == 7.0).all()
        lib.gl_moe_activate.argtypes = [ptr, i32, i64, i64, i32, ctypes.c_float, ptr]
        lib.gl_moe_combine.argtypes = [ptr, ptr, i64, i32, ptr, ptr, i64, i64, i64, ptr]
        assert lib.gl_moe_activate(h.data_ptr(), 0, 5, 20, 0, 7.0, out.data_ptr()) == -1
        bases, starts = torch.tensor([h.data_ptr()]), torch.tensor([0, 5])
        code = lib.gl_moe_combine(bases.data_ptr(), starts.data_ptr(), 1, 0, idx.data_ptr(), weights.data_ptr(), 5, 2,
                                  40, out.data_ptr())  # fmt: skip
        assert code == -1
        assert (out == 7.0).all()  # the prefill passes have no path there either: nothing written
        return
    assert code == 0
    with torch.no_grad():
        want, _ = _reduction(ex, h, idx, weights)
    _close_fp32(out, want)
    assert lib.gl_moe_experts(h.bfloat16().data_ptr(), 1, *args) == -1  # no bf16 tiles in this build


def test_fallback_without_kernels_agrees(without_kernels):
    script = (
        "import torch; from gptoss_lite.kernels import moe; from gptoss_lite.model.moe import Experts; "
        "assert moe.dtypes() == (); ex = Experts(4, 32, 16, 'gptoss', 7.0, True); "
        "ex.pack_for_decode(input_major=False); h = torch.randn(3, 32); "
        "idx = torch.tensor([[0, 1], [2, 3], [1, 2]]); w = torch.rand(3, 2); "
        "assert not moe.serves(h, ex._gate_up[0], ex.down_proj); "
        "torch.no_grad().__enter__(); "
        "assert torch.equal(ex.weighted_sum(h, idx, w), (ex.decode_step(h, idx) * w[..., None]).sum(1))"
    )
    without_kernels(script)


# Prefill's passes: `activate` and `combine` (around PyTorch's GEMMs in `MoE.forward` over many tokens).

needs_prefill_passes = pytest.mark.skipif(
    moe_kernel._prefill_library(torch.zeros(1)) is None, reason="prefill's MoE passes need AVX-512"
)


@needs_prefill_passes
@pytest.mark.parametrize("swiglu", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, I", [(0, 16), (1, 40), (37, 24), (300, 256)])
def test_activate_equals_the_reference(n, I, dtype, swiglu):
    # values past the clamp limit (7) on both sides, and large negative gates (sigmoid near 0)
    gate_up = (torch.randn(n, 2 * I, generator=torch.Generator().manual_seed(n + I)) * 6).to(dtype)
    got = moe_kernel.activate(gate_up, swiglu, 7.0)
    want = activate_halves_reference(gate_up, "swiglu" if swiglu else "gptoss", 7.0)
    assert got.shape == (n, I) and got.dtype == dtype
    if dtype == torch.float32:  # the kernel's e^x and PyTorch's differ by ulps
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:  # both round the same fp32 value once: at most one bf16 step apart
        exact = activate_fp32(gate_up.float(), swiglu)
        assert ((got.float() - exact).abs() <= 2**-8 * exact.abs() + 1e-30).all()
        assert ((want.float() - exact).abs() <= 2**-8 * exact.abs() + 1e-30).all()


def activate_fp32(gate_up, swiglu):
    from gptoss_lite.model.moe import activate

    return activate(*gate_up.chunk(2, dim=-1), "swiglu" if swiglu else "gptoss", 7.0)


@needs_prefill_passes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, A, C", [(1, 1, 16), (5, 2, 40), (300, 4, 256)])
@pytest.mark.parametrize("n_pieces", [1, 3, 8])
def test_combine_equals_the_reference(N, A, C, dtype, n_pieces):
    g = torch.Generator().manual_seed(N * A + C)
    rows = torch.randn(N * A + 3, C, generator=g).to(dtype)  # three rows no token takes
    at = torch.randperm(N * A + 3, generator=g)[: N * A].view(N, A)
    weights = torch.softmax(torch.randn(N, A, generator=g), dim=-1).to(dtype)
    # the rows in pieces of random sizes (each a tensor of its own, as each expert's product writes it)
    cuts = sorted(torch.randint(1, rows.shape[0], (n_pieces - 1,), generator=g).tolist())
    pieces = [rows[a:b].clone() for a, b in zip([0, *cuts], [*cuts, rows.shape[0]]) if b > a]
    got = moe_kernel.combine(pieces, at, weights)
    # the same fp32 products, summed in the same order and rounded once: equal, bit for bit
    assert got.dtype == dtype and torch.equal(got, combine_reference(rows, at, weights))


@pytest.mark.skipif(moe_kernel._library() is None, reason="no C compiler: MoE.forward groups with PyTorch's ops")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, A, E, C", [(1, 1, 4, 16), (7, 2, 8, 40), (300, 4, 32, 256), (64, 2, 8, 8)])
def test_group_equals_the_sort_it_replaces(N, A, E, C, dtype):
    """The counting sort and gather against what MoE.forward builds with PyTorch: a stable argsort of
    the experts, bincount, index_select and the scatter of each place."""
    g = torch.Generator().manual_seed(N + E)
    x = torch.randn(N, C, generator=g).to(dtype)
    idx = torch.randint(0, E if N != 64 else 2, (N, A), generator=g)  # N = 64: two experts, long runs of ties
    sorted_x, counts, at = moe_kernel.group(x, idx, E)
    order = torch.argsort(idx.reshape(-1), stable=True)
    want_at = torch.empty_like(order)
    want_at[order] = torch.arange(order.numel())
    assert counts == torch.bincount(idx.reshape(-1), minlength=E).tolist()
    assert torch.equal(at, want_at.view(N, A))
    assert torch.equal(sorted_x, x.index_select(0, order // A))


@pytest.mark.skipif(moe_kernel._library() is None, reason="no C compiler: MoE.forward asks torch.topk")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, E, k", [(1, 8, 2), (300, 8, 2), (64, 32, 4), (5, 4, 4), (9, 128, 4)])
def test_topk_is_torch_topk(N, E, k, dtype):
    """The same values and indices in the same order as torch.topk, on random rows and on rows built
    with ties (the kernel hands those to torch.topk) and a NaN."""
    g = torch.Generator().manual_seed(N + E)
    logits = (3 * torch.randn(N, E, generator=g)).to(dtype)
    logits[-1, :2] = logits[-1].max() + 1  # the two largest of a row equal
    if k < E:
        logits[0] = torch.arange(E, dtype=dtype)
        logits[0, E - k - 1] = logits[0, E - k]  # the k-th and the (k+1)-th largest equal
    if N > 2:
        logits[1, 0] = float("nan")
    got = moe_kernel.topk(logits, k)
    want = logits.topk(k, dim=-1)
    assert got is not None and got[0].dtype == dtype
    torch.testing.assert_close(got[0], want.values, rtol=0, atol=0, equal_nan=True)  # the same bits, NaN too
    assert torch.equal(got[1], want.indices)


@pytest.mark.skipif(moe_kernel._library() is None, reason="no C compiler: MoE.forward groups with PyTorch's ops")
def test_group_refuses_an_expert_outside_the_range():
    with pytest.raises(IndexError, match=r"outside \[0, 4\)"):
        moe_kernel.group(torch.randn(3, 8), torch.tensor([[0, 1], [2, 4], [1, 1]]), 4)
    assert moe_kernel.group(torch.randn(3, 8, requires_grad=True), torch.zeros(3, 2, dtype=torch.long), 4) is None


@needs_prefill_passes
def test_combine_refuses_a_place_outside_the_rows():
    rows, weights = torch.randn(4, 16), torch.ones(2, 2)
    with pytest.raises(IndexError, match="outside the 4 rows"):
        moe_kernel.combine([rows[:1], rows[1:]], torch.tensor([[0, 1], [2, 4]]), weights)
    assert moe_kernel.combine([rows, torch.randn(2, 8)], torch.tensor([[0, 1]]), weights[:1]) is None  # widths differ


@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_moe_equals_the_training_forward(preset, dtype, monkeypatch):
    """`MoE.forward` over many tokens at inference (packed weights: one gate|up GEMM per expert, the
    kernel's passes where built) equals the training forward (two GEMMs per expert, PyTorch's passes,
    index_add_), and so does the same inference path with PyTorch's passes and grouping."""
    model = make_model(preset).to(dtype)
    moe = model.blocks[0].moe
    x = torch.randn(1, 200, model.config.d_model, generator=torch.Generator().manual_seed(1)).to(dtype)
    want, _ = moe(x, need_aux=True)  # gradients on: the training forward
    moe.experts.pack_for_decode()
    with torch.no_grad():
        assert moe.experts.is_packed()
        fast, _ = moe(x, need_aux=False)
        monkeypatch.setattr(moe_kernel, "_prefill_library", lambda *t: None)
        monkeypatch.setattr(moe_kernel, "group", lambda *a: None)
        torch_passes, _ = moe(x, need_aux=False)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.03, rtol=0.03)
    torch.testing.assert_close(fast, want.detach(), **tol)
    torch.testing.assert_close(torch_passes, want.detach(), **tol)
    assert fast.dtype == dtype


def test_prefill_passes_fall_back_without_kernels(without_kernels):
    script = (
        "import torch; from gptoss_lite.kernels import moe; from gptoss_lite.model import moe as m; "
        "assert moe._prefill_library(torch.zeros(1)) is None; "
        "gu = torch.randn(9, 32); rows = torch.randn(6, 8); at = torch.tensor([[0, 5], [3, 2]]); w = torch.rand(2, 2); "
        "assert moe.activate(gu, False, 7.0) is None and moe.combine([rows], at, w) is None; "
        "assert moe.group(rows, at, 6) is None and moe.topk(rows, 2) is None; "
        "assert torch.equal(m.activate_halves(gu, 'gptoss', 7.0), m.activate_halves_reference(gu, 'gptoss', 7.0)); "
        "assert torch.equal(m.combine([rows[:2], rows[2:]], at, w), m.combine_reference(rows, at, w))"
    )
    without_kernels(script)
