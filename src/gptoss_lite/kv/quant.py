"""Quantised KV storage for full layers, KIVI-style (docs/kv-cache.md#quantised-kv-cache).

Keys are quantised per channel over groups of `key_group` consecutive tokens, values per token over
groups of `value_group` channels. What a code is, is its format's `Codec` (`CODECS`, by the
`gptoss_lite.kvspec` format name): the one place a format's rule is written. The dense cache here and
the engine's paged blocks (`kv/paged_quant.py`) both store through it:

- int8 / int4 (`MinMaxCodec`): asymmetric min/max, `zero = min(x)`, `scale = (max(x) - min(x)) /
  (2^bits - 1)`, `code = round((x - zero) / scale)`; int8 codes take a byte each, int4 codes are
  packed two per byte (channel 2i in the low nibble, 2i + 1 in the high one).
- fp8 (`Fp8Codec`): float8 e4m3 codes, one byte each, centred on the group's midpoint: `zero = (min(x)
  + max(x)) / 2`, `scale = half the range / 448` (e4m3's largest value), `code = e4m3((x - zero) /
  scale)`. Its error is relative (3 mantissa bits: at most 1/16 of a value's distance from the
  midpoint), where int8's is a fixed step of the range.

Every codec stores byte codes with a float16 scale and zero point per group (counted in `nbytes`), and
a code reads back as `value(code) · scale + zero`. The most recent `residual` to `residual +
key_group - 1` tokens stay in full precision: a key group is quantised only once it is complete and
has left the residual window.

`QuantizedKVCache` is a `MixedKVCache` whose full layers are `QuantizedBuffer`s (sliding layers keep
their full-precision rings: they hold only W tokens). A full layer's `update` returns a segmented
`gptoss_lite.kv.base.KVRead`: attention dequantises one block of key groups at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptoss_lite.config import ModelConfig
from gptoss_lite.kv.base import KVRead, KVSegment, TensorSegment
from gptoss_lite.kv.mixed import DEFAULT_FULL_CAP_TOKENS, MixedKVCache, _LayerStore
from gptoss_lite.kvspec import INT8, KVFormat, LayerKind, LayerKVSpec, kv_format
from gptoss_lite.validation import check_int

SCALE_DTYPE = torch.float16  # scales and zero points: 2 bytes each
FP16_MAX = 65504.0


# ---- codecs: what a code is, one per quantised format ---------------------------------------------


def _steps(scale: torch.Tensor) -> torch.Tensor:
    """The float16 scale as fp32, 1 where it is 0 (a constant group: every code reads back as zero)."""
    step = scale.float()
    return torch.where(step > 0, step, torch.ones_like(step))


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(..., D) codes in [0, 15] -> (..., D/2) bytes, channel 2i low nibble, 2i + 1 high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: (..., D/2) bytes -> (..., D) codes."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


@dataclass(frozen=True)
class MinMaxCodec:
    """int8 / int4: asymmetric min/max over a group; `bits`-bit unsigned codes, int4 packed in pairs."""

    bits: int

    def encode(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (fp32) over `dim` -> (codes uint8 like x, one per element, unpacked; scale; zero), scale and
        zero float16 with `dim` kept as size 1. The codes come from the float16-rounded scale and zero,
        so what is stored reads back within half a step of x."""
        qmax = (1 << self.bits) - 1
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        zero = lo.clamp(-FP16_MAX, FP16_MAX).to(SCALE_DTYPE)
        scale = ((hi - zero.float()) / qmax).clamp(max=FP16_MAX).to(SCALE_DTYPE)
        codes = ((x - zero.float()) / _steps(scale)).round_().clamp_(0, qmax).to(torch.uint8)
        return codes, scale, zero

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """One code per channel -> the stored bytes (D · bits / 8 a row)."""
        return pack_int4(codes) if self.bits == 4 else codes

    def values(self, stored: torch.Tensor) -> torch.Tensor:
        """The stored bytes -> each code's value (fp32, one per channel), before scale and zero."""
        return (unpack_int4(stored) if self.bits == 4 else stored).float()


FP8_MAX = 448.0  # the largest float8 e4m3 value


@dataclass(frozen=True)
class Fp8Codec:
    """fp8: float8 e4m3 codes, one byte each, for (x - midpoint) / scale (see the module docstring)."""

    bits: int = 8

    def encode(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As `MinMaxCodec.encode`; the codes are e4m3 bit patterns held as uint8, from the float16-rounded
        scale and midpoint."""
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        zero = ((lo + hi) / 2).clamp(-FP16_MAX, FP16_MAX).to(SCALE_DTYPE)
        half = torch.maximum(hi - zero.float(), zero.float() - lo)  # the rounded midpoint moved a little
        scale = (half / FP8_MAX).clamp(max=FP16_MAX).to(SCALE_DTYPE)
        y = ((x - zero.float()) / _steps(scale)).clamp_(-FP8_MAX, FP8_MAX)  # e4m3 has no infinity: saturate
        return y.to(torch.float8_e4m3fn).view(torch.uint8), scale, zero

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        return codes

    def values(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.view(torch.float8_e4m3fn).float()


CODECS: dict[str, MinMaxCodec | Fp8Codec] = {"int8": MinMaxCodec(8), "int4": MinMaxCodec(4), "fp8": Fp8Codec()}


@dataclass(frozen=True)
class QuantSpec:
    """How a full layer's K and V are quantised."""

    format: KVFormat | str | int = INT8  # a quantised format of `gptoss_lite.kvspec`, or its name
    key_group: int = 64  # tokens per key group (keys: one scale/zero per channel per group)
    value_group: int = 64  # channels per value group (values: one scale/zero per token per group)
    residual: int = 64  # most recent tokens always kept in full precision (plus < key_group more)

    def __post_init__(self) -> None:
        fmt = kv_format(self.format)
        if fmt.name not in CODECS:
            raise ValueError(
                f"KV format {fmt.name!r}: quantised KV is one of {', '.join(CODECS)} (the model's own dtype "
                "is the plain cache)"
            )
        object.__setattr__(self, "format", fmt)  # always the KVFormat itself from here on
        check_int("key_group", self.key_group, minimum=1)
        check_int("value_group", self.value_group, minimum=1)
        check_int("residual", self.residual, minimum=0)

    @property
    def codec(self) -> MinMaxCodec | Fp8Codec:
        """The format's rule: how a group becomes codes, scale and zero, and back."""
        return CODECS[kv_format(self.format).name]

    @property
    def bits(self) -> int:
        """Bits per stored code."""
        bits = kv_format(self.format).bits
        assert bits is not None
        return bits

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError unless the value group divides D and D's codes fill whole bytes."""
        if head_dim % self.value_group:
            raise ValueError(
                f"value_group={self.value_group}: must divide head_dim={head_dim}; use a divisor such as {head_dim}"
            )
        if head_dim * self.bits % 8:
            raise ValueError(f"head_dim={head_dim}: {self.bits}-bit codes pack whole bytes, so it must be even")


# ---- keys and values ------------------------------------------------------------------------------


def quantize_keys(k: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k (B, K, n, D), n a multiple of key_group -> codes (B, K, n, D·bits/8) uint8, scale and zero
    (B, K, n/key_group, D) float16: one per channel per group of tokens."""
    B, K, n, D = k.shape
    g = spec.key_group
    codes, scale, zero = spec.codec.encode(k.float().view(B, K, n // g, g, D), dim=3)
    return spec.codec.pack(codes.view(B, K, n, D)), scale.squeeze(3), zero.squeeze(3)


def dequantize_keys(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `quantize_keys` -> (B, K, n, D) in `dtype`."""
    c = spec.codec.values(codes)
    B, K, n, D = c.shape
    g = spec.key_group
    x = c.view(B, K, n // g, g, D) * scale.float()[:, :, :, None] + zero.float()[:, :, :, None]
    return x.view(B, K, n, D).to(dtype)


def quantize_values(v: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """v (B, K, n, D) -> codes (B, K, n, D·bits/8) uint8, scale and zero (B, K, n, D/value_group)
    float16: one per token per group of channels."""
    B, K, n, D = v.shape
    g = spec.value_group
    codes, scale, zero = spec.codec.encode(v.float().view(B, K, n, D // g, g), dim=4)
    return spec.codec.pack(codes.view(B, K, n, D)), scale.squeeze(4), zero.squeeze(4)


def dequantize_values(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: QuantSpec, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of `quantize_values` -> (B, K, n, D) in `dtype`."""
    c = spec.codec.values(codes)
    B, K, n, D = c.shape
    g = spec.value_group
    x = c.view(B, K, n, D // g, g) * scale.float()[..., None] + zero.float()[..., None]
    return x.view(B, K, n, D).to(dtype)


# ---- storage --------------------------------------------------------------------------------------------


class QuantizedSegment:
    """The quantised part of a layer as a `KVSegment`: views of the codes, scales and zeros of its
    first n tokens (n a multiple of key_group); `read` dequantises only the groups it is asked for."""

    def __init__(self, store: QuantizedBuffer):
        n = store.num_quantized
        g = store.spec.key_group
        self.spec, self.dtype, self._n = store.spec, store.dtype, n
        assert store.kq is not None and store.ks is not None and store.kz is not None
        assert store.vq is not None and store.vs is not None and store.vz is not None
        self.kq, self.ks, self.kz = store.kq[:, :, :n], store.ks[:, :, : n // g], store.kz[:, :, : n // g]
        self.vq, self.vs, self.vz = store.vq[:, :, :n], store.vs[:, :, :n], store.vz[:, :, :n]

    @property
    def num_tokens(self) -> int:
        return self._n

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.spec.key_group
        g0, g1 = start // g, -(-end // g)  # whole key groups covering [start, end)
        lo, hi = g0 * g, g1 * g
        k = dequantize_keys(self.kq[:, :, lo:hi], self.ks[:, :, g0:g1], self.kz[:, :, g0:g1], self.spec, self.dtype)
        v = dequantize_values(self.vq[:, :, lo:hi], self.vs[:, :, lo:hi], self.vz[:, :, lo:hi], self.spec, self.dtype)
        return k[:, :, start - lo : end - lo], v[:, :, start - lo : end - lo]


class QuantizedBuffer(_LayerStore):
    """A full layer: quantised key groups (growing storage) plus a full-precision residual window.

    After any sequence of appends the layer holds `num_quantized = max(0, (n - R) // G) · G` quantised
    tokens and `n - num_quantized` (in [R, R + G - 1] once n >= R) full-precision ones, whatever the
    chunking (R residual, G key_group). `self.k` / `self.v` are the residual buffers (R + G slots).
    """

    def __init__(self, batch_size: int, kv_heads: int, head_dim: int, spec: QuantSpec, cap_tokens: int):
        super().__init__(batch_size, kv_heads, head_dim)
        spec.check_head_dim(head_dim)
        self.spec = spec
        self.cap_tokens = cap_tokens
        self.num_quantized = 0
        self.num_residual = 0
        self.capacity = 0  # quantised tokens allocated
        self.kq = self.ks = self.kz = self.vq = self.vs = self.vz = None  # type: torch.Tensor | None

    @property
    def num_resident(self) -> int:
        return self.num_quantized + self.num_residual

    @property
    def dtype(self) -> torch.dtype:
        k, _ = self._buffers()
        return k.dtype

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store T new tokens: into the residual window, quantising the oldest whole key groups that
        leave it."""
        T = self._check(k, v)
        if self.num_tokens + T > self.cap_tokens:
            raise MemoryError(
                f"full-layer KV cache cap exceeded: {self.num_tokens} + {T} tokens > cap "
                f"{self.cap_tokens}; raise max_tokens_per_full_layer or shorten the sequence"
            )
        R, G = self.spec.residual, self.spec.key_group
        if self.k is None:
            shape = (self.batch_size, self.kv_heads, R + G, self.head_dim)
            self.k = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.v = torch.empty(shape, dtype=v.dtype, device=v.device)
        rk, rv = self._buffers()
        n = self.num_residual + T
        if n < R + G:  # fits in the residual window: no group leaves it
            rk[:, :, self.num_residual : n] = k
            rv[:, :, self.num_residual : n] = v
            self.num_residual = n
        else:
            all_k = torch.cat((rk[:, :, : self.num_residual], k), dim=2)  # (B, K, n, D), a new tensor
            all_v = torch.cat((rv[:, :, : self.num_residual], v), dim=2)
            flush = (n - R) // G * G
            self._store_quantized(all_k[:, :, :flush], all_v[:, :, :flush])
            rk[:, :, : n - flush] = all_k[:, :, flush:]
            rv[:, :, : n - flush] = all_v[:, :, flush:]
            self.num_residual = n - flush
        self.num_tokens += T

    def _store_quantized(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantise whole key groups k, v (B, K, n, D) and write them after the stored ones."""
        n, G = k.shape[2], self.spec.key_group
        needed = self.num_quantized + n
        if needed > self.capacity:
            # Grow by at least a quarter (amortised O(1) per token), rounded to whole key groups.
            new_cap = max(needed, self.capacity + self.capacity // 4)
            new_cap = -(-new_cap // G) * G
            self._reallocate(new_cap, k.device)
        assert self.kq is not None and self.ks is not None and self.kz is not None
        assert self.vq is not None and self.vs is not None and self.vz is not None
        a, b = self.num_quantized, needed
        self.kq[:, :, a:b], self.ks[:, :, a // G : b // G], self.kz[:, :, a // G : b // G] = quantize_keys(k, self.spec)
        self.vq[:, :, a:b], self.vs[:, :, a:b], self.vz[:, :, a:b] = quantize_values(v, self.spec)
        self.num_quantized = needed

    def _reallocate(self, capacity: int, device: torch.device) -> None:
        B, K, D, G = self.batch_size, self.kv_heads, self.head_dim, self.spec.key_group
        code_d = D * self.spec.bits // 8
        shapes = {
            "kq": ((B, K, capacity, code_d), torch.uint8),
            "vq": ((B, K, capacity, code_d), torch.uint8),
            "ks": ((B, K, capacity // G, D), SCALE_DTYPE),
            "kz": ((B, K, capacity // G, D), SCALE_DTYPE),
            "vs": ((B, K, capacity, D // self.spec.value_group), SCALE_DTYPE),
            "vz": ((B, K, capacity, D // self.spec.value_group), SCALE_DTYPE),
        }
        n = self.num_quantized
        for name, (shape, dtype) in shapes.items():
            new = torch.empty(shape, dtype=dtype, device=device)
            old = getattr(self, name)
            if old is not None and n:
                rows = n // G if name in ("ks", "kz") else n
                new[:, :, :rows] = old[:, :, :rows]
            setattr(self, name, new)
        self.capacity = capacity

    def segments(self, copy_residual: bool) -> list[KVSegment]:
        """The stored tokens as (quantised part, residual part); the residual is copied when the
        caller is about to append (which rewrites the residual buffer in place)."""
        segs: list[KVSegment] = []
        if self.num_quantized:
            segs.append(QuantizedSegment(self))
        if self.num_residual:
            rk, rv = self._buffers()
            rk, rv = rk[:, :, : self.num_residual], rv[:, :, : self.num_residual]
            segs.append(TensorSegment(rk.clone(), rv.clone()) if copy_residual else TensorSegment(rk, rv))
        return segs

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantised keys and values of every stored token, oldest first, each (B, K, n, D)."""
        if self.k is None:
            return self._empty()
        return KVRead(self.segments(copy_residual=False), 0, self.kv_heads).materialize()

    def rollback_floor(self) -> int:
        """Quantised tokens cannot be taken back: `truncate` goes back at most to the residual window."""
        return self.num_quantized

    def truncate(self, position: int) -> None:
        """Forget positions >= `position` (the caller checked num_quantized <= position <= num_tokens)."""
        self.num_residual = position - self.num_quantized
        self.num_tokens = position

    def reset(self) -> None:
        super().reset()
        self.kq = self.ks = self.kz = self.vq = self.vs = self.vz = None
        self.num_quantized = self.num_residual = self.capacity = 0

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.kq, self.ks, self.kz, self.vq, self.vs, self.vz) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes allocated: codes, scales and zero points (their capacity) and the residual buffers."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def payload_bytes(self) -> int:
        """Bytes of what is held: codes, scales and zeros of the quantised tokens, residual K and V."""
        if self.k is None:
            return 0
        K, D, q = self.kv_heads, self.head_dim, self.spec
        layer = LayerKVSpec(LayerKind.FULL, None, kv_format(q.format), self.k.element_size(), K, D, K, D, q.value_group)
        return self.batch_size * layer.quantized_bytes(self.num_quantized, q.key_group) + (
            self.num_residual * self._token_bytes()
        )


class QuantizedKVCache(MixedKVCache):
    """A MixedKVCache whose full layers store `full_format` codes (`QuantizedBuffer`: a format named in
    `CODECS`, or its KVFormat; the older bit counts 8 and 4 are accepted); sliding layers keep
    their full-precision rings. Its reads are segmented: attention dequantises one block of key groups at
    a time.

    `value_group` defaults to min(64, head_dim) when it divides head_dim, else head_dim. A cache built
    with rollback slack R keeps at least R + 1 tokens in the residual window, so speculative decoding
    never needs to take back a quantised token.
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int = 1,
        max_tokens_per_full_layer: int = DEFAULT_FULL_CAP_TOKENS,
        *,
        rollback_tokens: int = 0,
        full_format: KVFormat | str | int = INT8,
        key_group: int = 64,
        value_group: int | None = None,
        residual: int = 64,
    ):
        super().__init__(config, batch_size, max_tokens_per_full_layer, rollback_tokens=rollback_tokens)
        D = config.head_dim
        if value_group is None:
            value_group = 64 if D % 64 == 0 else D
        check_int("residual", residual, minimum=0)
        residual = max(residual, rollback_tokens + 1) if rollback_tokens else residual
        self.spec = QuantSpec(full_format, key_group, value_group, residual)
        self.spec.check_head_dim(D)
        for i in range(config.n_layers):
            if not config.is_sliding(i):
                self.layers[i] = QuantizedBuffer(  # type: ignore[call-overload]
                    batch_size, config.n_kv_heads, D, self.spec, max_tokens_per_full_layer
                )

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> KVRead:
        """Store the new tokens. A quantised layer returns a segmented read (quantised groups, residual
        window, and for a chunk the new tokens themselves in full precision), first = 0; a sliding
        layer is the mixed cache's ring."""
        store = self.layers[layer]
        if not isinstance(store, QuantizedBuffer):
            return super().update(layer, k, v, start_pos)
        self._check_start(layer, start_pos)
        if k.shape[2] == 1 and self.spec.residual >= 1:
            store.append(k, v)  # the new token stays in the residual window
            segs = store.segments(copy_residual=False)
        else:  # a chunk attends to its own keys in full precision, then is stored
            segs = store.segments(copy_residual=True) + [TensorSegment(k, v)]
            store.append(k, v)
        return KVRead(segs, 0, self.config.n_kv_heads, self.spec.key_group)

    @property
    def payload_bytes(self) -> int:
        """Bytes of what every layer holds: ring K/V, and codes + scales + zeros + residual K/V."""
        return sum(
            store.payload_bytes() if isinstance(store, QuantizedBuffer) else store.num_resident * store._token_bytes()
            for store in self.layers
        )

    def full_layer_nbytes(self) -> int:
        """Bytes allocated by the full (quantised) layers alone."""
        return sum(store.nbytes for store in self.layers if isinstance(store, QuantizedBuffer))
