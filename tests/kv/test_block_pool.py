"""Tests for the tensor-free paged KV block pool (docs/paged.md#block-pool, docs/paged.md#rollback)."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gptoss_lite.kv.block_pool import AppendPlan, PagedKVPool, PoolExhaustedError


def dump(pool: PagedKVPool) -> str:
    return json.dumps(pool.snapshot(), sort_keys=True)


class Mirror:
    """A fake tensor store: (block, slot) -> value, driven only by AppendPlans."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], object] = {}

    def apply(self, plan: AppendPlan, values: list[object]) -> None:
        assert len(values) == plan.n_tokens
        for src, dst, n in plan.copies:
            for s in range(n):
                self.slots[(dst, s)] = self.slots[(src, s)]
        for (block, slot), v in zip(plan.slots, values):
            self.slots[(block, slot)] = v

    def read(self, pool: PagedKVPool, seq_id: object) -> list[object]:
        """Resident tokens of a sequence, read through its page table."""
        bs, first = pool.block_size, pool.first_block_index(seq_id)
        table = pool.page_table(seq_id)
        return [self.slots[(table[p // bs - first], p % bs)] for p in range(first * bs, pool.num_tokens(seq_id))]


def expect_unchanged(pool: PagedKVPool, exc: type[BaseException], match: str, fn, *args) -> None:
    before = dump(pool)
    with pytest.raises(exc, match=match):
        fn(*args)
    assert dump(pool) == before
    pool.validate()


# ---------------------------------------------------------------------------- pinned scenarios


def test_free_list_hands_out_in_order_then_lifo():
    """Blocks come out 0, 1, 2, …; released blocks go on top in page-table order (docs/paged.md#block-pool)."""
    pool = PagedKVPool(8, block_size=4)
    pool.create("a")
    assert pool.append("a", 12).new_blocks == (0, 1, 2)
    pool.create("b")
    assert pool.append("b", 4).new_blocks == (3,)
    assert pool.release("a") == (0, 1, 2)
    # 2 was pushed last, so it is the next block handed out, then 1, then 0, then 4.
    pool.create("c")
    assert pool.append("c", 16).new_blocks == (2, 1, 0, 4)
    assert pool.page_table("c") == (2, 1, 0, 4)
    pool.validate()


def test_append_plan_slots_cover_new_tokens_in_order():
    """An append's slots list one (block, slot) per new token, in token order."""
    pool = PagedKVPool(4, block_size=4)
    pool.create(1)
    plan = pool.append(1, 3)
    assert plan == AppendPlan(copies=(), slots=((0, 0), (0, 1), (0, 2)), new_blocks=(0,))
    plan = pool.append(1, 3)
    assert plan.slots == ((0, 3), (1, 0), (1, 1)) and plan.new_blocks == (1,)
    assert pool.append(1, 0) == AppendPlan((), (), ())


def test_shared_partial_last_block_is_copied_before_writer_appends():
    """A shared, partially filled last block is replaced by a private copy before a write."""
    pool = PagedKVPool(8, block_size=4)
    pool.create("parent")
    pool.append("parent", 6)  # blocks 0 (full), 1 (2 slots)
    pool.share_prefix("parent", "child", 6)
    assert pool.page_table("child") == (0, 1)
    assert pool.refcount(0) == pool.refcount(1) == 2
    plan = pool.append("child", 1)
    assert plan.copies == ((1, 2, 2),)  # copy the 2 filled slots of block 1 into block 2
    assert plan.slots == ((2, 2),)
    assert plan.new_blocks == (2,)
    assert pool.page_table("child") == (0, 2)
    assert pool.page_table("parent") == (0, 1)  # the reader's table is unchanged
    assert pool.refcount(1) == 1 and pool.refcount(0) == 2
    # The parent is now the sole holder of block 1 and writes in place.
    assert pool.append("parent", 1) == AppendPlan((), ((1, 2),), ())
    pool.validate()


def test_full_shared_blocks_are_never_copied():
    """Appending after a block-aligned shared prefix allocates a new block and copies nothing."""
    pool = PagedKVPool(8, block_size=4)
    pool.create("p")
    pool.append("p", 8)
    pool.share_prefix("p", "c", 8)
    plan = pool.append("c", 5)
    assert plan.copies == () and plan.new_blocks == (2, 3)
    assert pool.page_table("c") == (0, 1, 2, 3)
    assert pool.blocks_needed("p", 1) == 1
    pool.validate()


def test_partial_share_of_a_longer_parent_copies_only_the_childs_slots():
    """A child sharing mid-block copies only the slots it sees, not the parent's longer fill."""
    pool = PagedKVPool(8, block_size=4)
    mirror = Mirror()
    pool.create("p")
    mirror.apply(pool.append("p", 7), list("abcdefg"))
    pool.share_prefix("p", "c", 5)
    plan = pool.append("c", 2)
    mirror.apply(plan, ["X", "Y"])
    assert plan.copies == ((1, 2, 1),)
    assert mirror.read(pool, "c") == list("abcdeXY")
    assert mirror.read(pool, "p") == list("abcdefg")
    pool.validate()


def test_short_child_survives_parent_release_and_parent_cow():
    """A child keeps its tokens after its longer parent copies-on-write and is released."""
    pool = PagedKVPool(8, block_size=4)
    mirror = Mirror()
    pool.create("p")
    mirror.apply(pool.append("p", 6), list("abcdef"))
    pool.share_prefix("p", "c", 5)
    mirror.apply(pool.append("p", 3), list("ghi"))  # parent CoWs block 1 (shared, partial)
    assert pool.page_table("c") == (0, 1)
    assert pool.page_table("p") == (0, 2, 3)
    assert pool.release("p") == (2, 3)  # block 0 and 1 stay: the child holds them
    assert pool.refcount(0) == pool.refcount(1) == 1
    assert mirror.read(pool, "c") == list("abcde")
    # The child is now sole holder of block 1 (fill recomputed to its view) and appends in place.
    assert pool.block_fill(1) == 1
    plan = pool.append("c", 1)
    assert plan.copies == () and plan.slots == ((1, 1),)
    mirror.apply(plan, ["Z"])
    assert mirror.read(pool, "c") == list("abcdeZ")
    pool.validate()


def test_truncate_frees_exactly_the_blocks_past_the_new_end():
    """Rollback returns only blocks past the new end, and never a block another sequence holds."""
    pool = PagedKVPool(10, block_size=4)
    pool.create("a")
    pool.append("a", 20)  # blocks 0..4
    pool.share_prefix("a", "b", 14)  # b holds 0..3
    assert pool.truncate("a", 9) == (4,)  # 3 is still held by b; 4 is a's alone
    assert pool.page_table("a") == (0, 1, 2)
    assert pool.refcount(3) == 1 and pool.refcount(2) == 2
    assert pool.truncate("a", 9) == ()
    assert pool.truncate("a", 0) == ()  # every block still held by b
    assert pool.page_table("a") == () and pool.num_tokens("a") == 0
    assert pool.truncate("b", 4) == (1, 2, 3)
    assert pool.free_blocks == 9
    pool.validate()


def test_truncate_into_a_shared_block_then_append_copies():
    """After rolling back into a shared block, the next append copies it rather than overwrite."""
    pool = PagedKVPool(8, block_size=4)
    mirror = Mirror()
    pool.create("a")
    mirror.apply(pool.append("a", 8), list("abcdefgh"))
    pool.share_prefix("a", "b", 8)
    pool.truncate("a", 6)
    plan = pool.append("a", 1)
    mirror.apply(plan, ["X"])
    assert plan.copies == ((1, 2, 2),)
    assert mirror.read(pool, "b") == list("abcdefgh")
    assert mirror.read(pool, "a") == list("abcdefX")
    pool.validate()


def test_block_aligned_tokens_waste_nothing():
    """2,048 tokens in 16-token blocks occupy 128 full blocks: zero internal waste."""
    pool = PagedKVPool(128)
    pool.create(0)
    pool.append(0, 2048)
    assert pool.allocated_blocks == 128 and pool.free_blocks == 0
    assert pool.physical_capacity_tokens == pool.physical_payload_tokens == 2048
    assert pool.internal_waste_tokens == 0
    pool.validate()


def test_accounting_counts_shared_prefix_once_physically_and_per_sequence_logically():
    """Payload counts a shared block once at its largest fill; logical counts per sequence."""
    pool = PagedKVPool(16, block_size=16)
    pool.create("a")
    pool.append("a", 40)  # 3 blocks, last has 8
    pool.share_prefix("a", "b", 36)
    pool.append("b", 10)  # CoW block 2 (4 slots) -> 14 slots
    snap = pool.snapshot()
    assert snap["sequences"] == {
        "a": {"num_tokens": 40, "blocks": [0, 1, 2], "first_block_index": 0},
        "b": {"num_tokens": 46, "blocks": [0, 1, 3], "first_block_index": 0},
    }
    assert snap["allocated_blocks"] == 4 and snap["free_blocks"] == 12
    assert snap["physical_capacity_tokens"] == 64
    assert snap["physical_payload_tokens"] == 16 + 16 + 8 + 14
    assert snap["logical_tokens"] == 86
    assert snap["internal_waste_tokens"] == 64 - 54
    assert snap["sharing_savings_tokens"] == 86 - 54
    assert json.dumps(snap, sort_keys=True) == dump(pool)


def test_exhaustion_is_preflighted_and_leaves_pool_unchanged():
    """An append the free blocks cannot cover raises MemoryError before changing anything."""
    pool = PagedKVPool(3, block_size=4)
    pool.create("a")
    pool.append("a", 6)
    expect_unchanged(pool, PoolExhaustedError, r"needs 3 free blocks .* only 1", pool.append, "a", 11)
    assert issubclass(PoolExhaustedError, MemoryError)
    assert pool.append("a", 6).new_blocks == (2,)  # exactly fills the pool


def test_exhaustion_counts_the_copy_on_write_block():
    """A write into a shared partial block needs one free block for the copy, even for 1 token."""
    pool = PagedKVPool(2, block_size=4)
    pool.create("a")
    pool.append("a", 6)
    pool.share_prefix("a", "b", 6)
    assert pool.free_blocks == 0 and pool.blocks_needed("b", 1) == 1
    expect_unchanged(pool, MemoryError, r"1 copy-on-write", pool.append, "b", 1)


def test_window_release_before_bounds_resident_blocks():
    """A windowed sequence releasing blocks before its window holds <= ceil(W/b)+1 blocks."""
    window, bs = 100, 16
    bound = math.ceil(window / bs) + 1
    pool = PagedKVPool(bound, block_size=bs)
    mirror = Mirror()
    pool.create("w")
    peak = 0
    for t in range(2000):
        mirror.apply(pool.append("w", 1), [t])
        pool.release_before("w", max(0, pool.num_tokens("w") - window))
        peak = max(peak, len(pool.page_table("w")))
        resident = mirror.read(pool, "w")
        assert resident[-min(window, t + 1) :] == list(range(max(0, t + 1 - window), t + 1))
    assert peak <= bound
    assert pool.num_tokens("w") == 2000
    assert pool.first_block_index("w") == (2000 - window) // bs
    assert pool.logical_tokens == 2000 - pool.first_block_index("w") * bs
    pool.validate()


def test_window_rollback_cannot_resurrect_released_tokens():
    """Truncating below a sliding window's released point is rejected without change (docs/paged.md#rollback)."""
    pool = PagedKVPool(8, block_size=4)
    pool.create("w")
    pool.append("w", 14)
    assert pool.release_before("w", 9) == (0, 1)
    assert pool.first_block_index("w") == 2 and pool.page_table("w") == (2, 3)
    expect_unchanged(pool, ValueError, r"num_tokens=7: .*cannot be resurrected", pool.truncate, "w", 7)
    assert pool.truncate("w", 8) == (2, 3)
    assert pool.page_table("w") == () and pool.num_tokens("w") == 8
    plan = pool.append("w", 1)  # the next token lands at absolute block 2 in a fresh block
    assert plan.slots == ((3, 0),) and pool.first_block_index("w") == 2
    pool.validate()


def test_share_prefix_from_windowed_source_inherits_its_dropped_point():
    """A fork of a windowed sequence shares only resident blocks and inherits first_block_index."""
    pool = PagedKVPool(8, block_size=4)
    pool.create("w")
    pool.append("w", 14)
    pool.drop_leading_blocks("w", 2)
    pool.share_prefix("w", "f", 13)
    assert pool.first_block_index("f") == 2 and pool.page_table("f") == (2, 3)
    pool.share_prefix("w", "empty", 0)
    assert pool.first_block_index("empty") == 0 and pool.page_table("empty") == ()
    expect_unchanged(pool, ValueError, r"prefix_tokens=5: .*released tokens before 8", pool.share_prefix, "w", "g", 5)
    pool.validate()


def test_retain_keeps_a_block_alive_after_its_sequence_is_released():
    """A pinned block survives its sequences and frees when the last pin drops."""
    pool = PagedKVPool(4, block_size=4)
    pool.create("a")
    pool.append("a", 6)
    pool.retain(0)
    assert pool.refcount(0) == 2 and pool.pins(0) == 1
    assert pool.release("a") == (1,)
    assert pool.cache_only_tokens == 4 and pool.logical_tokens == 0
    assert pool.physical_payload_tokens == 0 and pool.internal_waste_tokens == 0
    pool.create("b", blocks=[0])
    assert pool.num_tokens("b") == 4 and pool.refcount(0) == 2
    assert pool.blocks_needed("b", 1) == 1  # block 0 is full: a new block, no copy
    pool.release("b")
    assert pool.release_block(0) is True
    assert pool.free_blocks == 4
    pool.validate()


def test_validate_detects_corruption():
    """validate() names a broken refcount and a duplicated free-list entry."""
    pool = PagedKVPool(4, block_size=4)
    pool.create("a")
    pool.append("a", 5)
    pool._refs[0] += 1
    with pytest.raises(AssertionError, match=r"block 0: refcount 2 != 1 page tables"):
        pool.validate()
    pool._refs[0] -= 1
    pool._free.append(pool._free[-1])
    with pytest.raises(AssertionError, match=r"free list has duplicates"):
        pool.validate()


# ---------------------------------------------------------------------------- bad input


def make_pool() -> PagedKVPool:
    pool = PagedKVPool(6, block_size=4)
    pool.create("a")
    pool.append("a", 6)
    pool.create("b")
    return pool


BAD_CALLS = [
    ("create duplicate", ValueError, r"seq_id='a': already exists", "create", ("a",)),
    ("create str collision", ValueError, r"collides", "create", (1,)),
    ("create unhashable", TypeError, r"unhashable list", "create", ([1],)),
    ("create with free block", ValueError, r"block 3 is free", "create", ("c", [3])),
    ("create with partial block", ValueError, r"block 1 has 2/4", "create", ("c", [1])),
    ("create with repeated block", ValueError, r"appears twice", "create", ("c", [0, 0])),
    ("create with foreign block", ValueError, r"block_id=9: must be < total_blocks=6", "create", ("c", [9])),
    ("append unknown", KeyError, r"seq_id='zz': unknown sequence", "append", ("zz", 1)),
    ("append unhashable", TypeError, r"unhashable dict", "append", ({}, 1)),
    ("append negative", ValueError, r"n_tokens=-1: must be >= 0", "append", ("a", -1)),
    ("append bool", TypeError, r"n_tokens=True: must be an int \(not bool\)", "append", ("a", True)),
    ("append float", TypeError, r"n_tokens=1.0: must be an int", "append", ("a", 1.0)),
    ("blocks_needed negative", ValueError, r"n_tokens=-2", "blocks_needed", ("a", -2)),
    ("share unknown source", KeyError, r"seq_id='x': unknown", "share_prefix", ("x", "y", 0)),
    ("share duplicate target", ValueError, r"seq_id='b': already exists", "share_prefix", ("a", "b", 2)),
    (
        "share too long",
        ValueError,
        r"prefix_tokens=7: longer than source 'a' \(num_tokens 6\)",
        "share_prefix",
        ("a", "c", 7),
    ),
    ("share bool", TypeError, r"prefix_tokens=False", "share_prefix", ("a", "c", False)),
    ("share negative", ValueError, r"prefix_tokens=-1", "share_prefix", ("a", "c", -1)),
    ("release unknown", KeyError, r"unknown sequence", "release", ("c",)),
    ("release unhashable", TypeError, r"unhashable", "release", (["a"],)),
    ("truncate past end", ValueError, r"num_tokens=7: past the end of 'a' \(num_tokens 6\)", "truncate", ("a", 7)),
    ("truncate negative", ValueError, r"num_tokens=-1", "truncate", ("a", -1)),
    ("truncate float", TypeError, r"num_tokens=2.5", "truncate", ("a", 2.5)),
    ("drop too many", ValueError, r"n_blocks=2: 'a' has only 1 full resident", "drop_leading_blocks", ("a", 2)),
    ("release_before past end", ValueError, r"token_index=7: past the end", "release_before", ("a", 7)),
    ("release_before bool", TypeError, r"token_index=True", "release_before", ("a", True)),
    ("retain free", ValueError, r"block_id=4: free", "retain", (4,)),
    ("retain partial", ValueError, r"block_id=1: 2/4 slots filled", "retain", (1,)),
    ("retain negative", ValueError, r"block_id=-1", "retain", (-1,)),
    ("release_block unpinned", ValueError, r"block_id=0: not retained", "release_block", (0,)),
    ("release_block out of range", ValueError, r"block_id=6: must be < total_blocks", "release_block", (6,)),
]


@pytest.mark.parametrize("name,exc,match,method,args", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_and_leaves_pool_unchanged(name, exc, match, method, args):
    """Every bad argument raises a clear error and leaves snapshot() byte-identical."""
    pool = make_pool()
    if name == "create str collision":
        pool.create("1")
    expect_unchanged(pool, exc, match, getattr(pool, method), *args)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"total_blocks": 0}, ValueError, r"total_blocks=0: must be >= 1"),
        ({"total_blocks": 4, "block_size": 0}, ValueError, r"block_size=0: must be >= 1"),
        ({"total_blocks": True}, TypeError, r"total_blocks=True"),
        ({"total_blocks": 4, "block_size": 16.0}, TypeError, r"block_size=16.0"),
    ],
)
def test_constructor_rejects_bad_geometry(kwargs, exc, match):
    """The pool needs at least one block of at least one slot, given as ints."""
    with pytest.raises(exc, match=match):
        PagedKVPool(**kwargs)


def test_query_methods_reject_unknown_ids():
    """Read-only queries raise KeyError for an unknown sequence and ValueError for a bad block."""
    pool = make_pool()
    for method in ("page_table", "num_tokens", "first_block_index"):
        with pytest.raises(KeyError, match=r"seq_id='nope': unknown sequence"):
            getattr(pool, method)("nope")
    with pytest.raises(ValueError, match=r"block_id=6: must be < total_blocks=6"):
        pool.refcount(6)
    assert "a" in pool and "nope" not in pool and [1] not in pool


# ---------------------------------------------------------------------------- state machine

IDS = st.sampled_from([0, 1, 2, 3, 4])


class PoolMachine(RuleBasedStateMachine):
    """Random create/append/share/truncate/release/window/pin steps against a list model."""

    BS = 4

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagedKVPool(12, block_size=self.BS)
        self.mirror = Mirror()
        self.model: dict[int, list[int]] = {}  # seq -> logical token values
        self.start: dict[int, int] = {}  # seq -> first resident token (window)
        self.counter = 0

    def raises_unchanged(self, exc, match, fn, *args):
        expect_unchanged(self.pool, exc, match, fn, *args)

    def holders(self, block: int) -> int:
        return sum(block in self.pool.page_table(s) for s in self.model) + self.pool.pins(block)

    @rule(sid=IDS)
    def create(self, sid):
        if sid in self.model:
            self.raises_unchanged(ValueError, "already exists", self.pool.create, sid)
            return
        self.pool.create(sid)
        self.model[sid], self.start[sid] = [], 0

    @rule(sid=IDS, n=st.integers(0, 30))
    def append(self, sid, n):
        if sid not in self.model:
            self.raises_unchanged(KeyError, "unknown sequence", self.pool.append, sid, n)
            return
        length, bs = len(self.model[sid]), self.BS
        used = length % bs
        cow = n > 0 and used != 0 and self.holders(self.pool.page_table(sid)[-1]) > 1
        rest = max(0, n - (bs - used if used else 0))
        need = int(cow) + math.ceil(rest / bs)
        assert self.pool.blocks_needed(sid, n) == need
        if need > self.pool.free_blocks:
            self.raises_unchanged(PoolExhaustedError, "free blocks", self.pool.append, sid, n)
            return
        values = list(range(self.counter, self.counter + n))
        self.counter += n
        plan = self.pool.append(sid, n)
        assert len(plan.new_blocks) == need and len(plan.copies) == int(cow)
        self.mirror.apply(plan, values)
        self.model[sid] += values

    @rule(src=IDS, dst=IDS, prefix=st.integers(0, 60))
    def share(self, src, dst, prefix):
        if src not in self.model:
            self.raises_unchanged(KeyError, "unknown", self.pool.share_prefix, src, dst, prefix)
        elif dst in self.model:
            self.raises_unchanged(ValueError, "already exists", self.pool.share_prefix, src, dst, prefix)
        elif prefix > len(self.model[src]):
            self.raises_unchanged(ValueError, "longer than source", self.pool.share_prefix, src, dst, prefix)
        elif 0 < prefix < self.start[src]:
            self.raises_unchanged(ValueError, "released tokens", self.pool.share_prefix, src, dst, prefix)
        else:
            self.pool.share_prefix(src, dst, prefix)
            self.model[dst] = self.model[src][:prefix]
            self.start[dst] = self.start[src] if prefix else 0

    @rule(sid=IDS, new_length=st.integers(0, 60))
    def truncate(self, sid, new_length):
        if sid not in self.model:
            self.raises_unchanged(KeyError, "unknown", self.pool.truncate, sid, new_length)
        elif new_length > len(self.model[sid]):
            self.raises_unchanged(ValueError, "past the end", self.pool.truncate, sid, new_length)
        elif new_length < self.start[sid]:
            self.raises_unchanged(ValueError, "resurrected", self.pool.truncate, sid, new_length)
        else:
            before = set(self.pool.page_table(sid))
            freed = self.pool.truncate(sid, new_length)
            del self.model[sid][new_length:]
            assert set(freed) <= before - set(self.pool.page_table(sid))
            assert all(self.holders(b) == 0 for b in freed)

    @rule(sid=IDS)
    def release(self, sid):
        if sid not in self.model:
            self.raises_unchanged(KeyError, "unknown", self.pool.release, sid)
            return
        table = self.pool.page_table(sid)
        freed = self.pool.release(sid)
        del self.model[sid], self.start[sid]
        assert list(freed) == [b for b in table if self.holders(b) == 0]  # page-table order
        if freed:
            assert self.pool.snapshot()["free_list"][-len(freed) :] == list(freed)

    @rule(sid=IDS, window=st.integers(0, 20))
    def slide_window(self, sid, window):
        if sid not in self.model:
            self.raises_unchanged(KeyError, "unknown", self.pool.release_before, sid, 0)
            return
        cut = max(0, len(self.model[sid]) - window)
        self.pool.release_before(sid, cut)
        self.start[sid] = max(self.start[sid], cut // self.BS * self.BS)

    @rule(block=st.integers(0, 11))
    def pin(self, block):
        if self.pool.refcount(block) == 0:
            self.raises_unchanged(ValueError, "free", self.pool.retain, block)
        elif self.pool.block_fill(block) < self.BS:
            self.raises_unchanged(ValueError, "slots filled", self.pool.retain, block)
        else:
            self.pool.retain(block)

    @rule(block=st.integers(0, 11))
    def unpin(self, block):
        if self.pool.pins(block) == 0:
            self.raises_unchanged(ValueError, "not retained", self.pool.release_block, block)
        else:
            assert self.pool.release_block(block) == (self.pool.refcount(block) == 0)

    @rule(sid=IDS, bad=st.sampled_from([-1, True, 1.5, "3", None]))
    def bad_count(self, sid, bad):
        if sid not in self.model:
            return
        exc = ValueError if bad == -1 and not isinstance(bad, bool) else TypeError
        for fn in (self.pool.append, self.pool.truncate, self.pool.release_before, self.pool.drop_leading_blocks):
            self.raises_unchanged(exc, "must be", fn, sid, bad)

    @invariant()
    def consistent(self):
        pool, bs = self.pool, self.BS
        pool.validate()
        assert set(pool.sequences) == set(self.model)
        payload = 0
        for b in range(pool.total_blocks):
            views = [
                min(bs, len(self.model[s]) - (pool.first_block_index(s) + pool.page_table(s).index(b)) * bs)
                for s in self.model
                if b in pool.page_table(s)
            ]
            payload += max(views, default=0)
        assert pool.physical_payload_tokens == payload
        for sid, tokens in self.model.items():
            assert pool.num_tokens(sid) == len(tokens)
            assert pool.first_block_index(sid) * bs == self.start[sid]
            assert self.mirror.read(pool, sid) == tokens[self.start[sid] :]
        assert pool.logical_tokens == sum(len(t) - self.start[s] for s, t in self.model.items())


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
