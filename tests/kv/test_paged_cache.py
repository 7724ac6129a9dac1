"""Tests for the paged K/V store and PagedKVCache (docs/paged.md; the protocol: docs/kv-cache.md#the-cache-protocol)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import make_model
from gptoss_lite.config import FULL, SLIDING
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.generation import generate
from gptoss_lite.kv.block_pool import PoolExhaustedError
from gptoss_lite.kv.mixed import MixedKVCache
from gptoss_lite.kv.paged_cache import PagedKVCache, PagedKVStore

BS = 4  # small blocks so a window of 8 spans several blocks


def _prompt(B: int, T: int, seed: int = 0, vocab: int = 264) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _state(store: PagedKVStore) -> tuple[str, list[torch.Tensor]]:
    snaps = json.dumps({kind: pool.snapshot() for kind, pool in store.pools.items()}, sort_keys=True)
    return snaps, [t.clone() for t in store.k + store.v]


def _assert_same_state(store: PagedKVStore, before: tuple[str, list[torch.Tensor]]) -> None:
    snaps, tensors = _state(store)
    assert snaps == before[0]
    assert all(torch.equal(a, b) for a, b in zip(tensors, before[1]))


@torch.inference_mode()
def _greedy(model, cache, ids: torch.Tensor, start: int, n: int) -> list[list[int]]:
    """Greedy continuation of ids (B, T) placed at absolute `start`; n new tokens per row."""
    logits = model(ids, cache=cache, start_pos=start, last_only=True).logits
    pos, out = start + ids.shape[1], []
    for i in range(n):
        token = logits[:, -1].argmax(-1)  # (B,)
        out.append(token)
        if i + 1 < n:
            logits = model(token[:, None], cache=cache, start_pos=pos, last_only=True).logits
            pos += 1
    return torch.stack(out, dim=1).tolist()


@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny"])
@pytest.mark.parametrize("B,T", [(1, 5), (1, 21), (2, 5), (2, 21)])
def test_generation_matches_mixed_cache(preset, B, T):
    """Greedy generation through the paged cache equals MixedKVCache token for token."""
    model = make_model(preset)
    ids = _prompt(B, T, seed=T + B)
    expected = generate(model, ids, max_new_tokens=64, temperature=0, cache=MixedKVCache(model.config, B))
    # A prefill chunk of 7 reads W - 1 + 7 keys: ceil(14 / bs) + 1 blocks per row at most.
    store = PagedKVStore(model.config, total_blocks=B * 30, block_size=BS, sliding_blocks=B * 5)
    cache = PagedKVCache(model.config, store, [f"r{b}" for b in range(B)])
    got = generate(model, ids, max_new_tokens=64, temperature=0, cache=cache, prefill_chunk=7)
    assert torch.equal(got, expected)
    assert cache.num_tokens == T + 63
    assert all(len(store.pools[SLIDING].page_table(f"r{b}")) <= math.ceil(8 / BS) + 1 for b in range(B))
    for pool in store.pools.values():
        pool.validate()


@pytest.mark.parametrize("chunk", [1, 3, 9])
def test_chunked_prefill_logits_match_one_shot(chunk):
    """Chunked prefill through the paged cache gives one-shot (uncached) logits within 1e-5."""
    model = make_model("gpt-oss-tiny")
    ids = _prompt(2, 23, seed=3)
    with torch.inference_mode():
        ref = model(ids).logits  # (B, T, V)
        store = PagedKVStore(model.config, total_blocks=40, block_size=BS)
        cache = PagedKVCache(model.config, store, ["a", "b"])
        pieces = [model(ids[:, s : s + chunk], cache=cache, start_pos=s).logits for s in range(0, ids.shape[1], chunk)]
    got = torch.cat(pieces, dim=1)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5


def test_sliding_blocks_bounded_over_long_decode():
    """Over a 2,000-token decode a sliding layer holds <= ceil(W/bs)+1 blocks; full ones grow."""
    cfg = resolve_config("lite-tiny")
    W, K, D, n = cfg.sliding_window, cfg.n_kv_heads, cfg.head_dim, 2000
    bound = math.ceil(W / BS) + 1
    store = PagedKVStore(cfg, total_blocks=n // BS + 1, block_size=BS, sliding_blocks=bound)
    cache = PagedKVCache(cfg, store, ["s"])
    gen = torch.Generator().manual_seed(0)
    history = torch.randn(n, K, D, generator=gen)
    wpool, gpool = store.pools[SLIDING], store.pools[FULL]
    for p in range(n):
        k = history[p].view(1, K, 1, D)  # (B, K, T, D)
        for layer in range(cfg.n_layers):
            read = cache.update(layer, k, -k, p)
            (keys, _), first = read.materialize(), read.first
            if layer == 0 and p in (0, 7, 8, 13, 1999):  # sliding reads are exactly the window's blocks
                assert first == p + 1 - keys.shape[2] and first % BS == 0
                assert first <= max(0, p - W + 1) < first + BS
                assert torch.equal(keys[0].transpose(0, 1), history[first : p + 1])
        assert len(wpool.page_table("s")) <= bound
        assert len(gpool.page_table("s")) == p // BS + 1
    read = cache.update(1, history[:1].view(1, K, 1, D), history[:1].view(1, K, 1, D), n)
    (keys, _), first = read.materialize(), read.first
    assert first == 0 and keys.shape == (1, K, n + 1, D)
    assert torch.equal(keys[0, :, :n].transpose(0, 1), history)


def test_cow_shared_partial_block_on_real_tensors():
    """A shared partial last block is copied before the writer appends; the reader's view is unchanged."""
    model = make_model("lite-tiny")
    store = PagedKVStore(model.config, total_blocks=20, block_size=BS)
    parent = PagedKVCache(model.config, store, ["p"])
    ids = _prompt(1, 6, seed=1)  # 6 tokens: block 0 full, block 1 half filled
    with torch.inference_mode():
        model(ids, cache=parent, start_pos=0)
    child = parent.fork(["c"])
    gpool = store.pools[FULL]
    shared = gpool.page_table("p")[1]
    assert gpool.page_table("c") == gpool.page_table("p") and gpool.refcount(shared) == 2
    views = {layer: [t.clone() for t in store.gather("p", layer)] for layer in range(4)}
    child_tokens = _greedy(model, child, torch.tensor([[7]]), 6, 5)
    assert gpool.page_table("c")[0] == gpool.page_table("p")[0]  # full block: still shared
    assert gpool.page_table("c")[1] != shared and gpool.refcount(shared) == 1  # copied
    for layer in range(4):
        k, v = store.gather("p", layer)
        assert torch.equal(k, views[layer][0]) and torch.equal(v, views[layer][1])
        ck, cv = store.gather("c", layer)
        n = views[layer][0].shape[1]
        assert torch.equal(ck[:, :n], views[layer][0]) and torch.equal(cv[:, :n], views[layer][1])
    # The parent continues as if the child never existed.
    parent_tokens = _greedy(model, parent, torch.tensor([[7]]), 6, 5)
    fresh = PagedKVCache(model.config, store, ["f"])
    assert _greedy(model, fresh, torch.cat([ids, torch.tensor([[7]])], 1), 0, 5) == parent_tokens == child_tokens
    for pool in store.pools.values():
        pool.validate()


def test_prefix_hit_shares_blocks_and_generation_matches():
    """A prefix-cache hit shares physical blocks in both pools and generates as a cold start does."""
    model = make_model("lite-tiny")
    store = PagedKVStore(model.config, total_blocks=60, block_size=BS)
    prompt = _prompt(1, 18, seed=5)[0].tolist()
    donor = PagedKVCache(model.config, store, ["donor"])
    cold = _greedy(model, donor, torch.tensor([prompt]), 0, 20)
    donor.close()
    donor = PagedKVCache(model.config, store, ["donor2"])
    _greedy(model, donor, torch.tensor([prompt]), 0, 1)  # one-chunk prefill: nothing released yet
    assert donor.insert_prefix([prompt], "tenant", "rev") == 2 * 4  # 4 full blocks per pool
    donor.close()
    free = {kind: pool.free_blocks for kind, pool in store.pools.items()}
    cache, n = PagedKVCache.from_prefix(model.config, store, ["hit"], [prompt], "tenant", "rev")
    assert n == 16 and cache.num_tokens == 16
    for kind, pool in store.pools.items():
        table = pool.page_table("hit")
        assert len(table) == 4 and pool.free_blocks == free[kind]  # no new blocks for the hit
        assert all(pool.refcount(b) == 2 for b in table)  # the cache's pin + this sequence
    assert _greedy(model, cache, torch.tensor([prompt[n:]]), n, 20) == cold
    again, n = PagedKVCache.from_prefix(model.config, store, ["hit2"], [prompt], "tenant", "rev")
    out = generate(model, torch.tensor([prompt]), 20, temperature=0, cache=again)  # prefills the rest only
    assert out[:, len(prompt) :].tolist() == cold
    assert store.prefix[FULL].stats().hit_requests == 2
    other, m = PagedKVCache.from_prefix(model.config, store, ["miss"], [prompt], "other-tenant", "rev")
    assert m == 0 and other.num_tokens == 0  # scope isolates tenants


def test_a_whole_prompt_hit_leaves_the_last_block_to_run():
    """A prompt of whole blocks hits all but its last block (the last token must run to give the
    first logits), and generate() continues from the hit exactly as a cold start does."""
    model = make_model("lite-tiny")
    store = PagedKVStore(model.config, total_blocks=60, block_size=BS)
    prompt = _prompt(1, 4 * BS, seed=9)[0].tolist()
    cold = generate(model, torch.tensor([prompt]), 12, temperature=0)
    donor = PagedKVCache(model.config, store, ["donor"])
    _greedy(model, donor, torch.tensor([prompt]), 0, 1)
    assert donor.insert_prefix([prompt], "t", "r") == 2 * 4
    donor.close()
    cache, n = PagedKVCache.from_prefix(model.config, store, ["hit"], [prompt], "t", "r")
    assert n == len(prompt) - BS and cache.num_tokens == n
    assert torch.equal(generate(model, torch.tensor([prompt]), 12, temperature=0, cache=cache), cold)
    for pool in store.pools.values():
        pool.validate()


def test_pool_exhausted_leaves_store_and_pool_unchanged():
    """An append that does not fit raises PoolExhaustedError and changes no bookkeeping or tensor."""
    model = make_model("lite-tiny")
    store = PagedKVStore(model.config, total_blocks=5, block_size=BS)
    cache = PagedKVCache(model.config, store, ["a", "b"])
    with torch.inference_mode():
        model(_prompt(2, 6), cache=cache, start_pos=0)  # 2 blocks per row and pool
        before = _state(store)
        with pytest.raises(PoolExhaustedError, match="needs 2 free blocks in the full-layer pool but 1 are free"):
            model(_prompt(2, 3), cache=cache, start_pos=6)
    _assert_same_state(store, before)
    assert cache.num_tokens == 6
    with torch.inference_mode():
        model(_prompt(2, 2), cache=cache, start_pos=6)  # still usable: fills the last blocks
    assert cache.num_tokens == 8


def test_truncate_rollback_and_rejections():
    """truncate inside the retained interval matches a fresh run; outside it is rejected unchanged."""
    model = make_model("lite-tiny")
    store = PagedKVStore(model.config, total_blocks=40, block_size=BS)
    cache = PagedKVCache(model.config, store, ["s"], rollback_tokens=4)
    ids = _prompt(1, 30, seed=9)
    with torch.inference_mode():
        for p in range(30):  # token-by-token: windowed blocks get released
            model(ids[:, p : p + 1], cache=cache, start_pos=p)
    start = store.pools[SLIDING].first_block_index("s") * BS
    assert start > 0
    before = _state(store)
    lowest = start + model.config.sliding_window - 1
    with pytest.raises(ValueError, match="before the retained interval"):
        cache.truncate(lowest - 1)
    with pytest.raises(ValueError, match="outside"):
        cache.truncate(31)
    with pytest.raises(TypeError, match="must be an int"):
        cache.truncate(True)
    _assert_same_state(store, before)
    assert lowest <= 30 - 4  # rollback_tokens=4 guarantees at least 4 tokens of rollback
    cache.truncate(lowest)
    tail = ids[:, lowest:]
    fresh = PagedKVCache(model.config, store, ["f"])
    assert _greedy(model, cache, tail, lowest, 6) == _greedy(model, fresh, ids, 0, 6)


def test_bad_inputs_rejected():
    """Wrong shapes, dtypes, positions and ids raise clear errors before anything changes."""
    cfg = resolve_config("lite-tiny")
    store = PagedKVStore(cfg, total_blocks=8, block_size=BS)
    cache = PagedKVCache(cfg, store, ["a"])
    k = torch.zeros(1, cfg.n_kv_heads, 2, cfg.head_dim)
    before = _state(store)
    with pytest.raises(ValueError, match="expected \\(B, K, T, D\\)"):
        cache.update(0, k[:, :1], k[:, :1], 0)
    with pytest.raises(ValueError, match="dtype/device"):
        cache.update(0, k.double(), k.double(), 0)
    with pytest.raises(ValueError, match="positions must continue"):
        cache.update(0, k, k, 3)
    with pytest.raises(ValueError, match="already live"):
        PagedKVCache(cfg, store, ["a"])
    with pytest.raises(ValueError, match="duplicate"):
        PagedKVCache(cfg, store, ["x", "x"])
    with pytest.raises(ValueError, match="config differs"):
        PagedKVCache(resolve_config("gpt-oss-tiny"), store, ["y"])
    _assert_same_state(store, before)
    cache.update(0, k, k, 0)
    with pytest.raises(ValueError, match="appends 2"):
        cache.update(2, k[:, :, :1], k[:, :, :1], 0)
    with pytest.raises(ValueError, match="unfinished"):
        cache.update(0, k, k, 2)


def test_reset_releases_and_accounting():
    """reset() returns every block to the pools; nbytes counts held blocks across layers."""
    model = make_model("lite-tiny")
    store = PagedKVStore(model.config, total_blocks=10, block_size=BS)
    cache = PagedKVCache(model.config, store, ["a"])
    with torch.inference_mode():
        model(_prompt(1, 6), cache=cache, start_pos=0)
    per_block = 2 * BS * model.config.n_kv_heads * model.config.head_dim * 4 * 2  # K+V, fp32, 2 layers
    assert cache.nbytes == 2 * 2 * per_block  # 2 blocks in each of 2 pools
    assert cache.payload_bytes == 2 * 6 * per_block // BS
    cache.reset()
    assert cache.num_tokens == 0 and cache.nbytes == 0
    assert all(pool.free_blocks == 10 for pool in store.pools.values())
    out = generate(model, _prompt(1, 3), max_new_tokens=2, temperature=0, cache=cache)
    assert out.shape == (1, 5)
