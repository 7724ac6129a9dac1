"""Quantised paged blocks: the engine's reads equal dequantise-then-reference attention, the stored
blocks are within a quantisation step of what was written, and the bytes are what the planner says."""

import pytest
import torch

from gptoss_lite.config import FULL, SLIDING
from gptoss_lite.engine import paged_batch
from gptoss_lite.engine.paged_batch import PagedBatch, Segment
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.kv.paged_quant import QuantizedPagedStore
from gptoss_lite.kv.quant import CODECS
from gptoss_lite.kvspec import kv_format
from gptoss_lite.model.attention import attend_ragged, attention_reference
from gptoss_lite.plan.core import AttentionKVGeometry, quantized_kv_bytes


def _attend(batch, layer, q, k, v, sinks, window):
    """What an attention layer does with the batch: store k, v (K, N, D), attend q (H, N, D) over the read."""
    read = batch.update(layer, k[None], v[None])
    return attend_ragged(q, read, sinks, window, k.shape[0])


def _step(store, plan, gen, sids):
    """One step over the store: per sequence (sid, new tokens) append random K/V for every layer kind;
    returns the batch, the new K/V per kind (K, N, D) and the segments."""
    config = store.config
    K, D, bs = config.n_kv_heads, config.head_dim, store.block_size
    segments, write_slots, offset = [], {kind: [] for kind in store.pools}, 0
    for sid, new in zip(sids, plan):
        start = store.pools[FULL].num_tokens(sid)
        for kind, pool in store.pools.items():
            if kind == SLIDING:
                pool.release_before(sid, max(0, start - config.sliding_window + 1))
            after = pool.append(sid, new)
            store.apply_copies(kind, after.copies)
            write_slots[kind].extend(b * bs + s for b, s in after.slots)
        tables = {kind: (pool.page_table(sid), pool.first_block_index(sid) * bs) for kind, pool in store.pools.items()}
        segments.append(Segment(offset=offset, length=new, start_pos=start, tables=tables))
        offset += new
    batch = PagedBatch(store, segments, write_slots, [s.offset + s.length - 1 for s in segments])
    N = offset
    kv = {kind: (torch.randn(K, N, D, generator=gen), torch.randn(K, N, D, generator=gen)) for kind in store.pools}
    return batch, kv


@pytest.mark.parametrize("fmt", sorted(CODECS))
@pytest.mark.parametrize("with_sinks", [True, False])
def test_quantised_reads_match_dequantise_then_reference(fmt, with_sinks, monkeypatch):
    """Several steps (prefill chunks, decodes, blocks completing mid-step); each full-layer output equals
    attention_reference over the sequence's dequantised history (`gather`) within 1e-5."""
    monkeypatch.setattr(paged_batch, "QUANT_READ_ELEMENTS", 4096)  # several column chunks per decode read
    config = resolve_config("gpt-oss-tiny")
    gen = torch.Generator().manual_seed(0)
    store = QuantizedPagedStore(config, 120, 16, full_format=fmt, tail_blocks=16)
    for sid in range(3):
        for pool in store.pools.values():
            pool.create(sid)
    H, D = config.n_heads, config.head_dim
    layer = store.layers_of[FULL][0]
    sinks = torch.randn(H, generator=gen) if with_sinks else None
    for plan in ([40, 1, 15], [1, 70, 1], [1, 1, 1], [30, 1, 16], [1, 1, 1]):
        batch, kv = _step(store, plan, gen, range(3))
        q = torch.randn(H, batch.num_rows, D, generator=gen)
        for kind, lyr in ((SLIDING, store.layers_of[SLIDING][0]), (FULL, layer)):
            window = config.sliding_window if kind == SLIDING else None
            out = _attend(batch, lyr, q, *kv[kind], sinks, window)
            for seg in batch.segments:
                sid = batch.segments.index(seg)
                keys, values = (t[None] for t in store.gather(sid, lyr))  # (1, K, S', D) resident
                first = seg.tables[kind][1]
                rows = q[None, :, seg.offset : seg.offset + seg.length]
                want = attention_reference(rows, keys, values, sinks, seg.start_pos - first, window)[0]
                got = out[:, seg.offset : seg.offset + seg.length]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            for other in store.layers_of[kind][1:]:  # keep every layer of the kind written
                _attend(batch, other, q, *kv[kind], sinks, window)
    assert store.tails_in_use <= 3 + 3  # the partial blocks of live sequences (+ this step's completions)


@pytest.mark.parametrize("bits", [8, 4])
def test_stored_blocks_are_within_a_step_of_what_was_written(bits):
    config = resolve_config("gpt-oss-tiny")
    gen = torch.Generator().manual_seed(1)
    store = QuantizedPagedStore(config, 40, 16, full_format=bits, tail_blocks=8)
    for pool in store.pools.values():
        pool.create(0)
    batch, kv = _step(store, [50], gen, [0])
    layer = store.layers_of[FULL][0]
    H, D = config.n_heads, config.head_dim
    _attend(batch, layer, torch.randn(H, 50, D), *kv[FULL], None, None)
    keys, values = store.gather(0, layer)  # (K, 50, D)
    k, v = kv[FULL]
    qmax = (1 << bits) - 1
    key_step = (k[:, :48].unflatten(1, (3, 16)).amax(2) - k[:, :48].unflatten(1, (3, 16)).amin(2)) / qmax
    assert ((keys[:, :48] - k[:, :48]).abs().unflatten(1, (3, 16)) <= key_step[:, :, None] * 0.5 + 2e-3).all()
    value_step = (v[:, :48].amax(-1) - v[:, :48].amin(-1)) / qmax
    assert ((values[:, :48] - v[:, :48]).abs() <= value_step[..., None] * 0.5 + 2e-3).all()
    torch.testing.assert_close(keys[:, 48:], k[:, 48:])  # the partial block is full precision
    torch.testing.assert_close(values[:, 48:], v[:, 48:])


@pytest.mark.parametrize("fmt", sorted(CODECS))
def test_block_bytes_match_the_planner(fmt):
    """n complete blocks of a sequence cost what the planner charges n·bs quantised tokens (key group =
    block, no residual), and the store allocates exactly its blocks' bytes plus the tails."""
    config = resolve_config("gpt-oss-tiny")
    store = QuantizedPagedStore(config, 64, 16, full_format=fmt, tail_blocks=4)
    bits = kv_format(fmt).bits
    K, D, bs = config.n_kv_heads, config.head_dim, 16
    vg = 64 if D % 64 == 0 else D
    # codes of K and V, a float16 scale and zero per key channel (key group = the block) and per value
    # group of each token, in every full layer
    per_block = (2 * K * bs * D * bits // 8 + 2 * 2 * K * D + 2 * 2 * K * bs * (D // vg)) * len(config.full_layers)
    assert store.block_bytes(FULL) == per_block
    geometry = AttentionKVGeometry(
        "tiny",
        config.n_layers,
        config.n_kv_heads,
        config.head_dim,
        bytes_per_element=4,
        sliding_layers=len(config.sliding_layers),
        sliding_window=config.sliding_window,
    )
    T = 64 * 16
    planned = quantized_kv_bytes(geometry, T, bits, key_group=16, residual=0)
    sliding = geometry.bytes_per_token_per_layer * min(T, config.sliding_window) * len(config.sliding_layers)
    assert planned - sliding == 64 * per_block
    dense = sum(t.numel() * t.element_size() for t in store.k + store.v)
    assert store.nbytes == dense + 64 * per_block + store.tail_bytes
    fp_block = 2 * config.n_kv_heads * 16 * config.head_dim * 4 * len(config.full_layers)
    assert fp_block / per_block >= (3.2 if bits == 4 else 1.8)


def test_tails_of_released_sequences_are_reclaimed():
    config = resolve_config("gpt-oss-tiny")
    gen = torch.Generator().manual_seed(2)
    store = QuantizedPagedStore(config, 40, 16, full_format=8, tail_blocks=2)
    for sid in (0, 1):
        for pool in store.pools.values():
            pool.create(sid)
    _step(store, [5, 7], gen, [0, 1])
    assert store.tails_in_use == 2
    for pool in store.pools.values():
        pool.release(0)
        pool.create(2)
    _step(store, [3], gen, [2])  # needs a tail: sequence 0's is reclaimed
    assert store.tails_in_use == 2
    with pytest.raises(RuntimeError, match="tail blocks"):
        for pool in store.pools.values():
            pool.create(3)
        _step(store, [1], gen, [3])
