"""Serving arithmetic: KV bytes, decode rooflines, capacity, FLOPs and cost (SPEC §5.1-§5.4).

Pure Python on purpose (no torch, no numpy at import time): `gptoss-lite plan` must answer
"how much KV does this model need at 128K on an H100?" on any laptop in milliseconds.

Units (SPEC §5.1): KiB/MiB/GiB are powers of two; KB/MB/GB and every bandwidth are powers of ten.
Three different quantities are kept apart and labelled as such by callers:

- *payload*: the bytes of K and V a cache must hold (this module's `kv_payload_bytes`);
- *upper bound*: a ceiling from spec sheets (`decode_ceiling`, `max_resident_requests`), which
  no real system reaches;
- *measured*: what an allocator or a benchmark really observed (only `measure_this_machine` here).

NOTE: decode weight traffic uses the *active* parameters of a MoE model (the weights one token
reads). At batch > 1 different tokens pick different experts, so real traffic lies between the
active and the total weights; using active weights makes every decode ceiling an upper bound.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Union

from gptoss_lite.validation import check_int as _int

KIB, MIB, GIB = 2**10, 2**20, 2**30
KB, MB, GB = 10**3, 10**6, 10**9


# ---- validation helpers ---------------------------------------------------------------------------

def _real(name: str, value: Any, *, positive: bool = True) -> float:
    """A finite real number, > 0 (or >= 0 with positive=False); booleans are rejected."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction)):
        raise TypeError(f"{name}={value!r}: must be a real number (not bool)")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: must be finite (got NaN or inf)")
    if positive and value <= 0:
        raise ValueError(f"{name}={value}: must be > 0")
    if not positive and value < 0:
        raise ValueError(f"{name}={value}: must be >= 0")
    return float(value)


def _exact(value: Any) -> Fraction:
    """The exact rational a user meant: 0.1 means 1/10 (shortest repr), not the binary double."""
    return value if isinstance(value, Fraction) else Fraction(repr(value) if isinstance(value, float) else value)


# ---- geometry and payload (SPEC §5.2) ---------------------------------------------------------------

@dataclass(frozen=True)
class AttentionKVGeometry:
    """KV layout of ordinary attention (MHA / GQA / MQA), optionally with sliding-window layers.

    `attention_layers` counts every attention layer; `sliding_window_layers` of them keep only the
    last `min(window, T)` tokens, the rest keep all T. A hybrid model passes only its attention layers.
    """

    name: str
    attention_layers: int  # L_attn, all attention layers (sliding ones included)
    kv_heads: int  # K (H_kv)
    head_dim: int  # D
    bytes_per_element: int = 2  # 2 = BF16/FP16, 1 = FP8
    sliding_window_layers: int = 0  # how many of attention_layers are sliding-window
    window: int | None = None  # W tokens per sliding layer; None when there are none

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name={self.name!r}: must be a non-empty str")
        for field_name in ("attention_layers", "kv_heads", "head_dim", "bytes_per_element"):
            _int(field_name, getattr(self, field_name), 1)
        _int("sliding_window_layers", self.sliding_window_layers, 0)
        if self.sliding_window_layers > self.attention_layers:
            raise ValueError(f"sliding_window_layers={self.sliding_window_layers}: must be <= "
                             f"attention_layers={self.attention_layers} (it counts a subset of them)")
        if self.sliding_window_layers and self.window is None:
            raise ValueError(f"sliding_window_layers={self.sliding_window_layers} needs window=W tokens")
        if self.window is not None:
            _int("window", self.window, 1)
            if not self.sliding_window_layers:
                raise ValueError(f"window={self.window} given but sliding_window_layers=0; "
                                 "pass window=None for a model without sliding layers")

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K plus V of one token in one layer: 2 · H_kv · D · bytes_per_element."""
        return 2 * self.kv_heads * self.head_dim * self.bytes_per_element

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token over all attention layers, as if every layer were full attention."""
        return self.attention_layers * self.bytes_per_token_per_layer

    @property
    def global_layers(self) -> int:
        return self.attention_layers - self.sliding_window_layers

    def sequence_bytes(self, context_tokens: int) -> int:
        """Window-aware payload of one sequence of `context_tokens` tokens (unscaled, exact)."""
        t = _int("context_tokens", context_tokens, 0)
        windowed = min(self.window, t) if self.window is not None else 0
        stored = self.global_layers * t + self.sliding_window_layers * windowed  # token-layers
        return stored * self.bytes_per_token_per_layer


@dataclass(frozen=True)
class MLAKVGeometry:
    """KV layout of multi-head latent attention: one latent + one RoPE key per token per layer.

    Bytes per token `L · (latent_dim + rope_dim) · bytes_per_element` — no factor of two, because
    K and V are both re-expanded from the same cached latent (SPEC §5.2).
    """

    name: str
    attention_layers: int  # L_attn
    latent_dim: int  # compressed KV latent width
    rope_dim: int  # decoupled RoPE key width
    bytes_per_element: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name={self.name!r}: must be a non-empty str")
        for field_name in ("attention_layers", "latent_dim", "bytes_per_element"):
            _int(field_name, getattr(self, field_name), 1)
        _int("rope_dim", self.rope_dim, 0)

    @property
    def bytes_per_token(self) -> int:
        return self.attention_layers * (self.latent_dim + self.rope_dim) * self.bytes_per_element

    def sequence_bytes(self, context_tokens: int) -> int:
        """Payload of one sequence of `context_tokens` tokens (unscaled, exact)."""
        return self.bytes_per_token * _int("context_tokens", context_tokens, 0)


KVGeometry = Union[AttentionKVGeometry, MLAKVGeometry]


def _check_geometry(geometry: Any) -> KVGeometry:
    if not isinstance(geometry, (AttentionKVGeometry, MLAKVGeometry)):
        raise TypeError(f"geometry={geometry!r}: must be an AttentionKVGeometry or MLAKVGeometry")
    return geometry


def kv_payload_bytes(geometry: KVGeometry, context_tokens: int, batch_size: int = 1,
                     kv_scale: float = 1.0) -> int:
    """KV payload in bytes: sequence bytes × batch × kv_scale, an exact integer or a ValueError.

    `kv_scale` is a storage factor such as bits/16 (0.5 for 8-bit KV). It is read as the decimal the
    caller wrote (0.1 is 1/10), and a product that is not a whole number of bytes is an error,
    never a rounding. Quantisation metadata (scales, zero points) is not part of this payload.
    """
    _check_geometry(geometry)
    _int("batch_size", batch_size, 1)
    _real("kv_scale", kv_scale)
    raw = geometry.sequence_bytes(context_tokens) * batch_size
    scaled = raw * _exact(kv_scale)
    if scaled.denominator != 1:
        raise ValueError(f"kv_scale={kv_scale}: {raw} B x {kv_scale} = {float(scaled)} B is not a whole "
                         "number of bytes; pick a scale (bits/16) that divides the payload exactly")
    return int(scaled)


# ---- hardware and decode roofline (SPEC §5.3) -------------------------------------------------------

@dataclass(frozen=True)
class ServingHardware:
    """One serving deployment: the weights it streams, the chip(s) it runs on, the memory it has.

    `weight_bytes` is W, the weight bytes one decode step reads (active weights for MoE);
    `resident_weight_bytes` is what sits in device memory (total weights; defaults to W). Weights
    plus runtime reserve must fit in the capacity.
    """

    weight_bytes: int  # W, bytes read per decode step
    bandwidth_bytes_per_second: float  # β, bytes/s (powers of ten)
    peak_flops_per_second: float  # Π, FLOP/s
    parameter_count: int  # P, parameters multiplied per token (active for MoE)
    device_capacity_bytes: int  # memory of all devices together
    runtime_reserve_bytes: int = 0  # activations, CUDA context, fragmentation
    resident_weight_bytes: int | None = None  # None: same as weight_bytes (dense model)
    name: str = "custom"

    def __post_init__(self) -> None:
        _int("weight_bytes", self.weight_bytes, 1)
        _real("bandwidth_bytes_per_second", self.bandwidth_bytes_per_second)
        _real("peak_flops_per_second", self.peak_flops_per_second)
        _int("parameter_count", self.parameter_count, 1)
        _int("device_capacity_bytes", self.device_capacity_bytes, 1)
        _int("runtime_reserve_bytes", self.runtime_reserve_bytes, 0)
        if self.resident_weight_bytes is not None:
            _int("resident_weight_bytes", self.resident_weight_bytes, self.weight_bytes)
        if self.resident_bytes + self.runtime_reserve_bytes > self.device_capacity_bytes:
            raise ValueError(
                f"weights {self.resident_bytes} B + reserve {self.runtime_reserve_bytes} B exceed "
                f"device_capacity_bytes={self.device_capacity_bytes}; use more devices, smaller "
                "weights or a smaller reserve")

    @property
    def resident_bytes(self) -> int:
        """Weight bytes held in device memory."""
        return self.weight_bytes if self.resident_weight_bytes is None else self.resident_weight_bytes

    @property
    def ridge_flops_per_byte(self) -> float:
        """Π / β: below this intensity a kernel is memory-bound."""
        return self.peak_flops_per_second / self.bandwidth_bytes_per_second


def _check_hardware(hw: Any) -> ServingHardware:
    if not isinstance(hw, ServingHardware):
        raise TypeError(f"hw={hw!r}: must be a ServingHardware")
    return hw


@dataclass(frozen=True)
class DecodeCeiling:
    """Upper bound of one aggregate decode step: weights once plus every request's KV."""

    batch_size: int
    context_tokens: int
    kv_bytes: int  # payload read for the whole batch
    total_bytes_per_step: int  # W + kv_bytes
    aggregate_tokens_per_second: float  # B · β / bytes
    per_request_tokens_per_second: float  # aggregate / B


def decode_ceiling(hw: ServingHardware, geometry: KVGeometry, context_tokens: int, batch_size: int = 1,
                   kv_scale: float = 1.0) -> DecodeCeiling:
    """Bandwidth ceiling of decoding `batch_size` requests at `context_tokens` each (upper bound)."""
    _check_hardware(hw)
    kv = kv_payload_bytes(geometry, context_tokens, batch_size, kv_scale)
    total = hw.weight_bytes + kv
    aggregate = batch_size * hw.bandwidth_bytes_per_second / total
    return DecodeCeiling(batch_size, context_tokens, kv, total, aggregate, aggregate / batch_size)


def arithmetic_intensity(hw: ServingHardware, geometry: KVGeometry, context_tokens: int, batch_size: int = 1,
                         kv_scale: float = 1.0) -> float:
    """Projection-only FLOP per byte of one decode step: 2 · P · B / (W + KV). Compare to the ridge."""
    step = decode_ceiling(hw, geometry, context_tokens, batch_size, kv_scale)
    return 2 * hw.parameter_count * batch_size / step.total_bytes_per_step


def batch_knee(hw: ServingHardware, geometry: KVGeometry, context_tokens: int, kv_scale: float = 1.0) -> float:
    """B* = W / KV_payload(N, 1): the batch at which KV traffic equals weight traffic."""
    _check_hardware(hw)
    kv = kv_payload_bytes(geometry, context_tokens, 1, kv_scale)
    if kv == 0:
        raise ValueError(f"context_tokens={context_tokens}: the KV payload is 0 B, so there is no knee; "
                         "use context_tokens >= 1")
    return hw.weight_bytes / kv


def max_resident_requests(hw: ServingHardware, geometry: KVGeometry, context_tokens: int,
                          kv_scale: float = 1.0) -> int:
    """KV-only upper bound: (capacity − resident weights − reserve) // KV_payload(N, 1) requests."""
    _check_hardware(hw)
    kv = kv_payload_bytes(geometry, context_tokens, 1, kv_scale)
    if kv == 0:
        raise ValueError(f"context_tokens={context_tokens}: the KV payload is 0 B, so capacity is unbounded; "
                         "use context_tokens >= 1")
    free = hw.device_capacity_bytes - hw.resident_bytes - hw.runtime_reserve_bytes
    return free // kv


# ---- FLOP models (SPEC §5.3; two FLOPs per multiply-add) --------------------------------------------

def _causal_pairs(queries: int, prefix: int, window: int | None) -> int:
    """Query-key pairs of `queries` causal queries after `prefix` cached keys, each seeing <= window keys."""
    if window is None:
        return queries * prefix + queries * (queries + 1) // 2
    # Query at absolute position i sees min(window, i + 1) keys; S(n) = Σ_{i<n} (i + 1).
    end = prefix + queries
    growing_end = min(end, window)
    growing = max(0, growing_end * (growing_end + 1) // 2 - prefix * (prefix + 1) // 2) if prefix < window else 0
    capped = max(0, end - max(prefix, window)) * window
    return growing + capped


def attention_flops(layers: int, query_heads: int, head_dim: int, queries: int, cached_prefix: int = 0,
                    window: int | None = None) -> int:
    """QK + AV FLOPs of `queries` causal queries after `cached_prefix` keys: 4·L·H_q·D per pair.

    Pairs are `q·p + q(q+1)/2`; with `window=W` (sliding-window layers) each query sees at most W keys.
    Attention work depends on the query heads H_q; GQA storage depends on H_kv.
    """
    _int("layers", layers, 1)
    _int("query_heads", query_heads, 1)
    _int("head_dim", head_dim, 1)
    _int("queries", queries, 0)
    _int("cached_prefix", cached_prefix, 0)
    if window is not None:
        _int("window", window, 1)
    return 4 * layers * query_heads * head_dim * _causal_pairs(queries, cached_prefix, window)


def decode_flops(parameters: int, layers: int, query_heads: int, head_dim: int, keys: int, batch: int = 1) -> int:
    """FLOPs of one decode step at `keys` keys: B · (2P + attention(1 query, keys − 1 cached)).

    A zero-key step (nothing to attend to yet) is weights only.
    """
    _int("parameters", parameters, 1)
    _int("keys", keys, 0)
    _int("batch", batch, 1)
    attention = attention_flops(layers, query_heads, head_dim, 1 if keys else 0, max(keys - 1, 0))
    return batch * (2 * parameters + attention)


def prefill_flops(parameters: int, layers: int, query_heads: int, head_dim: int, suffix: int, prefix: int = 0) -> int:
    """FLOPs to prefill `suffix` new tokens after `prefix` cached ones: attention + 2 · P · suffix."""
    _int("parameters", parameters, 1)
    return attention_flops(layers, query_heads, head_dim, suffix, prefix) + 2 * parameters * _int("suffix", suffix, 0)


def prefill_floor_seconds(parameter_count: int, prompt_tokens: int, peak_flops_per_second: float) -> float:
    """Compute floor of a prefill, projections only: 2 · P · N / Π seconds (a lower bound)."""
    _int("parameter_count", parameter_count, 1)
    _int("prompt_tokens", prompt_tokens, 0)
    return 2 * parameter_count * prompt_tokens / _real("peak_flops_per_second", peak_flops_per_second)


@dataclass(frozen=True)
class CachedInputCost:
    """Prefix-reuse billing in input-token equivalents (illustrative, SPEC §5.3)."""

    baseline: int  # requests · (prefix + suffix)
    cached: float  # prefix · (write + (requests − 1) · read) + requests · suffix
    amortized_cost_factor: float  # cached / baseline
    warm_request_cost_ratio: float  # (prefix · read + suffix) / (prefix + suffix)


def cached_input_cost(prefix: int, suffix: int, requests: int, read_rate: float = 0.1,
                      write_rate: float = 1.25) -> CachedInputCost:
    """Cost of `requests` requests sharing a `prefix`, with and without a prefix cache."""
    _int("prefix", prefix, 0)
    _int("suffix", suffix, 0)
    _int("requests", requests, 1)
    read = _real("read_rate", read_rate, positive=False)
    write = _real("write_rate", write_rate, positive=False)
    if prefix + suffix == 0:
        raise ValueError("prefix=0 and suffix=0: a request needs at least one input token")
    baseline = requests * (prefix + suffix)
    cached = prefix * (write + (requests - 1) * read) + requests * suffix
    warm = (prefix * read + suffix) / (prefix + suffix)
    return CachedInputCost(baseline, cached, cached / baseline, warm)


# ---- waste (SPEC §5.4) ------------------------------------------------------------------------------

def naive_preallocation_waste(max_tokens: int, used_tokens: int) -> float:
    """Fraction wasted by reserving `max_tokens` slots for a request that uses `used_tokens`."""
    _int("max_tokens", max_tokens, 1)
    _int("used_tokens", used_tokens, 0)
    if used_tokens > max_tokens:
        raise ValueError(f"used_tokens={used_tokens}: must be <= max_tokens={max_tokens}")
    return (max_tokens - used_tokens) / max_tokens


def expected_paged_waste(avg_tokens: float, block_size: int) -> float:
    """Expected wasted fraction of allocated slots under paging: ((b−1)/2) / (avg + (b−1)/2)."""
    avg = _real("avg_tokens", avg_tokens)
    tail = (_int("block_size", block_size, 1) - 1) / 2
    return tail / (avg + tail)


# ---- presets ----------------------------------------------------------------------------------------

GEOMETRY_PRESETS: dict[str, KVGeometry] = {
    g.name: g for g in (
        # A 70B model if it kept one KV head per query head (pre-GQA); the GQA savings baseline.
        AttentionKVGeometry("mha-70b-equivalent", 80, 64, 128),
        AttentionKVGeometry("llama-3.3-70b", 80, 8, 128),
        AttentionKVGeometry("llama-3-8b", 32, 8, 128),
        MLAKVGeometry("deepseek-v3", 61, 512, 64),
        # gpt-oss: alternating sliding (W=128) and full layers (HF config layer_types).
        AttentionKVGeometry("gpt-oss-20b", 24, 8, 64, sliding_window_layers=12, window=128),
        AttentionKVGeometry("gpt-oss-120b", 36, 8, 64, sliding_window_layers=18, window=128),
        AttentionKVGeometry("gptoss-lite-502m", 12, 4, 96, sliding_window_layers=6, window=128),  # SPEC §1.1
    )
}


@dataclass(frozen=True)
class ModelWeights:
    """What a model contributes to a serving plan besides its KV geometry."""

    name: str
    total_parameters: int  # resident in memory
    active_parameters: int  # read and multiplied per token (== total for dense models)
    bytes_per_parameter: float = 2.0  # 2 = BF16
    query_heads: int = 1  # H_q, for attention FLOPs
    attention_head_dim: int = 1  # D used in 4·H·D per query-key pair

    def __post_init__(self) -> None:
        _int("total_parameters", self.total_parameters, 1)
        _int("active_parameters", self.active_parameters, 1)
        if self.active_parameters > self.total_parameters:
            raise ValueError(f"active_parameters={self.active_parameters}: must be <= "
                             f"total_parameters={self.total_parameters}")
        _real("bytes_per_parameter", self.bytes_per_parameter)
        _int("query_heads", self.query_heads, 1)
        _int("attention_head_dim", self.attention_head_dim, 1)

    @property
    def streamed_weight_bytes(self) -> int:
        """Weight bytes read per decode step (active parameters), rounded up to whole bytes."""
        return math.ceil(self.active_parameters * self.bytes_per_parameter)

    @property
    def resident_weight_bytes(self) -> int:
        return math.ceil(self.total_parameters * self.bytes_per_parameter)


MODEL_WEIGHTS: dict[str, ModelWeights] = {
    w.name: w for w in (
        # Hypothetical, for the GQA comparison: a dense 70B.
        ModelWeights("mha-70b-equivalent", 70_000_000_000, 70_000_000_000, 2.0, 64, 128),
        # Approximate published figures (Meta model cards): 70.6B and 8.03B parameters.
        ModelWeights("llama-3.3-70b", 70_600_000_000, 70_600_000_000, 2.0, 64, 128),
        ModelWeights("llama-3-8b", 8_030_000_000, 8_030_000_000, 2.0, 32, 128),
        # Approximate published figures (DeepSeek-V3 report): 671B total, 37B active. Attention D is
        # 160 = mean of the QK (192) and V (128) head dims, so 4·H·D counts QK + AV exactly.
        ModelWeights("deepseek-v3", 671_000_000_000, 37_000_000_000, 2.0, 128, 160),
        # Approximate published figures (OpenAI gpt-oss model card), BF16 here although the release
        # stores experts in MXFP4; active counts exclude the embedding, as the card does.
        ModelWeights("gpt-oss-20b", 20_900_000_000, 3_600_000_000, 2.0, 64, 64),
        ModelWeights("gpt-oss-120b", 116_800_000_000, 5_100_000_000, 2.0, 64, 64),
        # Exact (SPEC §1.1, pinned by the config tests).
        ModelWeights("gptoss-lite-502m", 501_836_640, 247_032_672, 2.0, 8, 96),
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
    h.name: h for h in (
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


def serving_hardware(spec: HardwareSpec, weights: ModelWeights, devices: int = 1,
                     runtime_reserve_bytes: int = 0) -> ServingHardware:
    """Combine a chip with a model: streamed = active weights, resident = total weights.

    `devices` > 1 models ideal tensor parallelism (bandwidth, FLOP/s and memory all scale); that is
    itself an upper bound, since real all-reduces cost time.
    """
    _int("devices", devices, 1)
    _int("runtime_reserve_bytes", runtime_reserve_bytes, 0)
    need = weights.resident_weight_bytes + runtime_reserve_bytes
    if need > spec.device_capacity_bytes * devices:
        fit = -(-need // spec.device_capacity_bytes)
        raise ValueError(f"{weights.name} weights {weights.resident_weight_bytes / GB:.1f} GB + reserve "
                         f"{runtime_reserve_bytes / GB:.1f} GB exceed {devices} x {spec.name} "
                         f"({spec.device_capacity_bytes / GB:.1f} GB each); use more devices (at least {fit})")
    return ServingHardware(
        weight_bytes=weights.streamed_weight_bytes,
        bandwidth_bytes_per_second=spec.bandwidth_bytes_per_second * devices,
        peak_flops_per_second=spec.peak_flops_per_second * devices,
        parameter_count=weights.active_parameters,
        device_capacity_bytes=spec.device_capacity_bytes * devices,
        runtime_reserve_bytes=runtime_reserve_bytes,
        resident_weight_bytes=weights.resident_weight_bytes,
        name=spec.name if devices == 1 else f"{devices}x {spec.name}")


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
    return HardwareSpec(THIS_MACHINE, bandwidth, flops, capacity,
                        source="measured (numpy copy bandwidth, fp32 matmul FLOP/s, physical RAM)")


def geometry_from_model_config(cfg: Any, bytes_per_element: int = 2, *, name: str = "model-config") -> AttentionKVGeometry:
    """KV geometry of a `ModelConfig` (duck-typed: n_layers, n_kv_heads, head_dim, sliding_layers, sliding_window)."""
    sliding = len(cfg.sliding_layers)
    return AttentionKVGeometry(name, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, bytes_per_element,
                               sliding, cfg.sliding_window if sliding else None)


def geometry_from_hf_config(config: dict[str, Any], bytes_per_element: int = 2, *,
                            name: str | None = None) -> AttentionKVGeometry:
    """KV geometry of a Hugging Face `config.json` dict.

    head_dim comes from `head_dim`, else hidden_size / num_attention_heads; missing
    `num_key_value_heads` means MHA (the transformers convention). Sliding layers are the
    `layer_types` entries equal to "sliding_attention". NOTE: a config without `layer_types` is read as
    all full attention (Mistral-style global `sliding_window` is not interpreted), which overstates KV.
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
            raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; "
                             "add an explicit head_dim")
        head_dim = hidden // heads
    types = config.get("layer_types") or ()
    if types and len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries; num_hidden_layers={layers}")
    unknown = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if unknown:
        raise ValueError(f"layer_types {unknown}: expected 'sliding_attention' or 'full_attention'")
    sliding = sum(t == "sliding_attention" for t in types)
    window = config.get("sliding_window") if sliding else None
    label = name or str(config.get("_name_or_path") or config.get("model_type") or "hf-config")
    return AttentionKVGeometry(label, layers, kv_heads, head_dim, bytes_per_element, sliding, window)
