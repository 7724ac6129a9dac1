"""What one layer's KV cache stores, written once (docs/kv-cache.md#the-kv-spec).

Pure Python, no torch: the planner reads it as well as the caches. A `LayerKVSpec` says, for one
layer of a model:

- its kind and window: `LayerKind.SLIDING` (a window of W keys) or `LayerKind.FULL` (every key, or the
  last N under the engine's full-layer window);
- its storage `KVFormat`: the model's own dtype (`DENSE`), or `INT8` / `INT4` / `FP8` codes with
  float16 scales and zero points (KIVI-style: keys per channel over a group of tokens, values per
  token over groups of channels; what a code is, is the format's codec in `kv.quant`);
- the K and V head counts and dims (equal in every model today, kept apart for attention families
  where they differ);
- its bytes: `token_bytes` (a token in the model's dtype), `quantized_bytes(n, key_group)` (n tokens as
  codes) and `block_bytes(block_size)`, each formula written here and nowhere else.

`model_kv_specs(config, ...)` gives one spec per layer. Callers branch on what a spec says (`window`,
`format.quantized`), never on a layer-kind string.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gptoss_lite.config import ModelConfig
from gptoss_lite.validation import check_int

SCALE_BYTES = 2  # a float16 scale or zero point


class LayerKind(str, enum.Enum):
    """The two layer kinds. A member equals (and hashes as) its Hugging Face `layer_types` word
    (`config.SLIDING` / `config.FULL`), so it keys JSON and dicts as that word did."""

    SLIDING = "sliding_attention"
    FULL = "full_attention"

    __hash__ = str.__hash__
    __str__ = str.__str__

    @classmethod
    def of(cls, config: ModelConfig, layer: int) -> LayerKind:
        return cls.SLIDING if config.is_sliding(layer) else cls.FULL

    @property
    def word(self) -> str:
        """'sliding-layer' or 'full-layer', for messages."""
        return "sliding-layer" if self is LayerKind.SLIDING else "full-layer"


@dataclass(frozen=True)
class KVFormat:
    """How K/V elements are stored: the model's dtype (`bits` None), or `bits`-bit codes with scales."""

    name: str  # 'dense', 'int8', 'int4': the --kv-format words
    bits: int | None = None  # bits per code; None: the model's own dtype

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def label(self) -> str:
        """'16-bit' for the model's dtype (bf16 or fp16 in serving), else the name."""
        return "16-bit" if self.bits is None else self.name

    def __str__(self) -> str:
        return self.name


DENSE = KVFormat("dense")
INT8 = KVFormat("int8", 8)
INT4 = KVFormat("int4", 4)
FP8 = KVFormat("fp8", 8)  # float8 e4m3 codes, centred on each group's midpoint
FORMATS: dict[str, KVFormat] = {f.name: f for f in (DENSE, INT8, INT4, FP8)}
BY_BITS: dict[int, KVFormat] = {16: DENSE, 8: INT8, 4: INT4}  # the older --kv-bits words


def token_bytes(k_heads: int, k_dim: int, v_heads: int, v_dim: int, element_bytes: int) -> int:
    """K and V of one token in one layer, uncompressed: (K_h·K_d + V_h·V_d) · element bytes. The one
    place this product is written; `LayerKVSpec.token_bytes`, the dense caches and the planner use it."""
    return (k_heads * k_dim + v_heads * v_dim) * element_bytes


def kv_format(value: KVFormat | str | int) -> KVFormat:
    """A format from itself, its name ('dense', 'int8', 'int4', 'fp8') or the older bit count (16, 8, 4)."""
    if isinstance(value, KVFormat):
        return value
    if isinstance(value, str) and value in FORMATS:
        return FORMATS[value]
    if isinstance(value, int) and not isinstance(value, bool) and value in BY_BITS:
        return BY_BITS[value]
    raise ValueError(f"KV format {value!r}: must be one of {sorted(FORMATS)} (or the bit counts 16, 8, 4)")


def default_value_group(v_dim: int) -> int:
    """Channels per value scale: 64 when it divides the value dim, else the whole dim."""
    return 64 if v_dim % 64 == 0 else v_dim


@dataclass(frozen=True)
class LayerKVSpec:
    """One layer's KV storage (see the module docstring)."""

    kind: LayerKind
    window: int | None  # keys a query sees (W on sliding layers); None: every key
    format: KVFormat
    element_bytes: int  # one element in the model's dtype (dense storage, quantised residual tokens)
    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int
    value_group: int | None = None  # quantised values: channels per scale (None: default_value_group)

    def __post_init__(self) -> None:
        for name in ("element_bytes", "k_heads", "k_dim", "v_heads", "v_dim"):
            check_int(name, getattr(self, name), minimum=1)
        if self.window is not None:
            check_int("window", self.window, minimum=1)
        if self.format.quantized:
            if self.v_dim % self.group:
                raise ValueError(
                    f"value_group={self.group}: must divide the value dim {self.v_dim}; use a divisor "
                    f"such as {self.v_dim}"
                )
            for dim in (self.k_dim, self.v_dim):
                if dim * self.format.bits % 8:
                    raise ValueError(f"head dim {dim}: {self.format.name} codes must fill whole bytes")

    @property
    def group(self) -> int:
        """Channels per value scale of a quantised format."""
        return default_value_group(self.v_dim) if self.value_group is None else self.value_group

    @property
    def token_bytes(self) -> int:
        """K and V of one token in the model's dtype."""
        return token_bytes(self.k_heads, self.k_dim, self.v_heads, self.v_dim, self.element_bytes)

    def quantized_bytes(self, n_tokens: int, key_group: int) -> int:
        """n_tokens (whole key groups) as codes: K and V codes, one scale and zero per key channel per
        key group, one per value group per token."""
        bits = self.format.bits
        if bits is None:
            raise ValueError(f"quantized_bytes: the {self.format.name} format has no codes")
        if n_tokens % key_group:
            raise ValueError(f"quantized_bytes: {n_tokens} tokens is not a whole number of key groups of {key_group}")
        codes = token_bytes(self.k_heads, self.k_dim, self.v_heads, self.v_dim, n_tokens * bits) // 8
        key_scales = 2 * SCALE_BYTES * self.k_heads * self.k_dim * (n_tokens // key_group)
        value_scales = 2 * SCALE_BYTES * self.v_heads * (self.v_dim // self.group) * n_tokens
        return codes + key_scales + value_scales

    def block_bytes(self, block_size: int) -> int:
        """One paged block of this layer: block_size tokens, quantised with the block as the key group."""
        if self.format.quantized:
            return self.quantized_bytes(block_size, key_group=block_size)
        return block_size * self.token_bytes

    def resident_tokens(self, context_tokens: int) -> int:
        """Tokens this layer keeps of a context: all of them, or its window."""
        return context_tokens if self.window is None else min(self.window, context_tokens)


def model_kv_specs(
    config: ModelConfig,
    element_bytes: int,
    full_format: KVFormat | str | int = DENSE,
    *,
    full_window: int | None = None,
    value_group: int | None = None,
) -> tuple[LayerKVSpec, ...]:
    """One spec per layer: sliding layers keep their window in the model's dtype; full layers store
    `full_format` and see every key, or their last `full_window` (which needs the dense format:
    quantised blocks keep every key)."""
    fmt = kv_format(full_format)
    if full_window is not None and fmt.quantized:
        raise ValueError(f"full_window={full_window} with the {fmt.name} KV format: give one of them")
    K, D = config.n_kv_heads, config.head_dim
    specs = []
    for layer in range(config.n_layers):
        kind = LayerKind.of(config, layer)
        if kind is LayerKind.SLIDING:
            specs.append(LayerKVSpec(kind, config.sliding_window, DENSE, element_bytes, K, D, K, D))
        else:
            specs.append(LayerKVSpec(kind, full_window, fmt, element_bytes, K, D, K, D, value_group))
    return tuple(specs)
