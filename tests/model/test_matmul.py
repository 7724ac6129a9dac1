"""model.matmul.linear: F.linear, except 16-bit products of many rows on CPUs without native bf16."""

import pytest
import torch
import torch.nn.functional as F

from gptoss_lite.model import matmul


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(matmul, "cpu_has_native_bf16", lambda: False)


@pytest.fixture
def native(monkeypatch):
    monkeypatch.setattr(matmul, "cpu_has_native_bf16", lambda: True)


def _inputs(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    w = torch.randn(48, 64, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_many_16_bit_rows_are_computed_in_fp32_and_rounded_once(no_native, dtype):
    x, w, b = _inputs(matmul.UPCAST_ROWS, dtype)
    y = matmul.linear(x, w, b)
    assert y.dtype == dtype
    assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).to(dtype))
    assert matmul.upcasts(x) and matmul.upcasts(x.view(2, -1, 64))  # rows count across leading dims


def test_few_rows_fp32_and_native_cpus_are_plain_f_linear(no_native, monkeypatch):
    for x, w, b in (_inputs(matmul.UPCAST_ROWS - 1, torch.bfloat16), _inputs(64, torch.float32)):
        assert not matmul.upcasts(x)
        assert torch.equal(matmul.linear(x, w, b), F.linear(x, w, b))
    monkeypatch.setattr(matmul, "cpu_has_native_bf16", lambda: True)
    x, w, b = _inputs(64, torch.bfloat16)
    assert not matmul.upcasts(x) and torch.equal(matmul.linear(x, w, b), F.linear(x, w, b))


def test_autocast_is_left_alone(no_native):
    x, w, b = _inputs(64, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not matmul.upcasts(x)


def test_gradients_flow_through_the_upcast(no_native):
    x, w, b = _inputs(16, torch.bfloat16)
    w.requires_grad_(True)
    matmul.linear(x, w, b).float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.bfloat16 and w.grad.abs().sum() > 0


def test_bf16_model_logits_match_either_way(no_native, monkeypatch):
    """A bf16 model's prefill and decode logits with the fp32 products are those of bf16 products, to
    bf16 precision (both accumulate in fp32 and round once)."""
    from conftest import make_model
    from gptoss_lite.kv.mixed import MixedKVCache

    model = make_model("gpt-oss-tiny").to(torch.bfloat16).prepare_for_inference()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))

    def run():
        with torch.inference_mode():
            cache = MixedKVCache(model.config)
            a = model(ids, cache=cache).logits
            return a, model(ids[:, -1:], cache=cache, start_pos=40).logits

    up = run()
    monkeypatch.setattr(matmul, "cpu_has_native_bf16", lambda: True)
    plain = run()
    for a, b in zip(up, plain):
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("out_rows, fused", [(384, True), (4096, False)])
def test_one_compiled_bf16_row_is_fused_below_the_size_limit(out_rows, fused):
    """In a traced graph, one bf16 row by a weight of at most FUSED_ROW_BYTES is the fused reduction;
    by a larger one it is the bf16 GEMV op where that kernel is built (it reads large weights faster).
    Both give the fp32 sums of F.linear."""
    from gptoss_lite.kernels import bf16 as bf16_kernel

    g = torch.Generator().manual_seed(1)
    w = torch.randn(out_rows, 256, generator=g).bfloat16()
    x = torch.randn(1, 256, generator=g).bfloat16()
    assert (w.numel() * 2 <= matmul.FUSED_ROW_BYTES) == fused
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    with torch.inference_mode():
        got = torch.compile(lambda x: matmul.decode_linear(x, w), fullgraph=True, backend=recorder)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(got, F.linear(x.float(), w.float()), atol=1e-3, rtol=1e-4)
    uses_op = "gptoss_lite.bf16_gemv" in graphs[0]
    assert uses_op == (not fused and bf16_kernel.available())


needs_packs = pytest.mark.skipif(
    not matmul.packs_dtype(torch.float32), reason="prompt packs need oneDNN and an AVX-512 CPU"
)


@needs_packs
def test_a_prompt_pack_gives_the_product_of_many_rows_and_only_those():
    x, w, b = _inputs(matmul.PACKED_ROWS, torch.float32)
    pack = matmul.PromptPack(w)
    with torch.inference_mode():
        assert pack.serves(x, w)
        torch.testing.assert_close(matmul.linear(x, w, b, pack), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        few = x[: matmul.PACKED_ROWS - 1]
        assert not pack.serves(few, w)
        assert torch.equal(matmul.linear(few, w, b, pack), F.linear(few, w, b))
    assert not pack.serves(x, w)  # grad mode: a pack carries no gradient


@needs_packs
def test_a_prompt_pack_is_dropped_silently_once_its_weight_changes():
    x, w, b = _inputs(matmul.PACKED_ROWS, torch.float32)
    pack = matmul.PromptPack(w)
    with torch.inference_mode():
        w.mul_(2)  # in place: same storage, new version
        assert not pack.serves(x, w)
        assert torch.equal(matmul.linear(x, w, b, pack), F.linear(x, w, b))
        other = w.clone()  # same values elsewhere
        assert not pack.serves(x, other)
        assert not pack.serves(x.double(), w.double())


@needs_packs
@pytest.mark.parametrize("name", ["lite-tiny", "gpt-oss-tiny"])
def test_a_model_with_prompt_packs_prefills_as_without(name):
    """`prepare_for_inference` packs within its budget; a budget the packs exceed (or 0) leaves none,
    and the logits of a prompt are the same to fp32 rounding either way."""
    from conftest import make_model

    model = make_model(name)
    ids = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(2))
    packed = model.pack_for_prompts()
    assert packed > 0
    assert model.pack_for_prompts(packed - 1) == 0  # over the budget: none
    with torch.inference_mode():
        plain = model(ids).logits
        assert model.pack_for_prompts(None) == packed
        with_packs = model(ids).logits
    torch.testing.assert_close(with_packs, plain, rtol=1e-4, atol=1e-4)
    assert model.inference_ready


@needs_packs
def test_a_copied_model_runs_without_its_originals_packs():
    import copy

    from conftest import make_model

    model = make_model("lite-tiny")
    assert model.pack_for_prompts() > 0
    twin = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for block in twin.blocks:
            block.attn.o_proj.weight.mul_(0)  # the twin's own weights; the original's packs must not serve
        assert not torch.allclose(twin(ids).logits, model(ids).logits)
