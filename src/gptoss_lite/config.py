"""Model configuration: one frozen dataclass, presets by exact name, parameter counting.

Every knob that distinguishes GPT-OSS-Lite from the released gpt-oss models
(docs/model.md#gpt-oss-family-knobs) is a field
here, so the same model code runs both.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gptoss_lite.validation import check_int as _check_int

SLIDING = "sliding_attention"
FULL = "full_attention"
ACTIVATIONS = ("swiglu", "gptoss")

# Bumped when the native config.json layout changes incompatibly.
CONFIG_FORMAT_VERSION = 1


def _alternating_layer_types(n_layers: int) -> tuple[str, ...]:
    """Even layers sliding, odd layers full (docs/model.md#the-502m-preset)."""
    return tuple(SLIDING if i % 2 == 0 else FULL for i in range(n_layers))


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a GPT-OSS-Lite / gpt-oss model. Defaults are the 502M preset (docs/model.md#the-502m-preset)."""

    vocab_size: int = 128_000  # tokens
    d_model: int = 768  # residual width C
    n_layers: int = 12  # transformer blocks L
    n_heads: int = 8  # query heads H
    n_kv_heads: int = 4  # key/value heads K (GQA: head h reads KV head h // (H / K))
    head_dim: int = 96  # D
    sliding_window: int = 128  # W keys, including the query's own position
    # Per-layer attention kind; empty means "even layers sliding, odd layers full".
    layer_types: tuple[str, ...] = ()
    n_experts: int = 8  # routed experts E
    top_k: int = 2  # active routed experts per token A
    n_shared_experts: int = 1  # experts applied to every token
    expert_hidden: int = 1536  # I, hidden width of every expert MLP
    activation: str = "swiglu"  # "swiglu": silu(gate)*up; "gptoss": clamped (up+1)*gate*sigmoid(1.702 gate)
    swiglu_limit: float = 7.0  # clamp limit of the "gptoss" activation
    attention_bias: bool = False  # biases on q/k/v/o projections
    router_bias: bool = False
    expert_bias: bool = False  # biases on expert gate/up and down projections
    sink_clamp: tuple[float, float] | None = (-10.0, 15.0)  # None: sinks unclamped
    rope_theta: float = 100_000.0
    rope_factor: float = 32.0  # YaRN scale s (1.0 disables YaRN)
    rope_original_context: int = 4096  # L0, the context the rotary frequencies were trained at
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_pruned_pairs: int = 24  # on global layers, the first (highest-frequency) pairs left unrotated
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    dropout: float = 0.0  # training only; model.eval() disables it
    max_position_embeddings: int = 131_072  # longest sequence generate() accepts, in tokens
    initializer_range: float = 0.02
    # Context length the checkpoint was trained at (docs/training.md); None when unknown/untrained.
    train_context_length: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "sliding_window",
            "n_experts",
            "top_k",
            "expert_hidden",
            "rope_original_context",
            "max_position_embeddings",
        ):
            object.__setattr__(self, name, _check_int(name, getattr(self, name), minimum=1))
        for name in ("n_shared_experts", "rope_pruned_pairs"):
            object.__setattr__(self, name, _check_int(name, getattr(self, name), minimum=0))
        if self.train_context_length is not None:
            object.__setattr__(
                self, "train_context_length", _check_int("train_context_length", self.train_context_length, minimum=1)
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: must be even for rotary embeddings")
        if self.rope_pruned_pairs > self.head_dim // 2:
            raise ValueError(
                f"rope_pruned_pairs={self.rope_pruned_pairs}: must be <= head_dim/2 = {self.head_dim // 2}"
            )
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be <= n_experts={self.n_experts}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}: must be one of {ACTIVATIONS}")
        for name in (
            "rope_theta",
            "rope_factor",
            "rope_beta_fast",
            "rope_beta_slow",
            "norm_eps",
            "swiglu_limit",
            "initializer_range",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a finite number > 0")
        if self.rope_theta <= 1:
            raise ValueError(f"rope_theta={self.rope_theta}: must be > 1")
        if self.rope_factor < 1:
            raise ValueError(f"rope_factor={self.rope_factor}: must be >= 1 (1 disables YaRN)")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"dropout={self.dropout!r}: must be in [0, 1)")
        if self.sink_clamp is not None:
            lo, hi = self.sink_clamp
            if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise ValueError(f"sink_clamp={self.sink_clamp}: must be (low, high) with low < high")
            object.__setattr__(self, "sink_clamp", (float(lo), float(hi)))
        for name in ("attention_bias", "router_bias", "expert_bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r}: must be a bool")
        types = tuple(self.layer_types) if self.layer_types else _alternating_layer_types(self.n_layers)
        if len(types) != self.n_layers:
            raise ValueError(f"layer_types has {len(types)} entries; n_layers={self.n_layers}")
        bad = sorted({t for t in types if t not in (SLIDING, FULL)})
        if bad:
            raise ValueError(f"layer_types {bad}: each must be {SLIDING!r} or {FULL!r}")
        object.__setattr__(self, "layer_types", types)

    # ---- derived values -------------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        """G = H / K query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` is a sliding-window layer."""
        return self.layer_types[layer] == SLIDING

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def with_rope_factor(self, factor: float) -> ModelConfig:
        """This config with its YaRN factor set at load time (as llama.cpp's and vLLM's rope-scaling
        overrides): the weights stay as trained, the rotary frequencies stretch to a target of
        rope_original_context × factor tokens, and positions up to twice that target are accepted (the
        shipped configs' own margin), never fewer than before. ValueError for a factor below 1."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
            raise ValueError(f"rope factor {factor!r}: must be a finite number >= 1")
        if factor < 1:
            raise ValueError(f"rope factor {factor}: must be >= 1 (1 disables YaRN)")
        target = int(self.rope_original_context * factor)
        return self.replace(
            rope_factor=float(factor), max_position_embeddings=max(self.max_position_embeddings, 2 * target)
        )

    # ---- serialisation ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["sink_clamp"] = list(self.sink_clamp) if self.sink_clamp is not None else None
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a dict, rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}; valid fields: {sorted(known)}")
        data = dict(data)
        if data.get("layer_types") is not None:
            data["layer_types"] = tuple(data["layer_types"])
        if data.get("sink_clamp") is not None:
            data["sink_clamp"] = tuple(data["sink_clamp"])
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps({"format_version": CONFIG_FORMAT_VERSION, "model": self.to_dict()}, indent=2)

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        data = json.loads(Path(path).read_text())
        version = data.get("format_version")
        if version != CONFIG_FORMAT_VERSION or "model" not in data:
            raise ValueError(
                f"{path}: not a gptoss-lite config (format_version={version!r}, "
                f"expected {CONFIG_FORMAT_VERSION} with a 'model' section)"
            )
        return cls.from_dict(data["model"])


# ---- presets ------------------------------------------------------------------------------------
# Product presets only: the models this stack is for. Tiny test and benchmark configs live in
# `gptoss_lite.fixtures`, whose `resolve_config` looks a name up in both tables.

# The released gpt-oss knobs (biases, clamped activation, no shared expert, untied head, ...).
GPT_OSS_KNOBS: dict[str, Any] = dict(
    attention_bias=True,
    router_bias=True,
    expert_bias=True,
    n_shared_experts=0,
    activation="gptoss",
    sink_clamp=None,
    rope_pruned_pairs=0,
    rope_theta=150_000.0,
    tie_embeddings=False,
    rope_factor=32.0,
    rope_original_context=4096,
)

PRESETS: dict[str, ModelConfig] = {
    "gptoss-lite-502m": ModelConfig(),
    "gpt-oss-20b": ModelConfig(
        vocab_size=201_088,
        d_model=2880,
        n_layers=24,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        n_experts=32,
        top_k=4,
        expert_hidden=2880,
        **GPT_OSS_KNOBS,
    ),
    "gpt-oss-120b": ModelConfig(
        vocab_size=201_088,
        d_model=2880,
        n_layers=36,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        n_experts=128,
        top_k=4,
        expert_hidden=2880,
        **GPT_OSS_KNOBS,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """Look up a product preset by exact name; an unknown name lists the valid ones."""
    if name not in PRESETS:
        raise ValueError(
            f"unknown preset {name!r}; valid presets: {', '.join(sorted(PRESETS))} "
            "(tiny test/benchmark configs: gptoss_lite.fixtures.resolve_config)"
        )
    return PRESETS[name]


# ---- parameter counting (no model built) -----------------------------------------------------------


def _layer_param_counts(cfg: ModelConfig) -> tuple[int, int, int]:
    """(dense params per layer, params per routed expert, params per shared expert)."""
    C, H, K, D, I, E = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.expert_hidden, cfg.n_experts
    attn = C * H * D + C * 2 * K * D + H * D * C
    if cfg.attention_bias:
        attn += H * D + 2 * K * D + C
    attn += H  # sinks
    norms = 2 * C
    router = C * E + (E if cfg.router_bias else 0)
    expert = 3 * C * I + ((2 * I + C) if cfg.expert_bias else 0)
    return attn + norms + router, expert, expert


def count_parameters(cfg: ModelConfig) -> int:
    """Total parameters of a model built from `cfg`."""
    dense, routed, shared = _layer_param_counts(cfg)
    per_layer = dense + cfg.n_experts * routed + cfg.n_shared_experts * shared
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return cfg.vocab_size * cfg.d_model + cfg.n_layers * per_layer + cfg.d_model + head


def count_active_parameters(cfg: ModelConfig) -> int:
    """Parameters touched per token: everything except the routed experts not selected."""
    _, routed, _ = _layer_param_counts(cfg)
    return count_parameters(cfg) - cfg.n_layers * (cfg.n_experts - cfg.top_k) * routed
