import pytest
import torch

from gptoss_lite.model.attention import attention_fast, attention_reference, visible_mask
from gptoss_lite.model.attention import blocks as blocks_module
from gptoss_lite.model.attention.plan import MIN_UNMASKED_KEYS, key_blocks


def _qkv(B=2, H=4, K=2, T=7, S=19, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, K, S, D, generator=g)
    v = torch.randn(B, K, S, D, generator=g)
    sinks = torch.randn(H, generator=g) * 2
    return q, k, v, sinks


CASES = [  # (T, S) : full prefill, single-token decode (past the window and inside it), chunk into a cached prefix
    (23, 23),
    (1, 23),
    (1, 6),
    (7, 23),
    (5, 300),
    (64, 64),
    (9, 700),  # a few queries over a long past: the always-visible band gets its own unmasked blocks
    (40, 900),
]


@pytest.mark.parametrize("T,S", CASES)
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("with_sinks", [True, False])
@pytest.mark.parametrize("blocks", [(None, None), (3, 5)])
def test_fast_matches_reference(T, S, window, with_sinks, blocks):
    """The blocked online-softmax kernel equals dense attention within 1e-5 (fp32) for any (T, S)."""
    q, k, v, sinks = _qkv(T=T, S=S)
    sinks = sinks if with_sinks else None
    ref = attention_reference(q, k, v, sinks, S - T, window)
    fast = attention_fast(q, k, v, sinks, S - T, window, q_block=blocks[0], k_block=blocks[1])
    assert fast.shape == (2, 4, T, 16)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "lo,hi,k_block,first_q,last_q,window",
    [
        (0, 1000, 128, 990, 999, None),  # long band: cut at the causal edge
        (0, 1000, 4096, 990, 999, None),
        (0, 300, 4096, 290, 299, None),
        (872, 1000, 4096, 990, 999, 128),  # window band shorter than MIN_UNMASKED_KEYS: one block
        (0, 2000, 512, 1500, 1999, 1024),  # window band long enough: cut at both edges
        (0, 64, 16, 0, 63, None),  # prefill block: no band
    ],
)
def test_key_blocks_tile_the_range_and_respect_the_band(lo, hi, k_block, first_q, last_q, window):
    """Key blocks tile [lo, hi) in order, each at most k_block keys; when the band every query sees
    is long enough, no block straddles its edges (so only edge blocks are masked)."""
    blocks = key_blocks(lo, hi, k_block, first_q, last_q, window, band_block=k_block)
    assert blocks[0][0] == lo and blocks[-1][1] == hi
    assert all(a < b <= a + k_block for a, b in blocks) and all(p[1] == n[0] for p, n in zip(blocks, blocks[1:]))
    band_lo = lo if window is None else max(lo, last_q - window + 1)
    band_hi = first_q + 1
    if band_hi - band_lo >= MIN_UNMASKED_KEYS:
        assert not any(a < edge < b for a, b in blocks for edge in (band_lo, band_hi))


def test_mask_matches_spec_rule():
    """Key j is visible to query i iff j <= i + offset and (i + offset) - j < W."""
    m = visible_mask(3, 10, 7, 4)
    for i in range(3):
        for j in range(10):
            assert bool(m[i, j]) == (j <= i + 7 and (i + 7) - j < 4)


@pytest.mark.parametrize("impl", [attention_fast, attention_reference])
def test_chunk_never_sees_future_keys(impl):
    """Changing keys/values after a query's position cannot change that query's output."""
    q, k, v, sinks = _qkv(T=6, S=20)
    out = impl(q, k, v, sinks, 14, None)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 17:] += 5.0
    v2[:, :, 17:] -= 3.0
    out2 = impl(q, k2, v2, sinks, 14, None)
    torch.testing.assert_close(out[:, :, :3], out2[:, :, :3], atol=0, rtol=0)  # queries at 14, 15, 16
    assert not torch.allclose(out[:, :, 3:], out2[:, :, 3:])


@pytest.mark.parametrize("impl", [attention_fast, attention_reference])
def test_window_sees_exactly_w_keys(impl):
    """A windowed query at p depends on keys p-W+1 … p and not on p-W."""
    q, k, v, sinks = _qkv(T=1, S=30)
    W = 8
    base = impl(q, k, v, sinks, 29, W)
    k_old = k.clone()
    k_old[:, :, 29 - W] += 10.0  # just outside the window
    torch.testing.assert_close(impl(q, k_old, v, sinks, 29, W), base, atol=0, rtol=0)
    k_in = k.clone()
    k_in[:, :, 29 - W + 1] += 10.0  # oldest key inside the window
    assert not torch.allclose(impl(q, k_in, v, sinks, 29, W), base)


def test_sink_closed_form():
    """out_with_sink = out_without_sink * sigmoid(lse - sink) (docs/model.md#attention-with-sinks)."""
    q, k, v, sinks = _qkv(T=5, S=12)
    with_sink = attention_reference(q, k, v, sinks, 7, None)
    without = attention_reference(q, k, v, None, 7, None)
    K = k.shape[1]
    kk = k.repeat_interleave(4 // K, dim=1)
    scores = (q @ kk.transpose(-1, -2)) / 16**0.5
    scores = scores.masked_fill(~visible_mask(5, 12, 7, None), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (B, H, T, 1)
    expected = without * torch.sigmoid(lse - sinks.view(1, -1, 1, 1))
    torch.testing.assert_close(with_sink, expected, atol=1e-6, rtol=1e-5)


def test_sink_weights_sum_below_one():
    """With a sink, attention weights over real keys sum to less than one (value vectors of ones)."""
    q, k, _, sinks = _qkv(T=4, S=9)
    ones = torch.ones(2, 2, 9, 16)
    out = attention_fast(q, k, ones, sinks, 5, None)
    assert (out < 1).all() and (out > 0).all()


def test_no_repeated_kv_in_fast_kernel(monkeypatch):
    """The fast kernel never calls repeat_interleave/expand on K or V (GQA without materialising)."""
    q, k, v, sinks = _qkv(T=4, S=9)

    def boom(*a, **kw):
        raise AssertionError("repeat_interleave used")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", boom)
    attention_fast(q, k, v, sinks, 5, None)


@pytest.mark.parametrize(
    "T,S,window",
    [
        (16, 16, None),
        (300, 300, 128),
        (300, 1300, None),
        (300, 1300, 128),
        (2100, 2100, None),
        (2100, 2100, 8),
        (40, 41, 8),
    ],
)
@pytest.mark.parametrize("with_sinks", [True, False])
def test_flash_path_matches_reference(T, S, window, with_sinks, monkeypatch):
    """Prompts (T >= FLASH_MIN_QUERIES) go through the fused CPU kernel, block results merged by their
    log-sum-exp (several query blocks at T = 2,100, masked window edges, a cached past): within 1e-5 of
    dense attention in fp32."""
    calls = []
    flash = blocks_module._FLASH
    monkeypatch.setattr(blocks_module, "_FLASH", lambda *a, **kw: calls.append(a[4]) or flash(*a, **kw))
    q, k, v, sinks = _qkv(B=1, T=T, S=S)
    sinks = sinks if with_sinks else None
    ref = attention_reference(q, k, v, sinks, S - T, window)
    torch.testing.assert_close(attention_fast(q, k, v, sinks, S - T, window), ref, atol=1e-5, rtol=1e-5)
    assert calls, "the flash kernel was not used"
    # without a window, each query block's diagonal block runs in the kernel's causal mode, unmasked
    assert (True in calls) == (window is None)


@pytest.mark.parametrize("window", [None, 16])
def test_training_gets_the_reference_gradients(window, monkeypatch):
    """A forward that autograd records gives the reference's gradients for q, k, v and the sinks. The
    fused kernel's log-sum-exp carries no gradient, so such a forward never calls it (it gave q and k
    gradients off by up to half their size)."""
    calls, flash = [], blocks_module._FLASH
    monkeypatch.setattr(blocks_module, "_FLASH", lambda *a, **kw: calls.append(1) or flash(*a, **kw))
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, 64, 8, generator=gen)
    k, v = torch.randn(1, 2, 64, 8, generator=gen), torch.randn(1, 2, 64, 8, generator=gen)
    sinks = torch.randn(4, generator=gen)
    grads = []
    for fn in (attention_fast, attention_reference):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        (fn(*leaves[:3], leaves[3], 0, window) * torch.linspace(-1, 1, 8)).sum().backward()
        grads.append([t.grad for t in leaves])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert not calls
    with torch.no_grad():  # the same call without autograd takes the fused kernel
        attention_fast(q, k, v, sinks, 0, window)
    assert calls


def test_flash_path_in_bf16_is_as_close_as_the_blocked_kernel():
    q, k, v, sinks = (t.bfloat16() for t in _qkv(B=1, T=200, S=260))
    ref = attention_reference(q.float(), k.float(), v.float(), sinks.float(), 60, 64)
    flash = attention_fast(q, k, v, sinks, 60, 64).float()
    blocked = attention_fast(q, k, v, sinks, 60, 64, q_block=200).float()  # a forced block size: online softmax
    assert (flash - ref).abs().max() <= max(2e-2, 1.5 * (blocked - ref).abs().max())


@pytest.mark.parametrize(
    "lo,hi,k_block,first_q,last_q,window",
    [
        (0, 300, 128, 100, 299, None),
        (0, 2000, 512, 1500, 1999, None),
        (0, 40, 16, 20, 39, 8),
        (172, 428, 64, 300, 427, 128),
    ],
)
def test_band_blocks_tile_the_range(lo, hi, k_block, first_q, last_q, window):
    """Without a band block size, `key_blocks` tiles [lo, hi) in order; masked blocks hold at most
    k_block keys, and a band of MIN_UNMASKED_KEYS keys or more is one unmasked block (the fused kernel's
    plan)."""
    blocks = key_blocks(lo, hi, k_block, first_q, last_q, window)
    assert blocks[0][0] == lo and blocks[-1][1] == hi
    assert all(p[1] == n[0] for p, n in zip(blocks, blocks[1:]))
    band_lo = lo if window is None else max(lo, last_q - window + 1)
    band = (band_lo, min(hi, first_q + 1))
    if band[1] - band[0] >= MIN_UNMASKED_KEYS:
        assert band in blocks
    assert all(b - a <= k_block for a, b in blocks if (a, b) != band)


def test_flash_block_masks_are_reused_without_autograd_and_built_fresh_with_it():
    from gptoss_lite.model.attention.plan import _cached_block_mask, flash_block_mask

    _cached_block_mask.cache_clear()
    with torch.inference_mode():
        first = flash_block_mask(4, 6, 2, 3, 2, torch.float32, "cpu")
        again = flash_block_mask(4, 6, 2, 3, 2, torch.float32, "cpu")
    assert first[0] is again[0]  # one build per shape and offset
    visible = visible_mask(4, 6, 2, 3).repeat(2, 1)  # (G·T, S) for G = 2 stacked heads
    assert torch.equal(first[0] == 0, visible) and torch.equal(first[0] < -1e29, ~visible)
    assert torch.equal(first[1], ~visible.any(dim=-1))
    assert flash_block_mask(4, 6, 2, 3, 2, torch.float32, "cpu")[0] is not first[0]  # autograd on: fresh


def test_flash_attention_trains_after_an_inference_call_of_the_same_shape():
    # The masks cached by an inference call must not reach a training forward (inference tensors
    # cannot be saved for backward): with autograd on they are built fresh.
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 40, 8, generator=gen)
    k, v = torch.randn(1, 2, 40, 8, generator=gen), torch.randn(1, 2, 40, 8, generator=gen)
    sinks = torch.randn(4, generator=gen)
    with torch.inference_mode():
        attention_fast(q, k, v, sinks, 0, 16)
    qg = q.clone().requires_grad_()
    out = attention_fast(qg, k, v, sinks, 0, 16)
    out.sum().backward()
    torch.testing.assert_close(out, attention_reference(q, k, v, sinks, 0, 16), atol=1e-5, rtol=0)
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
