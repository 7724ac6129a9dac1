import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_model
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.kv.mixed import GrowingBuffer, MixedKVCache, RingBuffer


def _tok(values, K=1, D=2):
    """(1, K, T, D) tensor whose every coordinate of token t equals values[t]."""
    t = torch.tensor(values, dtype=torch.float32)
    return t.view(1, 1, -1, 1).expand(1, K, len(values), D).contiguous()


def test_ring_window3_tokens_1_to_7():
    """A window-3 ring given tokens 1…7 one at a time returns [5, 6, 7] in order."""
    ring = RingBuffer(1, 1, 2, window=3)
    for t in range(1, 8):
        ring.append(_tok([t]), _tok([t]))
    k, v = ring.get()
    assert k[0, 0, :, 0].tolist() == [5, 6, 7] and v[0, 0, :, 0].tolist() == [5, 6, 7]
    assert ring.num_resident == 3 and ring.num_tokens == 7


def test_ring_long_prefill_keeps_last_w():
    """A prefill of T >= W keeps only the last W, position p at slot p mod W (the layout a static decode
    step reads), and reads back chronological."""
    ring = RingBuffer(1, 1, 2, window=3)
    ring.append(_tok([1, 2, 3, 4, 5]), _tok([1, 2, 3, 4, 5]))  # positions 0 … 4
    assert ring.get()[0][0, 0, :, 0].tolist() == [3, 4, 5]
    assert ring.k[0, 0, :, 0].tolist() == [4, 5, 3]  # positions 3, 4, 2 at slots 0, 1, 2
    assert ring.head == 5 % 3 and ring.num_resident == 3


@given(st.lists(st.integers(1, 9), min_size=1, max_size=12), st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_ring_matches_list_model(chunks, window):
    """For any chunking of a stream, the ring holds the last min(W, n) tokens in order, in O(W) storage."""
    ring = RingBuffer(1, 1, 2, window=window)
    stream = []
    for n in chunks:
        vals = list(range(len(stream) + 1, len(stream) + n + 1))
        stream += vals
        ring.append(_tok(vals), _tok(vals))
        assert ring.get()[0][0, 0, :, 0].tolist() == stream[-window:]
        assert ring.k.shape[2] == window


def test_num_resident_caps_and_reset():
    """num_resident caps at W on sliding layers, grows on full layers, is 0 unwritten and after reset."""
    cfg = resolve_config("lite-tiny")  # window 8, layers 0/2 windowed
    cache = MixedKVCache(cfg)
    assert cache.num_resident(0) == 0 and cache.num_resident(1) == 0 and len(cache) == 4
    k = torch.randn(1, cfg.n_kv_heads, 20, cfg.head_dim)
    for layer in range(cfg.n_layers):
        cache[layer].append(k, k)
    assert cache.num_resident(0) == 8 and cache.num_resident(1) == 20
    cache.reset()
    assert [cache.num_resident(i) for i in range(4)] == [0, 0, 0, 0] and cache.nbytes == 0


def test_growing_buffer_policy_and_cap():
    """Growth to max(needed, int(1.5·cap)+1), prefix copied, and the cap raises instead of truncating."""
    buf = GrowingBuffer(1, 1, 2, cap_tokens=20)
    buf.append(_tok([1, 2, 3]), _tok([1, 2, 3]))
    assert buf.capacity == 3  # first write: exactly what is needed
    buf.append(_tok([4]), _tok([4]))
    assert buf.capacity == 5  # int(3 * 1.5) + 1
    buf.append(_tok(list(range(5, 15))), _tok(list(range(5, 15))))
    assert buf.capacity == 14  # needed beats the growth step
    assert buf.get()[0][0, 0, :, 0].tolist() == list(range(1, 15))
    with pytest.raises(MemoryError, match="cap exceeded"):
        buf.append(_tok(list(range(7))), _tok(list(range(7))))
    assert buf.num_resident == 14  # unchanged


def test_append_rejects_wrong_geometry_and_dtype():
    """Appends with a wrong shape or a dtype change are rejected with the cache unchanged."""
    ring = RingBuffer(1, 2, 4, window=3)
    with pytest.raises(ValueError, match="expected"):
        ring.append(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
    ring.append(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    with pytest.raises(ValueError, match="dtype"):
        ring.append(torch.zeros(1, 2, 1, 4, dtype=torch.float64), torch.zeros(1, 2, 1, 4, dtype=torch.float64))
    assert ring.num_resident == 1


def test_positions_must_continue(tiny_model):
    """A forward whose start_pos does not continue the cache is an error."""
    cache = MixedKVCache(tiny_model.config)
    tiny_model(torch.randint(0, 256, (1, 5)), cache=cache, start_pos=0)
    with pytest.raises(ValueError, match="start_pos=3"):
        tiny_model(torch.randint(0, 256, (1, 2)), cache=cache, start_pos=3)


def test_bytes_after_32k_prefill_match_formula():
    """After a 32,768-token prefill the payload equals the mixed formula exactly; allocation is within slack."""
    # A narrow model keeps the O(T²) global-layer prefill to seconds on 2 cores.
    tiny_model = make_model(n_heads=2, n_kv_heads=1, head_dim=8, rope_pruned_pairs=2)
    cfg = tiny_model.config
    T = 32_768
    cache = MixedKVCache(cfg)
    ids = torch.randint(0, 256, (1, T))
    with torch.inference_mode():
        for start in range(0, T, 4096):
            tiny_model(ids[:, start : start + 4096], cache=cache, start_pos=start, last_only=True)
    per_token_layer = 2 * cfg.n_kv_heads * cfg.head_dim * 4  # K + V, fp32
    n_win, n_glob = len(cfg.sliding_layers), len(cfg.full_layers)
    expected = per_token_layer * (n_win * min(cfg.sliding_window, T) + n_glob * T)
    assert cache.payload_bytes == expected
    ring_bytes = n_win * cfg.sliding_window * per_token_layer
    glob_alloc = cache.nbytes - ring_bytes
    assert n_glob * T * per_token_layer <= glob_alloc <= 1.5 * n_glob * T * per_token_layer
    all_global = cfg.n_layers * T * per_token_layer
    assert all_global / cache.payload_bytes > 1.9


def test_repeat_rows_continues_like_a_whole_prefill():
    """A batch-1 cache holding a shared prefix, repeated to 3 rows and continued with 3 different tails,
    gives the logits of prefilling the 3 whole prompts (the rings wrap: prefix 40 > window 8); the
    source cache is unchanged; a batch > 1 or a quantised cache is refused by name."""
    from conftest import make_model
    from gptoss_lite.kv.quant import QuantizedKVCache

    model = make_model("lite-tiny")
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, model.config.vocab_size, (1, 40), generator=gen)
    tails = torch.randint(0, model.config.vocab_size, (3, 9), generator=gen)
    prompts = torch.cat((prefix.expand(3, -1), tails), dim=1)
    with torch.inference_mode():
        whole = model.prefill(prompts, MixedKVCache(model.config, batch_size=3), 16)
        shared = MixedKVCache(model.config, batch_size=1)
        model.prefill(prefix, shared, 16)
        before = [(s.k.clone(), s.num_tokens) for s in shared.layers]
        rows = shared.repeat_rows(3)
        got = model.prefill(prompts, rows, 16)
    torch.testing.assert_close(got, whole, atol=1e-5, rtol=0)
    assert rows.num_tokens == 49 and shared.num_tokens == 40
    assert all(torch.equal(s.k, k) and s.num_tokens == n for s, (k, n) in zip(shared.layers, before))
    with pytest.raises(ValueError, match="batch-1"):
        rows.repeat_rows(2)
    quantised = QuantizedKVCache(model.config, batch_size=1, full_format=8)
    with pytest.raises(TypeError, match="plain ring"):
        quantised.repeat_rows(2)
