"""KV groups (kv/groups.py): one group per layer kind, built from the layers' spec, owning their pool,
prefix cache and window rule; the store's by-kind views are views of the groups."""

from __future__ import annotations

import pytest

from gptoss_lite.config import FULL, SLIDING
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.kv.groups import KVGroup, attach_prefix
from gptoss_lite.kv.paged_cache import PagedKVStore
from gptoss_lite.kv.paged_quant import QuantizedPagedStore
from gptoss_lite.kvspec import DENSE, LayerKind, LayerKVSpec

BS = 4


def sliding_group(layers, total_blocks: int, block_size: int, window: int) -> KVGroup:
    """A sliding group of W = window over specs of 2 heads of 8 (the sizes do not matter here)."""
    return KVGroup(LayerKVSpec(LayerKind.SLIDING, window, DENSE, 4, 2, 8, 2, 8), layers, total_blocks, block_size)


def full_group(layers, total_blocks: int, block_size: int, window: int | None = None) -> KVGroup:
    return KVGroup(LayerKVSpec(LayerKind.FULL, window, DENSE, 4, 2, 8, 2, 8), layers, total_blocks, block_size)


def _filled(group: KVGroup, seq: str, n_tokens: int) -> None:
    group.pool.create(seq)
    group.pool.append(seq, n_tokens)


def test_sliding_group_releases_behind_its_window():
    """A sliding group releases the blocks every slot of which precedes num_computed - W + 1."""
    group = sliding_group((0, 2), total_blocks=10, block_size=BS, window=8)
    _filled(group, "s", 20)  # blocks 0..4 (tokens 0..19)
    assert group.release_window("s", 10) == ()  # window starts at 3: block 0 still needed
    assert group.pool.first_block_index("s") == 0
    assert len(group.release_window("s", 17)) == 2  # window starts at 10: blocks 0 and 1 go
    assert group.released_tokens("s") == 8
    assert group.window_start(17) == 10
    assert group.release_target(17, slack=4) == 6  # rollback slack keeps 4 tokens more


def test_full_group_releases_nothing_without_a_window_and_like_sliding_with_one():
    plain = full_group((1,), total_blocks=10, block_size=BS)
    _filled(plain, "s", 20)
    assert plain.release_window("s", 20) == () and plain.released_tokens("s") == 0
    assert plain.window_start(19) == 0
    windowed = full_group((1,), total_blocks=10, block_size=BS, window=8)
    sliding = sliding_group((0,), total_blocks=10, block_size=BS, window=8)
    for group in (windowed, sliding):
        _filled(group, "s", 20)
        group.release_window("s", 17)
    assert windowed.pool.page_table("s") == sliding.pool.page_table("s")
    assert windowed.released_tokens("s") == sliding.released_tokens("s") == 8


def test_block_arithmetic_per_group():
    """prompt_blocks: all of the prompt without a window, at most window + one step with one;
    growth_blocks: none on a windowed group; min_blocks: one step beside the window."""
    full = full_group((1,), total_blocks=100, block_size=BS)
    sliding = sliding_group((0,), total_blocks=100, block_size=BS, window=8)
    windowed = full_group((1,), total_blocks=100, block_size=BS, window=12)
    assert full.prompt_blocks(100, 16) == 25 + 1
    assert sliding.prompt_blocks(100, 16) == 6 + 1  # 8 + 16 tokens
    assert windowed.prompt_blocks(100, 16) == 7 + 1  # 12 + 16 tokens
    assert sliding.prompt_blocks(5, 16) == full.prompt_blocks(5, 16) == 2 + 1
    assert full.growth_blocks(tokens_left=100, reserve=10) == 3
    assert full.growth_blocks(tokens_left=5, reserve=10) == 2
    assert full.growth_blocks(tokens_left=-3, reserve=10) == 0
    assert full.growth_blocks(tokens_left=100, reserve=0) == 0
    assert sliding.growth_blocks(100, 10) == windowed.growth_blocks(100, 10) == 0
    assert full.min_blocks(16) == 4 + 1 + 0 + 1
    assert sliding.min_blocks(16) == 4 + 1 + 2 + 1


def test_chain_intact_and_attach_prefix():
    """A prompt can still be cached while nothing was released, or while every released block is
    still cached; attach_prefix gives the shortest hit over the groups."""
    full = full_group((1,), total_blocks=20, block_size=BS)
    sliding = sliding_group((0,), total_blocks=20, block_size=BS, window=4)
    prompt = list(range(1, 14))
    for group in (full, sliding):
        _filled(group, "a", len(prompt))
        assert group.chain_intact("a", prompt, "t", "r")
        group.prefix.insert(prompt[:12], "t", "r", seq_id="a")
    assert attach_prefix((full, sliding), "b", prompt, "t", "r") == 12
    sliding.pool.release("b")
    _filled(sliding, "c", len(prompt))  # the same prompt computed again, on blocks of its own
    sliding.release_window("c", 13)  # its tokens 0..7 leave the window of 4
    assert sliding.released_tokens("c") == 8
    assert sliding.chain_intact("c", prompt, "t", "r")  # the cache still holds those blocks for "t"
    assert not sliding.chain_intact("c", prompt, "other-tenant", "r")  # ... but not for another scope
    # the hit is cut back to the shorter group's
    full.pool.release("b")
    full.prefix.clear()
    assert attach_prefix((full, sliding), "d", prompt, "t", "r") == 0
    assert full.pool.num_tokens("d") == sliding.pool.num_tokens("d") == 0


def test_groups_refuse_bad_input():
    with pytest.raises(TypeError, match="LayerKVSpec"):
        KVGroup(LayerKind.FULL, (0,), 4, BS)
    with pytest.raises(ValueError, match="no layers"):
        full_group((), 4, BS)
    with pytest.raises(ValueError, match="window"):
        full_group((0,), 4, BS, window=0)
    with pytest.raises(TypeError, match="window"):
        full_group((0,), 4, BS, window=2.5)


def test_store_views_are_the_groups():
    """store.pools / prefix / layers_of are read-only views of the groups; names are the layer kinds."""
    cfg = resolve_config("lite-tiny")
    store = PagedKVStore(cfg, total_blocks=12, block_size=BS, sliding_blocks=6)
    assert store.kinds == (FULL, SLIDING)
    assert [g.spec for g in store.groups] == [store.specs[1], store.specs[0]]  # each group reads its layers' spec
    for group in store.groups:
        assert store.group(group.name) is group
        assert store.pools[group.name] is group.pool
        assert store.prefix[group.name] is group.prefix
        assert store.layers_of[group.name] == group.layers
        assert all(store.group_of(layer) is group and store.pool(layer) is group.pool for layer in group.layers)
    assert store.group(SLIDING).window == cfg.sliding_window and store.group(SLIDING).pool.total_blocks == 6
    assert store.group(FULL).window is None and store.full_window is None
    with pytest.raises(TypeError):
        store.pools[FULL] = store.group(SLIDING).pool
    with pytest.raises(ValueError, match="no 'nope' layers"):
        store.group("nope")


def test_full_window_lives_in_the_full_group_and_quantised_blocks_refuse_it():
    cfg = resolve_config("lite-tiny")
    store = PagedKVStore(cfg, total_blocks=12, block_size=BS, full_window=8)
    assert store.full_window == store.group(FULL).window == 8
    with pytest.raises(ValueError, match="quantised full-layer blocks hold every key"):
        QuantizedPagedStore(cfg, 12, BS, full_window=8)
