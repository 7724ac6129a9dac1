"""The Hugging Face `GptOssForCausalLM` layout: config mapping, tensor mapping, save_hf (docs/checkpoints.md).

Expert tensors, per layer, in the HF layout (input-major, `x @ W`):
  mlp.experts.gate_up_proj       (E, C, 2I)  gate and up INTERLEAVED by column: [..., ::2] gate, [..., 1::2] up
  mlp.experts.gate_up_proj_bias  (E, 2I)     interleaved the same way
  mlp.experts.down_proj          (E, I, C)
  mlp.experts.down_proj_bias     (E, C)
This is both the layout of the released checkpoints once MXFP4 is dequantised and what
transformers 5.23 `save_pretrained` writes for an unquantised model (GptOssExperts holds exactly
these parameters and 5.23 has no save-time conversion for gpt_oss; pinned by tests/test_hf_oracle.py).
Released checkpoints store gate_up_proj / down_proj as MXFP4 `*_blocks` / `*_scales` in the
(out, in) orientation (docs/mxfp4.md). They are either kept as they are, for `MXFP4Experts`, or
dequantised and transposed here.

Ours stores every expert matrix nn.Linear-style (out × in) with separate gate/up, and fuses K and
V into one kv_proj (K rows first); the mapping below converts between the two exactly.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gptoss_lite.checkpoint.io import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_BYTES,
    read_json,
    read_tensors,
    write_checkpoint_dir,
)
from gptoss_lite.checkpoint.state_dict import check_state_dict
from gptoss_lite.config import FULL, SLIDING, ModelConfig
from gptoss_lite.kernels.mxfp4 import BLOCK as MXFP4_BLOCK
from gptoss_lite.kernels.mxfp4 import NAN_SCALE, dequantize_mxfp4

SWIGLU_ALPHA = (
    1.702  # sigmoid gain of the gpt-oss activation, fixed in our model code (docs/model.md#gpt-oss-family-knobs)
)
# HF GptOssConfig defaults (transformers 5.23 configuration_gpt_oss.py), used for absent keys.
_HF_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_HF_DEFAULT_THETA = 150_000.0
# What the released gpt-oss config.json says of its MXFP4 experts; save_hf writes it for packed experts.
MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


# ---- config -----------------------------------------------------------------------------------------


def _rope_params(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The flat RoPE dict transformers would use: rope_scaling wins over rope_parameters (5.23 order)."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ValueError(f"rope_scaling/rope_parameters={params!r}: must be an object of RoPE parameters")
    params = dict(_HF_DEFAULT_ROPE if params is None else params)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type RoPE parameters are not supported: {params}")
    params.setdefault("rope_theta", hf.get("rope_theta", _HF_DEFAULT_THETA))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


# Our ModelConfig field -> the HF config.json key it comes from (for messages in HF terms).
_HF_KEY_OF = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "n_experts": "num_local_experts",
    "top_k": "num_experts_per_tok",
    "expert_hidden": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
    "sliding_window": "sliding_window",
    "layer_types": "layer_types",
    "rope_factor": "rope factor",
    "rope_original_context": "rope original_max_position_embeddings",
    "rope_theta": "rope_theta",
    "swiglu_limit": "swiglu_limit",
    "norm_eps": "rms_norm_eps",
    "initializer_range": "initializer_range",
}


def _hf_int(hf: Mapping[str, Any], key: str, minimum: int = 1, optional: bool = False) -> int | None:
    """hf[key] as an int >= minimum, the message naming the HF key; None when optional and absent/null."""
    if key not in hf or hf[key] is None:
        if optional:
            return None
        raise ValueError(f"HF gpt-oss config lacks required key {key!r}")
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}={value!r}: must be an integer")
    if value < minimum:
        raise ValueError(f"{key}={value}: must be >= {minimum}")
    return value


def _hf_float(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}={value!r}: must be a finite number")
    return float(value)


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig of an HF gpt-oss config.json dict; anything our model cannot reproduce is a ValueError.

    Messages name the HF keys (hidden_size, num_key_value_heads, ...), not our field names; callers
    that read a file prefix its path.
    """
    if not isinstance(hf, Mapping):
        raise ValueError(f"an HF config must be a JSON object, got {type(hf).__name__}")
    if hf.get("model_type") != "gpt_oss":
        raise ValueError(f"not an HF gpt-oss config: model_type={hf.get('model_type')!r}, expected 'gpt_oss'")
    C, H = _hf_int(hf, "hidden_size"), _hf_int(hf, "num_attention_heads")
    n_layers = _hf_int(hf, "num_hidden_layers")
    # NOTE: an explicit 0 is an error, not "absent": `x or default` once turned 0 heads into H.
    n_kv = _hf_int(hf, "num_key_value_heads", optional=True)
    head_dim = _hf_int(hf, "head_dim", optional=True)
    expert_key = "num_local_experts" if "num_local_experts" in hf else "num_experts"
    fields = dict(
        vocab_size=_hf_int(hf, "vocab_size"),
        d_model=C,
        n_layers=n_layers,
        n_heads=H,
        n_kv_heads=H if n_kv is None else n_kv,
        head_dim=head_dim if head_dim is not None else C // H,
        n_experts=_hf_int(hf, expert_key),
        top_k=_hf_int(hf, "num_experts_per_tok"),
        expert_hidden=_hf_int(hf, "intermediate_size"),
        max_position_embeddings=_hf_int(hf, "max_position_embeddings"),
    )
    if fields["head_dim"] < 1:
        raise ValueError(f"head_dim is absent and hidden_size={C} // num_attention_heads={H} is 0; give head_dim")
    alpha = hf.get("swiglu_alpha", SWIGLU_ALPHA)
    if alpha != SWIGLU_ALPHA:
        raise ValueError(f"swiglu_alpha={alpha}: this model implements only {SWIGLU_ALPHA}")
    quant = hf.get("quantization_config")
    if quant is not None and not isinstance(quant, Mapping):
        raise ValueError(f'quantization_config={quant!r}: must be an object such as {{"quant_method": "mxfp4"}}')
    if quant is not None and quant.get("quant_method") != "mxfp4":
        raise ValueError(f"quantization_config {quant}: only MXFP4 is supported")
    layer_types = hf.get("layer_types")
    if layer_types is not None and (isinstance(layer_types, str) or not isinstance(layer_types, (list, tuple))):
        raise ValueError(f"layer_types={layer_types!r}: must be a list of 'sliding_attention'/'full_attention'")
    layer_types = tuple(layer_types or (SLIDING if i % 2 == 0 else FULL for i in range(n_layers)))
    window = _hf_int(hf, "sliding_window", optional=True)
    if window is None:
        if SLIDING in layer_types:
            raise ValueError("sliding_window is null but layer_types has sliding_attention layers")
        window = fields["max_position_embeddings"]
    rope = _rope_params(hf)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={rope['partial_rotary_factor']}: only 1.0 is supported")
    if rope["rope_type"] == "yarn":
        if rope.get("truncate", True):
            raise ValueError(
                "rope truncate is true (or absent, which transformers reads as true): gpt-oss YaRN "
                'uses unrounded ramp bounds; set "truncate": false if that is what the model was trained with'
            )
        for key in ("factor", "original_max_position_embeddings"):
            if rope.get(key) is None:
                raise ValueError(f"rope_scaling/rope_parameters of type yarn lacks {key!r}")
        factor = _hf_float("rope factor", rope["factor"])
        concentration = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        for key in ("mscale", "mscale_all_dim"):
            if rope.get(key):
                raise ValueError(f"rope {key}={rope[key]}: not supported (gpt-oss uses 0.1·ln(factor) + 1)")
        if rope.get("attention_factor") is not None and not math.isclose(
            _hf_float("rope attention_factor", rope["attention_factor"]), concentration
        ):
            raise ValueError(
                f"rope attention_factor={rope['attention_factor']}: this model uses "
                f"0.1·ln(factor) + 1 = {concentration}"
            )
        rope_fields = dict(
            rope_factor=factor,
            rope_original_context=_hf_int(rope, "original_max_position_embeddings"),
            rope_beta_fast=_hf_float("rope beta_fast", rope.get("beta_fast") or 32.0),
            rope_beta_slow=_hf_float("rope beta_slow", rope.get("beta_slow") or 1.0),
        )
    elif rope["rope_type"] == "default":
        rope_fields = dict(rope_factor=1.0, rope_original_context=fields["max_position_embeddings"])
    else:
        raise ValueError(f"rope_type={rope['rope_type']!r}: only 'yarn' and 'default' are supported")
    try:
        cfg = ModelConfig(
            **fields,
            **rope_fields,
            sliding_window=window,
            layer_types=layer_types,
            n_shared_experts=0,
            activation="gptoss",
            swiglu_limit=_hf_float("swiglu_limit", hf.get("swiglu_limit", 7.0)),
            attention_bias=bool(hf.get("attention_bias", True)),
            router_bias=True,
            expert_bias=True,
            sink_clamp=None,
            rope_theta=_hf_float("rope_theta", rope["rope_theta"]),
            rope_pruned_pairs=0,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            norm_eps=_hf_float("rms_norm_eps", hf.get("rms_norm_eps", 1e-5)),
            initializer_range=_hf_float("initializer_range", hf.get("initializer_range", 0.02)),
        )
    except (TypeError, ValueError) as e:
        # ModelConfig speaks in our field names; say the HF keys the values came from.
        message = re.sub(
            r"\b(" + "|".join(sorted(_HF_KEY_OF, key=len, reverse=True)) + r")\b(?==)",
            lambda m: _HF_KEY_OF[m.group(1)],
            str(e),
        )
        raise ValueError(message) from None
    return cfg


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """HF gpt-oss config.json dict for `cfg`; a ValueError for any GPT-OSS-Lite knob HF cannot express.

    Absent router/expert biases are fine (written as zeros, exactly equivalent); dropout is a
    training-only setting and is not carried.
    """
    refuse = []
    if cfg.n_shared_experts:
        refuse.append(f"n_shared_experts={cfg.n_shared_experts} (HF gpt-oss has no shared experts)")
    if cfg.activation != "gptoss":
        refuse.append(f"activation={cfg.activation!r} (HF gpt-oss has only the clamped 'gptoss' activation)")
    if cfg.sink_clamp is not None:
        refuse.append(f"sink_clamp={cfg.sink_clamp} (HF gpt-oss does not clamp sinks)")
    if cfg.rope_pruned_pairs:
        refuse.append(f"rope_pruned_pairs={cfg.rope_pruned_pairs} (HF gpt-oss rotates every pair)")
    if refuse:
        raise ValueError("cannot write the HF gpt-oss layout for this config: " + "; ".join(refuse))
    if cfg.rope_factor == 1.0:
        rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    else:
        # NOTE: truncate must be written as false: transformers reads a missing key as true (rounded bounds).
        rope = {
            "rope_type": "yarn",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_factor,
            "beta_fast": cfg.rope_beta_fast,
            "beta_slow": cfg.rope_beta_slow,
            "original_max_position_embeddings": cfg.rope_original_context,
            "truncate": False,
        }
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types),
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.top_k,
        "intermediate_size": cfg.expert_hidden,
        "hidden_act": "silu",
        "swiglu_limit": cfg.swiglu_limit,
        "swiglu_alpha": SWIGLU_ALPHA,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        # transformers 5.x reads rope_parameters (rope_scaling wins when both exist); 4.x, vLLM and
        # other engines read rope_scaling + rope_theta. Both carry the same values.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": dict(rope),
        "rope_scaling": dict(rope),
    }


# ---- tensors ----------------------------------------------------------------------------------------


def hf_shapes(cfg: ModelConfig, mxfp4: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the HF layout for `cfg`, with its shape: unquantised, or with the expert
    matrices as MXFP4 `*_blocks` / `*_scales` (the released checkpoints' layout) when `mxfp4`."""
    C, H, K, D, E, I = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_experts, cfg.expert_hidden
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, C), "model.norm.weight": (C,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, C)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (C,),
                p + "post_attention_layernorm.weight": (C,),
                p + "self_attn.q_proj.weight": (H * D, C),
                p + "self_attn.k_proj.weight": (K * D, C),
                p + "self_attn.v_proj.weight": (K * D, C),
                p + "self_attn.o_proj.weight": (C, H * D),
                p + "self_attn.sinks": (H,),
                p + "mlp.router.weight": (E, C),
                p + "mlp.router.bias": (E,),
                p + "mlp.experts.gate_up_proj": (E, C, 2 * I),
                p + "mlp.experts.gate_up_proj_bias": (E, 2 * I),
                p + "mlp.experts.down_proj": (E, I, C),
                p + "mlp.experts.down_proj_bias": (E, C),
            }
        )
        if cfg.attention_bias:
            out.update(
                {
                    p + "self_attn.q_proj.bias": (H * D,),
                    p + "self_attn.k_proj.bias": (K * D,),
                    p + "self_attn.v_proj.bias": (K * D,),
                    p + "self_attn.o_proj.bias": (C,),
                }
            )
    if mxfp4:
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}.mlp.experts."
            del out[p + "gate_up_proj"], out[p + "down_proj"]
            for name, (rows, n_in) in (("gate_up_proj", (2 * I, C)), ("down_proj", (C, I))):
                out[p + name + "_blocks"] = (E, rows, n_in // MXFP4_BLOCK, MXFP4_BLOCK // 2)
                out[p + name + "_scales"] = (E, rows, n_in // MXFP4_BLOCK)
    return out


def _dequantize_experts(state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Replace every `X_blocks` + `X_scales` pair by the dequantised (E, in, out) tensor `X`, in place."""
    for name in sorted(k for k in state if k.endswith("_blocks")):
        base = name[: -len("_blocks")]
        scales = base + "_scales"
        if scales not in state:
            raise ValueError(f"MXFP4 tensor {name} has no matching {scales}")
        if base in state:
            raise ValueError(f"tensor {base} is stored both unquantised and as MXFP4 {name}; each must appear once")
        try:
            state[base] = dequantize_mxfp4(state.pop(name), state.pop(scales), dtype)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
    orphans = sorted(k for k in state if k.endswith("_scales"))
    if orphans:
        raise ValueError(f"MXFP4 scales without blocks: {orphans}")


def _check_scales(state: Mapping[str, torch.Tensor], source: str) -> None:
    """Every MXFP4 scale is a number: the E8M0 code 255 means NaN."""
    bad = sorted(k for k, t in state.items() if k.endswith("_scales") and bool((t == NAN_SCALE).any()))
    if bad:
        raise ValueError(f"{source}: MXFP4 scales hold the NaN code {NAN_SCALE}: {bad}")


def load_hf_state_dict(
    directory: str | Path, cfg: ModelConfig | None = None, mxfp4: str = "dequantize"
) -> dict[str, torch.Tensor]:
    """Read an HF gpt-oss directory into a NATIVE state dict, strictly checked.

    MXFP4 experts are dequantised (`mxfp4="dequantize"`) or kept as stored (`"packed"`, for
    `MXFP4Experts`: the codes stay the file's memory-mapped tensors). The HF tensors are checked by
    their HF names first (missing / unexpected / both shapes / dtype / non-finite), so errors name
    what is actually in the files.
    """
    if mxfp4 not in ("dequantize", "packed"):
        raise ValueError(f"mxfp4={mxfp4!r}: must be 'dequantize' or 'packed'")
    directory = Path(directory)
    if cfg is None:
        try:
            cfg = config_from_hf(read_json(directory / CONFIG_NAME))
        except ValueError as e:
            if str(e).startswith(str(directory)):
                raise
            raise ValueError(f"{directory / CONFIG_NAME}: {e}") from None
    state = read_tensors(directory)
    packed = mxfp4 == "packed" and any(k.endswith("_blocks") for k in state)
    if packed:
        _check_scales(state, str(directory))
    else:
        floats = {t.dtype for t in state.values() if t.is_floating_point()}
        _dequantize_experts(state, floats.pop() if len(floats) == 1 else torch.float32)
    if cfg.tie_embeddings and "lm_head.weight" in state:
        # Some writers store the tied head anyway; accept it only if it really is the embedding.
        head = state.pop("lm_head.weight")
        emb = state.get("model.embed_tokens.weight")
        if emb is not None and not (head.shape == emb.shape and torch.equal(head, emb)):
            raise ValueError("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
    codes = [k for k in state if k.endswith(("_blocks", "_scales"))] if packed else ()
    check_state_dict(hf_shapes(cfg, mxfp4=packed), state, str(directory), codes)
    return hf_to_native(state, cfg, consume=True)


def hf_to_native(hf: Mapping[str, torch.Tensor], cfg: ModelConfig, consume: bool = False) -> dict[str, torch.Tensor]:
    """Map a complete, shape-checked HF state dict to native names and layouts.

    The native tensors come out in the decode layout of `GPTOSS.pack_for_decode` wherever a
    conversion copies anyway, so that packing the loaded model copies nothing more: q and kv are
    views of one input-major (C, Nq + Nkv) buffer, each expert's gate and up views of one (E, C, 2I)
    buffer (gate block, then up block), and down_proj is a view of the HF tensor, which is already
    input-major. `consume=True` (for a dict the caller hands over) pops each HF tensor once
    converted, so peak memory stays near one copy of the model instead of two.
    """
    take = hf.pop if consume else hf.__getitem__
    out = {"embed.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    nq = cfg.n_heads * cfg.head_dim
    for i in range(cfg.n_layers):
        p, n = f"model.layers.{i}.", f"blocks.{i}."
        out[n + "norm1.weight"] = take(p + "input_layernorm.weight")
        out[n + "norm2.weight"] = take(p + "post_attention_layernorm.weight")
        out[n + "attn.sinks"] = take(p + "self_attn.sinks")
        q, k, v = (take(p + f"self_attn.{x}_proj.weight") for x in "qkv")  # each (out, in)
        qkv = torch.cat((q.t(), k.t(), v.t()), dim=1)  # (C, Nq + 2·K·D), input-major; kv = K rows then V
        out[n + "attn.q_proj.weight"], out[n + "attn.kv_proj.weight"] = qkv[:, :nq].t(), qkv[:, nq:].t()
        out[n + "attn.o_proj.weight"] = take(p + "self_attn.o_proj.weight")
        if cfg.attention_bias:
            qkv_b = torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            out[n + "attn.q_proj.bias"], out[n + "attn.kv_proj.bias"] = qkv_b[:nq], qkv_b[nq:]
            out[n + "attn.o_proj.bias"] = take(p + "self_attn.o_proj.bias")
        out[n + "moe.router.weight"] = take(p + "mlp.router.weight")
        out[n + "moe.router.bias"] = take(p + "mlp.router.bias")
        e = p + "mlp.experts."
        if e + "gate_up_proj_blocks" in hf:  # MXFP4Experts: the stored tensors themselves, nothing copied
            for ours, theirs in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
                for part in ("blocks", "scales"):
                    out[n + f"moe.experts.{ours}_{part}"] = take(e + f"{theirs}_{part}")
                out[n + f"moe.experts.{ours}_bias"] = take(e + f"{theirs}_bias")
            continue
        gate_up = take(p + "mlp.experts.gate_up_proj")  # (E, C, 2I), interleaved columns
        hidden = gate_up.shape[-1] // 2
        packed = torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), dim=-1)  # (E, C, 2I): gate | up
        out[n + "moe.experts.gate_proj"] = packed[..., :hidden].transpose(1, 2)  # (E, I, C) view
        out[n + "moe.experts.up_proj"] = packed[..., hidden:].transpose(1, 2)  # (E, I, C) view
        gate_up_bias = take(p + "mlp.experts.gate_up_proj_bias")  # (E, 2I), interleaved
        packed_b = torch.cat((gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]), dim=-1)
        out[n + "moe.experts.gate_bias"], out[n + "moe.experts.up_bias"] = packed_b[:, :hidden], packed_b[:, hidden:]
        out[n + "moe.experts.down_proj"] = take(p + "mlp.experts.down_proj").transpose(1, 2)  # (E, C, I) view
        out[n + "moe.experts.down_bias"] = take(p + "mlp.experts.down_proj_bias")  # (E, C)
    return out


def native_to_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map a native state dict to HF names and layouts; absent router/expert biases become zeros."""
    K, D, E, I = cfg.n_kv_heads, cfg.head_dim, cfg.n_experts, cfg.expert_hidden
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layers):
        p, n = f"model.layers.{i}.", f"blocks.{i}."
        out[p + "input_layernorm.weight"] = state[n + "norm1.weight"]
        out[p + "post_attention_layernorm.weight"] = state[n + "norm2.weight"]
        out[p + "self_attn.sinks"] = state[n + "attn.sinks"]
        kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
        for kind in kinds:
            out[p + f"self_attn.q_proj.{kind}"] = state[n + f"attn.q_proj.{kind}"]
            out[p + f"self_attn.o_proj.{kind}"] = state[n + f"attn.o_proj.{kind}"]
            kv = state[n + f"attn.kv_proj.{kind}"]  # (2·K·D, …): K rows then V rows
            out[p + f"self_attn.k_proj.{kind}"] = kv[: K * D].clone()
            out[p + f"self_attn.v_proj.{kind}"] = kv[K * D :].clone()
        router_w = state[n + "moe.router.weight"]
        out[p + "mlp.router.weight"] = router_w
        out[p + "mlp.router.bias"] = state.get(n + "moe.router.bias", router_w.new_zeros(E))
        if n + "moe.experts.gate_up_blocks" in state:  # MXFP4Experts hold the HF layout already
            for ours, theirs in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
                for part in ("blocks", "scales", "bias"):
                    out[p + f"mlp.experts.{theirs}_{part}"] = state[n + f"moe.experts.{ours}_{part}"]
            continue
        gate, up = state[n + "moe.experts.gate_proj"], state[n + "moe.experts.up_proj"]  # (E, I, C)
        gate_up = torch.stack((gate, up), dim=2).reshape(E, 2 * I, -1)  # rows g0, u0, g1, u1, …
        out[p + "mlp.experts.gate_up_proj"] = gate_up.transpose(1, 2).contiguous()  # (E, C, 2I)
        zeros_i = gate.new_zeros(E, I)
        gb = state.get(n + "moe.experts.gate_bias", zeros_i)
        ub = state.get(n + "moe.experts.up_bias", zeros_i)
        out[p + "mlp.experts.gate_up_proj_bias"] = torch.stack((gb, ub), dim=2).reshape(E, 2 * I)  # (E, 2I)
        down = state[n + "moe.experts.down_proj"]  # (E, C, I)
        out[p + "mlp.experts.down_proj"] = down.transpose(1, 2).contiguous()  # (E, I, C)
        out[p + "mlp.experts.down_proj_bias"] = state.get(n + "moe.experts.down_bias", down.new_zeros(E, down.shape[1]))
    return out


def save_hf(model, directory: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write `model` in the HF GptOssForCausalLM layout (config.json + safetensors), atomically.

    Raises ValueError (before writing anything) for a config HF gpt-oss cannot express.
    """
    cfg = model.config
    hf_config = config_to_hf(cfg)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    hf_config["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    if getattr(model, "mxfp4_experts", False):
        hf_config["quantization_config"] = dict(MXFP4_QUANTIZATION_CONFIG)
    return write_checkpoint_dir(directory, hf_config, native_to_hf(state, cfg), max_shard_bytes)
