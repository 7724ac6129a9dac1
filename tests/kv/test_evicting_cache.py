"""Eviction during generation (kv/evicting_cache.py): budget, exact positions, the H2O mass, the rules."""

import pytest
import torch

from gptoss_lite.fixtures import resolve_config
from gptoss_lite.generation import generate, stream_generate
from gptoss_lite.kv.base import KVRead, TensorSegment
from gptoss_lite.kv.evict import heavy_hitter_indices, streaming_keep_indices
from gptoss_lite.kv.evicting_cache import EvictingBuffer, EvictingKVCache
from gptoss_lite.kv.mixed import MixedKVCache
from gptoss_lite.kv.settings import KVSettings
from gptoss_lite.model.attention import attend, attention_mass_reference


def _ids(model, B=2, T=40, seed=0):
    return torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_budget_covering_the_context_equals_the_full_cache(tiny_model, policy):
    """A budget >= every token ever held evicts nothing: the same tokens as the plain mixed cache."""
    ids = _ids(tiny_model)
    ref = generate(tiny_model, ids, max_new_tokens=16, temperature=0, prefill_chunk=16)
    cache = EvictingKVCache(tiny_model.config, batch_size=2, budget=56, policy=policy)
    out = generate(tiny_model, ids, max_new_tokens=16, temperature=0, prefill_chunk=16, cache=cache)
    assert torch.equal(out, ref)
    assert cache.num_resident(1) == 55  # 40 prompt + 15 fed back (the last token is never run)


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_generation_never_exceeds_the_budget(tiny_model, policy):
    """After every step each full layer holds at most `budget` tokens per head, in `budget` slots."""
    cache = EvictingKVCache(tiny_model.config, batch_size=2, budget=12, policy=policy)
    held = []
    for _ in stream_generate(
        tiny_model, _ids(tiny_model), max_new_tokens=20, temperature=0, prefill_chunk=8, cache=cache
    ):
        for layer in (1, 3):
            held.append(cache.num_resident(layer))
            assert cache[layer].k.shape[2] == 12 and cache.positions(layer).shape[2] == cache.num_resident(layer)
    assert max(held) == 12 and cache.num_tokens == 59
    ring = 2 * tiny_model.config.sliding_window
    per_slot = 2 * 2 * tiny_model.config.n_kv_heads * tiny_model.config.head_dim * 4  # K+V, B=2, fp32
    assert cache.nbytes == per_slot * (ring + 2 * 12)


def test_streaming_keeps_sinks_and_recent_at_exact_positions(tiny_model):
    """StreamingLLM holds positions {0..s-1} and the last budget - s (kv.evict.streaming_keep_indices),
    and layer 1's stored keys at prompt positions are bit-identical to a full cache's (RoPE at the
    original positions, never re-rotated; layer 1's keys depend only on the tokens and the sliding
    layer 0, so the prompt's keys are the same in both caches)."""
    ids = _ids(tiny_model, B=1)
    full = MixedKVCache(tiny_model.config)
    generate(tiny_model, ids, 10, temperature=0, prefill_chunk=8, cache=full)
    cache = EvictingKVCache(tiny_model.config, budget=16, policy="streaming", sink_tokens=4)
    generate(tiny_model, ids, 10, temperature=0, prefill_chunk=8, cache=cache)
    n = cache.num_tokens
    for layer in (1, 3):
        assert sorted(cache.positions(layer)[0, 0].tolist()) == list(streaming_keep_indices(n, 16, 4))
    pos = cache.positions(1)  # (1, K, 16)
    keys, values = cache.get(1)
    full_k, full_v = full.get(1)
    prompt = pos < ids.shape[1]
    assert prompt.sum() > 4 * pos.shape[1]  # sinks and some recent prompt tokens are compared
    idx = pos[..., None].expand_as(keys)
    sel = prompt[..., None].expand_as(keys)
    assert torch.equal(keys[sel], full_k.gather(2, idx)[sel]) and torch.equal(values[sel], full_v.gather(2, idx)[sel])


@pytest.mark.parametrize("window", [None, 5])
def test_kernel_mass_equals_dense_probabilities(window):
    """The attention mass `attend` adds (second pass, block by block) equals the column sums of
    the dense reference probabilities, per KV head (1e-5), with sinks."""
    g = torch.Generator().manual_seed(0)
    B, H, K, T, P, D = 2, 4, 2, 7, 30, 8
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, K, P + T, D, generator=g), torch.randn(B, K, P + T, D, generator=g)
    sinks = torch.randn(H, generator=g)
    blocks = KVRead(
        [TensorSegment(k[:, :, :P], v[:, :, :P]), TensorSegment(k[:, :, P:], v[:, :, P:])],
        0,
        K,
        mass=torch.zeros(B, K, P + T),
    )
    list(blocks.blocks(4))  # iterable more than once
    attend(q, blocks, sinks, P, window)
    ref = attention_mass_reference(q, k, sinks, P, window)
    assert blocks.mass.shape == (B, K, P + T)
    assert torch.allclose(blocks.mass, ref, atol=1e-5)
    assert blocks.mass.sum() < B * H * T  # the sink takes some of every query's mass


def _buffer(policy, budget, recent=2, sinks=1):
    return EvictingBuffer(1, 2, 4, budget, policy, sinks, recent)


def test_h2o_keeps_recent_and_heaviest_like_the_rule():
    """H2O: after a decode step over a full buffer, each head keeps the `recent` newest positions and the
    heaviest of the rest; the kept set equals kv.evict.heavy_hitter_indices on the older tokens."""
    buf = _buffer("h2o", budget=6, recent=2)
    x = torch.randn(1, 2, 6, 4)
    blocks = buf.stage(x, x, 0)
    blocks.mass += torch.tensor([[[5.0, 1, 4, 0.5, 3, 2], [0.1, 9, 8, 7, 0.2, 0.3]]])
    buf.commit()
    y = torch.randn(1, 2, 1, 4)
    blocks = buf.stage(y, y, 6)
    blocks.mass += torch.tensor([[[0.0, 0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0, 1]]])
    buf.commit()
    masses = [[5.0, 1, 4, 0.5], [0.1, 9, 8, 7]]  # positions 0..3; 4..6 are within recent=2 of the end? no: 5, 6
    for head in range(2):
        kept = sorted(buf.positions()[0, head].tolist())
        older = masses[head] + [[3.0, 0.2][head]]  # positions 0..4 compete; 5 and 6 are the recent two
        heavy = heavy_hitter_indices(older, 4)
        assert kept == sorted(list(heavy) + [5, 6])
    assert buf.num_resident == 6


def test_streaming_chunk_eviction_matches_the_rule():
    """A chunk that overflows the budget keeps exactly streaming_keep_indices(end, budget, sinks)."""
    buf = _buffer("streaming", budget=5, sinks=2)
    for start, T in ((0, 3), (3, 4), (7, 1), (8, 6)):
        x = torch.randn(1, 2, T, 4)
        buf.stage(x, x, start)
        buf.commit()
        assert sorted(buf.positions()[0, 1].tolist()) == list(streaming_keep_indices(start + T, 5, 2))


def test_bad_arguments_raise():
    """Unknown policy, sinks >= budget, budget < 2 and rollback slack are refused before anything is built."""
    cfg = resolve_config("lite-tiny")
    with pytest.raises(ValueError, match="policy='lru'"):
        EvictingKVCache(cfg, budget=8, policy="lru")
    with pytest.raises(ValueError, match="sink_tokens=8"):
        EvictingKVCache(cfg, budget=8, sink_tokens=8)
    with pytest.raises(ValueError, match="budget"):
        EvictingKVCache(cfg, budget=1)
    with pytest.raises(ValueError, match="cannot take tokens back"):
        EvictingKVCache(cfg, budget=8, rollback_tokens=2)
    cache = EvictingKVCache(cfg, budget=8)
    x = torch.randn(1, cfg.n_kv_heads, 3, cfg.head_dim)
    with pytest.raises(ValueError, match="start_pos=1"):
        cache.update(1, x, x, 1)
    assert cache.num_tokens == 0


def test_kv_settings_build_label_and_errors():
    """KVSettings builds the right cache, labels it, cuts prefill to the budget and refuses mixtures."""
    cfg = resolve_config("lite-tiny")
    assert type(KVSettings().build(cfg)) is MixedKVCache and KVSettings().label == "16-bit"
    assert KVSettings(format="int4").label == "int4" and KVSettings(format="int4").build(cfg).spec.bits == 4
    s = KVSettings(budget=64, policy="h2o")
    assert s.label == "h2o@64" and s.prefill_chunk(2048) == 64 and KVSettings().prefill_chunk(2048) == 2048
    assert isinstance(s.build(cfg), EvictingKVCache)
    with pytest.raises(ValueError, match="KV format 2"):
        KVSettings(format=2)
    with pytest.raises(ValueError, match="give one of them"):
        KVSettings(format="int8", budget=64)
    with pytest.raises(ValueError, match="speculative"):
        s.build(cfg, rollback_tokens=4)
