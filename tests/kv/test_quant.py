"""Quantised full-layer KV (kv/quant.py): codes, block reads, the attention oracle and real bytes."""

import pytest
import torch

from conftest import make_model
from gptoss_lite import plan as P
from gptoss_lite.config import get_preset
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.generation import generate
from gptoss_lite.kv.base import KVRead
from gptoss_lite.kv.quant import (
    CODECS,
    QuantizedKVCache,
    QuantSpec,
    dequantize_keys,
    dequantize_values,
    pack_int4,
    quantize_keys,
    quantize_values,
    unpack_int4,
)
from gptoss_lite.kvspec import kv_format
from gptoss_lite.model.attention import attend, attention_reference


def test_int4_pack_roundtrip():
    """Two codes per byte: unpack(pack(c)) == c for every code in [0, 15]."""
    codes = torch.randint(0, 16, (2, 3, 5, 8), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (2, 3, 5, 4) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_error_within_half_a_step(bits):
    """Dequantised keys (per channel per token group) and values (per token per channel group) are within
    half a quantisation step (plus float16 rounding of scale and zero) of the input."""
    torch.manual_seed(0)
    spec = QuantSpec(bits, key_group=4, value_group=8, residual=0)
    x = torch.randn(1, 2, 8, 16) * 3
    codes, scale, zero = quantize_keys(x, spec)
    assert codes.shape == (1, 2, 8, 16 * bits // 8) and scale.shape == (1, 2, 2, 16)
    k = dequantize_keys(codes, scale, zero, spec, torch.float32)
    step_k = scale.float().repeat_interleave(4, dim=2)  # (1, 2, 8, 16)
    assert ((k - x).abs() <= step_k / 2 + 2e-3 * x.abs().amax()).all()
    codes, scale, zero = quantize_values(x, spec)
    assert scale.shape == (1, 2, 8, 2)
    v = dequantize_values(codes, scale, zero, spec, torch.float32)
    step_v = scale.float().repeat_interleave(8, dim=3)
    assert ((v - x).abs() <= step_v / 2 + 2e-3 * x.abs().amax()).all()
    # and the error is not zero: the quantiser really quantises
    assert (v - x).abs().max() > 0


def test_constant_group_is_exact():
    """A group whose values are all equal (scale 0) dequantises to that value exactly."""
    spec = QuantSpec(4, key_group=4, value_group=4, residual=0)
    x = torch.full((1, 1, 4, 4), 0.75)
    assert torch.equal(dequantize_keys(*quantize_keys(x, spec), spec, torch.float32), x)


def _fill(cache, layer, chunks, K, D, seed=0):
    """Append random K/V in the given chunk sizes through update; return all K and V appended."""
    g = torch.Generator().manual_seed(seed)
    ks, vs, pos = [], [], 0
    for T in chunks:
        k, v = torch.randn(1, K, T, D, generator=g), torch.randn(1, K, T, D, generator=g)
        cache.update(layer, k, v, pos)
        ks.append(k)
        vs.append(v)
        pos += T
    return torch.cat(ks, 2), torch.cat(vs, 2)


@pytest.mark.parametrize("chunks", [[37], [1] * 37, [5, 1, 1, 20, 3, 1, 6], [13, 24]])
def test_residual_window_invariant(chunks):
    """Whatever the chunking, a layer holds max(0, (n - R) // G) * G quantised tokens and the rest
    (the newest) in full precision, bit for bit."""
    cfg = resolve_config("lite-tiny")
    cache = QuantizedKVCache(cfg, full_format=8, key_group=8, residual=5)
    k, v = _fill(cache, 1, chunks, cfg.n_kv_heads, cfg.head_dim)
    store = cache[1]
    n = sum(chunks)
    assert store.num_quantized == max(0, (n - 5) // 8) * 8 and store.num_tokens == n
    got_k, got_v = store.get()
    q = store.num_quantized
    assert torch.equal(got_k[:, :, q:], k[:, :, q:]) and torch.equal(got_v[:, :, q:], v[:, :, q:])
    assert (got_k[:, :, :q] - k[:, :, :q]).abs().max() < 0.05  # int8 of N(0, 1)


@pytest.mark.parametrize("fmt", sorted(CODECS))
@pytest.mark.parametrize("window", [None, 6])
def test_quantized_attention_equals_dequantize_then_reference(fmt, window):
    """`attend` over quantised blocks == attention_reference over the dequantised keys (1e-5),
    for prefill chunks (own keys full precision) and decode steps, with sinks, with and without a window."""
    cfg = resolve_config("lite-tiny")
    K, D, H = cfg.n_kv_heads, cfg.head_dim, cfg.n_heads
    cache = QuantizedKVCache(cfg, full_format=fmt, key_group=4, residual=3)
    g = torch.Generator().manual_seed(1)
    sinks = torch.randn(H, generator=g)
    pos = 0
    for T in (9, 1, 1, 1, 12, 1, 1):
        k, v = torch.randn(1, K, T, D, generator=g), torch.randn(1, K, T, D, generator=g)
        q = torch.randn(1, H, T, D, generator=g)
        blocks = cache.update(1, k, v, pos)
        first = blocks.first
        assert isinstance(blocks, KVRead) and blocks.tensors() is None and blocks.num_keys == pos + T
        y = attend(q, blocks, sinks, pos - first, window)
        keys, values = blocks.materialize()
        y_ref = attention_reference(q, keys, values, sinks, pos - first, window)
        assert y.shape == (1, H, T, D)
        assert torch.allclose(y, y_ref, atol=1e-5, rtol=0)
        pos += T
    assert cache[1].num_quantized > 0  # the check covered quantised blocks


def test_blocks_are_read_group_by_group():
    """A block read never covers more than the block size asked for (rounded to whole key groups): no
    full-history full-precision copy."""
    cfg = resolve_config("lite-tiny")
    cache = QuantizedKVCache(cfg, full_format=4, key_group=4, residual=3)
    _fill(cache, 1, [60], cfg.n_kv_heads, cfg.head_dim)
    blocks = cache.update(1, *(torch.randn(1, cfg.n_kv_heads, 1, cfg.head_dim),) * 2, 60)
    sizes = [k.shape[2] for _, k, _ in blocks.blocks(8)]
    assert max(sizes) == 8 and sum(sizes) == 61


@pytest.mark.parametrize("fmt", sorted(CODECS))
def test_generation_with_residual_covering_everything_equals_plain(tiny_model, fmt):
    """With a residual window longer than the sequence nothing is quantised: tokens equal the 16-bit cache."""
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(0))
    ref = generate(tiny_model, ids, max_new_tokens=12, temperature=0, prefill_chunk=8)
    cache = QuantizedKVCache(tiny_model.config, batch_size=2, full_format=fmt, key_group=8, residual=64)
    out = generate(tiny_model, ids, max_new_tokens=12, temperature=0, prefill_chunk=8, cache=cache)
    assert torch.equal(out, ref)


def test_quantized_generation_fast_equals_reference_impl(tiny_model):
    """Cached generation through the blocked kernel and through the dense oracle on the same quantised
    cache gives the same tokens."""
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    outs = []
    for impl in ("fast", "reference"):
        cache = QuantizedKVCache(tiny_model.config, full_format=4, key_group=8, residual=2)
        outs.append(generate(tiny_model, ids, 16, temperature=0, prefill_chunk=16, cache=cache, attn_impl=impl))
        assert cache[1].num_quantized > 0
    assert torch.equal(outs[0], outs[1])


def test_full_layers_return_segmented_reads_that_materialise():
    """A quantised full layer returns a segmented read (no dense tensors) whose materialised keys cover
    every token; a sliding layer returns the ring's dense read."""
    cfg = resolve_config("lite-tiny")
    cache = QuantizedKVCache(cfg, full_format=8, key_group=4, residual=2)
    x = torch.randn(1, cfg.n_kv_heads, 11, cfg.head_dim)
    read = cache.update(1, x, x, 0)
    assert read.tensors() is None and read.first == 0
    keys, values = read.materialize()
    assert keys.shape == (1, cfg.n_kv_heads, 11, cfg.head_dim)
    assert cache.update(0, x, x, 0).tensors() is not None


def test_bad_settings_raise():
    """A format that is not quantised or not known, a value group that does not divide D, and a wrong
    start_pos are refused."""
    cfg = resolve_config("lite-tiny")
    with pytest.raises(ValueError, match="KV format 2"):
        QuantizedKVCache(cfg, full_format=2)
    with pytest.raises(ValueError, match="quantised KV is one of int8, int4"):
        QuantizedKVCache(cfg, full_format="dense")
    with pytest.raises(ValueError, match="must divide head_dim"):
        QuantizedKVCache(cfg, full_format=8, value_group=5)
    cache = QuantizedKVCache(cfg, full_format=8)
    x = torch.randn(1, cfg.n_kv_heads, 3, cfg.head_dim)
    with pytest.raises(ValueError, match="start_pos=2"):
        cache.update(1, x, x, 2)
    with pytest.raises(ValueError, match="expected"):
        cache.update(1, x[:, :1], x[:, :1], 0)
    assert cache[1].num_tokens == 0


def test_truncate_within_residual_only():
    """Rollback reaches back into the residual window, not into quantised tokens (ValueError, unchanged)."""
    cfg = resolve_config("lite-tiny")
    cache = QuantizedKVCache(cfg, full_format=8, key_group=4, residual=3)
    for layer in range(cfg.n_layers):
        x = torch.randn(1, cfg.n_kv_heads, 20, cfg.head_dim)
        cache.update(layer, x, x, 0)
    assert cache[1].rollback_floor() == cache[1].num_quantized == 16
    assert cache.rollback_floor() >= 16
    with pytest.raises(ValueError, match="retained interval"):
        cache.truncate(15)
    assert cache.num_tokens == 20 and cache[1].num_residual == 4
    cache.truncate(19)
    assert cache[1].num_tokens == 19 and cache[1].num_residual == 3


def test_rollback_slack_widens_the_residual(tiny_model):
    """Speculative decoding on a quantised cache: greedy output equals plain greedy."""
    from gptoss_lite.speculative import PromptLookup

    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3] * 3])
    cache = QuantizedKVCache(tiny_model.config, full_format=8, key_group=8, residual=2, rollback_tokens=4)
    assert cache.spec.residual == 5
    spec = generate(tiny_model, ids, 20, temperature=0, cache=cache, speculate=PromptLookup(k=4))
    plain_cache = QuantizedKVCache(tiny_model.config, full_format=8, key_group=8, residual=5)
    plain = generate(tiny_model, ids, 20, temperature=0, cache=plain_cache)
    assert torch.equal(spec, plain)


@pytest.mark.parametrize("fmt", sorted(CODECS))
def test_real_bytes_at_8192_match_the_planner(fmt):
    """502M geometry, 8,192 tokens in BF16: the full layers' allocated bytes (codes, scales, zeros,
    residual) are within 5% of plan.quantized_kv_bytes, whose payload equals the cache's exactly, and
    are >= 1.8x (8-bit codes) / 3.2x (4-bit) smaller than 16-bit full layers."""
    bits = kv_format(fmt).bits
    min_ratio = {8: 1.8, 4: 3.2}[bits]
    cfg = get_preset("gptoss-lite-502m")
    geometry = P.get_geometry("gptoss-lite-502m")
    T, chunk = 8192, 2048
    x = torch.randn(1, cfg.n_kv_heads, chunk, cfg.head_dim, dtype=torch.bfloat16)
    cache = QuantizedKVCache(cfg, full_format=fmt)
    for start in range(0, T, chunk):
        for layer in range(cfg.n_layers):
            cache.update(layer, x, x, start)
    sliding = geometry.sliding_layers * cfg.sliding_window * geometry.bytes_per_token_per_layer
    planned_full = P.quantized_kv_bytes(geometry, T, bits) - sliding
    assert cache.payload_bytes == P.quantized_kv_bytes(geometry, T, bits)
    measured_full = cache.full_layer_nbytes()
    assert abs(measured_full - planned_full) <= 0.05 * planned_full
    sixteen_bit_full = geometry.full_layers * T * geometry.bytes_per_token_per_layer
    assert sixteen_bit_full / measured_full >= min_ratio


def test_plan_formula_small_case_by_hand():
    """quantized_kv_bytes on one full layer, K=1, D=4, T=10, G=4, R=2, int8: 8 quantised tokens
    (8·2·4 code bytes + 2 groups·4 ch·2·2 + 8 tok·1 group·2·2) + 2 residual tokens at 2·4·2 B."""
    g = P.AttentionKVGeometry("t", 1, 1, 4, 2)
    assert P.quantized_kv_bytes(g, 10, 8, key_group=4, value_group=4, residual=2) == 64 + 32 + 32 + 32
    with pytest.raises(ValueError, match="8 or 4"):
        P.quantized_kv_bytes(g, 10, 3)


def test_make_model_generation_runs_on_int4(tiny_gptoss):
    """The gpt-oss-shaped tiny model (sinks, biases) generates through an int4 cache without error and
    the full layers actually hold quantised tokens."""
    ids = torch.randint(0, tiny_gptoss.config.vocab_size, (1, 50), generator=torch.Generator().manual_seed(3))
    cache = QuantizedKVCache(tiny_gptoss.config, full_format=4, key_group=8, residual=4)
    out = generate(tiny_gptoss, ids, 8, temperature=0, cache=cache)
    assert out.shape == (1, 58) and cache[1].num_quantized == 48


_ = make_model  # fixtures come from conftest


def test_every_quantised_format_has_its_codec():
    """The formats the flags offer (`kvspec.FORMATS`) and the codecs that store them are the same set."""
    from gptoss_lite.kvspec import FORMATS

    assert set(CODECS) == {name for name, fmt in FORMATS.items() if fmt.quantized}
    assert all(CODECS[name].bits == FORMATS[name].bits for name in CODECS)
