"""KV blocks for the engine's requests: one sequence per request in each layer kind's pool.

`KVManager` owns a `PagedKVStore` (per-layer block tensors, one `PagedKVPool` and one `PrefixCache`
per layer kind) and keeps every request's sequences in step:

- `start(request)`: create the request's sequence in every pool, attached to the prompt's cached
  blocks when the prefix cache has them (the hit is the shorter of the two kinds' hits, so that every
  layer holds the same tokens); the request then starts computing at the hit.
- `allocate(request, n)`: room for the next n tokens in every pool, or False with nothing changed.
  Sliding-layer blocks that left the window of every future query are released first; blocks only
  the prefix cache holds are evicted (least recently used) when a pool is short.
- `cache_prompt(request)`: pin the prompt's computed full blocks in the prefix cache. Called after
  every step, so a prompt prefilled in chunks is cached before the sliding layers release its
  leading blocks.
- `free(request)`: release everything the request holds (finish, abort, preemption).

Prefix-cache keys carry the request's scope (a tenant) and the engine's revision (the weights), so a
prefix cached for one tenant or one set of weights is never a hit for another.
"""

from __future__ import annotations

import math

import torch

from gptoss_lite.config import FULL, SLIDING, ModelConfig
from gptoss_lite.engine.paged_batch import PagedBatch, PagedDecode, Segment
from gptoss_lite.engine.request import Request
from gptoss_lite.kv.block_pool import AppendPlan
from gptoss_lite.kv.paged_cache import PagedKVStore
from gptoss_lite.kv.paged_quant import QuantizedPagedStore


class KVManager:
    """Per-request block allocation over the store's pools and prefix caches (module docstring). The
    engine's one door to KV: nothing else in `engine/` reads the store, its pools or its prefix caches
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
        kv_bits: int,
        tail_blocks: int,
        revision: str,
        enable_prefix_caching: bool,
        kv_budget: int | None,
    ) -> KVManager:
        """The store (16-bit blocks, or int8 / int4 full-layer blocks with `tail_blocks` full-precision
        tails) and its manager."""
        quant = {}
        store_type: type[PagedKVStore] = PagedKVStore
        if kv_bits != 16 and config.full_layers:
            store_type, quant = QuantizedPagedStore, {"bits": kv_bits, "tail_blocks": tail_blocks}
        store = store_type(
            config, kv_blocks, block_size, sliding_blocks=sliding_blocks, dtype=dtype, device=device, **quant
        )
        return cls(store, revision=revision, enable_prefix_caching=enable_prefix_caching, kv_budget=kv_budget)

    def __init__(
        self,
        store: PagedKVStore,
        *,
        revision: str,
        enable_prefix_caching: bool = True,
        kv_budget: int | None = None,
    ) -> None:
        self.store = store
        self.config: ModelConfig = store.config
        # (LLM refuses a budget with prefix caching: a budget releases prompt blocks)
        # the window each layer kind's keys are kept for: sliding layers the model's W, full layers the
        # KV budget (docs/engine.md#kv-budget) or everything
        self.windows: dict[str, int | None] = {SLIDING: self.config.sliding_window, FULL: kv_budget}
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
            for pool in self.store.pools.values():
                pool.create(rid)
            return 0
        hits = [self.store.prefix[kind].attach(rid, tokens, request.scope, self.revision) for kind in self.store.pools]
        hit = min(hits)
        for pool in self.store.pools.values():
            pool.truncate(rid, hit)  # a longer hit in one pool is cut back to the common one
        self.lookups += 1
        self.lookup_tokens += len(tokens)
        self.hit_tokens += hit
        return hit

    def fork(self, source: Request, target: Request, n_tokens: int) -> None:
        """Start `target` holding `source`'s first n_tokens in every pool, on the same blocks
        (copy-on-write: the first append into a shared block copies it)."""
        for pool in self.store.pools.values():
            pool.share_prefix(source.request_id, target.request_id, n_tokens)
        target.num_prompt_inserted = source.num_prompt_inserted  # the same blocks, already cached

    def free(self, request: Request) -> None:
        """Release the request's sequences in every pool (blocks the prefix cache pins stay cached)."""
        request.num_prompt_inserted = 0  # a preempted request inserts again as it recomputes
        for pool in self.store.pools.values():
            if request.request_id in pool:
                pool.release(request.request_id)

    def truncate(self, request: Request, n_tokens: int) -> None:
        """Roll the request back to its first n_tokens in every pool (a rejected speculative draft)."""
        for pool in self.store.pools.values():
            pool.truncate(request.request_id, n_tokens)

    def holds(self, request: Request) -> bool:
        return any(request.request_id in pool for pool in self.store.pools.values())

    # ------------------------------------------------------------------ allocation

    def _release_window(self, request: Request) -> None:
        """Blocks every slot of which precedes the next query's window are released (sliding layers, and
        full layers under a KV budget)."""
        for kind, pool in self.store.pools.items():
            window = self.windows[kind]
            if window is not None:
                pool.release_before(request.request_id, max(0, request.num_computed - window + 1))

    def allocate(self, request: Request, n_tokens: int) -> dict[str, AppendPlan] | None:
        """Append n_tokens to the request in every pool; None (nothing appended) if they do not fit even
        after evicting blocks only the prefix cache holds. Sliding-layer blocks that left the window are
        released first either way (they are never needed again)."""
        self._release_window(request)
        shortfall = {}
        for kind, pool in self.store.pools.items():
            short = pool.blocks_needed(request.request_id, n_tokens) - pool.free_blocks
            if short > 0 and (not self.enable_prefix_caching or self.store.prefix[kind].evictable_blocks < short):
                return None
            shortfall[kind] = short
        plans = {}
        for kind, pool in self.store.pools.items():
            if shortfall[kind] > 0:
                self.evicted_blocks += self.store.prefix[kind].evict(shortfall[kind])
            plans[kind] = pool.append(request.request_id, n_tokens)
            self.store.apply_copies(kind, plans[kind].copies)
        return plans

    def cache_prompt(self, request: Request) -> None:
        """Pin the computed full blocks of the prompt in every kind's prefix cache. A no-op unless the
        step completed prompt blocks not inserted yet: hashing the prompt again on every decode step
        would cost O(prompt) per request per step."""
        if not self.enable_prefix_caching:
            return
        n = min(request.num_computed, len(request.prompt_token_ids))
        n -= n % self.block_size
        if n <= request.num_prompt_inserted:
            return
        tokens = request.prompt_token_ids[:n]
        if SLIDING in self.store.pools:
            # Blocks the window released can be cached no more; if the cache evicted one of them under
            # pressure, the chain of hashes is broken there and nothing after it can be cached.
            released = self.store.pools[SLIDING].first_block_index(request.request_id) * self.block_size
            if (
                released
                and self.store.prefix[SLIDING].match(tokens[: released + 1], request.scope, self.revision, record=False)
                < released
            ):
                request.num_prompt_inserted = len(request.prompt_token_ids)  # broken for good: stop trying
                return
        for kind in self.store.pools:
            self.store.prefix[kind].insert(tokens, request.scope, self.revision, seq_id=request.request_id)
        request.num_prompt_inserted = n

    # ------------------------------------------------------------------ the batch

    @property
    def kinds(self) -> tuple[str, ...]:
        """The layer kinds with a pool (sliding and/or full)."""
        return tuple(self.store.pools)

    @property
    def quantized(self) -> bool:
        return isinstance(self.store, QuantizedPagedStore)

    def batch(self, segments: list[Segment], write_slots: dict[str, list[int]], logits_index: list[int]) -> PagedBatch:
        """A step's ragged batch over the store (the model's writes and reads go through it)."""
        return PagedBatch(self.store, segments, write_slots, logits_index, full_window=self.windows[FULL])

    def warm_up_state(self, rows: int, device: torch.device) -> PagedDecode:
        """A dummy all-decode state of `rows` rows at position 0 of block 0 of each pool, which no request
        may hold yet (for compiling the decode step before the first request)."""
        store, bs = self.store, self.block_size
        if any(pool.allocated_blocks for pool in store.pools.values()):
            raise RuntimeError("warm_up() writes block 0: call it before any request is admitted")
        kinds = list(store.pools)
        # distinct sizes (rows, and a table width per kind): sizes equal at trace time would be taken for
        # one symbol, and a later step where they differ would compile again
        widths = {kind: 3 + i for i, kind in enumerate(kinds)}
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        return PagedDecode(
            store,
            zeros.clone(),
            {kind: torch.zeros(rows, w, dtype=torch.long, device=device) for kind, w in widths.items()},
            {kind: zeros.clone() for kind in kinds},
            # only slot 0 (position 0) is visible
            {kind: -torch.arange(w * bs, device=device).expand(rows, -1).contiguous() for kind, w in widths.items()},
            {kind: None for kind in kinds},
        )

    # ------------------------------------------------------------------ reads

    def resident(self, request: Request, kind: str) -> tuple[tuple[int, ...], int]:
        """(resident blocks, position of the first resident token) of the request in `kind`'s pool."""
        pool = self.store.pools[kind]
        rid = request.request_id
        return pool.page_table(rid), pool.first_block_index(rid) * self.block_size

    # ------------------------------------------------------------------ accounting

    def spare_blocks(self, kind: str) -> int:
        """Blocks of `kind` a new request could take now: free ones, and those only the prefix cache
        holds (it gives them up)."""
        spare = self.store.pools[kind].free_blocks
        if self.enable_prefix_caching:
            spare += self.store.prefix[kind].evictable_blocks
        return spare

    def cached_blocks(self) -> int:
        """Blocks held by nobody but the prefix cache (reclaimable), both kinds."""
        return sum(cache.evictable_blocks for cache in self.store.prefix.values())

    def pool_tokens(self) -> int:
        """Tokens the first pool holds (a request's whole length must fit in it without a KV budget)."""
        return self.store.pools[self.kinds[0]].total_blocks * self.block_size

    def check_step_fits(self, max_batch_tokens: int) -> None:
        """Every pool holds one step of max_batch_tokens beside a window (ValueError if not)."""
        bs = self.block_size
        need = math.ceil(max_batch_tokens / bs) + 1
        for kind, pool in self.store.pools.items():
            window = self.windows[kind] or 0
            if pool.total_blocks < need + math.ceil(window / bs) + 1:
                raise ValueError(
                    f"the {kind}-layer pool has {pool.total_blocks} blocks of {bs} tokens, too few for one step of "
                    f"max_batch_tokens={max_batch_tokens}; use more kv_blocks/sliding_blocks or a smaller "
                    "max_batch_tokens"
                )

    def sequences(self) -> set:
        """Every sequence id some pool holds."""
        return {seq for pool in self.store.pools.values() for seq in pool.sequences}

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
        return {kind: pool.allocated_blocks for kind, pool in self.store.pools.items()}

    def blocks_total(self) -> dict[str, int]:
        return {kind: pool.total_blocks for kind, pool in self.store.pools.items()}

    def clear_prefix_cache(self) -> None:
        for cache in self.store.prefix.values():
            cache.clear()

    def validate(self) -> None:
        """Every pool's and prefix cache's own consistency checks."""
        for kind, pool in self.store.pools.items():
            pool.validate()
            self.store.prefix[kind].validate()

    def all_free(self) -> bool:
        """No block held by anyone (prefix-cache pins included)."""
        return all(pool.free_blocks == pool.total_blocks for pool in self.store.pools.values())
