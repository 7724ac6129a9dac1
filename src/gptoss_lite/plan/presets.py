"""Presets and sources of plan inputs: reference KV geometries, model weights and accelerators, a
measurement of this machine, and geometries read from our ModelConfig or a Hugging Face config.

Our own models are not retyped here: their geometries and parameter counts are derived from
`config.PRESETS` (pure Python, like this module).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

from gptoss_lite.config import PRESETS, ModelConfig, count_active_parameters, count_parameters
from gptoss_lite.kvspec import LayerKind
from gptoss_lite.plan.core import GB, MIB, AttentionKVGeometry, KVGeometry, MLAKVGeometry, ServingHardware, _real
from gptoss_lite.validation import check_int as _int


@dataclass(frozen=True)
class ModelWeights:
    """What a model contributes to a serving plan besides its KV geometry."""

    name: str
    total_parameters: int  # resident in memory
    active_parameters: int  # read and multiplied per token (== total for dense models)
    bytes_per_parameter: float = 2.0  # 2 = BF16
    query_heads: int = 1  # H_q, for attention FLOPs
    attention_head_dim: int = 1  # D used in 4·H·D per query-key pair
    # Routed-expert matrices stored in their own format (gpt-oss: MXFP4, 4.25 bits per weight):
    expert_parameters: int = 0  # of total_parameters
    active_expert_parameters: int = 0  # of active_parameters
    expert_bytes_per_parameter: float | None = None  # None: bytes_per_parameter

    def __post_init__(self) -> None:
        _int("total_parameters", self.total_parameters, 1)
        _int("active_parameters", self.active_parameters, 1)
        if self.active_parameters > self.total_parameters:
            raise ValueError(
                f"active_parameters={self.active_parameters}: must be <= total_parameters={self.total_parameters}"
            )
        _real("bytes_per_parameter", self.bytes_per_parameter)
        _int("query_heads", self.query_heads, 1)
        _int("attention_head_dim", self.attention_head_dim, 1)
        _int("expert_parameters", self.expert_parameters, 0)
        _int("active_expert_parameters", self.active_expert_parameters, 0)
        if self.expert_parameters > self.total_parameters or self.active_expert_parameters > min(
            self.active_parameters, self.expert_parameters
        ):
            raise ValueError(
                f"expert_parameters={self.expert_parameters} / active_expert_parameters="
                f"{self.active_expert_parameters}: must fit in the total / active parameters"
            )
        if self.expert_bytes_per_parameter is not None:
            _real("expert_bytes_per_parameter", self.expert_bytes_per_parameter)

    @property
    def expert_bytes(self) -> float:
        return self.bytes_per_parameter if self.expert_bytes_per_parameter is None else self.expert_bytes_per_parameter

    def _bytes(self, parameters: int, experts: int) -> int:
        return math.ceil((parameters - experts) * self.bytes_per_parameter + experts * self.expert_bytes)

    @property
    def streamed_weight_bytes(self) -> int:
        """Weight bytes read per decode step (active parameters), rounded up to whole bytes."""
        return self._bytes(self.active_parameters, self.active_expert_parameters)

    @property
    def resident_weight_bytes(self) -> int:
        return self._bytes(self.total_parameters, self.expert_parameters)


# ---- our model presets: geometry and parameter counts derived from config.PRESETS --------------------


def geometry_from_model_config(
    cfg: Any, bytes_per_element: int = 2, *, name: str = "model-config"
) -> AttentionKVGeometry:
    """KV geometry of a `ModelConfig` (duck-typed: n_layers, n_kv_heads, head_dim, sliding_layers, sliding_window)."""
    sliding = len(cfg.sliding_layers)
    return AttentionKVGeometry(
        name,
        cfg.n_layers,
        cfg.n_kv_heads,
        cfg.head_dim,
        bytes_per_element,
        sliding,
        cfg.sliding_window if sliding else None,
    )


def weights_from_model_config(
    cfg: ModelConfig,
    bytes_per_parameter: float = 2.0,
    *,
    name: str = "model-config",
    expert_bytes_per_parameter: float | None = None,
) -> ModelWeights:
    """Parameter counts of a `ModelConfig`, from `config.count_parameters` / `count_active_parameters`.

    Active (streamed) parameters leave out an untied input embedding: a token looks up one row of it,
    which is neither a read of the whole table nor a multiply (the gpt-oss model card's active counts
    exclude it too). A tied embedding is also the output head, read in full every step, so it counts.
    The routed experts' gate, up and down matrices (not their biases) are counted apart, for a
    storage of their own (`expert_bytes_per_parameter`: 4.25 / 8 for MXFP4).
    """
    embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    per_expert = 3 * cfg.d_model * cfg.expert_hidden
    return ModelWeights(
        name,
        count_parameters(cfg),
        count_active_parameters(cfg) - embedding,
        bytes_per_parameter,
        cfg.n_heads,
        cfg.head_dim,
        expert_parameters=cfg.n_layers * cfg.n_experts * per_expert,
        active_expert_parameters=cfg.n_layers * cfg.top_k * per_expert,
        expert_bytes_per_parameter=expert_bytes_per_parameter,
    )


MXFP4_BYTES_PER_PARAMETER = 4.25 / 8  # 32 four-bit codes + one 8-bit scale per block
# Models whose released checkpoints store the routed experts in MXFP4 (and which load them packed).
MXFP4_MODELS = ("gpt-oss-20b", "gpt-oss-120b")


# ---- presets ----------------------------------------------------------------------------------------
# Our models (gptoss-lite-502m, gpt-oss-20b, gpt-oss-120b) come from config.PRESETS, so a geometry or a
# parameter count is written down once. gptoss-lite-502m: 501,836,640 total, 247,032,672 active
# (docs/model.md#the-502m-preset, pinned by the config tests). gpt-oss-20b: 20,914,757,184 / 3,608,307,264 and
# gpt-oss-120b: 116,829,156,672 / 5,132,849,472, where this table used to carry the approximate
# published figures 20.9B / 3.6B and 116.8B / 5.1B (OpenAI model card): the derived counts agree with
# them to every digit given.

GEOMETRY_PRESETS: dict[str, KVGeometry] = {
    g.name: g
    for g in (
        # A 70B model if it kept one KV head per query head (pre-GQA); the GQA savings baseline.
        AttentionKVGeometry("mha-70b-equivalent", 80, 64, 128),
        AttentionKVGeometry("llama-3.3-70b", 80, 8, 128),
        AttentionKVGeometry("llama-3-8b", 32, 8, 128),
        MLAKVGeometry("deepseek-v3", 61, 512, 64),
        *(geometry_from_model_config(cfg, name=name) for name, cfg in PRESETS.items()),
    )
}

MODEL_WEIGHTS: dict[str, ModelWeights] = {
    w.name: w
    for w in (
        # Hypothetical, for the GQA comparison: a dense 70B.
        ModelWeights("mha-70b-equivalent", 70_000_000_000, 70_000_000_000, 2.0, 64, 128),
        # Approximate published figures (Meta model cards): 70.6B and 8.03B parameters.
        ModelWeights("llama-3.3-70b", 70_600_000_000, 70_600_000_000, 2.0, 64, 128),
        ModelWeights("llama-3-8b", 8_030_000_000, 8_030_000_000, 2.0, 32, 128),
        # Approximate published figures (DeepSeek-V3 report): 671B total, 37B active. Attention D is
        # 160 = mean of the QK (192) and V (128) head dims, so 4·H·D counts QK + AV exactly.
        ModelWeights("deepseek-v3", 671_000_000_000, 37_000_000_000, 2.0, 128, 160),
        # BF16, with the routed experts in MXFP4 where the release stores them so (see --expert-bits).
        *(
            weights_from_model_config(
                cfg, name=name, expert_bytes_per_parameter=MXFP4_BYTES_PER_PARAMETER if name in MXFP4_MODELS else None
            )
            for name, cfg in PRESETS.items()
        ),
    )
}


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator's spec-sheet (or measured) figures, independent of any model."""

    name: str
    bandwidth_bytes_per_second: float  # β, powers of ten
    peak_flops_per_second: float  # Π, dense BF16 unless `source` says otherwise
    device_capacity_bytes: int
    source: str = "spec sheet"  # "spec sheet" or "measured ..."

    def __post_init__(self) -> None:
        _real("bandwidth_bytes_per_second", self.bandwidth_bytes_per_second)
        _real("peak_flops_per_second", self.peak_flops_per_second)
        _int("device_capacity_bytes", self.device_capacity_bytes, 1)


# NOTE: capacities use the marketing "80 GB" / "141 GB" as decimal bytes (80e9), not GiB. The
# physical HBM is somewhat larger (an A100 80GB reports 81,920 MiB ≈ 85.9e9 B), but the CUDA
# context, driver and ECC take part of it, so the decimal figure is the safer capacity upper bound.
# Bandwidth and dense BF16 FLOP/s are NVIDIA data-sheet values (SXM parts, no sparsity).
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    h.name: h
    for h in (
        HardwareSpec("a100-80gb", 2.039e12, 312e12, 80 * GB),
        HardwareSpec("h100-sxm", 3.35e12, 989e12, 80 * GB),
        HardwareSpec("h200", 4.8e12, 989e12, 141 * GB),
    )
}
THIS_MACHINE = "this-machine"


def _lookup(kind: str, table: dict[str, Any], name: str, extra: tuple[str, ...] = ()) -> Any:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(sorted((*table, *extra)))}")
    return table[name]


def get_geometry(name: str) -> KVGeometry:
    """A KV geometry preset by exact name."""
    return _lookup("geometry preset", GEOMETRY_PRESETS, name)


def get_hardware(name: str) -> HardwareSpec:
    """A hardware preset by exact name; `this-machine` is measured now (about a second)."""
    if name == THIS_MACHINE:
        return measure_this_machine()
    return _lookup("hardware preset", HARDWARE_PRESETS, name, (THIS_MACHINE,))


def serving_hardware(
    spec: HardwareSpec, weights: ModelWeights, devices: int = 1, runtime_reserve_bytes: int = 0
) -> ServingHardware:
    """Combine a chip with a model: streamed = active weights, resident = total weights.

    `devices` > 1 models ideal tensor parallelism (bandwidth, FLOP/s and memory all scale); that is
    itself an upper bound, since real all-reduces cost time.
    """
    _int("devices", devices, 1)
    _int("runtime_reserve_bytes", runtime_reserve_bytes, 0)
    need = weights.resident_weight_bytes + runtime_reserve_bytes
    if need > spec.device_capacity_bytes * devices:
        fit = -(-need // spec.device_capacity_bytes)
        raise ValueError(
            f"{weights.name} weights {weights.resident_weight_bytes / GB:.1f} GB + reserve "
            f"{runtime_reserve_bytes / GB:.1f} GB exceed {devices} x {spec.name} "
            f"({spec.device_capacity_bytes / GB:.1f} GB each); use more devices (at least {fit})"
        )
    return ServingHardware(
        weight_bytes=weights.streamed_weight_bytes,
        bandwidth_bytes_per_second=spec.bandwidth_bytes_per_second * devices,
        peak_flops_per_second=spec.peak_flops_per_second * devices,
        parameter_count=weights.active_parameters,
        device_capacity_bytes=spec.device_capacity_bytes * devices,
        runtime_reserve_bytes=runtime_reserve_bytes,
        resident_weight_bytes=weights.resident_weight_bytes,
        name=spec.name if devices == 1 else f"{devices}x {spec.name}",
    )


def measure_this_machine(copy_bytes: int = 256 * MIB, repeats: int = 5) -> HardwareSpec:
    """Measure host memory bandwidth (numpy copy) and fp32 matmul FLOP/s; capacity = physical RAM.

    Bandwidth counts read + write bytes of the best of `repeats` copies of `copy_bytes`. These are
    *measured* figures for the CPU, not an accelerator; BF16 peaks do not apply.
    """
    import numpy as np  # lazily: plan stays importable without numpy

    _int("copy_bytes", copy_bytes, 8)
    _int("repeats", repeats, 1)
    src = np.ones(copy_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    bandwidth = 2 * src.nbytes / best
    n = 512
    a = np.ones((n, n), dtype=np.float32)
    best_mm = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best_mm = min(best_mm, time.perf_counter() - start)
    flops = 2 * n**3 / best_mm
    capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HardwareSpec(
        THIS_MACHINE,
        bandwidth,
        flops,
        capacity,
        source="measured (numpy copy bandwidth, fp32 matmul FLOP/s, physical RAM)",
    )


def geometry_from_hf_config(
    config: dict[str, Any], bytes_per_element: int = 2, *, name: str | None = None
) -> AttentionKVGeometry:
    """KV geometry of a Hugging Face `config.json` dict.

    head_dim comes from `head_dim`, else hidden_size / num_attention_heads; missing
    `num_key_value_heads` means MHA (the transformers convention). Sliding layers are the
    `layer_types` entries equal to "sliding_attention". NOTE: a config without `layer_types` is read as
    all full attention (a Mistral-style `sliding_window` applied to every layer is not interpreted), which
    overstates KV.
    """
    if not isinstance(config, dict):
        raise TypeError(f"config={type(config).__name__}: must be a dict parsed from config.json")
    for key in ("num_hidden_layers", "num_attention_heads"):
        if key not in config:
            raise ValueError(f"HF config has no {key!r}; is this a decoder config.json?")
    layers = _int("num_hidden_layers", config["num_hidden_layers"], 1)
    heads = _int("num_attention_heads", config["num_attention_heads"], 1)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim")
    if head_dim is None:
        hidden = _int("hidden_size", config.get("hidden_size"), 1)
        if hidden % heads:
            raise ValueError(
                f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; add an explicit head_dim"
            )
        head_dim = hidden // heads
    types = config.get("layer_types") or ()
    if types and len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries; num_hidden_layers={layers}")
    words = [kind.value for kind in LayerKind]
    unknown = sorted({t for t in types if t not in words})
    if unknown:
        raise ValueError(f"layer_types {unknown}: expected one of {words}")
    sliding = sum(t == LayerKind.SLIDING for t in types)
    window = config.get("sliding_window") if sliding else None
    label = name or str(config.get("_name_or_path") or config.get("model_type") or "hf-config")
    return AttentionKVGeometry(label, layers, kv_heads, head_dim, bytes_per_element, sliding, window)
