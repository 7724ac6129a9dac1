import pytest
import torch
import torch.nn.functional as F

from gptoss_lite.fixtures import resolve_config
from gptoss_lite.model.moe import MoE


def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token-by-token reference: top-k, softmax over the k logits, weighted expert sum + shared."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        logits = moe.router(flat[n])
        vals, idx = logits.topk(moe.top_k)
        w = torch.softmax(vals, dim=-1)
        for j in range(moe.top_k):
            out[n] += w[j] * moe.experts.expert(int(idx[j]), flat[n : n + 1])[0]
        if moe.shared is not None:
            for s in range(moe.shared.gate_proj.shape[0]):
                out[n] += moe.shared.expert(s, flat[n : n + 1])[0]
    return out.view_as(x)


def _random_moe(preset: str, seed: int) -> MoE:
    """An MoE layer of the preset with weights large enough to make routing and rounding matter."""
    torch.manual_seed(seed)
    moe = MoE(resolve_config(preset))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny"])
def test_grouped_moe_matches_token_loop(preset):
    """Grouped-by-expert dispatch equals a per-token loop (both activations, with/without biases)."""
    moe = _random_moe(preset, seed=0)
    x = torch.randn(2, 9, 64)
    y, aux = moe(x)
    assert y.shape == (2, 9, 64)
    torch.testing.assert_close(y, _naive_moe(moe, x), atol=1e-4, rtol=1e-5)
    assert torch.isfinite(aux) and aux > 0


def test_gptoss_activation_formula():
    """gpt-oss activation: gate<=7, up in [-7,7], (up+1)·gate·sigmoid(1.702·gate), bias before weighting."""
    cfg = resolve_config("gpt-oss-tiny")
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 2.0)  # large enough that the clamps bite
    x = torch.randn(5, 64)
    e = moe.experts
    gate = (x @ e.gate_proj[1].T + e.gate_bias[1]).clamp(max=7)
    up = (x @ e.up_proj[1].T + e.up_bias[1]).clamp(-7, 7)
    expected = ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ e.down_proj[1].T + e.down_bias[1]
    torch.testing.assert_close(e.expert(1, x), expected, atol=1e-4, rtol=1e-5)


def test_swiglu_activation_formula():
    """GPT-OSS-Lite experts are silu(gate) * up, no biases."""
    moe = MoE(resolve_config("lite-tiny"))
    torch.nn.init.normal_(moe.experts.gate_proj)
    x = torch.randn(4, 64)
    e = moe.experts
    expected = (F.silu(x @ e.gate_proj[2].T) * (x @ e.up_proj[2].T)) @ e.down_proj[2].T
    torch.testing.assert_close(e.expert(2, x), expected, atol=1e-5, rtol=1e-5)


def test_aux_loss_balanced_is_one():
    """Switch aux loss E·Σ f_e·P_e is exactly 1 when routing and probabilities are uniform."""
    moe = MoE(resolve_config("lite-tiny"))
    with torch.no_grad():
        moe.router.weight.zero_()  # uniform probabilities; topk ties resolve deterministically
    x = torch.randn(1, 8, 64)
    _, aux = moe(x)
    # f concentrates on the tie-broken experts, P is uniform: E · Σ f_e / E = 1.
    assert aux.item() == pytest.approx(1.0)


def test_only_selected_experts_run(monkeypatch):
    """Experts that no token selects are never evaluated."""
    moe = MoE(resolve_config("lite-tiny"))
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0
        moe.router.weight[1] = 0.5
    calls = []
    original = moe.experts.expert
    monkeypatch.setattr(moe.experts, "expert", lambda e, x: calls.append(e) or original(e, x))
    moe(torch.ones(1, 3, 64))
    assert sorted(calls) == [0, 1]


@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny"])
@pytest.mark.parametrize("N", [2, 9, 16])
def test_few_token_path_matches_grouped_dispatch(preset, N):
    """At inference, 2..FEW_TOKENS tokens take the all-experts batched path; it equals the grouped one."""
    from gptoss_lite.model.moe import FEW_TOKENS

    moe = _random_moe(preset, seed=1)
    x = torch.randn(1, N, 64)
    grouped, _ = moe(x)  # need_aux: the grouped path
    moe.experts.pack_for_decode()
    with torch.no_grad():
        few, aux = moe(x, need_aux=False)
        vals, idx = moe.router(x[0]).topk(moe.top_k)
        assert moe.experts.mix_few_tokens(x[0], idx, torch.softmax(vals, -1)) is not None
    assert aux is None and N <= FEW_TOKENS
    torch.testing.assert_close(few, grouped, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(few, _naive_moe(moe, x), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny"])
@pytest.mark.parametrize("packed", [False, True])
def test_one_token_forward_is_the_decode_step(preset, packed, monkeypatch):
    """An eager forward of one token runs `MoE.decode_step` (the compiled step's function) and equals
    the per-token reference, on the parameters and on the packed weights (fp32 and bf16)."""
    moe = _random_moe(preset, seed=1)
    x = torch.randn(1, 1, 64)
    want = _naive_moe(moe, x)
    if packed:
        moe.experts.pack_for_decode()
    calls = []
    step = moe.decode_step
    monkeypatch.setattr(moe, "decode_step", lambda h: calls.append(h.shape) or step(h))
    with torch.no_grad():
        y, aux = moe(x, need_aux=False)
        moe.to(torch.bfloat16)
        y16, _ = moe(x.bfloat16(), need_aux=False)
        want16 = _naive_moe(moe, x.bfloat16())  # the same routing, every product rounded to bf16
    assert aux is None and calls == [(1, 64), (1, 64)] and y16.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    scale = want16.float().abs().max().item()  # bf16 sums of terms this large differ by their rounding
    torch.testing.assert_close(y16.float(), want16.float(), atol=0.01 * scale, rtol=0.02)


@pytest.mark.parametrize("packed", [False, True])
def test_no_tokens_give_no_rows_in_every_path(packed):
    """An empty chunk (zero tokens) through training, inference with the load-balancing loss and
    without it, on stored and on packed weights: an empty output of the right shape, no error."""
    moe = _random_moe("gpt-oss-tiny", seed=3)
    if packed:
        moe.experts.pack_for_decode()
    x = torch.zeros(2, 0, moe.router.weight.shape[1])
    for grad in (True, False):
        for need_aux in (True, False):
            with torch.set_grad_enabled(grad and not packed):
                y, _ = moe(x, need_aux=need_aux)
            assert y.shape == x.shape
