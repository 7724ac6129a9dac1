"""Tiny test and benchmark model configs, kept out of the product preset table (`config.PRESETS`).

They exist so unit tests run in milliseconds on a CPU and benchmarks have a fixed small model; none
is a model anyone would ship. `resolve_config(name)` is the one name lookup for code that accepts
either kind (the CLI's `--model`, `load_model`, the trainer's `model.preset`): product presets
first, then these. Listings shown to users (`gptoss-lite plan --help`, its geometry presets) name
product presets only.
"""

from __future__ import annotations

from gptoss_lite.config import GPT_OSS_KNOBS, PRESETS, ModelConfig

FIXTURES: dict[str, ModelConfig] = {
    # Tiny GPT-OSS-Lite for unit tests: every knob of the family, byte vocabulary.
    "lite-tiny": ModelConfig(
        vocab_size=264,
        d_model=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        sliding_window=8,
        n_experts=4,
        top_k=2,
        n_shared_experts=1,
        expert_hidden=64,
        rope_original_context=64,
        rope_pruned_pairs=4,
        max_position_embeddings=65_536,
    ),
    # Tiny gpt-oss-knob model for unit tests (biases, clamped activation, untied head).
    "gpt-oss-tiny": ModelConfig(
        vocab_size=264,
        d_model=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        sliding_window=8,
        n_experts=4,
        top_k=2,
        expert_hidden=64,
        max_position_embeddings=65_536,
        **{**GPT_OSS_KNOBS, "rope_original_context": 64},
    ),
    # ~20M-parameter gpt-oss config used by the benchmarks (issue: inference path).
    "gpt-oss-bench-20m": ModelConfig(
        vocab_size=12_288,
        d_model=256,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        sliding_window=128,
        n_experts=8,
        top_k=2,
        expert_hidden=256,
        max_position_embeddings=131_072,
        **{**GPT_OSS_KNOBS, "rope_original_context": 4096},
    ),
}


def valid_names() -> str:
    """The names `resolve_config` accepts, as one line for error messages: presets, then fixtures."""
    return f"valid presets: {', '.join(sorted(PRESETS))}; test fixtures: {', '.join(sorted(FIXTURES))}"


def resolve_config(name: str) -> ModelConfig:
    """The config called `name`: a product preset, else a test/benchmark fixture; unknown names list both."""
    if name in PRESETS:
        return PRESETS[name]
    if name in FIXTURES:
        return FIXTURES[name]
    raise ValueError(f"unknown preset {name!r}; {valid_names()}")
