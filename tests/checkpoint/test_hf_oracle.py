"""transformers' GptOssForCausalLM as the oracle for our HF-layout loader and writer (docs/checkpoints.md).

Peer tests (`-m peer`): transformers is a test-only dependency, never imported by src/.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from gptoss_lite.checkpoint import WEIGHTS_NAME, dequantize_mxfp4, load_model, quantize_mxfp4, save_hf  # noqa: E402
from gptoss_lite.checkpoint.hf import config_from_hf  # noqa: E402
from gptoss_lite.fixtures import resolve_config  # noqa: E402
from gptoss_lite.generation import generate  # noqa: E402
from gptoss_lite.kv.mixed import MixedKVCache  # noqa: E402
from gptoss_lite.model import GPTOSS  # noqa: E402
from gptoss_lite.model.rope import yarn_inv_freq  # noqa: E402

pytestmark = pytest.mark.peer
TOL = 1e-4  # fp32 logits

# 64 < beta_fast·2π puts the YaRN ramp bound below 0: both implementations must clamp it.
ORIGINALS = [256, 64]


def _hf_greedy(hf, ids: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' greedy generate of exactly n tokens, with the explicit attention mask it needs
    (docs/checkpoints.md#comparing-with-transformers)."""
    return hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )


def _hf_model(original: int, tmp_path) -> tuple[torch.nn.Module, object]:
    """A small random GptOssForCausalLM (non-trivial biases, norms, sinks) saved to tmp_path."""
    config = transformers.GptOssConfig(
        vocab_size=264,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        sliding_window=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150_000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": original,
            "truncate": False,
        },
        attn_implementation="eager",
    )
    torch.manual_seed(original)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(tmp_path)
    return model, config


def _prompt(T: int = 40) -> torch.Tensor:
    return torch.randint(0, 264, (1, T), generator=torch.Generator().manual_seed(1))


def _greedy(model: GPTOSS, prompt: torch.Tensor, n: int) -> list[int]:
    """Cached greedy decoding: one prefill, then one token per step at its absolute position."""
    cache = MixedKVCache(model.config, prompt.shape[0])
    logits = model(prompt, cache=cache, start_pos=0, last_only=True).logits  # (1, 1, V)
    pos, out = prompt.shape[1], []
    for _ in range(n):
        tok = logits[:, -1].argmax(dim=-1, keepdim=True)  # (1, 1)
        out.append(int(tok))
        logits = model(tok, cache=cache, start_pos=pos, last_only=True).logits
        pos += 1
    return out


@pytest.mark.parametrize("original", [256, 64])
def test_our_reading_of_hf_yarn(original, tmp_path):
    """Our YaRN frequencies (bounds clamped to [0, D-1], truncate=false) equal transformers' inv_freq."""
    hf, config = _hf_model(original, tmp_path)
    cfg = resolve_config("gpt-oss-tiny").replace(rope_original_context=original)
    ours = yarn_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_factor, original)
    assert torch.allclose(hf.model.rotary_emb.inv_freq, ours, rtol=1e-6, atol=0)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["truncate"] is False


def test_save_pretrained_layout(tmp_path):
    """transformers 5.x save_pretrained writes gate_up_proj (E, C, 2I) and down_proj (E, I, C), unquantised."""
    _hf_model(256, tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    assert tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 128)
    assert tensors["model.layers.0.mlp.experts.gate_up_proj_bias"].shape == (4, 128)
    assert tensors["model.layers.0.mlp.experts.down_proj"].shape == (4, 64, 64)
    assert tensors["model.layers.0.self_attn.sinks"].shape == (4,)


@pytest.mark.parametrize("original", ORIGINALS)
def test_prefill_logits_match_hf(original, tmp_path):
    """load_model of an HF save_pretrained directory gives HF's logits (1e-4) past the window and L0."""
    hf, _ = _hf_model(original, tmp_path)
    ours = load_model(tmp_path)
    assert ours.config == config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    ids = _prompt(40 if original == 256 else 80)
    with torch.no_grad():
        ref = hf(ids, attention_mask=torch.ones_like(ids)).logits
        got = ours(ids).logits
    assert got.shape == ref.shape == (1, ids.shape[1], 264)
    assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize("original", ORIGINALS)
def test_greedy_tokens_match_hf_generate(original, tmp_path):
    """32 greedy tokens from our cached loop equal HF generate's (explicit attention mask, its own cache)."""
    hf, _ = _hf_model(original, tmp_path)
    ours = load_model(tmp_path)
    prompt = _prompt(40)
    with torch.no_grad():
        ref = _hf_greedy(hf, prompt, 32)
        got = _greedy(ours, prompt, 32)
    assert ref[0, prompt.shape[1] :].tolist() == got


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_equals_hf_generate_64_tokens(batch, tmp_path):
    """gptoss_lite.generation (greedy, chunked prefill) equals transformers' greedy generate for 64 tokens."""
    hf, _ = _hf_model(256, tmp_path)
    ours = load_model(tmp_path)
    prompt = torch.randint(0, 264, (batch, 30), generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        ref = _hf_greedy(hf, prompt, 64)
    got = generate(ours, prompt, 64, temperature=0, prefill_chunk=16)
    assert torch.equal(got, ref)


def test_mxfp4_copy_loads_to_dequantised(tmp_path):
    """An MXFP4-packed copy of the HF experts loads to exactly the tensors transformers' dequantiser gives."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf, _ = _hf_model(256, tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    reference = {}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))  # (E, out, in/32, 16), (E, out, in/32)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        reference[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, in, out)
        assert torch.equal(reference[name], dequantize_mxfp4(blocks, scales))
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = load_model(tmp_path, mxfp4="dequantize")
    for i in range(4):
        gate_up = reference[f"model.layers.{i}.mlp.experts.gate_up_proj"]  # (E, C, 2I)
        experts = ours.blocks[i].moe.experts
        assert torch.equal(experts.gate_proj, gate_up[..., 0::2].transpose(1, 2))
        assert torch.equal(experts.up_proj, gate_up[..., 1::2].transpose(1, 2))
        assert torch.equal(experts.down_proj, reference[f"model.layers.{i}.mlp.experts.down_proj"].transpose(1, 2))


@pytest.mark.parametrize("original", ORIGINALS)
def test_save_hf_loads_in_transformers(original, tmp_path):
    """A gpt-oss-knob model of ours -> save_hf -> AutoModelForCausalLM gives the same logits (1e-4)."""
    cfg = resolve_config("gpt-oss-tiny").replace(rope_original_context=original)
    model = GPTOSS(cfg)
    model.reset_parameters(3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name.rsplit(".", 1)[-1] or name.endswith("sinks") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    model.eval()
    save_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = _prompt(80)
    with torch.no_grad():
        ref = hf(ids, attention_mask=torch.ones_like(ids)).logits
        got = model(ids).logits
    assert (got - ref).abs().max().item() < TOL


def test_packed_mxfp4_checkpoint_matches_transformers(tmp_path):
    """A tiny MXFP4 checkpoint, loaded packed, gives transformers' logits on the same weight values
    (transformers holding them dequantised, as it does on a CPU), and the same greedy tokens."""
    hf, _ = _hf_model(256, tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_NAME))
    with torch.no_grad():
        for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = quantize_mxfp4(tensors.pop(name))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            getattr(hf.model.layers[int(name.split(".")[2])].mlp.experts, name.rsplit(".", 1)[1]).copy_(
                dequantize_mxfp4(blocks, scales)
            )
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = load_model(tmp_path)
    assert ours.mxfp4_experts
    ids = torch.randint(0, 264, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(ids, attention_mask=torch.ones_like(ids)).logits
        got = ours(ids).logits
    assert (got - ref).abs().max().item() <= TOL
    with torch.no_grad():
        want = _hf_greedy(hf, ids, 24)
    assert torch.equal(generate(ours, ids, 24, temperature=0, prefill_chunk=16), want)
