"""The model↔cache contract (kv/base.py): every cache keeps it, and the model needs nothing more."""

import random

import pytest
import torch

from conftest import make_model
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.generation import generate
from gptoss_lite.kv.base import KVCache
from gptoss_lite.kv.mixed import MixedKVCache

CFG = resolve_config("lite-tiny")  # window 8; layers 0 and 2 sliding, 1 and 3 full


def _mixed(batch: int) -> MixedKVCache:
    return MixedKVCache(CFG, batch_size=batch)


CACHES = {"mixed": _mixed}


@pytest.mark.parametrize("kind", CACHES)
def test_caches_are_kv_caches(kind):
    """Both caches implement the protocol (explicit subclasses, so a type checker checks them too)."""
    cache = CACHES[kind](2)
    assert isinstance(cache, KVCache) and KVCache in type(cache).__mro__
    assert cache.batch_size == 2 and cache.num_tokens == 0


@pytest.mark.parametrize("kind", CACHES)
def test_update_returns_every_visible_key_by_position(kind):
    """update() returns keys with key j at position first + j (or, for one token inside one window,
    exactly the last S positions in any order), covering every key the layer's window lets a new
    query see: all of them on full layers, the last W - 1 before each query on sliding layers."""
    B, K, D, W = 2, CFG.n_kv_heads, CFG.head_dim, CFG.sliding_window
    cache = CACHES[kind](B)
    rng = random.Random(0)
    history = torch.randn(B, K, 120, D, generator=torch.Generator().manual_seed(0))
    pos = 0
    while pos < 120:
        T = min(120 - pos, rng.choice([1, 1, 1, 3, 9, 17]))
        new = history[:, :, pos : pos + T]  # (B, K, T, D)
        for layer in range(CFG.n_layers):
            read = cache.update(layer, new, -new, pos)
            (keys, values), first = read.materialize(), read.first  # (B, K, S, D)
            S = keys.shape[2]
            assert first + S == pos + T and first >= 0 and torch.equal(values, -keys)
            lowest_visible = 0 if not CFG.is_sliding(layer) else max(0, pos - W + 1)
            assert first <= lowest_visible
            expected = history[:, :, first : pos + T]
            if T == 1 and CFG.is_sliding(layer) and S <= W:  # the protocol's one freedom: any order
                got = sorted(keys[0, 0].tolist())
                assert got == sorted(expected[0, 0].tolist())
            else:
                assert torch.equal(keys, expected)
        pos += T
        assert cache.num_tokens == pos


@pytest.mark.parametrize("kind", CACHES)
def test_wrong_position_raises_and_changes_nothing(kind):
    """An update at a position other than where the layer ends raises and leaves num_tokens as is."""
    cache = CACHES[kind](1)
    k = torch.zeros(1, CFG.n_kv_heads, 3, CFG.head_dim)
    with pytest.raises(ValueError, match="start_pos=2 .*positions must continue"):
        cache.update(0, k, k, 2)
    assert cache.num_tokens == 0


class _ProtocolOnly:
    """A cache that exposes the protocol and nothing else, to prove the model needs no more."""

    def __init__(self, inner: KVCache) -> None:
        self._inner = inner
        self.calls = 0

    @property
    def batch_size(self) -> int:
        return self._inner.batch_size

    @property
    def num_tokens(self) -> int:
        return self._inner.num_tokens

    def update(self, layer, k, v, start_pos):
        self.calls += 1
        return self._inner.update(layer, k, v, start_pos)


@pytest.mark.parametrize("kind", CACHES)
def test_model_calls_only_the_protocol(kind):
    """generate() through a protocol-only wrapper gives the same tokens as through the cache itself,
    with one update per layer per forward pass."""
    model = make_model("lite-tiny")
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    wrapped = _ProtocolOnly(CACHES[kind](1))
    assert isinstance(wrapped, KVCache)  # structural: no subclassing needed
    out = generate(model, ids, 10, temperature=0, prefill_chunk=16, cache=wrapped)
    assert torch.equal(out, generate(model, ids, 10, temperature=0, prefill_chunk=16, cache=CACHES[kind](1)))
    passes = 2 + 9  # two prefill chunks, then a decode step for every token after the first
    assert wrapped.calls == passes * CFG.n_layers


def test_generate_rejects_a_non_cache():
    """Anything that is not a KV cache is refused by name before any work."""
    model = make_model("lite-tiny")
    with pytest.raises(TypeError, match="expected a KV cache"):
        generate(model, torch.tensor([[1, 2]]), 2, cache=object())
