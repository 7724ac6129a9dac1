"""KV blocks for the engine's requests: one sequence per request in each layer kind's pool.

`KVManager` holds the `KVGroup`s of a `PagedKVStore` (one per layer kind: its layers, `PagedKVPool`,
`PrefixCache` and window rule, `gptoss_lite.kv.groups`) and keeps every request's sequences in step,
group by group. It holds block ids and counts, never a tensor: the store's tensors are the runner's
(`engine/runner.py`), which makes the step's copy-on-write copies and builds its batch from what the
scheduler hands it (`ScheduledBatch`: each request's block tables, the step's copies).

- `start(request)`: create the request's sequence in every pool, attached to the prompt's cached
  blocks when the prefix cache has them (the hit is the shorter of the two kinds' hits, so that every
  layer holds the same tokens); the request then starts computing at the hit.
- `allocate(request, n, copies)`: room for the next n tokens in every pool, or None with nothing
  changed; the copy-on-write copies it needs are added to `copies`. Blocks that left the window of
  every future query are released first (each group by its own rule); blocks only the prefix cache
  holds are evicted (least recently used) when a pool is short.
- `cache_prompt(request)`: pin the prompt's computed full blocks in the prefix cache. Called after
  every step, so a prompt prefilled in chunks is cached before the sliding layers release its
  leading blocks.
- `free(request)`: release everything the request holds (finish, abort, preemption).

Prefix-cache keys carry the request's scope (a tenant) and the engine's revision (the weights), so a
prefix cached for one tenant or one set of weights is never a hit for another.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gptoss_lite.kv.block_pool import AppendPlan
from gptoss_lite.kv.groups import KVGroup, attach_prefix, step_blocks
from gptoss_lite.kvspec import LayerKind, LayerKVSpec

if TYPE_CHECKING:  # annotations only: this module imports nothing that imports torch
    from gptoss_lite.engine.config import EngineConfig
    from gptoss_lite.engine.request import Request
    from gptoss_lite.kv.paged_cache import PagedKVStore

#: one copy-on-write copy: (layer kind, source block, destination block, slots [0, n) to copy)
BlockCopy = tuple[str, int, int, int]


class Sequenced(Protocol):
    """What the manager reads of a sequence's owner (a `Request`, or the draft model's own sequence
    of one, `engine/drafting.py`): its id, the position of its next query, its tokens and its prefix-
    cache scope."""

    @property
    def request_id(self) -> Hashable: ...
    @property
    def num_computed(self) -> int: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def scope(self) -> str: ...


@dataclass(frozen=True)
class KVUsage:
    """The pools at one moment, per layer kind: blocks held (by a request or the prefix cache), all
    blocks, and those only the prefix cache holds (reclaimable); and every sequence some pool holds."""

    blocks_used: dict[str, int]
    blocks_total: dict[str, int]
    blocks_cached: int
    sequences: frozenset[Hashable]

    @property
    def all_free(self) -> bool:
        """No block held by anyone (prefix-cache pins included)."""
        return not any(self.blocks_used.values())


class KVManager:
    """Per-request block allocation over the KV groups (module docstring). It deals in block ids and
    counts only: the device tensors are the runner's (`ModelRunner`, over the `PagedKVStore` whose
    groups these are), and the copies copy-on-write needs go to it in the step's `ScheduledBatch`.
    The engine's one door to the groups, pools and prefix caches: nothing else in `engine/` reads
    them (tests/test_import_graph.py checks it); the scheduler and the facade ask here."""

    def __init__(self, store: PagedKVStore, *, revision: str, enable_prefix_caching: bool = True) -> None:
        """Manage the blocks of `store`'s groups (its tensors stay the runner's: read here, never)."""
        groups = store.groups
        window = next((g.window for g in groups if g.name == LayerKind.FULL), None)
        if enable_prefix_caching and window is not None:
            # a window releases prompt blocks the prefix cache would need
            raise ValueError(
                f"the store's full-layer window of {window} keys releases prompt blocks the prefix "
                "cache would need; pass enable_prefix_caching=False"
            )
        self.groups: tuple[KVGroup, ...] = tuple(groups)
        self.block_size = self.groups[0].block_size
        self.revision = revision
        self.enable_prefix_caching = enable_prefix_caching
        self.evicted_blocks = 0
        self.lookups = self.lookup_tokens = self.hit_tokens = 0  # prefix-cache lookups by start()
        self._by_kind = {group.name: group for group in self.groups}
        # per request id: the prompt tokens its blocks have put in the prefix cache so far
        self._inserted: dict[Hashable, int] = {}

    # ------------------------------------------------------------------ lifetime

    def start(self, request: Sequenced) -> int:
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
        if source.request_id in self._inserted:  # the same blocks, already cached
            self._inserted[target.request_id] = self._inserted[source.request_id]

    def free(self, request: Sequenced) -> None:
        """Release the request's sequences in every pool (blocks the prefix cache pins stay cached)."""
        self._inserted.pop(request.request_id, None)  # a preempted request inserts again as it recomputes
        for group in self.groups:
            if request.request_id in group.pool:
                group.pool.release(request.request_id)

    def truncate(self, request: Sequenced, n_tokens: int) -> None:
        """Roll the request back to its first n_tokens in every pool (a rejected speculative draft)."""
        for group in self.groups:
            group.pool.truncate(request.request_id, n_tokens)

    # ------------------------------------------------------------------ allocation

    def allocate(self, request: Sequenced, n_tokens: int, copies: list[BlockCopy]) -> dict[str, AppendPlan] | None:
        """Append n_tokens to the request in every pool; None (nothing appended) if they do not fit even
        after evicting blocks only the prefix cache holds. Blocks that left the window of the next query
        are released first either way (they are never needed again). The copy-on-write copies the
        appends need go to the end of `copies`, in order: the runner makes them before the step's
        forward, and a later copy may write a block an earlier one read."""
        rid = request.request_id
        if n_tokens == 1 and all(self._in_place(group, rid, request.num_computed) for group in self.groups):
            # a decode token into room each pool already holds: the same plans as below, found faster
            return {group.name: group.pool.append_in_place(rid) for group in self.groups}
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
            copies.extend((group.name, src, dst, n) for src, dst, n in plan.copies)
        return plans

    def _in_place(self, group: KVGroup, rid: Hashable, num_computed: int) -> bool:
        """Whether the request's next token goes into room its last block in `group` has, with no block
        leaving the window first: then the general path would release nothing, evict nothing and
        copy nothing, and its plan is `append_in_place`'s."""
        return group.pool.has_room(rid, group.release_target(num_computed))

    def cache_prompt(self, request: Request) -> None:
        """Pin the computed full blocks of the prompt in every group's prefix cache. A no-op unless the
        step completed prompt blocks not inserted yet: hashing the prompt again on every decode step
        would cost O(prompt) per request per step."""
        if not self.enable_prefix_caching:
            return
        n = min(request.num_computed, len(request.prompt_token_ids))
        n -= n % self.block_size
        if n <= self._inserted.get(request.request_id, 0):
            return
        tokens = request.prompt_token_ids[:n]
        rid, scope = request.request_id, request.scope
        # Blocks a window released can be cached no more; if the cache evicted one of them under
        # pressure, the chain of hashes is broken there and nothing after it can be cached.
        if not all(group.chain_intact(rid, tokens, scope, self.revision) for group in self.groups):
            self._inserted[rid] = len(request.prompt_token_ids)  # broken for good: stop trying
            return
        for group in self.groups:
            group.prefix.insert(tokens, scope, self.revision, seq_id=rid)
        self._inserted[rid] = n

    # ------------------------------------------------------------------ admission arithmetic

    @property
    def kinds(self) -> tuple[str, ...]:
        """The layer kinds with a group (sliding and/or full)."""
        return tuple(self._by_kind)

    def prompt_blocks(self, kind: str, n_tokens: int, max_batch_tokens: int) -> int:
        """Blocks of `kind` a request needs to run n_tokens of prompt from scratch, max_batch_tokens a
        step (`KVGroup.prompt_blocks`: all of them, or at most a window plus one step)."""
        return self._by_kind[kind].prompt_blocks(n_tokens, max_batch_tokens)

    def growth_blocks(self, kind: str, tokens_left: int, reserve: int) -> int:
        """Blocks of `kind` the admission watermark keeps for a request's next decode tokens: up to
        `reserve` of the `tokens_left` it may still generate (`KVGroup.growth_blocks`: none on a
        windowed kind)."""
        return self._by_kind[kind].growth_blocks(tokens_left, reserve)

    def spare_blocks(self, kind: str) -> int:
        """Blocks of `kind` a new request could take now: free ones, and those only the prefix cache
        holds (it gives them up)."""
        group = self._by_kind[kind]
        spare = group.pool.free_blocks
        if self.enable_prefix_caching:
            spare += group.prefix.evictable_blocks
        return spare

    def check_step_fits(self, max_batch_tokens: int) -> None:
        """Every pool holds one step of max_batch_tokens beside a window (ValueError if not)."""
        for group in self.groups:
            if group.pool.total_blocks < group.min_blocks(max_batch_tokens):
                raise ValueError(
                    f"the {group.word} pool has {group.pool.total_blocks} blocks of {self.block_size} tokens, "
                    f"too few for one step of max_batch_tokens={max_batch_tokens}; use more kv_blocks/sliding_blocks "
                    "or a smaller max_batch_tokens"
                )

    # ------------------------------------------------------------------ the batch's block tables

    def tables(self, request: Sequenced) -> dict[str, tuple[tuple[int, ...], int]]:
        """Per layer kind: (the request's resident blocks, the position of its first resident token),
        what the runner's batch reads the request's keys through."""
        rid = request.request_id
        return {group.name: group.resident(rid) for group in self.groups}

    # ------------------------------------------------------------------ accounting

    def usage(self) -> KVUsage:
        return KVUsage(
            blocks_used={group.name: group.pool.allocated_blocks for group in self.groups},
            blocks_total={group.name: group.pool.total_blocks for group in self.groups},
            blocks_cached=sum(group.prefix.evictable_blocks for group in self.groups),
            sequences=frozenset(seq for group in self.groups for seq in group.pool.sequences),
        )

    def clear_prefix_cache(self) -> None:
        for group in self.groups:
            group.prefix.clear()

    def validate(self, live: set[Hashable]) -> None:
        """Every group's pool and prefix cache pass their own consistency checks, and every sequence a
        pool holds is one of the `live` request ids (AssertionError if not)."""
        for group in self.groups:
            group.validate()
        orphans = self.usage().sequences - live
        assert not orphans, f"pool sequences without a request: {sorted(map(str, orphans))}"


def pool_blocks(specs: Sequence[LayerKVSpec], cfg: EngineConfig, max_model_len: int) -> tuple[int, int]:
    """(full-layer, sliding-layer) pool blocks, each given by the config or sized here from the layers'
    specs. The full-layer pool: `kv_cache_bytes` over both pools (every layer's `block_bytes`), but no
    more than `max_running` requests of `max_model_len` tokens need (under a full-layer window, the
    window plus one step). The sliding pool: as large while the prefix cache is on (a cached prompt
    pins its sliding-layer blocks too); without it, what the running requests hold at once,
    ceil(W / bs) + 1 blocks each in decode plus the window and one chunk for a prefill. Either pool, sized
    here, holds at least one step beside its window (`step_blocks`, what `check_step_fits` asks) where
    the memory allows: a single request whose whole context is one step (max_running 1, max_batch_tokens
    = max_model_len) needs a block or two more than its tokens fill."""
    bs, running, step = cfg.block_size, cfg.max_running, cfg.step_tokens
    by_memory = cfg.kv_bytes // sum(spec.block_bytes(bs) for spec in specs)
    full = cfg.kv_blocks
    if full is None:
        window = cfg.full_window
        held = max_model_len if window is None else min(max_model_len, window + step)
        by_need = max(running * (math.ceil(held / bs) + (window is not None)), step_blocks(step, window, bs))
        full = max(1, min(by_memory, by_need))
    sliding = cfg.sliding_blocks
    if sliding is None:
        W = next((spec.window for spec in specs if spec.kind is LayerKind.SLIDING), None)
        if cfg.enable_prefix_caching or W is None:
            sliding = full
        else:
            need = min(full, running * (math.ceil(W / bs) + 1) + math.ceil((W + step) / bs) + 1)
            sliding = max(need, min(by_memory, step_blocks(step, W, bs)))
    return full, sliding
