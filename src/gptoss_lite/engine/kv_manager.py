"""KV blocks for the engine's requests: one sequence per request in each layer kind's pool.

`KVManager` owns a `PagedKVStore` (per-layer block tensors, and one `KVGroup` per layer kind: its
layers, `PagedKVPool`, `PrefixCache` and window rule, `gptoss_lite.kv.groups`) and keeps every
request's sequences in step, group by group:

- `start(request)`: create the request's sequence in every pool, attached to the prompt's cached
  blocks when the prefix cache has them (the hit is the shorter of the two kinds' hits, so that every
  layer holds the same tokens); the request then starts computing at the hit.
- `allocate(request, n)`: room for the next n tokens in every pool, or False with nothing changed.
  Blocks that left the window of every future query are released first (each group by its own
  rule); blocks only the prefix cache holds are evicted (least recently used) when a pool is short.
- `cache_prompt(request)`: pin the prompt's computed full blocks in the prefix cache. Called after
  every step, so a prompt prefilled in chunks is cached before the sliding layers release its
  leading blocks.
- `free(request)`: release everything the request holds (finish, abort, preemption).

Prefix-cache keys carry the request's scope (a tenant) and the engine's revision (the weights), so a
prefix cached for one tenant or one set of weights is never a hit for another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gptoss_lite.config import ModelConfig
from gptoss_lite.engine.config import EngineConfig
from gptoss_lite.engine.paged_batch import PagedBatch, PagedDecode, Segment
from gptoss_lite.engine.request import Request
from gptoss_lite.kv.block_pool import AppendPlan
from gptoss_lite.kv.groups import KVGroup, attach_prefix
from gptoss_lite.kv.paged_cache import PagedKVStore
from gptoss_lite.kv.paged_quant import QuantizedPagedStore
from gptoss_lite.kvspec import KVFormat, LayerKind, LayerKVSpec


class KVManager:
    """Per-request block allocation over the store's KV groups (module docstring). The engine's one
    door to KV: nothing else in `engine/` reads the store, its groups, pools or prefix caches
    (tests/test_import_graph.py checks it); the scheduler, the runner and the facade ask here."""

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        *,
        kv_blocks: int,
        sliding_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_format: KVFormat,
        tail_blocks: int,
        revision: str,
        enable_prefix_caching: bool,
        full_window: int | None,
    ) -> KVManager:
        """The store (16-bit blocks, or int8 / int4 full-layer blocks with `tail_blocks` full-precision
        tails; the full layers' group keeps the last `full_window` keys, if given:
        docs/engine.md#full-layer-window) and its manager."""
        quant = {}
        store_type: type[PagedKVStore] = PagedKVStore
        if kv_format.quantized and config.full_layers:
            store_type, quant = QuantizedPagedStore, {"bits": kv_format.bits, "tail_blocks": tail_blocks}
        store = store_type(
            config,
            kv_blocks,
            block_size,
            sliding_blocks=sliding_blocks,
            full_window=full_window,
            dtype=dtype,
            device=device,
            **quant,
        )
        return cls(store, revision=revision, enable_prefix_caching=enable_prefix_caching)

    def __init__(self, store: PagedKVStore, *, revision: str, enable_prefix_caching: bool = True) -> None:
        if store.full_window is not None and enable_prefix_caching:
            # a window releases prompt blocks the prefix cache would need
            raise ValueError(
                f"the store's full-layer window of {store.full_window} keys releases prompt blocks the prefix "
                "cache would need; pass enable_prefix_caching=False"
            )
        self.store = store
        self.config: ModelConfig = store.config
        self.groups: tuple[KVGroup, ...] = store.groups
        self.block_size = store.block_size
        self.revision = revision
        self.enable_prefix_caching = enable_prefix_caching
        self.evicted_blocks = 0
        self.lookups = self.lookup_tokens = self.hit_tokens = 0  # prefix-cache lookups by start()

    # ------------------------------------------------------------------ lifetime

    def start(self, request: Request) -> int:
        """Create the request's sequences; return the prompt tokens served by the prefix cache."""
        rid = request.request_id
        tokens = request.all_token_ids
        if not self.enable_prefix_caching:
            for group in self.groups:
                group.pool.create(rid)
            return 0
        hit = attach_prefix(self.groups, rid, tokens, request.scope, self.revision)
        self.lookups += 1
        self.lookup_tokens += len(tokens)
        self.hit_tokens += hit
        return hit

    def fork(self, source: Request, target: Request, n_tokens: int) -> None:
        """Start `target` holding `source`'s first n_tokens in every pool, on the same blocks
        (copy-on-write: the first append into a shared block copies it)."""
        for group in self.groups:
            group.pool.share_prefix(source.request_id, target.request_id, n_tokens)
        target.num_prompt_inserted = source.num_prompt_inserted  # the same blocks, already cached

    def free(self, request: Request) -> None:
        """Release the request's sequences in every pool (blocks the prefix cache pins stay cached)."""
        request.num_prompt_inserted = 0  # a preempted request inserts again as it recomputes
        for group in self.groups:
            if request.request_id in group.pool:
                group.pool.release(request.request_id)

    def truncate(self, request: Request, n_tokens: int) -> None:
        """Roll the request back to its first n_tokens in every pool (a rejected speculative draft)."""
        for group in self.groups:
            group.pool.truncate(request.request_id, n_tokens)

    # ------------------------------------------------------------------ allocation

    def allocate(self, request: Request, n_tokens: int) -> dict[str, AppendPlan] | None:
        """Append n_tokens to the request in every pool; None (nothing appended) if they do not fit even
        after evicting blocks only the prefix cache holds. Blocks that left the window of the next query
        are released first either way (they are never needed again)."""
        rid = request.request_id
        for group in self.groups:
            group.release_window(rid, request.num_computed)
        shortfall = []
        for group in self.groups:
            short = group.pool.blocks_needed(rid, n_tokens) - group.pool.free_blocks
            if short > 0 and (not self.enable_prefix_caching or group.prefix.evictable_blocks < short):
                return None
            shortfall.append(short)
        plans = {}
        for group, short in zip(self.groups, shortfall):
            if short > 0:
                self.evicted_blocks += group.prefix.evict(short)
            plans[group.name] = plan = group.pool.append(rid, n_tokens)
            self.store.apply_copies(group.name, plan.copies)
        return plans

    def cache_prompt(self, request: Request) -> None:
        """Pin the computed full blocks of the prompt in every group's prefix cache. A no-op unless the
        step completed prompt blocks not inserted yet: hashing the prompt again on every decode step
        would cost O(prompt) per request per step."""
        if not self.enable_prefix_caching:
            return
        n = min(request.num_computed, len(request.prompt_token_ids))
        n -= n % self.block_size
        if n <= request.num_prompt_inserted:
            return
        tokens = request.prompt_token_ids[:n]
        rid, scope = request.request_id, request.scope
        # Blocks a window released can be cached no more; if the cache evicted one of them under
        # pressure, the chain of hashes is broken there and nothing after it can be cached.
        if not all(group.chain_intact(rid, tokens, scope, self.revision) for group in self.groups):
            request.num_prompt_inserted = len(request.prompt_token_ids)  # broken for good: stop trying
            return
        for group in self.groups:
            group.prefix.insert(tokens, scope, self.revision, seq_id=rid)
        request.num_prompt_inserted = n

    # ------------------------------------------------------------------ admission arithmetic

    def prompt_blocks(self, kind: str, n_tokens: int, max_batch_tokens: int) -> int:
        """Blocks of `kind` a request needs to run n_tokens of prompt from scratch, max_batch_tokens a
        step (`KVGroup.prompt_blocks`: all of them, or at most a window plus one step)."""
        return self.store.group(kind).prompt_blocks(n_tokens, max_batch_tokens)

    def growth_blocks(self, kind: str, tokens_left: int, reserve: int) -> int:
        """Blocks of `kind` the admission watermark keeps for a request's next decode tokens: up to
        `reserve` of the `tokens_left` it may still generate (`KVGroup.growth_blocks`: none on a
        windowed kind)."""
        return self.store.group(kind).growth_blocks(tokens_left, reserve)

    # ------------------------------------------------------------------ the batch

    @property
    def kinds(self) -> tuple[str, ...]:
        """The layer kinds with a group (sliding and/or full)."""
        return tuple(group.name for group in self.groups)

    @property
    def quantized(self) -> bool:
        return isinstance(self.store, QuantizedPagedStore)

    @property
    def full_window(self) -> int | None:
        """The full layers' window: they attend to their last N keys (None: to every key)."""
        return self.store.full_window

    def batch(self, segments: list[Segment], write_slots: dict[str, list[int]], logits_index: list[int]) -> PagedBatch:
        """A step's ragged batch over the store (the model's writes and reads go through it)."""
        return PagedBatch(self.store, segments, write_slots, logits_index, full_window=self.full_window)

    #: rows per group of the warm-up step that compiles the draft-verifying graph: any size above 1
    #: gives that graph, and one unlike the warm-up's other sizes keeps them apart as symbols
    WARM_UP_GROUP_ROWS = 7

    def warm_up_state(self, groups: int, per_group: int, device: torch.device) -> PagedDecode:
        """A dummy decode state of `groups` groups of `per_group` rows at position 0 of block 0 of each
        pool, which no request may hold yet (for compiling the decode step before the first request)."""
        bs = self.block_size
        if any(group.pool.allocated_blocks for group in self.groups):
            raise RuntimeError("warm_up() writes block 0: call it before any request is admitted")
        kinds = self.kinds
        # distinct sizes (groups, rows per group, a table width per kind): sizes equal at trace time
        # would be taken for one symbol, and a later step where they differ would compile again
        widths = {kind: 3 + i for i, kind in enumerate(kinds)}
        rows = groups * per_group
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        return PagedDecode(
            self.store,
            zeros.clone(),
            {kind: torch.zeros(groups, w, dtype=torch.long, device=device) for kind, w in widths.items()},
            {kind: zeros.clone() for kind in kinds},
            # only slot 0 (position 0) is visible
            {
                kind: -torch.arange(w * bs, device=device).expand(groups, per_group, -1).contiguous()
                for kind, w in widths.items()
            },
            {kind: None for kind in kinds},
            torch.zeros(rows, dtype=torch.long, device=device),
            torch.arange(rows, device=device),
        )

    # ------------------------------------------------------------------ reads

    def resident(self, request: Request, kind: str) -> tuple[tuple[int, ...], int]:
        """(resident blocks, position of the first resident token) of the request in `kind`'s pool."""
        group = self.store.group(kind)
        rid = request.request_id
        return group.pool.page_table(rid), group.released_tokens(rid)

    # ------------------------------------------------------------------ accounting

    def spare_blocks(self, kind: str) -> int:
        """Blocks of `kind` a new request could take now: free ones, and those only the prefix cache
        holds (it gives them up)."""
        group = self.store.group(kind)
        spare = group.pool.free_blocks
        if self.enable_prefix_caching:
            spare += group.prefix.evictable_blocks
        return spare

    def cached_blocks(self) -> int:
        """Blocks held by nobody but the prefix cache (reclaimable), both kinds."""
        return sum(group.prefix.evictable_blocks for group in self.groups)

    def pool_tokens(self) -> int:
        """Tokens the first pool holds (a request's whole length must fit in it without a full-layer
        window)."""
        return self.groups[0].pool.total_blocks * self.block_size

    def check_step_fits(self, max_batch_tokens: int) -> None:
        """Every pool holds one step of max_batch_tokens beside a window (ValueError if not)."""
        for group in self.groups:
            if group.pool.total_blocks < group.min_blocks(max_batch_tokens):
                raise ValueError(
                    f"the {group.word} pool has {group.pool.total_blocks} blocks of {self.block_size} tokens, "
                    f"too few for one step of max_batch_tokens={max_batch_tokens}; use more kv_blocks/sliding_blocks "
                    "or a smaller max_batch_tokens"
                )

    def sequences(self) -> set:
        """Every sequence id some pool holds."""
        return {seq for group in self.groups for seq in group.pool.sequences}

    @property
    def nbytes(self) -> int:
        """Bytes allocated for K/V (both pools; scales and full-precision tails included)."""
        return self.store.nbytes

    @property
    def tail_bytes(self) -> int:
        """Full-precision staging bytes of quantised blocks being filled (0 for 16-bit blocks)."""
        return getattr(self.store, "tail_bytes", 0)

    @property
    def dtype(self) -> torch.dtype:
        return self.store.dtype

    def blocks_used(self) -> dict[str, int]:
        return {group.name: group.pool.allocated_blocks for group in self.groups}

    def blocks_total(self) -> dict[str, int]:
        return {group.name: group.pool.total_blocks for group in self.groups}

    def clear_prefix_cache(self) -> None:
        for group in self.groups:
            group.prefix.clear()

    def validate(self) -> None:
        """Every group's pool and prefix cache pass their own consistency checks."""
        for group in self.groups:
            group.validate()

    def all_free(self) -> bool:
        """No block held by anyone (prefix-cache pins included)."""
        return all(group.pool.free_blocks == group.pool.total_blocks for group in self.groups)


def pool_blocks(specs: Sequence[LayerKVSpec], cfg: EngineConfig, max_model_len: int) -> tuple[int, int]:
    """(full-layer, sliding-layer) pool blocks, each given by the config or sized here from the layers'
    specs. The full-layer pool: `kv_cache_bytes` over both pools (every layer's `block_bytes`), but no
    more than `max_running` requests of `max_model_len` tokens need (under a full-layer window, the
    window plus one step). The sliding pool: as large while the prefix cache is on (a cached prompt
    pins its sliding-layer blocks too); without it, what the running requests hold at once,
    ceil(W / bs) + 1 blocks each in decode plus the window and one chunk for a prefill."""
    bs, running, step = cfg.block_size, cfg.max_running, cfg.max_batch_tokens
    full = cfg.kv_blocks
    if full is None:
        by_memory = cfg.kv_bytes // sum(spec.block_bytes(bs) for spec in specs)
        window = cfg.full_window
        held = max_model_len if window is None else min(max_model_len, window + step)
        by_need = running * (math.ceil(held / bs) + (window is not None))
        full = max(1, min(by_memory, by_need))
    sliding = cfg.sliding_blocks
    if sliding is None:
        W = next((spec.window for spec in specs if spec.kind is LayerKind.SLIDING), None)
        if cfg.enable_prefix_caching or W is None:
            sliding = full
        else:
            sliding = min(full, running * (math.ceil(W / bs) + 1) + math.ceil((W + step) / bs) + 1)
    return full, sliding
