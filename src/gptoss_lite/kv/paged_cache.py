"""Paged KV tensors driven by `PagedKVPool` bookkeeping, and a paged drop-in for MixedKVCache.

Layout. Every layer owns K and V tensors of shape (K, N, bs, D): for each KV head, N physical blocks
of bs token slots. Head-major, so the blocks of a table gathered with one `index_select` are already
the (K, S, D) keys attention multiplies, with no transposing copy (the batched engine's decode
attention is 1.7-4x faster this way than with token-major (N, bs, K, D) blocks). Block ids are not
per layer: **one pool per layer kind** hands them out, and a block id names the same slots in the
tensors of every layer of that kind. Each kind is a `KVGroup` (`gptoss_lite.kv.groups`: its layer
ids, pool, prefix cache and window rule; `store.groups`, or `store.group(kind)`):

- The full layers are a `FullGroup` (`store.group(FULL).pool`): they see every token, so their page
  tables are identical.
- The sliding layers are a `SlidingGroup` (`store.group(SLIDING).pool`): every sliding layer has the
  same window W (`config.sliding_window`) and sees the same positions, so their page tables are
  identical too; the group releases a sequence's leading blocks once they fall outside the window
  (`release_window`), which is why it cannot share a table with the full-layer pool.

(FULL and SLIDING are the layer kinds of `gptoss_lite.config`, and the groups' names. `store.pools`,
`store.prefix` and `store.layers_of` are read-only views of the groups by kind.)

So a decode step costs one `append` per kind per sequence, not one per layer, and a prefix hit
shares a block across all layers of a kind at once.

`PagedKVCache` is the cache the model calls (the `KVCache` protocol of `gptoss_lite.kv.base`), for a
batch of pool sequences (one per row). A forward pass is a *step*: the first `update` at a new
`start_pos` preflights both pools for the whole batch (raising `PoolExhaustedError` with nothing
changed), releases sliding-layer blocks that fell out of the window, appends the new tokens in both
pools and applies copy-on-write copies; every layer then writes its K/V into the planned slots and
gathers what its queries need.

Window release is lazy: at the start of a step at `start_pos`, sliding-layer blocks whose every slot is before
`start_pos - W + 1 - rollback_tokens` are released. A decode step therefore holds at most
`ceil(W / bs) + 1` sliding-layer blocks per sequence (with `rollback_tokens=0`), and after a one-chunk
prefill nothing has been released yet, which is what lets a prompt be inserted into the prefix
cache (below).

Prefix caching (docs/paged.md#prefix-caching). Each group keeps one `PrefixCache` over its pool,
keyed by the same chained hashes. A sliding layer at position N needs the K/V of the W - 1 tokens
before N, and those cannot be recomputed without the sliding-layer K/V before *them* (and so on back
to 0), so a sliding-layer hit must come from stored blocks as well: `insert_prefix` pins the prompt's
full blocks in *both* pools (so cached prompts cost sliding-layer memory too, until evicted), and
`from_prefix` attaches a sequence to the cached blocks of both pools, the hit being the shorter of
the two; the sliding-layer pool then drops the leading shared blocks on its first append.
`insert_prefix` therefore requires that the sliding-layer sequence has released nothing yet (prefill in one chunk, or
insert before the prompt outgrows the window).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType

import torch

from gptoss_lite.config import FULL, SLIDING, ModelConfig
from gptoss_lite.kv.base import KVRead, RollbackKVCache, check_rollback, rollback_floor
from gptoss_lite.kv.block_pool import DEFAULT_BLOCK_SIZE, PagedKVPool, PoolExhaustedError
from gptoss_lite.kv.groups import FullGroup, KVGroup, SlidingGroup, attach_prefix
from gptoss_lite.kv.prefix import PrefixCache
from gptoss_lite.validation import check_int


class PagedKVStore:
    """Per-layer K/V block tensors (K, N, bs, D) plus one `KVGroup` per layer kind (its layers, pool,
    prefix cache and window: `gptoss_lite.kv.groups`).

    `total_blocks` sizes the full-layer pool, `sliding_blocks` the sliding-layer pool (default: the
    same). `full_window` N gives the full layers a window of their last N keys
    (docs/engine.md#full-layer-window; the batched engine reads it, `PagedKVCache` refuses it).
    """

    def __init__(
        self,
        config: ModelConfig,
        total_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        sliding_blocks: int | None = None,
        full_window: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        total_blocks = check_int("total_blocks", total_blocks, minimum=0)
        if sliding_blocks is None:
            sliding_blocks = total_blocks
        sliding_blocks = check_int("sliding_blocks", sliding_blocks, minimum=0)
        if full_window is not None and not config.full_layers:
            raise ValueError(f"full_window={full_window}: the model has no full layers")
        self.config = config
        self.block_size = block_size
        self.dtype, self.device = dtype, torch.device(device)
        groups: list[KVGroup] = []
        if config.full_layers:
            groups.append(FullGroup(config.full_layers, total_blocks, block_size, full_window))
        if config.sliding_layers:
            groups.append(SlidingGroup(config.sliding_layers, sliding_blocks, block_size, config.sliding_window))
        self.groups: tuple[KVGroup, ...] = tuple(groups)
        self._by_kind = {group.name: group for group in self.groups}
        # read-only views by kind, for callers that index pools or prefix caches directly
        self._pools = MappingProxyType({group.name: group.pool for group in self.groups})
        self._prefix = MappingProxyType({group.name: group.prefix for group in self.groups})
        self._layers_of = MappingProxyType({group.name: group.layers for group in self.groups})
        K, D = config.n_kv_heads, config.head_dim
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for layer in range(config.n_layers):
            group = self.group_of(layer)
            blocks = group.pool.total_blocks if group.name in self.dense_kinds else 0
            shape = (K, blocks, block_size, D)  # (K, N, bs, D)
            self.k.append(torch.zeros(shape, dtype=dtype, device=self.device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=self.device))

    #: layer kinds whose blocks are the dense (K, N, bs, D) tensors `k` / `v` (a subclass may store a
    #: kind another way and leave its tensors empty)
    dense_kinds: frozenset[str] = frozenset((FULL, SLIDING))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The layer kinds with a group (full first)."""
        return tuple(self._by_kind)

    def group(self, kind: str) -> KVGroup:
        """The group of layer kind `kind` (FULL or SLIDING)."""
        try:
            return self._by_kind[kind]
        except KeyError:
            raise ValueError(f"no {kind!r} layers in this store; its kinds are {self.kinds}") from None

    def group_of(self, layer: int) -> KVGroup:
        """The group `layer` belongs to."""
        return self._by_kind[self.kind(layer)]

    @property
    def pools(self) -> Mapping[str, PagedKVPool]:
        """{kind: the group's pool}, read-only (the groups own them)."""
        return self._pools

    @property
    def prefix(self) -> Mapping[str, PrefixCache]:
        """{kind: the group's prefix cache}, read-only (the groups own them)."""
        return self._prefix

    @property
    def layers_of(self) -> Mapping[str, tuple[int, ...]]:
        """{kind: the group's layer ids}, read-only."""
        return self._layers_of

    @property
    def full_window(self) -> int | None:
        """The full layers' window (None: they keep every key)."""
        return self._by_kind[FULL].window if FULL in self._by_kind else None

    def kind(self, layer: int) -> str:
        """SLIDING for a sliding layer, FULL otherwise."""
        return SLIDING if self.config.is_sliding(layer) else FULL

    def pool(self, layer: int) -> PagedKVPool:
        """The pool whose page tables index `layer`'s tensors."""
        return self.group_of(layer).pool

    def apply_copies(self, kind: str, copies: Sequence[tuple[int, int, int]]) -> None:
        """Copy-on-write: slots [0, n) of block src -> dst, in every layer of `kind`."""
        for src, dst, n in copies:
            for layer in self.group(kind).layers:
                self.k[layer][:, dst, :n] = self.k[layer][:, src, :n]
                self.v[layer][:, dst, :n] = self.v[layer][:, src, :n]

    def write(self, layer: int, blocks: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write token i's k[:, i], v[:, i] (K, N_tok, D) into (blocks[i], slots[i]) of `layer`."""
        self.k[layer][:, blocks, slots] = k
        self.v[layer][:, blocks, slots] = v

    def gather(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's resident K and V in `layer`, chronological, each (K, n, D).

        n counts resident tokens: the whole sequence on a full layer; on a sliding layer the
        tokens from `first_block_index * block_size` on.
        """
        pool = self.pool(layer)
        table = torch.tensor(pool.page_table(seq_id), dtype=torch.long, device=self.device)
        n = pool.num_tokens(seq_id) - pool.first_block_index(seq_id) * self.block_size
        K, D = self.config.n_kv_heads, self.config.head_dim
        keys = self.k[layer].index_select(1, table).view(K, -1, D)[:, :n]  # (K, n, D)
        values = self.v[layer].index_select(1, table).view(K, -1, D)[:, :n]
        return keys, values

    def block_bytes(self, kind: str) -> int:
        """Bytes of one block id across every layer of `kind`, K and V."""
        K, D = self.config.n_kv_heads, self.config.head_dim
        per_layer = 2 * self.block_size * K * D * torch.empty((), dtype=self.dtype).element_size()
        return per_layer * len(self.group(kind).layers)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for every layer's block tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class _Step:
    """One forward pass's plan: where each layer writes and which blocks each layer reads."""

    def __init__(self, start_pos: int, T: int) -> None:
        self.start_pos, self.T = start_pos, T
        self.write_at: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # kind -> (blocks, slots)
        self.read: dict[str, tuple[torch.Tensor, int]] = {}  # kind -> (table (B, nb), first token)


class PagedKVCache(RollbackKVCache):
    """A batch of pool sequences behind the `KVCache` protocol, like MixedKVCache.

    Row b of the batch is sequence `seq_ids[b]` in every pool of `store`. `rollback_tokens` keeps
    that many extra tokens before each sliding layer's window, so `truncate` can go back at least
    that far (plus the last step's tokens).
    """

    def __init__(
        self,
        config: ModelConfig,
        store: PagedKVStore,
        seq_ids: Sequence[Hashable],
        *,
        rollback_tokens: int = 0,
        _attached: bool = False,
    ) -> None:
        if not isinstance(store, PagedKVStore):
            raise TypeError(f"store: expected a PagedKVStore, got {type(store).__name__}")
        if config != store.config:
            raise ValueError("config differs from the store's; build the store with this config")
        seq_ids = tuple(seq_ids)
        if not seq_ids:
            raise ValueError("seq_ids: empty; give one sequence id per batch row")
        for s in seq_ids:
            hash(s)  # unhashable ids raise TypeError here, before anything is created
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids={seq_ids}: duplicate ids; one distinct id per batch row")
        if store.full_window is not None:
            raise ValueError(
                f"store has a full-layer window of {store.full_window} keys, which PagedKVCache does not apply "
                "(the model's full layers would attend to released keys); build the store without full_window"
            )
        if not _attached:
            for group in store.groups:
                taken = [s for s in seq_ids if s in group.pool]
                if taken:
                    raise ValueError(
                        f"seq_ids {taken}: already live in the {group.word} pool; release them or pick new ids"
                    )
            for group in store.groups:
                for s in seq_ids:
                    group.pool.create(s)
        self.config, self.store, self.seq_ids = config, store, seq_ids
        self.rollback_tokens = check_int("rollback_tokens", rollback_tokens, minimum=0)
        self._batch_size = len(seq_ids)
        self._num_tokens = self._pool_num_tokens()
        self._layer_tokens = [self._num_tokens] * config.n_layers  # per layer: tokens written so far
        self._step: _Step | None = None
        self._closed = False

    def _pool_num_tokens(self) -> int:
        lengths = {group.pool.num_tokens(s) for group in self.store.groups for s in self.seq_ids}
        assert len(lengths) == 1, f"batch rows disagree on length: {lengths}"
        return lengths.pop()

    # ------------------------------------------------------------------ prefix sharing

    @classmethod
    def from_prefix(
        cls,
        config: ModelConfig,
        store: PagedKVStore,
        seq_ids: Sequence[Hashable],
        prompts: Sequence[Sequence[int]],
        scope: str,
        revision: str,
        *,
        rollback_tokens: int = 0,
    ) -> tuple[PagedKVCache, int]:
        """A cache whose rows start with the prompts' cached blocks, shared in every pool.

        Returns (cache, n): the first n tokens of every prompt are cached (the same n for every
        row: the shortest hit over rows and pools, a block multiple, and below every prompt's
        length, since a prefix cache leaves the last token to run for the logits that start
        generation); run the model on `prompt[n:]` at `start_pos=n`, or pass the cache and the
        whole prompts to `generate()`. Each pool's prefix cache records one request per row.
        """
        seq_ids = tuple(seq_ids)
        if len(prompts) != len(seq_ids):
            raise ValueError(f"prompts: {len(prompts)} prompts for {len(seq_ids)} seq_ids; give one prompt per row")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids={seq_ids}: duplicate ids; one distinct id per batch row")
        for group in store.groups:
            if any(s in group.pool for s in seq_ids):
                raise ValueError(f"seq_ids {seq_ids}: some are already live in the {group.word} pool")
        n = min(attach_prefix(store.groups, s, p, scope, revision) for s, p in zip(seq_ids, prompts))
        for group in store.groups:
            for s in seq_ids:
                group.pool.truncate(s, n)  # a longer hit in one row is cut back to the common one
        return cls(config, store, seq_ids, rollback_tokens=rollback_tokens, _attached=True), n

    def insert_prefix(self, prompts: Sequence[Sequence[int]], scope: str, revision: str) -> int:
        """Cache each row's prompt (its full blocks, in every pool); return blocks newly cached.

        Call after the prompt's prefill and before the sliding layers release any block (the
        first decode steps past the window); otherwise raises ValueError, nothing cached.
        """
        if len(prompts) != self.batch_size:
            raise ValueError(f"prompts: {len(prompts)} prompts for batch size {self.batch_size}")
        if self._step is not None and any(w != self._num_tokens for w in self._layer_tokens):
            raise ValueError("insert_prefix: a forward pass is in progress; finish it first")
        for s, p in zip(self.seq_ids, prompts):
            if len(p) > self._num_tokens:
                raise ValueError(
                    f"prompt of {len(p)} tokens but the cache holds {self._num_tokens}; prefill the prompt first"
                )
            for group in self.store.groups:
                if group.released_tokens(s):
                    raise ValueError(
                        f"seq {s!r}: its {group.word} pool already released leading blocks, "
                        "so the prompt cannot be cached; insert right after prefill "
                        "(prefill in one chunk)"
                    )
        return sum(
            group.prefix.insert(p, scope, revision, seq_id=s)
            for group in self.store.groups
            for s, p in zip(self.seq_ids, prompts)
        )

    def fork(self, new_seq_ids: Sequence[Hashable]) -> PagedKVCache:
        """A cache whose row b shares every block of row b here (copy-on-write on append)."""
        new_seq_ids = tuple(new_seq_ids)
        if len(new_seq_ids) != self.batch_size:
            raise ValueError(f"new_seq_ids: {len(new_seq_ids)} ids for batch size {self.batch_size}")
        if self._step is not None and any(w != self._num_tokens for w in self._layer_tokens):
            raise ValueError("fork: a forward pass is in progress; finish it first")
        for group in self.store.groups:
            if len(set(new_seq_ids)) != len(new_seq_ids) or any(s in group.pool for s in new_seq_ids):
                raise ValueError(f"new_seq_ids={new_seq_ids}: duplicate or already live in the {group.word} pool")
        for group in self.store.groups:
            for src, dst in zip(self.seq_ids, new_seq_ids):
                group.pool.share_prefix(src, dst, self._num_tokens)
        child = PagedKVCache(self.config, self.store, new_seq_ids, rollback_tokens=self.rollback_tokens, _attached=True)
        return child

    # ------------------------------------------------------------------ the model's interface

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def num_tokens(self) -> int:
        """Tokens held per row: the absolute position of the next token."""
        return self._num_tokens

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> KVRead:
        """Store new rotated K/V (B, K, T, D) of `layer`; return the dense read the `KVCache` protocol
        says, chronological.

        Full layers: every key (first = 0). Sliding layers: the resident blocks from the one that
        holds position start_pos - W + 1, so first is that block's first position.
        """
        if self._closed:
            raise ValueError("cache is closed; build a new PagedKVCache")
        B, K, T, D = k.shape
        expected = (self.batch_size, self.config.n_kv_heads, T, self.config.head_dim)
        if k.dim() != 4 or tuple(k.shape) != expected or v.shape != k.shape or T < 1:
            raise ValueError(
                f"KV append: got k {tuple(k.shape)}, v {tuple(v.shape)}; expected "
                f"(B, K, T, D) = {expected[:2] + ('T>=1',) + expected[3:]} for both"
            )
        if k.dtype != self.store.dtype or k.device != self.store.device:
            raise ValueError(
                f"KV append: dtype/device {k.dtype}/{k.device} differs from the "
                f"store's {self.store.dtype}/{self.store.device}"
            )
        if start_pos != self._layer_tokens[layer]:
            raise ValueError(
                f"layer {layer}: start_pos={start_pos} but the cache holds "
                f"{self._layer_tokens[layer]} tokens for it; positions must continue "
                "where the cache ends"
            )
        step = self._step
        if step is None or step.start_pos != start_pos:
            if start_pos != self._num_tokens or any(w != self._num_tokens for w in self._layer_tokens):
                raise ValueError(
                    f"layer {layer}: start_pos={start_pos} starts a new step but the "
                    f"previous one is unfinished (written per layer: {self._layer_tokens})"
                )
            step = self._begin_step(start_pos, T)
        elif step.T != T:
            raise ValueError(f"layer {layer}: {T} new tokens but this step appends {step.T}")
        kind = self.store.kind(layer)
        blocks, slots = step.write_at[kind]
        self.store.write(
            layer, blocks, slots, k.transpose(0, 1).reshape(K, B * T, D), v.transpose(0, 1).reshape(K, B * T, D)
        )
        self._layer_tokens[layer] = start_pos + T
        table, first = step.read[kind]
        S = start_pos + T - first
        rows = table.view(-1)
        keys = self.store.k[layer].index_select(1, rows).view(K, B, -1, D)[:, :, :S].transpose(0, 1)  # (B, K, S, D)
        values = self.store.v[layer].index_select(1, rows).view(K, B, -1, D)[:, :, :S].transpose(0, 1)
        return KVRead.dense(keys, values, first)

    def _begin_step(self, start_pos: int, T: int) -> _Step:
        """Preflight every pool for the batch, then release, append, copy; plan writes and reads."""
        bs = self.store.block_size
        slack = self.rollback_tokens
        for group in self.store.groups:
            pool = group.pool
            needed = sum(pool.blocks_needed(s, T) for s in self.seq_ids)
            # blocks the window release is sure to free (held by this row alone)
            freed = sum(group.releasable_blocks(s, start_pos, slack=slack) for s in self.seq_ids)
            if needed > pool.free_blocks + freed:
                raise PoolExhaustedError(
                    f"step at position {start_pos} (+{T} tokens x {self.batch_size} rows) needs {needed} "
                    f"free blocks in the {group.word} pool but {pool.free_blocks} are free (+{freed} the "
                    "window would release); release or truncate sequences, evict prefix-cache "
                    "blocks, or use a larger store. The cache is unchanged"
                )
        step = _Step(start_pos, T)
        dev = self.store.device
        for group in self.store.groups:
            kind, pool = group.name, group.pool
            blocks: list[int] = []
            slots: list[int] = []
            for s in self.seq_ids:
                group.release_window(s, start_pos, slack=slack)
                plan = pool.append(s, T)
                self.store.apply_copies(kind, plan.copies)
                for b, slot in plan.slots:
                    blocks.append(b)
                    slots.append(slot)
            step.write_at[kind] = (
                torch.tensor(blocks, dtype=torch.long, device=dev),
                torch.tensor(slots, dtype=torch.long, device=dev),
            )
            # Reads: from the block holding the window's first key (all blocks without a window).
            first_block = group.window_start(start_pos) // bs
            rows = []
            for s in self.seq_ids:
                skip = first_block - pool.first_block_index(s)
                assert skip >= 0, f"seq {s!r}: window start block {first_block} was released"
                rows.append(pool.page_table(s)[skip:])
            step.read[kind] = (torch.tensor(rows, dtype=torch.long, device=dev), first_block * bs)
        self._step = step
        self._num_tokens = start_pos + T
        return step

    # ------------------------------------------------------------------ rollback and lifetime

    def rollback_floor(self) -> int:
        """Lowest position `truncate` accepts now: the retained interval is [this, num_tokens]."""
        floors = [
            rollback_floor(max(group.released_tokens(s) for s in self.seq_ids), group.window)
            for group in self.store.groups
            if group.window is not None
        ]
        return max(floors, default=0)

    def truncate(self, position: int) -> None:
        """Roll every row back to `position` tokens (speculative-decoding rejection, docs/paged.md#rollback).

        Allowed when rollback_floor() <= position <= self.num_tokens: every key the next query at
        `position` needs is still resident (its window start not before a sliding layer's released
        blocks); the same rule as MixedKVCache (`gptoss_lite.kv.base.check_rollback`).
        Also recovers from a forward pass that raised half way.
        """
        position = check_int("position", position, minimum=0)
        check_rollback(position, self._num_tokens, self.rollback_floor(), self.config.sliding_window)
        for group in self.store.groups:
            for s in self.seq_ids:
                group.pool.truncate(s, position)
        self._num_tokens = position
        self._layer_tokens = [position] * self.config.n_layers
        self._step = None

    def reset(self) -> None:
        """Release every row's blocks and start the same ids over, empty (position 0)."""
        self._release_all()
        for group in self.store.groups:
            for s in self.seq_ids:
                group.pool.create(s)
        self._closed = False

    def close(self) -> None:
        """Release every row's blocks for good; the ids become free for reuse."""
        self._release_all()
        self._closed = True

    def _release_all(self) -> None:
        if not self._closed:
            for group in self.store.groups:
                for s in self.seq_ids:
                    group.pool.release(s)
        self._num_tokens = 0
        self._layer_tokens = [0] * self.config.n_layers
        self._step = None

    # ------------------------------------------------------------------ byte accounting

    @property
    def nbytes(self) -> int:
        """Bytes of the distinct blocks this cache's rows hold, across layers (capacity)."""
        if self._closed:
            return 0
        total = 0
        for group in self.store.groups:
            held = {b for s in self.seq_ids for b in group.pool.page_table(s)}
            total += len(held) * self.store.block_bytes(group.name)
        return total

    @property
    def payload_bytes(self) -> int:
        """Bytes of resident K and V across layers, rows counted separately (shared or not)."""
        if self._closed:
            return 0
        bs = self.store.block_size
        total = 0
        for group in self.store.groups:
            tokens = sum(group.pool.num_tokens(s) - group.released_tokens(s) for s in self.seq_ids)
            total += tokens * self.store.block_bytes(group.name) // bs
        return total
