"""Random sequences of pool + prefix-cache operations (pins and releases from both sides, bad arguments
included): after every step both validate(), every sequence reads its own K/V, and a call that raises
changed nothing."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from gptoss_lite.kv.block_pool import PagedKVPool, PoolExhaustedError
from gptoss_lite.kv.prefix import PrefixCache

BS = 4
N_BLOCKS = 10
SIDS = st.sampled_from(["s0", "s1", "s2", "s3", 7])
OWNERS = st.sampled_from([None, "user", "other"])
BLOCKS = st.integers(-1, N_BLOCKS)  # -1 and N_BLOCKS are out of range on purpose
TOKENS = st.lists(st.integers(0, 1), min_size=0, max_size=14)
KEYS = st.sampled_from([("t1", "r1"), ("t2", "r1"), ("t1", "r2")])
ERRORS = (ValueError, TypeError, KeyError, PoolExhaustedError)
STEPS = {"n": 0}  # operations run in this process, counted by `step`


class PoolPrefixMachine(RuleBasedStateMachine):
    """Every rule goes through `step`, which checks no-mutation-on-error; invariants run after every rule."""

    @initialize()
    def setup(self):
        self.pool = PagedKVPool(N_BLOCKS, block_size=BS)
        self.cache = PrefixCache(block_size=BS, pool=self.pool)
        self.slots: dict[tuple[int, int], object] = {}  # (block, slot) -> the K/V written there
        self.seqs: dict[object, tuple[list[int], tuple[str, str]]] = {}  # id -> (tokens, (scope, rev))
        self.user_pins: dict[tuple[object, int], int] = {}  # (owner, block) -> pins we took

    # ---- helpers ------------------------------------------------------------------------------------
    def state(self):
        c = self.cache
        return (
            json.dumps(self.pool.snapshot(), sort_keys=True),
            list(c._entries.items()),
            dict(c._block_pins),
            c.stats(),
        )

    def step(self, fn, *args, **kwargs):
        """Run one operation; if it raises, nothing may have changed."""
        STEPS["n"] += 1
        before = self.state()
        try:
            return True, fn(*args, **kwargs)
        except ERRORS:
            assert self.state() == before, f"{fn.__name__}{args} raised but changed state"
            return False, None

    def write(self, sid, plan, start):
        tokens, key = self.seqs[sid]
        for src, dst, n in plan.copies:
            for s in range(n):
                self.slots[(dst, s)] = self.slots[(src, s)]
        for i, slot in enumerate(plan.slots):
            self.slots[slot] = (key, tuple(tokens[: start + i + 1]))

    # ---- sequences --------------------------------------------------------------------------------
    @rule(sid=SIDS, prompt=TOKENS, key=KEYS)
    def request(self, sid, prompt, key):
        ok, cached = self.step(self.cache.attach, sid, prompt, *key)
        assert ok == (sid not in self.seqs)
        if ok:
            self.seqs[sid] = (list(prompt[:cached]), key)
            self.append(sid, list(prompt[cached:]))

    def append(self, sid, new):
        ok, plan = self.step(self.pool.append, sid, len(new))
        if ok:
            start = len(self.seqs[sid][0])
            self.seqs[sid][0].extend(new)
            self.write(sid, plan, start)

    @rule(sid=SIDS, new=st.lists(st.integers(0, 1), min_size=0, max_size=6))
    def decode(self, sid, new):
        if sid in self.seqs:
            self.append(sid, new)
        else:
            assert not self.step(self.pool.append, sid, len(new))[0]

    @rule(sid=SIDS, n=st.integers(-2, 3))
    def bad_append(self, sid, n):
        if n < 0 or sid not in self.seqs:
            assert not self.step(self.pool.append, sid, n)[0]

    @rule(sid=SIDS, cut=st.integers(-1, 20))
    def rollback(self, sid, cut):
        tokens = self.seqs[sid][0] if sid in self.seqs else []
        new_length = len(tokens) - cut
        ok, _ = self.step(self.pool.truncate, sid, new_length)
        if ok:
            del tokens[new_length:]

    @rule(sid=SIDS)
    def finish(self, sid):
        ok, _ = self.step(self.pool.release, sid)
        assert ok == (sid in self.seqs)
        if ok:
            del self.seqs[sid]

    # ---- the cache's side -------------------------------------------------------------------------------
    @rule(sid=SIDS, drop=st.integers(0, 3))
    def cache_sequence(self, sid, drop):
        tokens, key = self.seqs[sid] if sid in self.seqs else ([0] * 4, ("t1", "r1"))
        self.step(self.cache.insert, tokens[: max(0, len(tokens) - drop)], *key, seq_id=sid)

    @rule(prompt=TOKENS, key=KEYS)
    def probe(self, prompt, key):
        ok, hit = self.step(self.cache.match, prompt, *key, record=False)
        assert ok and hit % BS == 0

    @rule(n=st.integers(-1, 4))
    def evict(self, n):
        free, evictable = self.pool.free_blocks, self.cache.evictable_blocks
        ok, freed = self.step(self.cache.evict, n)
        assert ok == (n >= 0)
        if ok:
            assert freed == min(n, evictable) and self.pool.free_blocks == free + freed

    @rule()
    def clear(self):
        ok, _ = self.step(self.cache.clear)
        assert ok and len(self.cache) == 0

    # ---- the pool's pins, from outside the cache ------------------------------------------------------
    @rule(block=BLOCKS, owner=OWNERS)
    def retain(self, block, owner):
        ok, _ = self.step(self.pool.retain, block, owner=owner)
        if ok:
            self.user_pins[(owner, block)] = self.user_pins.get((owner, block), 0) + 1

    @rule(block=BLOCKS, owner=OWNERS)
    def release_block(self, block, owner):
        ok, _ = self.step(self.pool.release_block, block, owner=owner)
        assert ok == (self.user_pins.get((owner, block), 0) > 0), "a pin was released by a non-owner"
        if ok:
            self.user_pins[(owner, block)] -= 1

    # ---- after every step ------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        self.pool.validate()
        self.cache.validate()
        for (owner, block), n in self.user_pins.items():
            assert self.pool.pins(block, owner=owner) == n
        for sid, (tokens, key) in self.seqs.items():
            table = self.pool.page_table(sid)
            for p in range(len(tokens)):  # no sequence ever reads a recycled or foreign block
                assert self.slots[(table[p // BS], p % BS)] == (key, tuple(tokens[: p + 1]))


def test_pool_and_prefix_cache_survive_ten_thousand_random_operations():
    """>= 10,000 random pool/prefix-cache operations keep every invariant; failed calls change nothing."""
    STEPS["n"] = 0
    run_state_machine_as_test(
        PoolPrefixMachine,
        settings=settings(
            max_examples=220,
            stateful_step_count=60,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    assert STEPS["n"] >= 10_000, STEPS["n"]
