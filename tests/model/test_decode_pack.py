"""GPTOSS.pack_for_decode: a re-layout for one-token GEMVs that changes no shape, name or value."""

import copy

import pytest
import torch

from conftest import make_model
from gptoss_lite.checkpoint import save_model
from gptoss_lite.kv.mixed import MixedKVCache

PRESETS = ["lite-tiny", "gpt-oss-tiny"]  # without and with attention / expert biases


def _state(model):
    return {k: (tuple(v.shape), v.detach().clone()) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("preset", PRESETS)
def test_pack_keeps_names_shapes_values_and_is_idempotent(preset):
    model = make_model(preset)
    before = _state(model)
    model.pack_for_decode()
    after = _state(model)
    assert before.keys() == after.keys()
    for name, (shape, value) in before.items():
        assert after[name][0] == shape, name
        assert torch.equal(after[name][1], value), name
    attn, experts = model.blocks[0].attn, model.blocks[0].moe.experts
    assert attn._packed_qkv() is not None and experts._packed_gate_up() is not None
    assert attn.q_proj.weight.stride(-2) == 1 and experts.down_proj.stride(-2) == 1  # input-major
    ptrs = [p.data_ptr() for p in model.parameters()]
    model.pack_for_decode()
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # second call: nothing moves


def _prefill_and_decode(model, ids):
    with torch.inference_mode():
        cache = MixedKVCache(model.config)
        prefill = model(ids, cache=cache, start_pos=0).logits
        step = model(ids[:, -1:], cache=cache, start_pos=ids.shape[1]).logits
    return prefill, step


@pytest.mark.parametrize("preset", PRESETS)
def test_packed_prefill_and_decode_match_unpacked(preset):
    """Packed GEMVs (q|kv, gate|up) give the unpacked model's logits, prefill and decode step."""
    model = make_model(preset)
    packed = copy.deepcopy(model).pack_for_decode()
    ids = torch.randint(0, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    for a, b in zip(_prefill_and_decode(model, ids), _prefill_and_decode(packed, ids)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights_pack_out_major_and_match_unpacked(preset, dtype):
    """16-bit weights keep nn.Linear's (out, in) layout (their fast GEMV form), q|kv and gate|up are
    packed along the output dim, values unchanged, and the logits are the unpacked model's."""
    model = make_model(preset).to(dtype)
    before = _state(model)
    packed = copy.deepcopy(model).pack_for_decode()
    assert all(torch.equal(packed.state_dict()[k], v) for k, (_, v) in before.items())
    attn, experts = packed.blocks[0].attn, packed.blocks[0].moe.experts
    assert attn._packed_qkv()[2] is False and experts._packed_gate_up()[2] is False
    assert attn._packed_qkv()[0].shape == (
        attn.q_proj.weight.shape[0] + attn.kv_proj.weight.shape[0],
        attn.q_proj.weight.shape[1],
    )
    for w in (attn.o_proj.weight, experts.down_proj, packed.blocks[0].moe.router.weight, packed.head_weight()):
        assert w.is_contiguous()
    assert attn.q_proj.weight.stride(-1) == 1 and experts.gate_proj.stride(-1) == 1  # rows of the packed buffer
    ids = torch.randint(0, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    for a, b in zip(_prefill_and_decode(model, ids), _prefill_and_decode(packed, ids)):
        torch.testing.assert_close(b.float(), a.float(), atol=0.02, rtol=0.02)


def test_the_layout_rule():
    from gptoss_lite.model.decode_pack import input_major_for

    assert input_major_for(torch.float32) and input_major_for(torch.float64)
    assert not input_major_for(torch.bfloat16) and not input_major_for(torch.float16)


@pytest.mark.parametrize("preset", PRESETS)
def test_checkpoint_bytes_unchanged_by_packing(preset, tmp_path):
    """Packed (strided, buffer-sharing) parameters save to a byte-identical safetensors file."""
    model = make_model(preset)
    save_model(model, tmp_path / "before")
    save_model(model.pack_for_decode(), tmp_path / "after")
    assert (tmp_path / "before" / "model.safetensors").read_bytes() == (
        tmp_path / "after" / "model.safetensors"
    ).read_bytes()


def test_training_after_packing_reaches_every_parameter():
    """With gradients on, the model runs on its parameters (not the packed buffers): every weight
    gets a gradient, and an optimiser step updates the packed buffers in place."""
    model = make_model("gpt-oss-tiny").pack_for_decode().train()
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    model(ids, targets=ids).loss.backward()
    attn = model.blocks[0].attn
    for p in (
        attn.q_proj.weight,
        attn.kv_proj.weight,
        attn.q_proj.bias,
        model.blocks[0].moe.experts.gate_proj,
        model.blocks[0].moe.experts.up_bias,
    ):
        assert p.grad is not None and p.grad.abs().sum() > 0
    before = attn._packed_qkv()[0].clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert attn._packed_qkv() is not None and not torch.equal(attn._packed_qkv()[0], before)
    torch.testing.assert_close(attn._packed_qkv()[0][:, : attn.q_proj.weight.shape[0]], attn.q_proj.weight.t())


def test_dtype_change_falls_back_then_repacks():
    """After .to(bf16) the parameters leave the packed buffers: the unpacked path runs, and packing again works."""
    model = make_model("gpt-oss-tiny").pack_for_decode()
    model.to(torch.bfloat16)
    attn = model.blocks[0].attn
    assert attn._packed_qkv() is None and model.blocks[0].moe.experts._packed_gate_up() is None
    ids = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    a, b = _prefill_and_decode(model, ids)
    model.pack_for_decode()
    assert attn._packed_qkv()[0].dtype == torch.bfloat16
    a2, b2 = _prefill_and_decode(model, ids)
    torch.testing.assert_close(a2.float(), a.float(), atol=0.1, rtol=0.05)
    torch.testing.assert_close(b2.float(), b.float(), atol=0.1, rtol=0.05)


def test_joined_view_only_for_adjacent_blocks_of_one_buffer():
    """A buffer's two column blocks are re-joined as a view; anything else is not (so it gets copied)."""
    from gptoss_lite.model.decode_pack import join, joined_view

    buf = torch.arange(24.0).view(2, 12)
    a, b = buf[:, :5], buf[:, 5:]
    view = joined_view(a, b)
    assert view is not None and view.data_ptr() == buf.data_ptr() and torch.equal(view, buf)
    assert joined_view(b, a) is None  # wrong order
    assert joined_view(buf[:, :5], buf[:, 6:]) is None  # a gap
    assert joined_view(a, b.clone()) is None  # another buffer
    joined = join(a, b.clone())
    assert torch.equal(joined, buf) and joined.data_ptr() != buf.data_ptr()


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("top_k", [2, 3])
def test_one_token_expert_mix_matches_per_expert_reference(preset, top_k):
    """The one-token expert math run eagerly on the packed weights (one gate|up GEMV per expert)
    equals Σ w·expert(e, x) for every expert pair in either order, and for three experts, unpacked
    too (gradients on: the parameters themselves)."""
    model = make_model(preset).pack_for_decode()
    experts = model.blocks[0].moe.experts
    n = experts.gate_proj.shape[0]
    x = torch.randn(1, model.config.d_model, generator=torch.Generator().manual_seed(3))
    picks = [[a, b] for a in range(n) for b in range(n) if a != b] if top_k == 2 else [[2, 0, 3], [1, 3, 0]]
    with torch.inference_mode():
        for pick in picks:
            w = torch.softmax(torch.randn(top_k), dim=0)
            want = sum(wj * experts.expert(e, x) for e, wj in zip(pick, w.tolist()))
            got = (experts.decode_step(x, torch.tensor([pick])) * w[None, :, None]).sum(dim=1)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    unpacked = experts.decode_step(x, torch.tensor([picks[0]]))  # gradients on: gate_proj, up_proj
    torch.testing.assert_close(unpacked[0, 0:1], experts.expert(picks[0][0], x), atol=1e-6, rtol=1e-5)
    assert unpacked.requires_grad
