"""MXFP4-packed experts (`MXFP4Experts`) against the same weights dequantised (`Experts`): every path
of the model, fp32 to 1e-4, bf16 to the same greedy tokens."""

from __future__ import annotations

import copy
import zlib

import pytest
import torch

from gptoss_lite.fixtures import resolve_config
from gptoss_lite.generation import generate
from gptoss_lite.model import GPTOSS
from gptoss_lite.model.moe import MATVEC_ROWS, Experts, MXFP4Experts


def pair(dtype: torch.dtype, seed: int = 0) -> tuple[GPTOSS, GPTOSS]:
    """(packed model, the same weights with every expert dequantised), both prepared for inference."""
    cfg = resolve_config("gpt-oss-tiny")
    model = GPTOSS(cfg)
    model.reset_parameters(seed)
    with torch.no_grad():  # biases and sinks are zero after reset: give them values
        for name, p in model.named_parameters():
            if "bias" in name or name.endswith("sinks"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()) % 1000))
    packed = copy.deepcopy(model).use_mxfp4_experts()
    dense = copy.deepcopy(packed)
    for block in dense.blocks:
        block.moe.experts = block.moe.experts.dequantized()
    return packed.prepare_for_inference(dtype=dtype), dense.prepare_for_inference(dtype=dtype)


def test_packed_and_dense_hold_the_same_weights():
    packed, dense = pair(torch.float32)
    assert packed.mxfp4_experts and not dense.mxfp4_experts
    assert isinstance(packed.blocks[0].moe.experts, MXFP4Experts)
    assert isinstance(dense.blocks[0].moe.experts, Experts)
    # re-quantising the dequantised values is exact (the codes may differ: -0 and +0, or a block's scale)
    again = MXFP4Experts.quantize(dense.blocks[0].moe.experts).dequantized()
    for name, p in dense.blocks[0].moe.experts.named_parameters():
        assert torch.equal(p, getattr(again, name)), name


@pytest.mark.parametrize("tokens", [1, 3, 12, 2 * MATVEC_ROWS + 7])
def test_forward_logits_match_fp32(tokens):
    packed, dense = pair(torch.float32)
    ids = torch.randint(0, packed.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        a, b = packed(ids).logits, dense(ids).logits
    assert (a - b).abs().max().item() <= 1e-4


def test_greedy_generation_matches_fp32_and_bf16():
    ids = torch.randint(0, 264, (1, 40), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        packed, dense = pair(dtype)
        a = generate(packed, ids, max_new_tokens=32, temperature=0)
        b = generate(dense, ids, max_new_tokens=32, temperature=0)
        assert torch.equal(a, b), dtype


def test_compiled_decode_reads_the_codes():
    packed, dense = pair(torch.float32)
    compiled = copy.deepcopy(packed).prepare_for_inference(compile_decode=True)
    ids = torch.randint(0, 264, (2, 20), generator=torch.Generator().manual_seed(2))
    a = generate(compiled, ids, max_new_tokens=12, temperature=0)
    b = generate(dense, ids, max_new_tokens=12, temperature=0)
    assert torch.equal(a, b)


def test_codes_are_not_trainable_and_stay_uint8_under_to():
    packed, _ = pair(torch.float32)
    experts = packed.blocks[0].moe.experts
    packed.to(torch.bfloat16)
    assert experts.gate_up_blocks.dtype == torch.uint8 and experts.down_scales.dtype == torch.uint8
    assert experts.down_bias.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in experts.parameters())


def test_sizes_not_divisible_by_the_block_are_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        MXFP4Experts(4, 48, 64, "gptoss", 7.0, True)


@pytest.mark.parametrize("compiled", [False, True])
def test_engine_matches_generate_on_packed_experts(compiled):
    import random

    from gptoss_lite.engine import LLM
    from tests.engine.conftest import assert_same_as_generate, random_workload, run

    packed, _ = pair(torch.float32)
    engine_model = copy.deepcopy(packed).prepare_for_inference(compile_decode=compiled)
    work = random_workload(random.Random(3), packed.config.vocab_size, 10, 120, 12, 8)
    llm = LLM(engine_model, kv_blocks=400, max_batch_tokens=128, max_running=8)
    done = run(llm, work)
    assert len(done) == 10
    assert_same_as_generate(packed, llm, work, done, exact=False)


def test_speculative_decoding_on_packed_experts_keeps_greedy_tokens():
    from gptoss_lite.speculative import PromptLookup

    packed, _ = pair(torch.float32)
    ids = torch.randint(0, 264, (1, 24), generator=torch.Generator().manual_seed(4)).repeat(1, 3)  # repeats to look up
    plain = generate(packed, ids, 24, temperature=0)
    assert torch.equal(generate(packed, ids, 24, temperature=0, speculate=PromptLookup(k=4, min_ngram=1)), plain)


@pytest.fixture
def python_mxfp4_ops():
    """The mxfp4 ops served by their Python implementations (which the tests count calls of) rather than
    from C++ (`kernels/ops.cpp`, the same C function), for the test's length."""
    from gptoss_lite.kernels import cpp_ops, mxfp4

    ops = ("mxfp4_matvec", "mxfp4_matvec_int8", "mxfp4_gate_up_act")
    mxfp4._library()  # bound now, if ever: a binding during the test would bring C++ back
    cpp_ops.use_cpp(False, ops)
    yield
    cpp_ops.use_cpp(True, ops)


def test_int8_activations_are_opt_in_near_exact_and_compiled_alike(monkeypatch, python_mxfp4_ops):
    """`set_mxfp4_activations("int8")`: decode logits move by the inputs' rounding only (not 0, small), and
    the compiled step calls the same int8 kernel (the same greedy tokens as eager int8)."""
    packed, _ = pair(torch.float32)
    assert packed.mxfp4_activations == "exact"
    int8 = copy.deepcopy(packed).prepare_for_inference().set_mxfp4_activations("int8")
    assert int8.mxfp4_activations == "int8" and packed.mxfp4_activations == "exact"
    ids = torch.randint(0, 264, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # 6 tokens: every expert reads its codes (the decode kernels)
        a, b = packed(ids).logits, int8(ids).logits
    assert 0 < (a - b).abs().max().item() <= 0.05 * a.abs().max().item()
    compiled = copy.deepcopy(int8).prepare_for_inference(compile_decode=True)
    assert compiled.mxfp4_activations == "int8"
    prompt = torch.randint(0, 264, (2, 20), generator=torch.Generator().manual_seed(2))
    from gptoss_lite.kernels import mxfp4

    calls, kernel, act = {True: 0, False: 0}, mxfp4._matvec, mxfp4._gate_up_act

    def counted(*args, int8):
        calls[int8] += 1
        return kernel(*args, int8=int8)

    def counted_act(*args, int8):  # the gate|up products with the activation, where built (AVX-512)
        calls[int8] += 1
        return act(*args, int8=int8)

    monkeypatch.setattr(mxfp4, "_matvec", counted)
    monkeypatch.setattr(mxfp4, "_gate_up_act", counted_act)
    want = generate(int8, prompt, max_new_tokens=12, temperature=0)
    calls[True] = 0
    assert torch.equal(generate(compiled, prompt, max_new_tokens=12, temperature=0), want)
    assert calls[True] >= 11 * 2 * packed.config.n_layers and calls[False] == 0  # the compiled steps' too


def test_engine_takes_int8_activations_from_its_config():
    import random

    from gptoss_lite.engine import LLM
    from tests.engine.conftest import assert_same_as_generate, random_workload, run

    packed, _ = pair(torch.float32)
    work = random_workload(random.Random(4), packed.config.vocab_size, 6, 80, 10, 6)
    llm = LLM(
        copy.deepcopy(packed).prepare_for_inference(),
        kv_blocks=300,
        max_batch_tokens=64,
        max_running=6,
        mxfp4_activations="int8",
    )
    assert llm.model.mxfp4_activations == "int8"
    done = run(llm, work)
    assert_same_as_generate(
        copy.deepcopy(packed).prepare_for_inference().set_mxfp4_activations("int8"), llm, work, done, exact=False
    )


def test_bad_mxfp4_activations_are_refused():
    from gptoss_lite.engine.config import EngineConfig

    packed, dense = pair(torch.float32)
    with pytest.raises(ValueError, match=r"mxfp4 activations 'fp8': must be one of \('exact', 'int8'\)"):
        packed.set_mxfp4_activations("fp8")
    assert packed.mxfp4_activations == "exact"
    with pytest.raises(ValueError, match="apply to packed MXFP4 experts, and this model has none"):
        dense.set_mxfp4_activations("int8")
    dense.set_mxfp4_activations("exact")  # always allowed
    with pytest.raises(ValueError, match="mxfp4_activations='int4'"):
        EngineConfig(mxfp4_activations="int4")


def test_compiled_step_follows_a_later_activation_mode(monkeypatch, python_mxfp4_ops):
    # The compiled step has no guards on the model: a mode set after its first call must get a graph of
    # its own (calling the int8 kernel, the eager int8 model's greedy tokens), and switching back must
    # reuse the first graph (the exact kernel again).
    from gptoss_lite.kernels import mxfp4

    packed, _ = pair(torch.float32)
    compiled = copy.deepcopy(packed).prepare_for_inference(compile_decode=True)
    int8 = copy.deepcopy(packed).prepare_for_inference().set_mxfp4_activations("int8")
    ids = torch.randint(0, 264, (1, 20), generator=torch.Generator().manual_seed(6))
    calls, kernel, act = {True: 0, False: 0}, mxfp4._matvec, mxfp4._gate_up_act

    def counted(*args, int8):
        calls[int8] += 1
        return kernel(*args, int8=int8)

    def counted_act(*args, int8):  # the gate|up products with the activation, where built (AVX-512)
        calls[int8] += 1
        return act(*args, int8=int8)

    monkeypatch.setattr(mxfp4, "_matvec", counted)
    monkeypatch.setattr(mxfp4, "_gate_up_act", counted_act)
    for mode, reference in (("exact", packed), ("int8", int8), ("exact", packed)):
        compiled.set_mxfp4_activations(mode)
        want = generate(reference, ids, max_new_tokens=10, temperature=0)
        calls.update({True: 0, False: 0})
        assert torch.equal(generate(compiled, ids, max_new_tokens=10, temperature=0), want), mode
        assert calls[mode == "int8"] > 0 and calls[mode != "int8"] == 0, (mode, calls)
    assert {modes[0] for modes in compiled.compiled_decoder._by_mode} == {"exact", "int8"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_gate_up_activation_equals_the_separate_passes(monkeypatch, dtype):
    """Where `kernels.mxfp4.gate_up_act` is built (AVX-512) the decode step's gate|up products, bias,
    rounding and activation are one pass over the codes; with it off (`gate_up_act_available` False,
    every other CPU) they are the products and PyTorch's ops. Same outputs up to e^x's last bits, and the
    same greedy tokens, eager and compiled."""
    from gptoss_lite.kernels import mxfp4
    from gptoss_lite.model import moe

    if not mxfp4.gate_up_act_available():
        pytest.skip("the one-pass gate|up activation is built with AVX-512 only")
    packed, _ = pair(dtype)
    experts = packed.blocks[1].moe.experts
    h = torch.randn(3, packed.config.d_model, generator=torch.Generator().manual_seed(3)).to(dtype)
    top = torch.tensor([[0, 3], [3, 1], [2, 3]])
    ids = torch.randint(0, 264, (1, 24), generator=torch.Generator().manual_seed(4))
    fused, tokens = experts.decode_step(h, top), generate(packed, ids, max_new_tokens=16, temperature=0)
    compiled = copy.deepcopy(packed).prepare_for_inference(compile_decode=True)
    assert torch.equal(generate(compiled, ids, max_new_tokens=16, temperature=0), tokens)
    monkeypatch.setattr(moe, "gate_up_act_available", lambda: False)
    separate = experts.decode_step(h, top)
    torch.testing.assert_close(fused, separate, atol=1e-5, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    if dtype == torch.bfloat16:  # fp32's ulps move every output a little; bf16's rounding absorbs most
        assert (fused == separate).float().mean() >= 0.9
    assert torch.equal(generate(packed, ids, max_new_tokens=16, temperature=0), tokens)
