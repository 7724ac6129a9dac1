"""Tests for the chained-hash prefix cache and its sharing of paged pool blocks (docs/paged.md#prefix-caching)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gptoss_lite.kv.block_pool import AppendPlan, PagedKVPool, PoolExhaustedError
from gptoss_lite.kv.prefix import PrefixCache, PrefixCacheStats, chained_block_hashes

A = list(range(100, 104))  # one 4-token block
B = list(range(200, 204))
C = list(range(300, 304))


def dump(pool: PagedKVPool) -> str:
    return json.dumps(pool.snapshot(), sort_keys=True)


def compute(pool: PagedKVPool, cache: PrefixCache, seq_id, tokens, scope="t", rev="r") -> int:
    """Attach a request, compute (append) its uncached tokens, and cache its full blocks."""
    cached = cache.attach(seq_id, tokens, scope, rev)
    pool.append(seq_id, len(tokens) - cached)
    cache.insert(tokens, scope, rev, seq_id=seq_id)
    return cached


# ---------------------------------------------------------------------------- hashing


def test_hashes_cover_full_blocks_only_and_are_sha256():
    """One 32-byte SHA-256 digest per full block; a trailing partial block is not hashed."""
    hashes = chained_block_hashes(A + B + [1, 2], "t", "r", block_size=4)
    assert len(hashes) == 2 and all(len(h) == hashlib.sha256().digest_size for h in hashes)
    assert chained_block_hashes(A + B, "t", "r", block_size=4) == hashes
    assert chained_block_hashes([1, 2, 3], "t", "r", block_size=4) == ()


def test_block_identity_is_its_whole_prefix():
    """The same block after a different first block gets a different hash (chained)."""
    h1 = chained_block_hashes(A + C, "t", "r", block_size=4)
    h2 = chained_block_hashes(B + C, "t", "r", block_size=4)
    assert h1[1] != h2[1]
    assert chained_block_hashes(C, "t", "r", block_size=4)[0] not in (h1[1], h2[1])


def test_scope_and_revision_enter_the_first_block_unambiguously():
    """Scope and revision are length-prefixed, so ('ab','') and ('a','b') do not collide."""
    base = chained_block_hashes(A + B, "ab", "", block_size=4)
    assert chained_block_hashes(A + B, "a", "b", block_size=4)[0] != base[0]
    assert chained_block_hashes(A + B, "ab", "v2", block_size=4)[1] != base[1]


def test_standalone_identical_middle_blocks_after_different_first_blocks_do_not_hit():
    """A prompt sharing only a middle block with a cached prompt gets no hit."""
    cache = PrefixCache(block_size=4)
    assert cache.insert(A + C + B, "t", "r") == 3
    assert cache.match(B + C + B + [1], "t", "r") == 0
    assert cache.match(A + C + [7] * 5, "t", "r") == 8
    assert cache.match(A + B + C + [1], "t", "r") == 4  # stops at the first miss


def test_different_scope_or_revision_does_not_hit():
    """A request from another tenant or against another model revision never hits."""
    cache = PrefixCache(block_size=4)
    cache.insert(A + B + C, "tenant-1", "rev-1")
    assert cache.match(A + B + C, "tenant-1", "rev-1") == 8
    assert cache.match(A + B + C, "tenant-2", "rev-1") == 0
    assert cache.match(A + B + C, "tenant-1", "rev-2") == 0


def test_fully_cached_prompt_recomputes_its_last_token():
    """Match is capped at len(tokens)-1 rounded down to a block, so logits can be produced."""
    cache = PrefixCache(block_size=4)
    cache.insert(A + B + C, "t", "r")
    assert cache.match(A + B + C, "t", "r") == 8
    assert cache.match(A + B + C + [5], "t", "r") == 12
    assert cache.match(A + B, "t", "r") == 4
    assert cache.match(A[:1], "t", "r") == 0
    assert cache.match([], "t", "r") == 0


def test_standalone_lru_eviction_under_max_blocks():
    """With max_blocks, the least recently used blocks go first, chain tails before heads."""
    cache = PrefixCache(block_size=4, max_blocks=4)
    cache.insert(A + B, "t", "r")  # chain 1: A, A+B
    cache.insert(C + B, "t", "r")  # chain 2: C, C+B
    cache.match(A + B + [1], "t", "r")  # chain 1 becomes most recent
    cache.insert(B + C, "t", "r")  # 2 new blocks: evicts chain 2 (LRU), tail first
    assert cache.match(A + B + [1], "t", "r") == 8
    assert cache.match(C + B + [1], "t", "r") == 0
    assert cache.match(B + C + [1], "t", "r") == 8
    assert cache.stats().evicted_blocks == 2 and len(cache) == 4
    cache.validate()


def test_lru_order_evicts_tail_of_a_chain_before_its_head():
    """Within one chain, eviction trims from the tail so the remaining head still matches."""
    cache = PrefixCache(block_size=4)
    cache.insert(A + B + C, "t", "r")
    assert cache.evict(1) == 1
    assert cache.match(A + B + C + [1], "t", "r") == 8
    assert cache.evict(5) == 2 and len(cache) == 0


def test_stats_report_request_hits_and_reused_tokens_separately():
    """Request-hit fraction and reused-token fraction are different numbers (docs/paged.md#prefix-caching)."""
    cache = PrefixCache(block_size=4)
    assert cache.stats().request_hit_fraction == 0.0
    assert cache.stats().reused_token_fraction == 0.0
    cache.insert(A + B + C, "t", "r")
    cache.match(A + B + C + [1], "t", "r")  # 12 of 13 cached
    cache.match(C + [1], "t", "r")  # miss, 5 tokens
    cache.match(A + [9] * 15, "t", "r")  # 4 of 19
    cache.match(B + C + A + [1] * 3, "t", "r")  # miss, 15 tokens
    cache.match(A + B, "t", "r", record=False)  # a probe: not counted
    s = cache.stats()
    assert s == PrefixCacheStats(
        requests=4, hit_requests=2, input_tokens=52, cached_tokens=16, cached_blocks=3, evicted_blocks=0
    )
    assert s.request_hit_fraction == 0.5
    assert s.reused_token_fraction == pytest.approx(16 / 52)


# ---------------------------------------------------------------------------- pool-backed


def test_hit_shares_cached_blocks_instead_of_copying():
    """attach() puts the cached physical blocks in the new page table; refcounts rise."""
    pool = PagedKVPool(8, block_size=4)
    cache = PrefixCache(block_size=4, pool=pool)
    assert compute(pool, cache, "r1", A + B + [1, 2]) == 0
    assert pool.page_table("r1") == (0, 1, 2)
    assert pool.pins(0) == pool.pins(1) == 1 and pool.pins(2) == 0
    assert compute(pool, cache, "r2", A + B + [3]) == 8
    assert pool.page_table("r2") == (0, 1, 3)
    assert pool.refcount(0) == pool.refcount(1) == 3  # r1, r2 and the cache
    assert pool.allocated_blocks == 4
    pool.validate()
    cache.validate()


def test_cached_blocks_outlive_their_sequence_and_are_reused():
    """After the computing sequence is released, its cached blocks still serve a later hit."""
    pool = PagedKVPool(4, block_size=4)
    cache = PrefixCache(block_size=4, pool=pool)
    compute(pool, cache, "r1", A + B + [1])
    assert pool.release("r1") == (2,)
    assert pool.allocated_blocks == 2 and pool.cache_only_tokens == 8
    assert cache.attach("r2", A + B + [5, 6], "t", "r") == 8
    assert pool.page_table("r2") == (0, 1)
    plan = pool.append("r2", 2)  # block 1 is full: a fresh block, no copy
    assert plan == AppendPlan(copies=(), slots=((2, 0), (2, 1)), new_blocks=(2,))
    pool.validate()


def test_eviction_never_frees_a_referenced_block():
    """evict() frees only blocks whose sole holder is the cache."""
    pool = PagedKVPool(8, block_size=4)
    cache = PrefixCache(block_size=4, pool=pool)
    compute(pool, cache, "live", A + B + [1])
    compute(pool, cache, "done", C + A + [1])
    pool.release("done")
    assert cache.evictable_blocks == 2
    assert cache.evict(10) == 2  # only C and C+A
    assert len(cache) == 2 and pool.refcount(0) == 2 and pool.refcount(1) == 2
    assert cache.evict(1) == 0
    assert cache.match(A + B + [1], "t", "r", record=False) == 8
    pool.validate()
    cache.validate()


def test_eviction_order_is_least_recently_used_first():
    """Unreferenced cached blocks are freed least recently used first."""
    pool = PagedKVPool(8, block_size=4)
    cache = PrefixCache(block_size=4, pool=pool)
    blocks = {}
    for name, tokens in (("A", A + [1]), ("B", B + [1]), ("C", C + [1])):
        compute(pool, cache, name, tokens)
        blocks[name] = pool.page_table(name)[0]
        pool.release(name)
    cache.match(A + [2], "t", "r")  # A becomes most recent; B is now the oldest
    assert cache.evict(1) == 1 and pool.refcount(blocks["B"]) == 0
    assert cache.evict(1) == 1 and pool.refcount(blocks["C"]) == 0
    assert pool.refcount(blocks["A"]) == 1
    assert cache.match(A + [2], "t", "r") == 4


def test_evict_makes_room_for_an_append_that_would_exhaust_the_pool():
    """Evicting idle cached blocks avoids PoolExhaustedError for a new request."""
    pool = PagedKVPool(3, block_size=4)
    cache = PrefixCache(block_size=4, pool=pool)
    compute(pool, cache, "old", A + B + [1])
    pool.release("old")
    pool.create("new")
    expect = dump(pool)
    with pytest.raises(PoolExhaustedError, match=r"needs 2 free blocks .* only 1"):
        pool.append("new", 5)
    assert dump(pool) == expect
    assert cache.evict(pool.blocks_needed("new", 5) - pool.free_blocks) == 1
    assert pool.append("new", 5).new_blocks == (1, 2)  # the evicted tail is on top
    assert cache.match(A + B + [1], "t", "r", record=False) == 4  # the head survived
    pool.validate()
    cache.validate()


def test_clear_drops_only_the_caches_pins():
    """clear() forgets every entry; blocks a sequence holds stay allocated."""
    pool = PagedKVPool(4, block_size=4)
    cache = PrefixCache(block_size=4, pool=pool)
    compute(pool, cache, "s", A + B + [1])
    cache.clear()
    assert len(cache) == 0 and pool.allocated_blocks == 3
    assert all(pool.pins(b) == 0 for b in range(4))
    pool.validate()


# ---------------------------------------------------------------------------- bad input


def test_constructor_rejects_bad_arguments():
    """Block size must match the pool; max_blocks is standalone-only; pool must be a pool."""
    pool = PagedKVPool(4, block_size=8)
    with pytest.raises(ValueError, match=r"block_size=16: differs from the pool's 8"):
        PrefixCache(pool=pool)
    with pytest.raises(ValueError, match=r"max_blocks: only for the standalone"):
        PrefixCache(block_size=8, pool=pool, max_blocks=3)
    with pytest.raises(TypeError, match=r"pool: expected a PagedKVPool"):
        PrefixCache(pool="pool")
    with pytest.raises(ValueError, match=r"block_size=0: must be >= 1"):
        PrefixCache(block_size=0)
    with pytest.raises(ValueError, match=r"max_blocks=-1: must be >= 0"):
        PrefixCache(max_blocks=-1)


@pytest.mark.parametrize(
    "tokens,exc,match",
    [
        ("abc", TypeError, r"tokens: expected a sequence of ints"),
        ({1, 2}, TypeError, r"tokens: expected a sequence of ints"),
        ([1, True], TypeError, r"tokens\[1\]=True: token ids must be ints"),
        ([1.0], TypeError, r"tokens\[0\]=1.0"),
        ([-1], ValueError, r"tokens\[0\]=-1: token ids must be in \[0, 2\*\*63\)"),
        ([2**63], ValueError, r"must be in \[0, 2\*\*63\)"),
    ],
)
def test_bad_tokens_are_rejected_without_recording(tokens, exc, match):
    """Non-token input raises and leaves cache entries and stats unchanged."""
    cache = PrefixCache(block_size=4)
    cache.insert(A, "t", "r")
    before = cache.stats()
    for call in (lambda: cache.match(tokens, "t", "r"), lambda: cache.insert(tokens, "t", "r")):
        with pytest.raises(exc, match=match):
            call()
    assert cache.stats() == before


def test_scope_and_revision_must_be_strings():
    """A scope or revision that is not a str is a caller mistake, not a silent key."""
    cache = PrefixCache(block_size=4)
    with pytest.raises(TypeError, match=r"scope=None: must be a str .* not NoneType"):
        cache.match(A, None, "r")
    with pytest.raises(TypeError, match=r"revision=3: must be a str"):
        cache.insert(A, "t", 3)
    assert len(cache) == 0 and cache.stats().requests == 0


def test_insert_after_the_window_released_blocks_that_are_cached():
    """A prompt prefilled in chunks is cached chunk by chunk: blocks a sliding window released may be
    skipped when they are cached already, and the next blocks land at their absolute index."""
    pool = PagedKVPool(8, block_size=4)
    cache = PrefixCache(block_size=4, pool=pool)
    pool.create("w")
    pool.append("w", 4)
    assert cache.insert(A, "t", "r", seq_id="w") == 1
    pool.append("w", 4)
    pool.drop_leading_blocks("w", 1)  # the cache's pin keeps block 0 alive
    assert cache.insert(A + B, "t", "r", seq_id="w") == 1
    pool.release("w")
    pool.create("x")
    assert cache.attach("y", A + B + [1], "t", "r") == 8
    assert pool.page_table("y") == (0, 1)
    pool.validate()
    cache.validate()


def test_pool_mode_insert_and_attach_errors_leave_everything_unchanged():
    """Every insert/attach/evict error path raises clearly; pool and cache stay as they were."""
    pool = PagedKVPool(8, block_size=4)
    cache = PrefixCache(block_size=4, pool=pool)
    compute(pool, cache, "s", A + B + [1])
    pool.create("w")
    pool.append("w", 9)
    pool.drop_leading_blocks("w", 1)
    cases = [
        (ValueError, r"seq_id: required", lambda: cache.insert(A, "t", "r")),
        (KeyError, r"seq_id='zz': unknown sequence", lambda: cache.insert(A, "t", "r", seq_id="zz")),
        (
            ValueError,
            r"tokens: 13 tokens but sequence 's' holds 9",
            lambda: cache.insert(A + B + C + [1], "t", "r", seq_id="s"),
        ),
        (ValueError, r"seq_id='w': its sliding window released", lambda: cache.insert(C + B, "t", "r", seq_id="w")),
        (ValueError, r"seq_id='s': already exists", lambda: cache.attach("s", A + B + [1], "t", "r")),
        (TypeError, r"unhashable", lambda: cache.attach(["x"], A + B + [1], "t", "r")),
        (ValueError, r"n_blocks=-1: must be >= 0", lambda: cache.evict(-1)),
        (TypeError, r"n_blocks=2.0", lambda: cache.evict(2.0)),
    ]
    for exc, match, call in cases:
        before_pool, before_stats, before_len = dump(pool), cache.stats(), len(cache)
        with pytest.raises(exc, match=match):
            call()
        assert (dump(pool), cache.stats(), len(cache)) == (before_pool, before_stats, before_len)
        pool.validate()
        cache.validate()


def test_standalone_mode_errors():
    """A standalone cache rejects seq_id on insert and cannot attach sequences."""
    cache = PrefixCache(block_size=4)
    with pytest.raises(ValueError, match=r"seq_id=1: a standalone cache"):
        cache.insert(A, "t", "r", seq_id=1)
    with pytest.raises(ValueError, match=r"attach: needs a pool-backed cache"):
        cache.attach(1, A, "t", "r")
    assert len(cache) == 0 and cache.stats().requests == 0


def test_pool_refuses_to_release_a_cache_pin():
    """release_block() by anyone but the cache leaves the cache's pin (and everything else) in place."""
    pool = PagedKVPool(4, block_size=4)
    cache = PrefixCache(block_size=4, pool=pool)
    compute(pool, cache, "s", A + [1])
    pool.release("s")
    before = dump(pool)
    for owner in (None, "someone"):
        with pytest.raises(ValueError, match=r"block_id=0: owner .* holds no pin on it .*PrefixCache"):
            pool.release_block(0, owner=owner)
    assert dump(pool) == before
    cache.validate()
    # The block stays cached and is still what attach() shares.
    assert cache.attach("t", A + [1], "t", "r") == 4 and pool.page_table("t")[0] == 0


def test_validate_detects_a_lost_pin_and_clear_changes_nothing():
    """A pin dropped by impersonating the cache is caught by validate(); clear() then raises with nothing changed."""
    pool = PagedKVPool(4, block_size=4)
    cache = PrefixCache(block_size=4, pool=pool)
    compute(pool, cache, "s", A + [1])
    pool.release_block(0, owner=cache)
    with pytest.raises(AssertionError, match=r"block 0 has 0 pool pins of this cache != 1 entries"):
        cache.validate()
    before = (dump(pool), len(cache), cache.stats())
    with pytest.raises(ValueError, match=r"block 0: the pool holds 0 pin\(s\) of this cache"):
        cache.clear()
    assert (dump(pool), len(cache), cache.stats()) == before


# ---------------------------------------------------------------------------- state machine

PROMPTS = st.lists(st.integers(0, 1), min_size=0, max_size=14)
SIDS = st.sampled_from(["s0", "s1", "s2", "s3"])
SCOPES = st.sampled_from(["t1", "t2"])
REVS = st.sampled_from(["r1", "r2"])


class CacheMachine(RuleBasedStateMachine):
    """Requests, decodes, rollbacks, releases and evictions against a position -> KV model.

    The mirror stores, at each (block, slot), the "KV" of a position: (revision, every token up
    to and including it). A false hit, a wrongly shared block, or an evicted block that a sequence
    still reads all show up as a mismatch.
    """

    BS = 4

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagedKVPool(10, block_size=self.BS)
        self.cache = PrefixCache(block_size=self.BS, pool=self.pool)
        self.slots: dict[tuple[int, int], object] = {}
        self.seqs: dict[str, tuple[list[int], str, str]] = {}  # id -> (tokens, scope, rev)

    def write(self, sid: str, plan: AppendPlan, start: int) -> None:
        tokens, _, rev = self.seqs[sid]
        for src, dst, n in plan.copies:
            for s in range(n):
                self.slots[(dst, s)] = self.slots[(src, s)]
        for i, slot in enumerate(plan.slots):
            self.slots[slot] = (rev, tuple(tokens[: start + i + 1]))

    def grow(self, sid: str, new_tokens: list[int]) -> None:
        """Append tokens, evicting idle cached blocks first if the pool is short."""
        need = self.pool.blocks_needed(sid, len(new_tokens))
        if need > self.pool.free_blocks:
            freed = self.cache.evict(need - self.pool.free_blocks)
            assert freed <= need
        if need > self.pool.free_blocks:
            before = dump(self.pool)
            with pytest.raises(PoolExhaustedError):
                self.pool.append(sid, len(new_tokens))
            assert dump(self.pool) == before
            return
        start = len(self.seqs[sid][0])
        self.seqs[sid][0].extend(new_tokens)
        self.write(sid, self.pool.append(sid, len(new_tokens)), start)

    @rule(sid=SIDS, prompt=PROMPTS, scope=SCOPES, rev=REVS)
    def request(self, sid, prompt, scope, rev):
        if sid in self.seqs:
            before = (dump(self.pool), self.cache.stats())
            with pytest.raises(ValueError, match="already exists"):
                self.cache.attach(sid, prompt, scope, rev)
            assert (dump(self.pool), self.cache.stats()) == before
            return
        probe = self.cache.match(prompt, scope, rev, record=False)
        requests = self.cache.stats().requests
        cached = self.cache.attach(sid, prompt, scope, rev)
        assert cached == probe and self.cache.stats().requests == requests + 1
        assert cached % self.BS == 0 and (cached == 0 or cached <= len(prompt) - 1)
        self.seqs[sid] = (list(prompt[:cached]), scope, rev)
        self.grow(sid, list(prompt[cached:]))

    @rule(sid=SIDS, new=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def decode(self, sid, new):
        if sid in self.seqs:
            self.grow(sid, new)

    @rule(sid=SIDS)
    def cache_sequence(self, sid):
        if sid not in self.seqs:
            return
        tokens, scope, rev = self.seqs[sid]
        self.cache.insert(tokens, scope, rev, seq_id=sid)
        full = len(tokens) // self.BS
        expected = min(full, max(0, (len(tokens) - 1) // self.BS)) * self.BS
        assert self.cache.match(tokens, scope, rev, record=False) == expected

    @rule(sid=SIDS, cut=st.integers(0, 20))
    def rollback(self, sid, cut):
        if sid in self.seqs:
            tokens = self.seqs[sid][0]
            new_length = max(0, len(tokens) - cut)
            self.pool.truncate(sid, new_length)
            del tokens[new_length:]

    @rule(sid=SIDS)
    def finish(self, sid):
        if sid in self.seqs:
            self.pool.release(sid)
            del self.seqs[sid]

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        free = self.pool.free_blocks
        evictable = self.cache.evictable_blocks
        freed = self.cache.evict(n)
        assert freed == min(n, evictable)
        assert self.pool.free_blocks == free + freed

    @invariant()
    def consistent(self):
        self.pool.validate()
        self.cache.validate()
        bs = self.BS
        for sid, (tokens, _, rev) in self.seqs.items():
            assert self.pool.num_tokens(sid) == len(tokens)
            table = self.pool.page_table(sid)
            for p in range(len(tokens)):
                assert self.slots[(table[p // bs], p % bs)] == (rev, tuple(tokens[: p + 1]))
        s = self.cache.stats()
        assert 0 <= s.cached_tokens <= s.input_tokens and 0 <= s.hit_requests <= s.requests


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_stats_dataclass_is_frozen():
    """Stats are a snapshot value, not a live view that could be edited."""
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign"):
        PrefixCache().stats().requests = 3
