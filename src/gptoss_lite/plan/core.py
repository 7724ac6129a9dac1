"""The serving formulas: KV bytes, decode rooflines, capacity, FLOPs and cost (docs/plan.md).

Pure Python (see `gptoss_lite.plan`); presets and machine measurement live in `plan.presets`.

Units (docs/plan.md#units-and-labels): KiB/MiB/GiB are powers of two; KB/MB/GB and every bandwidth are powers of ten.
Three different quantities are kept apart and labelled as such by callers:

- *payload*: the bytes of K and V a cache must hold (this module's `kv_payload_bytes`);
- *upper bound*: a ceiling from spec sheets (`decode_ceiling`, `max_resident_requests`), which
  no real system reaches;
- *measured*: what an allocator or a benchmark really observed (`presets.measure_this_machine`).

NOTE: decode weight traffic uses the *active* parameters of a MoE model (the weights one token
reads). At batch > 1 different tokens pick different experts, so real traffic lies between the
active and the total weights; using active weights makes every decode ceiling an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Union

from gptoss_lite.kvspec import LayerKind, LayerKVSpec, kv_format, token_bytes
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


# ---- geometry and payload (docs/plan.md#kv-geometry-and-payload) -------------------------------------------


@dataclass(frozen=True)
class AttentionKVGeometry:
    """KV layout of ordinary attention (MHA / GQA / MQA), optionally with sliding layers.

    `attention_layers` counts every attention layer; `sliding_layers` of them (a count) keep only
    the last `min(sliding_window, T)` tokens, and the other `full_layers` keep all T. A hybrid model
    passes only its attention layers. Names follow `ModelConfig` (layer kinds *sliding* / *full*).
    """

    name: str
    attention_layers: int  # L_attn, all attention layers (sliding ones included)
    kv_heads: int  # K (H_kv)
    head_dim: int  # D
    bytes_per_element: int = 2  # 2 = BF16/FP16, 1 = FP8
    sliding_layers: int = 0  # how many of attention_layers are sliding-window layers
    sliding_window: int | None = None  # W tokens kept per sliding layer; None when there are none

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name={self.name!r}: must be a non-empty str")
        for field_name in ("attention_layers", "kv_heads", "head_dim", "bytes_per_element"):
            _int(field_name, getattr(self, field_name), 1)
        _int("sliding_layers", self.sliding_layers, 0)
        if self.sliding_layers > self.attention_layers:
            raise ValueError(
                f"sliding_layers={self.sliding_layers}: must be <= "
                f"attention_layers={self.attention_layers} (it counts a subset of them)"
            )
        if self.sliding_layers and self.sliding_window is None:
            raise ValueError(f"sliding_layers={self.sliding_layers} needs sliding_window=W tokens")
        if self.sliding_window is not None:
            _int("sliding_window", self.sliding_window, 1)
            if not self.sliding_layers:
                raise ValueError(
                    f"sliding_window={self.sliding_window} given but sliding_layers=0; "
                    "pass sliding_window=None for a model without sliding layers"
                )

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K plus V of one token in one layer: 2 · H_kv · D · bytes_per_element (`kvspec.token_bytes`)."""
        return token_bytes(self.kv_heads, self.head_dim, self.kv_heads, self.head_dim, self.bytes_per_element)

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token over all attention layers, as if every layer were full attention."""
        return self.attention_layers * self.bytes_per_token_per_layer

    @property
    def full_layers(self) -> int:
        """How many attention layers are full attention (keep every token)."""
        return self.attention_layers - self.sliding_layers

    def sequence_bytes(self, context_tokens: int) -> int:
        """Window-aware payload of one sequence of `context_tokens` tokens (unscaled, exact)."""
        t = _int("context_tokens", context_tokens, 0)
        windowed = min(self.sliding_window, t) if self.sliding_window is not None else 0
        stored = self.full_layers * t + self.sliding_layers * windowed  # token-layers
        return stored * self.bytes_per_token_per_layer


@dataclass(frozen=True)
class MLAKVGeometry:
    """KV layout of multi-head latent attention: one latent + one RoPE key per token per layer.

    Bytes per token `L · (latent_dim + rope_dim) · bytes_per_element` — no factor of two, because
    K and V are both re-expanded from the same cached latent (docs/plan.md#kv-geometry-and-payload).
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


KVGeometry = Union[AttentionKVGeometry, MLAKVGeometry]  # noqa: UP007 (a runtime alias; X | Y needs 3.10 objects)


def _check_geometry(geometry: Any) -> KVGeometry:
    if not isinstance(geometry, (AttentionKVGeometry, MLAKVGeometry)):
        raise TypeError(f"geometry={geometry!r}: must be an AttentionKVGeometry or MLAKVGeometry")
    return geometry


def kv_payload_bytes(geometry: KVGeometry, context_tokens: int, batch_size: int = 1, kv_scale: float = 1.0) -> int:
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
        raise ValueError(
            f"kv_scale={kv_scale}: {raw} B x {kv_scale} = {float(scaled)} B is not a whole "
            "number of bytes; pick a scale (bits/16) that divides the payload exactly"
        )
    return int(scaled)


def quantized_kv_bytes(
    geometry: AttentionKVGeometry,
    context_tokens: int,
    bits: int,
    batch_size: int = 1,
    key_group: int = 64,
    value_group: int | None = None,
    residual: int = 64,
) -> int:
    """Bytes of one batch of sequences whose full layers store KIVI-style quantised K/V, scales and
    zero points included (docs/plan.md#quantised-kv-bytes); sliding layers keep min(W, T) tokens at
    `bytes_per_element`.

    Per full layer, of T tokens the first `Q = max(0, (T - residual) // key_group) · key_group` are
    quantised: codes 2·K·D·bits/8 B per token, one float16 scale and one zero per channel
    per key group (keys) and per value group per token (values); the other T - Q stay at
    `bytes_per_element`. `value_group` defaults to 64 when it divides D, else D (as `QuantizedKVCache`).
    """
    t = _int("context_tokens", context_tokens, 0)
    _int("batch_size", batch_size, 1)
    if bits not in (8, 4):
        raise ValueError(f"bits={bits!r}: quantised KV is 8 or 4 bits")
    _int("key_group", key_group, 1)
    _int("residual", residual, 0)
    if value_group is not None:
        _int("value_group", value_group, 1)
    K, D = geometry.kv_heads, geometry.head_dim
    spec = LayerKVSpec(LayerKind.FULL, None, kv_format(bits), geometry.bytes_per_element, K, D, K, D, value_group)
    q = max(0, (t - residual) // key_group) * key_group
    residual_bytes = (t - q) * spec.token_bytes
    windowed = min(geometry.sliding_window, t) if geometry.sliding_window is not None else 0
    sliding = geometry.sliding_layers * windowed * geometry.bytes_per_token_per_layer
    return batch_size * (geometry.full_layers * (spec.quantized_bytes(q, key_group) + residual_bytes) + sliding)


# ---- hardware and decode roofline (docs/plan.md#decode-roofline-knee-and-capacity) -------------------------


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
                "weights or a smaller reserve"
            )

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


def decode_ceiling(
    hw: ServingHardware, geometry: KVGeometry, context_tokens: int, batch_size: int = 1, kv_scale: float = 1.0
) -> DecodeCeiling:
    """Bandwidth ceiling of decoding `batch_size` requests at `context_tokens` each (upper bound)."""
    _check_hardware(hw)
    kv = kv_payload_bytes(geometry, context_tokens, batch_size, kv_scale)
    total = hw.weight_bytes + kv
    aggregate = batch_size * hw.bandwidth_bytes_per_second / total
    return DecodeCeiling(batch_size, context_tokens, kv, total, aggregate, aggregate / batch_size)


def arithmetic_intensity(
    hw: ServingHardware, geometry: KVGeometry, context_tokens: int, batch_size: int = 1, kv_scale: float = 1.0
) -> float:
    """Projection-only FLOP per byte of one decode step: 2 · P · B / (W + KV). Compare to the ridge."""
    step = decode_ceiling(hw, geometry, context_tokens, batch_size, kv_scale)
    return 2 * hw.parameter_count * batch_size / step.total_bytes_per_step


def batch_knee(hw: ServingHardware, geometry: KVGeometry, context_tokens: int, kv_scale: float = 1.0) -> float:
    """B* = W / KV_payload(N, 1): the batch at which KV traffic equals weight traffic."""
    _check_hardware(hw)
    kv = kv_payload_bytes(geometry, context_tokens, 1, kv_scale)
    if kv == 0:
        raise ValueError(
            f"context_tokens={context_tokens}: the KV payload is 0 B, so there is no knee; use context_tokens >= 1"
        )
    return hw.weight_bytes / kv


def max_resident_requests(hw: ServingHardware, geometry: KVGeometry, context_tokens: int, kv_scale: float = 1.0) -> int:
    """KV-only upper bound: (capacity − resident weights − reserve) // KV_payload(N, 1) requests."""
    _check_hardware(hw)
    kv = kv_payload_bytes(geometry, context_tokens, 1, kv_scale)
    if kv == 0:
        raise ValueError(
            f"context_tokens={context_tokens}: the KV payload is 0 B, so capacity is unbounded; use context_tokens >= 1"
        )
    free = hw.device_capacity_bytes - hw.resident_bytes - hw.runtime_reserve_bytes
    return free // kv


# ---- FLOP models (docs/plan.md#flop-models; two FLOPs per multiply-add) --------------


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


def attention_flops(
    layers: int,
    query_heads: int,
    head_dim: int,
    queries: int,
    cached_prefix: int = 0,
    sliding_window: int | None = None,
) -> int:
    """QK + AV FLOPs of `queries` causal queries after `cached_prefix` keys: 4·L·H_q·D per pair.

    Pairs are `q·p + q(q+1)/2`; with `sliding_window=W` (sliding layers) each query sees at most W keys.
    Attention work depends on the query heads H_q; GQA storage depends on H_kv.
    """
    _int("layers", layers, 1)
    _int("query_heads", query_heads, 1)
    _int("head_dim", head_dim, 1)
    _int("queries", queries, 0)
    _int("cached_prefix", cached_prefix, 0)
    if sliding_window is not None:
        _int("sliding_window", sliding_window, 1)
    return 4 * layers * query_heads * head_dim * _causal_pairs(queries, cached_prefix, sliding_window)


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
    """Prefix-reuse billing in input-token equivalents (illustrative, docs/plan.md#prefix-reuse-billing)."""

    baseline: int  # requests · (prefix + suffix)
    cached: float  # prefix · (write + (requests − 1) · read) + requests · suffix
    amortized_cost_factor: float  # baseline / cached: how many times cheaper the cached input is
    warm_request_cost_ratio: float  # (prefix · read + suffix) / (prefix + suffix)


def cached_input_cost(
    prefix: int, suffix: int, requests: int, read_rate: float = 0.1, write_rate: float = 1.25
) -> CachedInputCost:
    """Cost of `requests` requests sharing a `prefix`, with and without a prefix cache.

    `amortized_cost_factor` is baseline / cached, so > 1 means the cache saves (3.79 for a 7,680-token
    prefix, a 512-token suffix and 10 requests at read 0.1, write 1.25); it is inf when the cached
    input costs nothing (zero rates and no suffix).
    """
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
    factor = baseline / cached if cached else math.inf
    return CachedInputCost(baseline, cached, factor, warm)


# ---- waste (docs/paged.md#block-pool) ----------------------------------------------------------------------


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
