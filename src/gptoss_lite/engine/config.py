"""`EngineConfig`: every knob of the batched engine, with its checks, in one place.

`LLM(model, config=EngineConfig(...))` or `LLM(model, kv_blocks=..., ...)` (the keywords are these
fields); `serve` and `bench-serve` build one from their flags (`commands.common.engine_config`).
Sizes the engine derives when a field is None (the KV blocks, the sliding pool, the context) are
worked out by `LLM` once the model is known.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptoss_lite.engine.tenants import TenantPolicy
from gptoss_lite.kv.block_pool import DEFAULT_BLOCK_SIZE
from gptoss_lite.kvspec import DENSE, KVFormat, kv_format
from gptoss_lite.model.moe import MXFP4Experts
from gptoss_lite.speculative import DraftModel, PromptLookup
from gptoss_lite.validation import check_int

DEFAULT_KV_CACHE_BYTES = 1 << 30  # both pools together, when kv_blocks is not given
# Tokens a step: `serve` and `bench-serve` default to 512, so that a prompt chunk delays the requests
# decoding beside it by little. The library's `LLM` (offline batches, where the batch's wall time is
# what counts) takes the first of OFFLINE_STEP_BUDGETS its pools hold a step of, else 512
# (`EngineConfig.max_batch_tokens` None): the batch-16 cell 1.10x (fp32) and 1.15x (bf16) faster
# at 2,048 than at 512, and with decode bursts 1.06x and 1.04x faster at 4,096 than at 2,048
# (benchmarks/engine_step_budget.py, docs/engine.md#how-a-step-works).
DEFAULT_MAX_BATCH_TOKENS = 512
OFFLINE_STEP_BUDGETS = (4096, 2048)
OFFLINE_MAX_BATCH_TOKENS = OFFLINE_STEP_BUDGETS[0]
DEFAULT_MAX_RUNNING = 64
# Decode tokens a request may run per scheduling round while every running request decodes greedily
# and nothing waits (`EngineConfig.decode_steps`, docs/engine.md#decode-bursts): the library's
# default. `serve` and `bench-serve` default to 1 (a token per round: tokens stream one at a time and
# a new request waits for one step at most).
DEFAULT_DECODE_STEPS = 8


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs (docs/engine.md).

    KV memory: `kv_blocks` (and `sliding_blocks`) size the pools directly; otherwise they are what
    `kv_cache_bytes` (default 1 GiB) holds, capped by what `max_running` requests of `max_model_len`
    tokens need. `kv_format` (a quantised `gptoss_lite.kvspec` format) stores full-layer blocks as codes.
    `full_window` N keeps only the last N keys of every full layer for each query (a full-layer window, not the eviction
    budget of `kv.evicting_cache`; docs/engine.md#full-layer-window). `decode_reserve` N is the
    admission watermark: blocks kept for every running request's next N decode tokens. `speculate`
    drafts decoding requests' tokens by prompt lookup or with a draft model. `compile_decode` None
    decodes as the model was prepared. `rope_factor` overrides a loaded checkpoint's YaRN factor
    (`ModelConfig.with_rope_factor`; not for a model passed in, which is used as built). `tenants`
    gives each tenant's share of the engine and its quotas (engine/fairness.py; None: equal shares,
    no quotas). `mxfp4_activations` "int8" opts packed MXFP4 experts into int8-rounded activations
    (`GPTOSS.set_mxfp4_activations`; changes results; None: "exact", or as a model passed in was set).
    `decode_steps` N lets a round of plain greedy decoding run up to N compiled steps back to back,
    scheduled once (1: one token per round; docs/engine.md#decode-bursts).
    """

    kv_blocks: int | None = None
    sliding_blocks: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_batch_tokens: int | None = None
    max_running: int = DEFAULT_MAX_RUNNING
    dtype: torch.dtype | None = None
    device: str | torch.device | None = None
    revision: str | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    kv_format: KVFormat = DENSE  # full-layer blocks: DENSE (the model's dtype), INT8, INT4, or their names
    kv_cache_bytes: int | None = None
    full_window: int | None = None
    compile_decode: bool | None = None
    speculate: PromptLookup | DraftModel | None = None
    decode_reserve: int = 0
    rope_factor: float | None = None
    tenants: TenantPolicy | None = None
    mxfp4_activations: str | None = None
    decode_steps: int = DEFAULT_DECODE_STEPS

    def __post_init__(self) -> None:
        for name in ("block_size", "max_running", "decode_steps"):
            check_int(name, getattr(self, name), 1)
        for name in ("kv_blocks", "sliding_blocks", "max_model_len", "kv_cache_bytes", "max_batch_tokens"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        check_int("decode_reserve", self.decode_reserve, 0)
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching={self.enable_prefix_caching!r}: expected a bool")
        if self.mxfp4_activations is not None and self.mxfp4_activations not in MXFP4Experts.ACTIVATIONS:
            raise ValueError(
                f"mxfp4_activations={self.mxfp4_activations!r}: must be None or one of {MXFP4Experts.ACTIVATIONS}"
            )
        object.__setattr__(self, "kv_format", kv_format(self.kv_format))
        if self.full_window is not None:
            check_int("full_window", self.full_window, 1)
            if self.kv_format.quantized:
                raise ValueError(f"full_window={self.full_window} with kv_format={self.kv_format}: give one of them")
            if self.enable_prefix_caching:
                raise ValueError(
                    f"full_window={self.full_window} releases prompt blocks the prefix cache would need; "
                    "pass enable_prefix_caching=False"
                )
        if self.tenants is not None and not isinstance(self.tenants, TenantPolicy):
            raise TypeError(f"tenants: expected a TenantPolicy (or None), got {type(self.tenants).__name__}")
        if self.speculate is not None and not isinstance(self.speculate, (PromptLookup, DraftModel)):
            raise TypeError(
                f"speculate: expected a PromptLookup or a DraftModel (or None), got {type(self.speculate).__name__}"
            )

    @property
    def kv_bytes(self) -> int:
        """The memory the pools may take when kv_blocks is not given."""
        return DEFAULT_KV_CACHE_BYTES if self.kv_cache_bytes is None else self.kv_cache_bytes

    @property
    def step_tokens(self) -> int:
        """`max_batch_tokens`, or where it is None (the library's default) the larger offline budget;
        `LLM` settles None to a number before it builds anything else (see DEFAULT_MAX_BATCH_TOKENS)."""
        return OFFLINE_MAX_BATCH_TOKENS if self.max_batch_tokens is None else self.max_batch_tokens

    @property
    def tail_blocks(self) -> int:
        """Full-precision tails of quantised blocks: every running request's partial block + one step."""
        return 2 * self.max_running + -(-self.step_tokens // self.block_size) + 2
