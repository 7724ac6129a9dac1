"""A PagedBatch read, attended as a layer does, against attention_reference run on each sequence alone."""

import pytest
import torch

from gptoss_lite.config import FULL, SLIDING
from gptoss_lite.engine.paged_batch import PagedBatch, Segment
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.kv.paged_cache import PagedKVStore
from gptoss_lite.model.attention import attend_ragged, attention_reference


def _attend(batch, layer, q, k, v, sinks, window):
    """What an attention layer does with the batch: store k, v (K, N, D), attend q (H, N, D) over the read."""
    read = batch.update(layer, k[None], v[None])
    return attend_ragged(q, read, sinks, window, k.shape[0])


def _batch(config, store, plan, gen):
    """Sequences with (past tokens, new tokens): fill the past with random K/V, append the new ones.
    Returns the batch and, per sequence, its full K/V history per layer kind (for the oracle)."""
    K, D, bs = config.n_kv_heads, config.head_dim, store.block_size
    segments, write_slots, history, offset = [], {kind: [] for kind in store.pools}, [], 0
    for sid, (past, new) in enumerate(plan):
        hist = {}
        for kind, pool in store.pools.items():
            pool.create(sid)
            before = pool.append(sid, past)
            layer = store.layers_of[kind][0]
            keys = torch.randn(past + new, K, D, generator=gen)
            values = torch.randn(past + new, K, D, generator=gen)
            for i, (b, s) in enumerate(before.slots):
                store.k[layer][:, b, s], store.v[layer][:, b, s] = keys[i], values[i]
            if kind == SLIDING:  # drop what no new query can see, as the engine does
                pool.release_before(sid, max(0, past - config.sliding_window + 1))
            after = pool.append(sid, new)
            write_slots[kind].extend(b * bs + s for b, s in after.slots)
            hist[kind] = (keys, values)
        tables = {kind: (pool.page_table(sid), pool.first_block_index(sid) * bs) for kind, pool in store.pools.items()}
        segments.append(Segment(offset=offset, length=new, start_pos=past, tables=tables))
        history.append(hist)
        offset += new
    logits_index = [s.offset + s.length - 1 for s in segments]
    return PagedBatch(store, segments, write_slots, logits_index), history


@pytest.mark.parametrize("plan", [[(0, 1)], [(5, 1), (300, 1), (17, 1)], [(0, 40), (200, 1), (130, 70), (3, 1)]])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_attend_matches_reference_per_sequence(plan, with_sinks):
    config = resolve_config("gpt-oss-tiny")
    gen = torch.Generator().manual_seed(0)
    store = PagedKVStore(config, 200, 16)
    batch, history = _batch(config, store, plan, gen)
    H, D = config.n_heads, config.head_dim
    N = batch.num_rows
    assert batch.positions.tolist() == [p + i for p, n in plan for i in range(n)]
    for kind in (FULL, SLIDING):
        layer = store.layers_of[kind][0]
        window = config.sliding_window if kind == SLIDING else None
        q = torch.randn(H, N, D, generator=gen)
        k_new = torch.cat([h[kind][0][p:] for h, (p, _) in zip(history, plan)]).transpose(0, 1)  # (K, N, D)
        v_new = torch.cat([h[kind][1][p:] for h, (p, _) in zip(history, plan)]).transpose(0, 1)
        sinks = torch.randn(H, generator=gen) if with_sinks else None
        out = _attend(batch, layer, q, k_new, v_new, sinks, window)
        for seg, hist, (past, new) in zip(batch.segments, history, plan):
            keys, values = (t.transpose(0, 1)[None] for t in hist[kind])  # (1, K, S, D)
            rows = q[None, :, seg.offset : seg.offset + new]
            want = attention_reference(rows, keys, values, sinks, past, window)[0]
            torch.testing.assert_close(out[:, seg.offset : seg.offset + new], want, atol=1e-5, rtol=1e-5)


def test_attend_masks_keys_outside_the_window():
    """A decode query far past the window: keys before it in its (resident) blocks get no weight, so
    poisoning them changes nothing."""
    config = resolve_config("gpt-oss-tiny")
    gen = torch.Generator().manual_seed(1)
    store = PagedKVStore(config, 100, 16)
    batch, _ = _batch(config, store, [(200, 1)], gen)
    layer = store.layers_of[SLIDING][0]
    H, K, D = config.n_heads, config.n_kv_heads, config.head_dim
    q, k, v = torch.randn(H, 1, D), torch.randn(K, 1, D), torch.randn(K, 1, D)
    before = _attend(batch, layer, q, k, v, None, config.sliding_window)
    table, first = batch.segments[0].tables[SLIDING]
    visible_from = 200 - config.sliding_window + 1
    assert first < visible_from  # the first resident block holds invisible keys
    block, slot = table[0], 0
    store.k[layer][:, block, slot : visible_from - first] = 1e4
    after = _attend(batch, layer, q, k, v, None, config.sliding_window)
    torch.testing.assert_close(after, before)


@pytest.mark.parametrize("with_prefill", [False, True])
def test_decode_rows_in_length_buckets_match_reference(with_prefill):
    """Twenty decode rows of very different lengths are gathered in several buckets, each padded to its
    own longest row; every row still equals attention_reference on its sequence alone."""
    from gptoss_lite.engine.paged_batch import MAX_DECODE_BUCKETS

    config = resolve_config("gpt-oss-tiny")
    gen = torch.Generator().manual_seed(4)
    store = PagedKVStore(config, 600, 16)
    plan = [(past, 1) for past in (3, 250, 17, 90, 5, 301, 44, 160, 2, 77, 210, 9, 130, 60, 280, 33, 1, 190, 120, 8)]
    if with_prefill:
        plan.insert(7, (40, 30))
    batch, history = _batch(config, store, plan, gen)
    H, D = config.n_heads, config.head_dim
    for kind in (FULL, SLIDING):
        layer = store.layers_of[kind][0]
        window = config.sliding_window if kind == SLIDING else None
        q = torch.randn(H, batch.num_rows, D, generator=gen)
        k_new = torch.cat([h[kind][0][p:] for h, (p, _) in zip(history, plan)]).transpose(0, 1)
        v_new = torch.cat([h[kind][1][p:] for h, (p, _) in zip(history, plan)]).transpose(0, 1)
        sinks = torch.randn(H, generator=gen)
        out = _attend(batch, layer, q, k_new, v_new, sinks, window)
        if kind == FULL:  # full-layer tables differ in width; sliding ones hold about a window each
            assert 1 < len(batch._buckets_of(kind)) <= MAX_DECODE_BUCKETS
        for seg, hist, (past, new) in zip(batch.segments, history, plan):
            keys, values = (t.transpose(0, 1)[None] for t in hist[kind])
            rows = q[None, :, seg.offset : seg.offset + new]
            want = attention_reference(rows, keys, values, sinks, past, window)[0]
            torch.testing.assert_close(out[:, seg.offset : seg.offset + new], want, atol=1e-5, rtol=1e-5)
