"""KV storage settings: a storage format and an optional token budget, and the cache they build
(docs/kv-cache.md#kv-settings-and-the-command-line).

`KVSettings()` is the plain `MixedKVCache` (the model's own dtype, the `dense` format);
`format="int8"` / `"int4"` a `QuantizedKVCache`; `budget=N` an `EvictingKVCache` of N tokens per
full layer under `policy`. Quantisation and eviction are not combined.
"""

from __future__ import annotations

from dataclasses import dataclass

from gptoss_lite.config import ModelConfig
from gptoss_lite.kv.evicting_cache import DEFAULT_SINK_TOKENS, POLICIES, EvictingKVCache
from gptoss_lite.kv.mixed import MixedKVCache
from gptoss_lite.kv.quant import QuantizedKVCache
from gptoss_lite.kvspec import DENSE, KVFormat, kv_format
from gptoss_lite.validation import check_int


@dataclass(frozen=True)
class KVSettings:
    """How full layers store K/V: a `format` (a `kvspec` format, or its name), or a token
    `budget` under `policy`."""

    format: KVFormat = DENSE
    budget: int | None = None  # tokens per full layer (None: no eviction)
    policy: str = "streaming"  # 'streaming' (sinks + recent) or 'h2o' (heavy hitters + recent)
    sink_tokens: int = DEFAULT_SINK_TOKENS  # streaming: initial tokens always kept

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", kv_format(self.format))
        if self.policy not in POLICIES:
            raise ValueError(f"kv policy={self.policy!r}: must be one of {POLICIES}")
        check_int("sink_tokens", self.sink_tokens, minimum=0)
        if self.budget is not None:
            check_int("kv budget", self.budget, minimum=2)
            if self.format.quantized:
                raise ValueError(
                    f"kv budget={self.budget} with format={self.format}: eviction runs on the dense cache; "
                    "give one of them"
                )
            if self.policy == "streaming" and self.sink_tokens >= self.budget:
                raise ValueError(f"sink_tokens={self.sink_tokens}: must be < kv budget={self.budget}")

    @property
    def label(self) -> str:
        """Short name for tables: '16-bit', 'int8', 'int4', 'streaming@1024', 'h2o@1024'."""
        if self.budget is not None:
            return f"{self.policy}@{self.budget}"
        return self.format.label

    def prefill_chunk(self, requested: int) -> int:
        """Prefill piece under a budget: at most the budget, so a query attends to at most
        budget + chunk - 1 keys and a needle cannot hide in a long chunk's own keys."""
        return requested if self.budget is None else min(requested, self.budget)

    def build(self, config: ModelConfig, batch_size: int = 1, rollback_tokens: int = 0) -> MixedKVCache:
        """A fresh cache of these settings."""
        if self.budget is not None:
            if rollback_tokens:
                raise ValueError("a KV budget (eviction) cannot be combined with speculative decoding")
            return EvictingKVCache(
                config, batch_size, budget=self.budget, policy=self.policy, sink_tokens=self.sink_tokens
            )
        if self.format.bits is None:
            return MixedKVCache(config, batch_size, rollback_tokens=rollback_tokens)
        return QuantizedKVCache(config, batch_size, rollback_tokens=rollback_tokens, full_format=self.format)
