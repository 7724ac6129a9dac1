"""Rollback (`truncate`) on MixedKVCache: the retained interval rule of `gptoss_lite.kv.base.check_rollback`."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from conftest import make_model
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.kv.mixed import MixedKVCache, RingBuffer
from gptoss_lite.model.attention import attention_reference

CFG = resolve_config("lite-tiny")  # window 8; layers 0, 2 sliding, 1, 3 full
B, K, D, H = 2, CFG.n_kv_heads, CFG.head_dim, CFG.n_heads


@functools.cache
def _token_kv(layer: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(layer * 100_003 + p)
    k, v = torch.randn(2, B, K, 1, D, generator=g)
    v[:, :, :, 0] = torch.arange(B).view(B, 1, 1) * 1000 + p
    return k, v


def _kv(layer: int, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic K/V (B, K, T, D) of positions start…start+T-1 in `layer`; v[..., 0] encodes
    row·1000 + position, so the positions a cache returns can be read back."""
    pairs = [_token_kv(layer, p) for p in range(start, start + T)]
    return torch.cat([k for k, _ in pairs], dim=2), torch.cat([v for _, v in pairs], dim=2)


def _make(slack: int) -> MixedKVCache:
    return MixedKVCache(CFG, batch_size=B, rollback_tokens=slack)


def _snapshot(cache: MixedKVCache):
    return [
        (
            None if s.k is None else (s.k.clone(), s.v.clone()),
            s.num_tokens,
            s.num_resident,
            getattr(s, "head", None),
        )
        for s in cache.layers
    ]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):  # bytes, so that uninitialised (NaN) slots compare too
        return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _check_update(cache: MixedKVCache, start: int, T: int) -> None:
    """Append T tokens on every layer; each layer's returned keys are exactly positions first…, and
    attention over them equals dense attention over the whole kept history (the layer's window)."""
    q = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(start * 7 + T))
    sinks = torch.linspace(-1, 1, H)
    for layer in range(CFG.n_layers):
        window = CFG.sliding_window if CFG.is_sliding(layer) else None
        k, v = _kv(layer, start, T)
        read = cache.update(layer, k, v, start)
        (keys, values), first = read.materialize(), read.first
        S = keys.shape[2]
        positions = values[0, 0, :, 0].long().tolist()
        ordered = list(range(first, first + S))
        if T == 1 and window is not None and S <= window:  # the protocol's one freedom: any order
            assert sorted(positions) == ordered
        else:
            assert positions == ordered
        assert first <= (0 if window is None else max(0, start - window + 1))  # covers every visible key
        full_k, full_v = _kv(layer, 0, start + T)
        got = attention_reference(q, keys, values, sinks, start - first, window)
        want = attention_reference(q, full_k, full_v, sinks, start, window)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("slack", [0, 3])
def test_random_append_and_rollback_match_a_rebuilt_cache(slack):
    """Random appends and truncations: held K/V equal a cache rebuilt from the kept tokens, attention
    over what update returns equals dense attention, and out-of-range truncations raise unchanged."""
    rng = random.Random(f"mixed{slack}")
    cache = _make(slack)
    n = last = 0  # last: the position of the latest truncation
    for _ in range(60):
        if n and rng.random() < 0.4:
            floor = cache.rollback_floor()
            # Slack R always allows going back R + 1 tokens, or to the latest truncation point.
            assert floor <= max(last, n - slack - 1)
            bad = rng.choice([n + rng.randint(1, 3), floor - rng.randint(1, 3)])
            if bad >= 0:  # outside [floor, n]
                before = _snapshot(cache)
                with pytest.raises(ValueError, match=f"position={bad}.*retained interval \\[{floor}, {n}\\]"):
                    cache.truncate(bad)
                assert _same(_snapshot(cache), before) and cache.num_tokens == n
            n = last = rng.randint(floor, n)
            cache.truncate(n)
            assert cache.num_tokens == n
            rebuilt = _make(slack)
            if n:
                for layer in range(CFG.n_layers):
                    rebuilt.update(layer, *_kv(layer, 0, n), 0)
            for layer in range(CFG.n_layers):
                got_k, got_v = cache.get(layer)
                want_k, want_v = rebuilt.get(layer)
                m = got_k.shape[2]
                assert m <= want_k.shape[2] or not CFG.is_sliding(layer)
                assert torch.equal(got_k, want_k[:, :, want_k.shape[2] - m :])
                assert torch.equal(got_v, want_v[:, :, want_v.shape[2] - m :])
                if not CFG.is_sliding(layer):
                    assert m == n
        else:
            T = rng.choice([1, 1, 1, 2, 3, 5, 9, 13])
            _check_update(cache, n, T)
            n += T


@pytest.mark.parametrize("slack", [0, 2, 5])
def test_ring_with_slack_keeps_w_plus_r_and_rolls_back_exactly_that_far(slack):
    """A ring built with slack R has W + R slots; after 30 tokens the retained interval is
    [30 - R - 1, 30] (the next query needs W - 1 earlier keys), one further raises."""
    cache = MixedKVCache(CFG, batch_size=B, rollback_tokens=slack)
    for p in range(30):
        for layer in range(CFG.n_layers):
            cache.update(layer, *_kv(layer, p, 1), p)
    ring = cache[0]
    assert isinstance(ring, RingBuffer) and ring.k.shape[2] == CFG.sliding_window + slack
    assert cache.num_resident(0) == CFG.sliding_window + slack and cache.num_resident(1) == 30
    assert cache.rollback_floor() == 30 - slack - 1
    before = _snapshot(cache)
    with pytest.raises(ValueError, match="before the retained interval"):
        cache.truncate(30 - slack - 2)
    with pytest.raises(ValueError, match="outside the retained interval"):
        cache.truncate(31)
    with pytest.raises(TypeError, match="must be an int"):
        cache.truncate(True)
    assert _same(_snapshot(cache), before)
    cache.truncate(30 - slack - 1)
    assert cache.num_tokens == 30 - slack - 1


@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny"])
def test_model_continues_after_rollback_like_a_fresh_run(preset):
    """Decode, truncate the last 3 tokens, decode other tokens: logits equal the uncached model's."""
    model = make_model(preset)
    ids = torch.randint(0, 256, (B, 24), generator=torch.Generator().manual_seed(5))
    alt = torch.randint(0, 256, (B, 4), generator=torch.Generator().manual_seed(6))
    cache = MixedKVCache(model.config, B, rollback_tokens=3)
    with torch.inference_mode():
        model(ids[:, :12], cache=cache, start_pos=0)
        for p in range(12, 24):
            model(ids[:, p : p + 1], cache=cache, start_pos=p)
        cache.truncate(21)
        got = [model(alt[:, :2], cache=cache, start_pos=21).logits]
        got += [model(alt[:, i : i + 1], cache=cache, start_pos=21 + i).logits for i in (2, 3)]
        want = model(torch.cat((ids[:, :21], alt), dim=1)).logits[:, 21:]
    torch.testing.assert_close(torch.cat(got, dim=1), want, atol=1e-5, rtol=1e-5)
