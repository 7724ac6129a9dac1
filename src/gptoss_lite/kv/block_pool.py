"""Paged KV block pool: the tensor-free bookkeeping half (docs/paged.md: block pool, rollback).

A pool of `total_blocks` physical blocks of `block_size` token slots. Each sequence owns a page
table (block ids in token order); blocks are reference counted so a forked sequence can share its
parent's prefix, and a shared, partially filled last block is copied before anyone writes into it.
No tensors live here: `append` returns an `AppendPlan` saying which block copies to perform and
which (block, slot) each new token goes to, so a tensor store can mirror the pool exactly.

Holders of a block. A block's reference count is the number of page tables holding it plus its
*pins* (`retain` / `release_block`), which is how a prefix cache keeps finished blocks alive
(see `gptoss_lite.kv.prefix`). Only full blocks can be pinned. Every pin has an *owner* (any
hashable; `None` for a caller that passes none): `release_block(b, owner)` drops only a pin that
`owner` took, so nobody can release a prefix cache's pin behind its back and recycle a block the
cache still hands out.

Sliding-window layers. `release_before(seq_id, token_index)` (or `drop_leading_blocks`) releases
leading blocks whose every slot lies before `token_index`; the sequence keeps its logical length
and remembers how many leading blocks it dropped (`first_block_index`). `page_table` returns the
resident blocks only, so position `p` lives in
`page_table(s)[p // block_size - first_block_index(s)]`.
Dropped tokens cannot come back: `truncate` below the dropped point is rejected (docs/paged.md#rollback).

Accounting (all in tokens = slots):
  physical_capacity_tokens = allocated_blocks * block_size
  physical_payload_tokens  = for each block held by >= 1 sequence, the largest fill any sequence
                             has in it (docs/paged.md#block-pool)
  cache_only_tokens        = block_size * blocks held only by pins (full, reusable, read by nobody)
  internal_waste_tokens    = capacity - payload - cache_only (slots no holder has filled)
  logical_tokens           = sum over sequences of their *resident* tokens
                             (num_tokens - first_block_index * block_size); dropped tokens hold no
                             memory, so they count in `num_tokens` but not here
  sharing_savings_tokens   = logical - payload
Without pins and dropped blocks these are exactly the docs/paged.md#block-pool figures.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gptoss_lite.validation import check_int

DEFAULT_BLOCK_SIZE = 16  # token slots per block; docs/paged.md#block-pool default (vLLM's default too)


class PoolExhaustedError(MemoryError):
    """The free blocks cannot cover an allocation; the pool was left exactly as it was."""


@dataclass(frozen=True)
class AppendPlan:
    """What one `PagedKVPool.append` did, for a tensor store to mirror.

    Apply `copies` first — each `(src_block, dst_block, n_slots)` copies slots `[0, n_slots)` of
    `src_block` into `dst_block` (copy-on-write) — then write new token `i` of the append into
    `slots[i] = (block_id, slot)`. `new_blocks` lists the blocks taken from the free list, in
    allocation order (a copy-on-write destination comes first).
    """

    copies: tuple[tuple[int, int, int], ...]
    slots: tuple[tuple[int, int], ...]
    new_blocks: tuple[int, ...]

    @property
    def n_tokens(self) -> int:
        """Number of tokens written by the append."""
        return len(self.slots)


@dataclass
class _Sequence:
    num_tokens: int = 0  # logical tokens, including dropped leading blocks
    first_block_index: int = 0  # leading blocks released by a sliding window
    table: list[int] = field(default_factory=list)  # resident blocks, absolute index first+j


_ALL = object()  # pins(block): every owner's pins


def _check_owner(owner: Any) -> None:
    try:
        hash(owner)
    except TypeError:
        raise TypeError(
            f"owner={owner!r}: unhashable {type(owner).__name__}; use the pinning object itself, an int or a str"
        ) from None


def _owner_name(owner: Any) -> str:
    return "None (no owner given)" if owner is None else repr(owner)


def _check_hashable(seq_id: Any) -> None:
    """Raise TypeError if `seq_id` cannot be a dict key."""
    try:
        hash(seq_id)
    except TypeError:
        raise TypeError(f"seq_id={seq_id!r}: unhashable {type(seq_id).__name__}; use an int or str id") from None


class PagedKVPool:
    """Reference-counted pool of fixed-size KV blocks with per-sequence page tables (docs/paged.md#block-pool).

    Every mutating method validates all of its arguments before changing anything, so a call that
    raises leaves `snapshot()` identical.
    """

    def __init__(self, total_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        total_blocks = check_int("total_blocks", total_blocks, 1)
        block_size = check_int("block_size", block_size, 1)
        self.total_blocks = total_blocks
        self.block_size = block_size
        # Stack: the top is the end of the list, so block 0 is handed out first.
        self._free: list[int] = list(range(total_blocks - 1, -1, -1))
        self._refs: list[int] = [0] * total_blocks
        # block -> {owner: pins that owner holds on it}; an owner with no pins has no entry
        self._pins: list[dict[Hashable, int]] = [{} for _ in range(total_blocks)]
        # block -> {seq_id: absolute block index in that sequence}
        self._holders: list[dict[Hashable, int]] = [{} for _ in range(total_blocks)]
        self._seqs: dict[Hashable, _Sequence] = {}
        self._names: set[str] = set()  # str(seq_id) of live sequences, keeps snapshot() lossless

    # ------------------------------------------------------------------ validation helpers

    def _seq(self, seq_id: Any) -> _Sequence:
        _check_hashable(seq_id)
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"seq_id={seq_id!r}: unknown sequence; create() it first ({len(self._seqs)} live sequences)")
        return seq

    def _check_new_id(self, seq_id: Any) -> None:
        _check_hashable(seq_id)
        if seq_id in self._seqs:
            raise ValueError(f"seq_id={seq_id!r}: already exists; release() it first or pick a new id")
        if str(seq_id) in self._names:
            raise ValueError(
                f"seq_id={seq_id!r}: str(seq_id) collides with a live sequence's "
                "id in snapshot(); pick an id with a distinct str()"
            )

    def _check_block(self, block_id: Any) -> int:
        block_id = check_int("block_id", block_id, 0)
        if block_id >= self.total_blocks:
            raise ValueError(f"block_id={block_id}: must be < total_blocks={self.total_blocks}")
        return block_id

    # ------------------------------------------------------------------ internal mutation

    def _view(self, seq_id: Hashable, index: int) -> int:
        """Slots of absolute block `index` that sequence `seq_id` has filled."""
        return min(self.block_size, self._seqs[seq_id].num_tokens - index * self.block_size)

    def _pop_free(self) -> int:
        block = self._free.pop()
        assert self._refs[block] == 0, f"free block {block} has refcount {self._refs[block]}"
        return block

    def _attach(self, block: int, seq_id: Hashable, index: int) -> None:
        self._refs[block] += 1
        self._holders[block][seq_id] = index

    def _detach(self, block: int, seq_id: Hashable, freed: list[int]) -> None:
        del self._holders[block][seq_id]
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
            freed.append(block)

    # ------------------------------------------------------------------ sequences

    def create(self, seq_id: Hashable, blocks: Iterable[int] = ()) -> None:
        """Start an empty sequence, or one whose page table is the given *full* `blocks`.

        With `blocks`, the sequence's length is `len(blocks) * block_size` and each block's
        reference count rises by one (this is how a prefix-cache hit shares cached blocks).
        """
        self._check_new_id(seq_id)
        blocks = tuple(blocks)
        checked = [self._check_block(b) for b in blocks]
        if len(set(checked)) != len(checked):
            raise ValueError(f"blocks={blocks}: a block appears twice; a page table holds each block at most once")
        for b in checked:
            if self._refs[b] == 0:
                raise ValueError(f"block {b} is free; only allocated blocks can be shared")
            if self._fill(b) != self.block_size:
                raise ValueError(
                    f"block {b} has {self._fill(b)}/{self.block_size} slots filled; "
                    "only full blocks can start a sequence"
                )
        seq = _Sequence(num_tokens=len(checked) * self.block_size, table=list(checked))
        self._seqs[seq_id] = seq
        self._names.add(str(seq_id))
        for i, b in enumerate(checked):
            self._attach(b, seq_id, i)

    def blocks_needed(self, seq_id: Hashable, n_tokens: int) -> int:
        """Free blocks `append(seq_id, n_tokens)` would take, copy-on-write block included."""
        seq = self._seq(seq_id)
        n_tokens = check_int("n_tokens", n_tokens, 0)
        return self._blocks_needed(seq, n_tokens)[0]

    def _blocks_needed(self, seq: _Sequence, n_tokens: int) -> tuple[int, bool]:
        if n_tokens == 0:
            return 0, False
        used = seq.num_tokens % self.block_size  # slots of the last block this sequence has filled
        cow = used != 0 and self._refs[seq.table[-1]] > 1
        room = self.block_size - used if used else 0
        rest = max(0, n_tokens - room)
        return int(cow) + -(-rest // self.block_size), cow

    def append(self, seq_id: Hashable, n_tokens: int) -> AppendPlan:
        """Grow a sequence by `n_tokens`; raise PoolExhaustedError (pool unchanged) if it can't fit.

        A shared, partially filled last block is first replaced by a private copy of this
        sequence's filled slots (copy-on-write); full shared blocks are never copied.
        """
        seq = self._seq(seq_id)
        n_tokens = check_int("n_tokens", n_tokens, 0)
        needed, cow = self._blocks_needed(seq, n_tokens)
        if needed > len(self._free):
            raise PoolExhaustedError(
                f"append({seq_id!r}, {n_tokens}) needs {needed} free blocks "
                f"({int(cow)} copy-on-write) but only {len(self._free)} of {self.total_blocks} "
                "are free; release or truncate sequences, evict cached blocks, or use a larger "
                "pool"
            )
        bs = self.block_size
        copies: list[tuple[int, int, int]] = []
        new_blocks: list[int] = []
        if cow:
            old = seq.table[-1]
            dst = self._pop_free()
            index = seq.first_block_index + len(seq.table) - 1
            self._detach(old, seq_id, [])  # still held by someone else, so never freed here
            seq.table[-1] = dst
            self._attach(dst, seq_id, index)
            copies.append((old, dst, seq.num_tokens % bs))
            new_blocks.append(dst)
        slots: list[tuple[int, int]] = []
        pos = seq.num_tokens
        for _ in range(n_tokens):
            if pos % bs == 0:
                block = self._pop_free()
                self._attach(block, seq_id, pos // bs)
                seq.table.append(block)
                new_blocks.append(block)
            slots.append((seq.table[-1], pos % bs))
            pos += 1
        seq.num_tokens = pos
        return AppendPlan(copies=tuple(copies), slots=tuple(slots), new_blocks=tuple(new_blocks))

    def has_room(self, seq_id: Hashable, keep_from: int = 0) -> bool:
        """Whether the sequence's next token fits in its own last block: a partly filled block no one
        else holds, so `append_in_place` takes no block and copies none; and no block lies wholly before
        token `keep_from` (`release_before(seq_id, keep_from)` would release nothing)."""
        seq = self._seq(seq_id)
        return (
            seq.num_tokens % self.block_size != 0
            and self._refs[seq.table[-1]] == 1
            and keep_from // self.block_size <= seq.first_block_index
        )

    def append_in_place(self, seq_id: Hashable) -> AppendPlan:
        """`append(seq_id, 1)` where `has_room` holds (checked again): one slot of the last block, the
        plan without the general path's block arithmetic (the engine's decode step asks this of every
        request in every pool)."""
        if not self.has_room(seq_id):
            raise ValueError(f"append_in_place({seq_id!r}): its last block is full or shared; use append()")
        seq = self._seqs[seq_id]
        slot = seq.num_tokens % self.block_size
        seq.num_tokens += 1
        return AppendPlan(copies=(), slots=((seq.table[-1], slot),), new_blocks=())

    def share_prefix(self, source_id: Hashable, target_id: Hashable, prefix_tokens: int) -> None:
        """Create `target_id` whose first `prefix_tokens` tokens are `source_id`'s, sharing blocks.

        The target references every source block covering the prefix, a partially covered one
        included (copy-on-write happens later, on append). A source with dropped leading blocks
        can only share a prefix reaching past its dropped point; the target inherits that point.
        """
        source = self._seq(source_id)
        self._check_new_id(target_id)
        prefix_tokens = check_int("prefix_tokens", prefix_tokens, 0)
        if prefix_tokens > source.num_tokens:
            raise ValueError(
                f"prefix_tokens={prefix_tokens}: longer than source {source_id!r} "
                f"(num_tokens {source.num_tokens}); share at most that many"
            )
        start = source.first_block_index * self.block_size
        if 0 < prefix_tokens < start:
            raise ValueError(
                f"prefix_tokens={prefix_tokens}: source {source_id!r} released "
                f"tokens before {start} (sliding window); share 0 or >= {start}"
            )
        first = source.first_block_index if prefix_tokens else 0
        n_blocks = -(-prefix_tokens // self.block_size) - first
        target = _Sequence(num_tokens=prefix_tokens, first_block_index=first, table=source.table[:n_blocks])
        self._seqs[target_id] = target
        self._names.add(str(target_id))
        for j, b in enumerate(target.table):
            self._attach(b, target_id, first + j)

    def release(self, seq_id: Hashable) -> tuple[int, ...]:
        """Drop a sequence; its blocks are released in page-table order. Returns freed blocks."""
        seq = self._seq(seq_id)
        freed: list[int] = []
        for b in seq.table:
            self._detach(b, seq_id, freed)
        del self._seqs[seq_id]
        self._names.discard(str(seq_id))
        return tuple(freed)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> tuple[int, ...]:
        """Roll back to `num_tokens` tokens (docs/paged.md#rollback); blocks past the new end are released.

        Allowed only inside the retained interval `[first_block_index * block_size, num_tokens]`.
        Returns the blocks that went back to the free list.
        """
        seq = self._seq(seq_id)
        num_tokens = check_int("num_tokens", num_tokens, 0)
        if num_tokens > seq.num_tokens:
            raise ValueError(
                f"num_tokens={num_tokens}: past the end of {seq_id!r} "
                f"(num_tokens {seq.num_tokens}); truncate can only shorten"
            )
        start = seq.first_block_index * self.block_size
        if num_tokens < start:
            raise ValueError(
                f"num_tokens={num_tokens}: tokens before {start} of {seq_id!r} were "
                "released by its sliding window and cannot be resurrected"
            )
        keep = -(-num_tokens // self.block_size) - seq.first_block_index
        freed: list[int] = []
        for b in seq.table[keep:]:
            self._detach(b, seq_id, freed)
        del seq.table[keep:]
        seq.num_tokens = num_tokens
        return tuple(freed)

    def drop_leading_blocks(self, seq_id: Hashable, n_blocks: int) -> tuple[int, ...]:
        """Release the first `n_blocks` resident (full) blocks, keeping the logical length.

        For sliding-window layers; returns the blocks that went back to the free list.
        """
        seq = self._seq(seq_id)
        n_blocks = check_int("n_blocks", n_blocks, 0)
        full = seq.num_tokens // self.block_size - seq.first_block_index
        if n_blocks > full:
            raise ValueError(
                f"n_blocks={n_blocks}: {seq_id!r} has only {full} full resident "
                "blocks; a partially filled block is still being written"
            )
        freed: list[int] = []
        for b in seq.table[:n_blocks]:
            self._detach(b, seq_id, freed)
        del seq.table[:n_blocks]
        seq.first_block_index += n_blocks
        return tuple(freed)

    def release_before(self, seq_id: Hashable, token_index: int) -> tuple[int, ...]:
        """Release every block whose slots all lie before `token_index` (a window's left edge)."""
        seq = self._seq(seq_id)
        token_index = check_int("token_index", token_index, 0)
        if token_index > seq.num_tokens:
            raise ValueError(f"token_index={token_index}: past the end of {seq_id!r} (num_tokens {seq.num_tokens})")
        n_blocks = max(0, token_index // self.block_size - seq.first_block_index)
        return self.drop_leading_blocks(seq_id, n_blocks)

    # ------------------------------------------------------------------ pins

    def retain(self, block_id: int, owner: Hashable = None) -> None:
        """Pin an allocated full block for `owner` so it outlives every page table holding it."""
        block_id = self._check_block(block_id)
        _check_owner(owner)
        if self._refs[block_id] == 0:
            raise ValueError(f"block_id={block_id}: free; only allocated blocks can be retained")
        if self._fill(block_id) != self.block_size:
            raise ValueError(
                f"block_id={block_id}: {self._fill(block_id)}/{self.block_size} "
                "slots filled; only full blocks can be retained"
            )
        self._pins[block_id][owner] = self._pins[block_id].get(owner, 0) + 1
        self._refs[block_id] += 1

    def release_block(self, block_id: int, owner: Hashable = None) -> bool:
        """Drop one of `owner`'s pins taken by `retain`; True if the block went back to the free list."""
        block_id = self._check_block(block_id)
        _check_owner(owner)
        pins = self._pins[block_id]
        if not pins:
            raise ValueError(f"block_id={block_id}: not retained; release_block() undoes retain() only")
        if owner not in pins:
            owners = ", ".join(sorted(_owner_name(o) for o in pins))
            raise ValueError(
                f"block_id={block_id}: owner {_owner_name(owner)} holds no pin on it (its pins "
                f"belong to {owners}); only the owner that retained a block may release it"
            )
        pins[owner] -= 1
        if pins[owner] == 0:
            del pins[owner]
        self._refs[block_id] -= 1
        if self._refs[block_id] == 0:
            self._free.append(block_id)
            return True
        return False

    # ------------------------------------------------------------------ queries

    def __contains__(self, seq_id: object) -> bool:
        try:
            return seq_id in self._seqs
        except TypeError:
            return False

    @property
    def sequences(self) -> tuple[Hashable, ...]:
        """Live sequence ids, in creation order."""
        return tuple(self._seqs)

    def resident(self, seq_id: Hashable) -> tuple[tuple[int, ...], int]:
        """(`page_table`, `first_block_index`) of a sequence, from one lookup (the engine asks every
        request's for every step)."""
        seq = self._seq(seq_id)
        return tuple(seq.table), seq.first_block_index

    def page_table(self, seq_id: Hashable) -> tuple[int, ...]:
        """Resident blocks of a sequence in token order (dropped leading blocks excluded)."""
        return tuple(self._seq(seq_id).table)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Logical length in tokens, dropped leading blocks included."""
        return self._seq(seq_id).num_tokens

    def first_block_index(self, seq_id: Hashable) -> int:
        """Number of leading blocks a sliding window released; page_table()[0] is this block."""
        return self._seq(seq_id).first_block_index

    def refcount(self, block_id: int) -> int:
        """Page tables holding the block plus its pins."""
        return self._refs[self._check_block(block_id)]

    def held_only_by(self, pins: Mapping[int, int]) -> int:
        """How many of the blocks `pins` maps to a pin count have no other reference (no page table,
        no other pin): what the owner of those pins could free. One pass, no per-block checks: the
        scheduler asks this of the prefix cache's blocks for every request it considers admitting."""
        refs = self._refs
        return sum(1 for block, n in pins.items() if refs[block] == n)

    def pins(self, block_id: int, owner: Any = _ALL) -> int:
        """Pins taken on the block by `retain` (by every owner, or by `owner` only)."""
        pins = self._pins[self._check_block(block_id)]
        if owner is _ALL:
            return sum(pins.values())
        _check_owner(owner)
        return pins.get(owner, 0)

    def block_fill(self, block_id: int) -> int:
        """Largest fill any holder has in the block (a pin counts as full); 0 for a free block."""
        return self._fill(self._check_block(block_id))

    def _fill(self, block: int) -> int:
        fill = self.block_size if self._pins[block] else 0
        for seq_id, index in self._holders[block].items():
            fill = max(fill, self._view(seq_id, index))
        return fill

    def _sequence_fill(self, block: int) -> int:
        return max((self._view(s, i) for s, i in self._holders[block].items()), default=0)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def allocated_blocks(self) -> int:
        return self.total_blocks - len(self._free)

    @property
    def physical_capacity_tokens(self) -> int:
        return self.allocated_blocks * self.block_size

    @property
    def physical_payload_tokens(self) -> int:
        return sum(self._sequence_fill(b) for b in range(self.total_blocks) if self._holders[b])

    @property
    def cache_only_tokens(self) -> int:
        return self.block_size * sum(1 for b in range(self.total_blocks) if self._pins[b] and not self._holders[b])

    @property
    def logical_tokens(self) -> int:
        return sum(s.num_tokens - s.first_block_index * self.block_size for s in self._seqs.values())

    @property
    def internal_waste_tokens(self) -> int:
        return self.physical_capacity_tokens - self.physical_payload_tokens - self.cache_only_tokens

    @property
    def sharing_savings_tokens(self) -> int:
        return self.logical_tokens - self.physical_payload_tokens

    def snapshot(self) -> dict[str, Any]:
        """Deterministic, JSON-serialisable state and accounting figures."""
        sequences = {
            str(sid): {"num_tokens": s.num_tokens, "blocks": list(s.table), "first_block_index": s.first_block_index}
            for sid, s in sorted(self._seqs.items(), key=lambda kv: str(kv[0]))
        }
        return {
            "block_size": self.block_size,
            "total_blocks": self.total_blocks,
            "sequences": sequences,
            "free_list": list(self._free),
            "pinned": {str(b): sum(self._pins[b].values()) for b in range(self.total_blocks) if self._pins[b]},
            "pin_owners": {
                str(b): sorted((_owner_name(o), n) for o, n in self._pins[b].items())
                for b in range(self.total_blocks)
                if self._pins[b]
            },
            "allocated_blocks": self.allocated_blocks,
            "free_blocks": self.free_blocks,
            "physical_capacity_tokens": self.physical_capacity_tokens,
            "physical_payload_tokens": self.physical_payload_tokens,
            "logical_tokens": self.logical_tokens,
            "internal_waste_tokens": self.internal_waste_tokens,
            "sharing_savings_tokens": self.sharing_savings_tokens,
            "cache_only_tokens": self.cache_only_tokens,
        }

    def validate(self) -> None:
        """Check every invariant of docs/paged.md#block-pool; raise AssertionError naming the first one broken."""
        bs, n = self.block_size, self.total_blocks

        def fail(msg: str) -> None:
            raise AssertionError(f"PagedKVPool invariant broken: {msg}")

        if len(set(self._free)) != len(self._free):
            fail(f"free list has duplicates: {self._free}")
        if any(not (isinstance(b, int) and 0 <= b < n) for b in self._free):
            fail(f"free list has foreign ids: {self._free}")
        holders: list[dict[Hashable, int]] = [{} for _ in range(n)]
        for sid, s in self._seqs.items():
            if not 0 <= s.first_block_index * bs <= s.num_tokens:
                fail(f"{sid!r}: first_block_index {s.first_block_index} past num_tokens {s.num_tokens}")
            expected = -(-s.num_tokens // bs) - s.first_block_index
            if len(s.table) != expected:
                fail(
                    f"{sid!r}: page table has {len(s.table)} blocks, expected "
                    f"ceil({s.num_tokens}/{bs}) - {s.first_block_index} = {expected}"
                )
            if len(set(s.table)) != len(s.table):
                fail(f"{sid!r}: a block appears twice in its page table {s.table}")
            for j, b in enumerate(s.table):
                holders[b][sid] = s.first_block_index + j
        if holders != self._holders:
            fail("holder index disagrees with the page tables")
        free = set(self._free)
        for b in range(n):
            if any(not (isinstance(n, int) and n > 0) for n in self._pins[b].values()):
                fail(f"block {b} has a non-positive pin count {self._pins[b]}")
            pinned = sum(self._pins[b].values())
            if self._refs[b] != len(holders[b]) + pinned:
                fail(f"block {b}: refcount {self._refs[b]} != {len(holders[b])} page tables + {pinned} pins")
            if self._refs[b] == 0:
                if b not in free:
                    fail(f"block {b} is unreferenced but not on the free list")
                if self._fill(b) != 0:
                    fail(f"free block {b} has fill {self._fill(b)}")
            else:
                if b in free:
                    fail(f"block {b} is referenced ({self._refs[b]}) but on the free list")
                if not 1 <= self._fill(b) <= bs:
                    fail(f"block {b} has fill {self._fill(b)}, expected 1..{bs}")
        if self.physical_payload_tokens > self.logical_tokens:
            fail(f"payload {self.physical_payload_tokens} > logical {self.logical_tokens}")
        if self.internal_waste_tokens < 0:
            fail(f"internal waste {self.internal_waste_tokens} < 0")
