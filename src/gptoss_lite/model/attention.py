"""Grouped-query attention with learned sinks, sliding windows and a KV cache (docs/model.md#attention-with-sinks).

Two kernels that must agree:
- `attention_reference`: dense (T, S) scores, repeated KV heads, an explicit sink column. Slow and
  obviously correct; the oracle for every test.
- `attention_fast`: query blocks × key blocks with an online softmax whose running state starts at
  the sink logit (max = sink, sum = exp(0) = 1, acc = 0), so the sink costs nothing extra. It never
  builds a (T, S) matrix larger than one block, never repeats KV heads (queries of one KV group are
  stacked as rows), skips key blocks outside the causal/window band, and only builds a mask for
  blocks that straddle the band's edge. On CPU a prompt's queries (T >= FLASH_MIN_QUERIES) go through
  PyTorch's fused flash-attention kernel instead (`_attend_flash`): the same blocks, each one call
  that also returns its log-sum-exp, merged exactly across blocks, the sink being a first "block"
  of log-sum-exp = sink logit and value 0. One decode query keeps its ten-op path.

Both take queries (B, H, T, D) whose first row sits at key index `q_offset` (query i has key-array
index i + q_offset) and keys/values (B, K, S, D) in chronological order. Key j is visible to query i
iff j <= i + q_offset and, with a window W, (i + q_offset) - j < W.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
from torch import nn

from gptoss_lite.config import ModelConfig
from gptoss_lite.kv.base import BlockKVCache, KVBlocks, KVCache, RaggedBatch
from gptoss_lite.model.decode_pack import input_major_for, pack_pair, pack_rows, still_packed
from gptoss_lite.model.matmul import Linear, linear
from gptoss_lite.model.rope import apply_rotary_tables

# A band of keys every query sees gets its own unmasked blocks only from this length on: below it, the
# ops of the extra blocks cost more than masking (a sliding window of 128 stays one block).
MIN_UNMASKED_KEYS = 256
# Budget for one score block (elements of B·H·Tq·Sk); 4M fp32 elements = 16 MiB.
SCORE_BLOCK_ELEMENTS = 1 << 22
# From this many queries on, CPU attention uses the fused flash kernel (`_attend_flash`).
FLASH_MIN_QUERIES = 16
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_DTYPES = (torch.float32, torch.bfloat16)
FLASH_BLOCK_KEYS = 1024  # keys per dequantised block `attention_blocks` hands the fused kernel


def visible_mask(T: int, S: int, q_offset: int, window: int | None, device=None) -> torch.Tensor:
    """Boolean (T, S) mask: True where query i may see key j (docs/model.md#attention-with-sinks)."""
    qi = torch.arange(T, device=device)[:, None] + q_offset
    kj = torch.arange(S, device=device)[None, :]
    mask = kj <= qi
    if window is not None:
        mask &= (qi - kj) < window
    return mask


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, q_offset: int, window: int | None
) -> torch.Tensor:
    """Dense attention with an explicit sink column. q (B,H,T,D), k/v (B,K,S,D) -> (B,H,T,D)."""
    B, H, T, D = q.shape
    G = H // k.shape[1]
    S = k.shape[2]
    k = k.repeat_interleave(G, dim=1)  # (B, H, S, D)
    v = v.repeat_interleave(G, dim=1)  # (B, H, S, D)
    scores = (q.float() @ k.float().transpose(-1, -2)) / D**0.5  # (B, H, T, S)
    scores = scores.masked_fill(~visible_mask(T, S, q_offset, window, q.device), float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)  # (B, H, T, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]  # (B, H, T, S)
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ v.float()).to(q.dtype)  # (B, H, T, D)


def attention_fast(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    q_offset: int,
    window: int | None,
    q_block: int | None = None,
    k_block: int | None = None,
) -> torch.Tensor:
    """Blocked online-softmax attention; same contract as `attention_reference`. One decode query:
    `_attend_one_query`; a prompt on CPU: `_attend_flash`; otherwise (or with explicit blocks)
    `_attend_blocked`."""
    T, D = q.shape[2], q.shape[3]
    S = k.shape[2]
    scale = D**-0.5
    if T == 1 and q_offset == S - 1 and (window is None or S <= window) and k_block is None:
        return _attend_one_query(q, k, v, sinks, scale)
    if T >= FLASH_MIN_QUERIES and flash_applies(q, k, v) and q_block is None and k_block is None:
        return _attend_flash(q, k, v, sinks, q_offset, window)
    return _attend_blocked(q, k, v, sinks, q_offset, window, q_block, k_block)


def flash_applies(q: torch.Tensor, *kv: torch.Tensor) -> bool:
    """Whether PyTorch's CPU flash-attention kernel takes these tensors (CPU, one float dtype)."""
    return (
        _FLASH is not None
        and q.device.type == "cpu"
        and q.dtype in _FLASH_DTYPES
        and all(t.dtype == q.dtype for t in kv)
    )


def _flash_state(sinks: torch.Tensor | None, B: int, K: int, G: int, T: int, D: int, device):
    """The merge's starting (lse, acc): the sink as a block of lse = sink logit and value 0 (or an
    empty start without sinks)."""
    if sinks is None:
        lse = torch.full((B, K, G * T), -1e30, device=device)
    else:
        lse = sinks.float().view(1, K, G, 1).expand(B, K, G, T).reshape(B, K, G * T)
    return lse, torch.zeros(B, K, G * T, D, device=device)


def _flash_merge(
    rows: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: tuple[torch.Tensor, torch.Tensor] | None,
    lse: torch.Tensor,
    acc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fused-kernel call over a key block, merged into (lse, acc) by log-sum-exp. `mask` is
    `flash_block_mask`'s (additive mask, hidden rows) for the block, or None when every key is visible;
    a row the mask hides entirely is reported by the kernel as lse = 0 and is set to -inf here."""
    assert _FLASH is not None, "flash_applies() was checked"
    additive = None if mask is None else mask[0]
    out_b, lse_b = _FLASH(rows, k, v, 0.0, False, attn_mask=additive, scale=rows.shape[-1] ** -0.5)
    if mask is not None:
        lse_b = lse_b.masked_fill(mask[1], float("-inf"))
    new = torch.logaddexp(lse, lse_b)
    acc = acc * torch.exp(lse - new)[..., None] + out_b.float() * torch.exp(lse_b - new)[..., None]
    return new, acc


def flash_block_mask(
    T: int, S: int, q_offset: int, window: int | None, G: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's inputs for a masked block: an additive (G·T, S) mask (0 where visible,
    -1e30 where not; `visible_mask` repeated for the G stacked heads) and the (G·T,) rows it hides
    entirely. Without autograd the pair is built once per shape and offset and reused: every layer of a
    kind, and every query block of a long prompt, masks the same edges, and building the masks was a
    fifth of a 2,048-token fp32 prefill of the 20M model."""
    if torch.is_grad_enabled():
        return _build_block_mask(T, S, q_offset, window, G, dtype, device)
    return _cached_block_mask(T, S, q_offset, window, G, dtype, torch.device(device))


def _build_block_mask(
    T: int, S: int, q_offset: int, window: int | None, G: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    visible = visible_mask(T, S, q_offset, window, device).repeat(G, 1)  # (G·T, S)
    additive = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, -1e30)
    return additive, ~visible.any(dim=-1)


# At most 8 masks of <= SCORE_BLOCK_ELEMENTS elements (16 MiB in fp32). Only used with autograd off,
# where nothing is saved for backward, so a mask made in inference mode may serve a later no-grad call.
_cached_block_mask = functools.lru_cache(maxsize=8)(_build_block_mask)


def _attend_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    q_offset: int,
    window: int | None,
    q_block: int | None = None,
    k_block: int | None = None,
) -> torch.Tensor:
    """The online-softmax kernel in tensor ops (any device and dtype); see the module docstring."""
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    scale = D**-0.5
    if q_block is None:
        q_block = T if T * G <= 2048 else max(1, 2048 // G)
    if k_block is None:
        k_block = max(128, SCORE_BLOCK_ELEMENTS // max(1, B * H * q_block))
    qg = q.view(B, K, G, T, D)
    if sinks is None:
        # NOTE: finite, not -inf: a row whose first key block is fully masked must not become NaN.
        sink_init = torch.full((1, K, G, 1, 1), -1e30, device=q.device)
    else:
        sink_init = sinks.float().view(1, K, G, 1, 1)
    out_blocks = []
    for qs in range(0, T, q_block):
        qe = min(T, qs + q_block)
        Tb = qe - qs
        first_q, last_q = qs + q_offset, qe - 1 + q_offset  # key-array indices of the block's queries
        lo = 0 if window is None else max(0, first_q - window + 1)
        hi = min(S, last_q + 1)
        rows = qg[:, :, :, qs:qe].reshape(B, K, G * Tb, D) * scale  # (B, K, G·Tb, D); row = g·Tb + t
        m = sink_init.expand(B, K, G, Tb, 1).reshape(B, K, G * Tb, 1)  # running max (B, K, G·Tb, 1)
        l = torch.ones_like(m) if sinks is not None else torch.zeros_like(m)  # running sum
        acc = torch.zeros(B, K, G * Tb, D, device=q.device, dtype=torch.float32)
        for ks, ke in _key_blocks(lo, hi, k_block, first_q, last_q, window):
            s = (rows @ k[:, :, ks:ke].transpose(-1, -2)).float()  # (B, K, G·Tb, Sb)
            fully_visible = ke - 1 <= first_q and (window is None or last_q - ks < window)
            if not fully_visible:
                mask = visible_mask(Tb, ke - ks, first_q - ks, window, q.device)  # (Tb, Sb)
                s = s.masked_fill(~mask.repeat(G, 1), float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # (B, K, G·Tb, 1)
            p = torch.exp(s - m_new)  # (B, K, G·Tb, Sb)
            corr = torch.exp(m - m_new)
            l = l * corr + p.sum(dim=-1, keepdim=True)
            acc = acc * corr + (p.to(v.dtype) @ v[:, :, ks:ke]).float()  # (B, K, G·Tb, D)
            m = m_new
        out_blocks.append((acc / l).view(B, K, G, Tb, D))
    out = out_blocks[0] if len(out_blocks) == 1 else torch.cat(out_blocks, dim=3)  # (B, K, G, T, D)
    return out.view(B, H, T, D).to(q.dtype)


def _attend_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, q_offset: int, window: int | None
) -> torch.Tensor:
    """`attention_fast` through the fused CPU kernel: per query block, one call per key block of the
    causal/window band (unmasked inside the band, an additive mask at its edges), each returning
    (out, log-sum-exp); blocks merge as out = Σ out_b · exp(lse_b − lse), lse = logaddexp over blocks
    (`_flash_merge`). The running state starts at lse = sink logit with out = 0, so the sink's share
    of the softmax comes out of the same merge."""
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    q_block = T if G * T <= 4096 else max(1, 4096 // G)
    if window is not None:
        q_block = min(q_block, window)  # a query block spans at most 2W - 1 keys, not its length + W
    qg = q.view(B, K, G, T, D)
    outs = []
    for qs in range(0, T, q_block):
        qe = min(T, qs + q_block)
        Tb = qe - qs
        first_q, last_q = qs + q_offset, qe - 1 + q_offset
        lo = 0 if window is None else max(0, first_q - window + 1)
        hi = min(S, last_q + 1)
        rows = qg[:, :, :, qs:qe].reshape(B, K, G * Tb, D)  # row = g·Tb + t
        lse, acc = _flash_state(sinks, B, K, G, Tb, D, q.device)
        k_block = max(128, SCORE_BLOCK_ELEMENTS // max(1, G * Tb))  # bounds a masked block's (G·Tb, Sb) mask
        for ks, ke in _band_blocks(lo, hi, k_block, first_q, last_q, window):
            mask = None
            if not (ke - 1 <= first_q and (window is None or last_q - ks < window)):
                mask = flash_block_mask(Tb, ke - ks, first_q - ks, window, G, q.dtype, q.device)
            lse, acc = _flash_merge(rows, k[:, :, ks:ke], v[:, :, ks:ke], mask, lse, acc)
        outs.append(acc.view(B, K, G, Tb, D))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    return out.view(B, H, T, D).to(q.dtype)


def _band_blocks(
    lo: int, hi: int, k_block: int, first_q: int, last_q: int, window: int | None
) -> list[tuple[int, int]]:
    """Key blocks for `_attend_flash`: the band every query sees is one unmasked block (the fused
    kernel tiles it itself); the keys before and after it (window and causal edges) are masked blocks
    of at most k_block keys."""
    band_lo = lo if window is None else max(lo, last_q - window + 1)
    band_hi = min(hi, first_q + 1)
    if band_hi - band_lo < MIN_UNMASKED_KEYS:  # a short band: one masked call costs less than three
        return [(ks, min(hi, ks + k_block)) for ks in range(lo, hi, k_block)]
    blocks = [(ks, min(band_lo, ks + k_block)) for ks in range(lo, band_lo, k_block)]
    blocks.append((band_lo, band_hi))
    blocks += [(ks, min(hi, ks + k_block)) for ks in range(band_hi, hi, k_block)]
    return blocks


def _key_blocks(lo: int, hi: int, k_block: int, first_q: int, last_q: int, window: int | None) -> list[tuple[int, int]]:
    """Key blocks [ks, ke) covering [lo, hi) for queries at key indices first_q … last_q, at most
    k_block keys each, cut at the edges of the band that every one of those queries sees (keys <=
    first_q, and with a window keys >= last_q - window + 1). Blocks inside the band need no mask, so
    only the few keys at its edges are masked: a handful of queries over a long past (a speculative
    verification, a prefill chunk after a long prompt) no longer masks the whole history."""
    cuts = {lo, hi}
    band_lo = lo if window is None else max(lo, last_q - window + 1)
    if min(hi, first_q + 1) - band_lo >= MIN_UNMASKED_KEYS:  # else one masked block costs fewer ops
        cuts.update(edge for edge in (band_lo, first_q + 1) if lo < edge < hi)
    edges = sorted(cuts)
    return [(ks, min(end, ks + k_block)) for start, end in zip(edges, edges[1:]) for ks in range(start, end, k_block)]


def _attend_one_query(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The decode step: one query per head that sees every key (the caller checked). q (B,H,1,D).

    One score row per head, so no blocking and no mask: about ten tensor ops instead of the
    blocked kernel's ~25. Checked against `attention_reference` like the blocked path.
    """
    B, H, _, D = q.shape
    K = k.shape[1]
    rows = q.view(B, K, H // K, D)  # (B, K, G, D): the G query heads of a KV group as rows
    fp32 = q.dtype == torch.float32 and v.dtype == torch.float32  # skip no-op casts (each is a dispatch)
    s = torch.matmul(rows, k.transpose(-1, -2))  # (B, K, G, S)
    s = (s if fp32 else s.float()) * scale
    m = s.amax(dim=-1, keepdim=True)  # (B, K, G, 1)
    if sinks is not None:
        sink = sinks.view(1, K, H // K, 1)
        sink = sink if sink.dtype == torch.float32 else sink.float()
        m = torch.maximum(m, sink)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - m)
    if fp32:
        return (torch.matmul(p, v) / denom).view(B, H, 1, D)
    out = torch.matmul(p.to(v.dtype), v).float() / denom  # (B, K, G, D)
    return out.view(B, H, 1, D).to(q.dtype)


def attention_blocks(
    q: torch.Tensor, blocks: KVBlocks, sinks: torch.Tensor | None, q_offset: int, window: int | None
) -> torch.Tensor:
    """Online-softmax attention over keys read block by block from a `KVBlocks` (a quantised or
    evicting cache): same contract and result as `attention_reference` over `blocks.materialize()`,
    but only one block of keys and values is ever full precision. When `blocks.mass` is set, a second
    pass over the blocks adds to it the attention each key received (B, K, S), summed over queries and
    the G heads of its group, without a (T, S) matrix larger than one block. q (B, H, T, D) -> (B, H, T, D).
    """
    B, H, T, D = q.shape
    K = blocks.kv_heads
    G = H // K
    if blocks.mass is None and flash_applies(q):
        return _attention_blocks_flash(q, blocks, sinks, q_offset, window)
    rows = q.view(B, K, G, T, D).reshape(B, K, G * T, D).float() * D**-0.5  # (B, K, G·T, D); row = g·T + t
    k_block = max(64, SCORE_BLOCK_ELEMENTS // max(1, B * H * T))
    first_q, last_q = q_offset, q_offset + T - 1
    lo = 0 if window is None else max(0, first_q - window + 1)

    def scores(ks: int, k: torch.Tensor) -> torch.Tensor | None:
        ke = ks + k.shape[2]
        if ke <= lo or ks > last_q:
            return None  # no query of this call sees the block
        s = rows @ k.float().transpose(-1, -2)  # (B, K, G·T, Sb)
        if not (ke - 1 <= first_q and (window is None or last_q - ks < window)):
            mask = visible_mask(T, ke - ks, first_q - ks, window, q.device)  # (T, Sb)
            s = s.masked_fill(~mask.repeat(G, 1), float("-inf"))
        return s

    if sinks is None:
        m = torch.full((B, K, G * T, 1), -1e30, device=q.device)  # finite: a fully masked block stays NaN-free
        l = torch.zeros_like(m)
    else:
        m = sinks.float().view(1, K, G, 1, 1).expand(B, K, G, T, 1).reshape(B, K, G * T, 1)
        l = torch.ones_like(m)
    acc = torch.zeros(B, K, G * T, D, device=q.device, dtype=torch.float32)
    for ks, k, v in blocks.blocks(k_block):
        s = scores(ks, k)
        if s is None:
            continue
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # (B, K, G·T, 1)
        p = torch.exp(s - m_new)
        corr = torch.exp(m - m_new)
        l = l * corr + p.sum(dim=-1, keepdim=True)
        acc = acc * corr + p @ v.float()  # (B, K, G·T, D)
        m = m_new
    if blocks.mass is not None:
        for ks, k, _ in blocks.blocks(k_block):
            s = scores(ks, k)
            if s is not None:
                p = torch.exp(s - m) / l  # (B, K, G·T, Sb): final probabilities of this block
                blocks.mass[:, :, ks : ks + k.shape[2]] += p.sum(dim=2)
    return (acc / l).view(B, K, G, T, D).reshape(B, H, T, D).to(q.dtype)


def _attention_blocks_flash(
    q: torch.Tensor, blocks: KVBlocks, sinks: torch.Tensor | None, q_offset: int, window: int | None
) -> torch.Tensor:
    """`attention_blocks` through the fused CPU kernel: one `_flash_merge` per block read (dequantised
    blocks of at most FLASH_BLOCK_KEYS keys, fewer when a masked block's (G·T, Sb) mask would exceed
    SCORE_BLOCK_ELEMENTS). Not used when the caller asks for the attention mass (H2O), which needs the
    probabilities themselves."""
    B, H, T, D = q.shape
    K = blocks.kv_heads
    G = H // K
    rows = q.view(B, K, G, T, D).reshape(B, K, G * T, D)  # row = g·T + t
    first_q, last_q = q_offset, q_offset + T - 1
    lo = 0 if window is None else max(0, first_q - window + 1)
    lse, acc = _flash_state(sinks, B, K, G, T, D, q.device)
    k_block = max(64, min(FLASH_BLOCK_KEYS, SCORE_BLOCK_ELEMENTS // max(1, G * T)))  # bounds a block's mask
    for ks, k, v in blocks.blocks(k_block):
        ke = ks + k.shape[2]
        if ke <= lo or ks > last_q:
            continue
        mask = None
        if not (ke - 1 <= first_q and (window is None or last_q - ks < window)):
            mask = flash_block_mask(T, ke - ks, first_q - ks, window, G, q.dtype, q.device)
        lse, acc = _flash_merge(rows, k.to(q.dtype), v.to(q.dtype), mask, lse, acc)
    return acc.view(B, K, G, T, D).reshape(B, H, T, D).to(q.dtype)


def attention_mass_reference(
    q: torch.Tensor, k: torch.Tensor, sinks: torch.Tensor | None, q_offset: int, window: int | None
) -> torch.Tensor:
    """Dense oracle of the attention mass: the (B, H, T, S) probabilities of `attention_reference`
    summed over queries and the G heads of each KV head -> (B, K, S) fp32."""
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    kr = k.repeat_interleave(H // K, dim=1).float()  # (B, H, S, D)
    scores = (q.float() @ kr.transpose(-1, -2)) / D**0.5  # (B, H, T, S)
    scores = scores.masked_fill(~visible_mask(T, S, q_offset, window, q.device), float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs.sum(dim=2).view(B, K, H // K, S).sum(dim=2)  # (B, K, S)


def _blocked(cache: KVCache, layer: int) -> bool:
    """Whether `cache` reads `layer` block by block (a `BlockKVCache` saying so). NOTE: a getattr, not
    isinstance on the runtime-checkable protocol, which costs ~100x more on every layer of every step."""
    is_blocked = getattr(cache, "is_blocked", None)
    return is_blocked is not None and is_blocked(layer)


class Attention(nn.Module):
    """GQA attention block: q_proj, fused kv_proj (K then V), o_proj, per-head sink logits."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        C, H, K, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = H, K, D
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        self.sink_clamp = cfg.sink_clamp
        self.q_proj = Linear(C, H * D, bias=cfg.attention_bias)
        self.kv_proj = Linear(C, 2 * K * D, bias=cfg.attention_bias)
        self.o_proj = Linear(H * D, C, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.zeros(H))  # learned sink logit per query head
        self._qkv: tuple[torch.Tensor, torch.Tensor | None, bool] | None = None  # see pack_for_decode
        self._clamped_sinks: tuple[tuple[int, int], torch.Tensor] | None = None  # see sink_logits

    @torch.no_grad()
    def pack_for_decode(self, input_major: bool | None = None) -> None:
        """Make q_proj and kv_proj views of one buffer (and their biases views of one vector), so the
        projections of a token are a single GEMV: input-major (C, H·D + 2·K·D) or out-major
        (H·D + 2·K·D, C); None picks the dtype's layout (`decode_pack.input_major_for`: input-major
        for fp32, out-major for 16-bit weights). Same shapes and values; the parameters stay separate
        for training and checkpoints. Idempotent; asking for the other layout re-packs.
        """
        q, kv = self.q_proj, self.kv_proj
        if input_major is None:
            input_major = input_major_for(q.weight.dtype)
        packed = self._packed_qkv()
        if packed is None or packed[2] != input_major:
            bias = None if q.bias is None else pack_pair(q.bias, kv.bias, transposed=False)
            buf = pack_pair(q.weight, kv.weight, transposed=True) if input_major else pack_rows(q.weight, kv.weight)
            self._qkv = (buf, bias, input_major)  # (C, Nq + Nkv) or (Nq + Nkv, C); (Nq + Nkv,)

    def is_packed(self) -> bool:
        """Whether q_proj and kv_proj still live in the buffer `pack_for_decode` made."""
        return self._packed_qkv() is not None

    def _packed_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None, bool] | None:
        """The packed (weight, bias, input_major) while the parameters still live in it (e.g. not after
        .to(dtype))."""
        if self._qkv is not None:
            buf, bias, input_major = self._qkv
            q, kv, split = self.q_proj, self.kv_proj, self.q_proj.weight.shape[0]
            offset = split if input_major else split * self.q_proj.weight.shape[1]
            if still_packed(buf, q.weight, kv.weight, offset) and (
                bias is None or still_packed(bias, q.bias, kv.bias, split)
            ):
                return self._qkv
            self._qkv = None
        return None

    def sink_logits(self) -> torch.Tensor:
        """The sink logits as used in the softmax (clamped where configured), shape (H,).

        Without autograd the clamped tensor is kept and reused until the weights change: a decode
        step then spends no op on it. The key is the parameter's storage and version counter, which
        every in-place write (optimiser step, load_state_dict, copy_) and every re-assignment
        (.to(), .data =) changes.
        """
        if self.sink_clamp is None:
            return self.sinks
        if torch.is_grad_enabled():
            return self.sinks.clamp(*self.sink_clamp)
        key = (self.sinks.data_ptr(), self.sinks._version)
        if self._clamped_sinks is None or self._clamped_sinks[0] != key:
            self._clamped_sinks = (key, self.sinks.detach().clamp(*self.sink_clamp))
        return self._clamped_sinks[1]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
        impl: str = "fast",
        batch: RaggedBatch | None = None,
    ) -> torch.Tensor:
        """x (B, T, C) at absolute positions start_pos…start_pos+T-1 -> (B, T, C); cos, sin are the
        (T, D) tables of `rope.rotary_tables` for this layer's kind.

        With a cache (`gptoss_lite.kv.base.KVCache`), new keys are rotated once at their absolute
        positions and stored; queries attend over what the cache returns, with this layer's own
        window and sinks. With a `RaggedBatch` instead of a cache (x is (1, N, C), the new tokens of
        several sequences, cos/sin at `batch.positions`), the batch stores the keys and attends with
        this layer's window and sinks.
        """
        B, T, C = x.shape
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        packed = None if torch.is_grad_enabled() else self._packed_qkv()  # the buffer carries no gradient
        if packed is None:
            q = self.q_proj(x)  # (B, T, H·D)
            kv = self.kv_proj(x)  # (B, T, 2·K·D)
        else:
            w, b, input_major = packed
            flat = x.view(B * T, C)
            if input_major:
                qkv = torch.mm(flat, w) if b is None else torch.addmm(b, flat, w)
            else:
                qkv = linear(flat, w, b)
            q, kv = qkv.view(B, T, -1).split((H * D, 2 * K * D), dim=-1)
        q = q.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        kv = kv.reshape(B, T, 2, K, D)
        k = kv[:, :, 0].transpose(1, 2)  # (B, K, T, D)
        v = kv[:, :, 1].transpose(1, 2).contiguous()  # (B, K, T, D)
        q = apply_rotary_tables(q, cos, sin)
        k = apply_rotary_tables(k, cos, sin)
        if batch is not None:  # B == 1: the flat batch of several sequences
            y = batch.attend(self.layer, q[0], k[0], v[0], self.sink_logits(), self.window)  # (H, T, D)
            return self.o_proj(y.transpose(0, 1).reshape(B, T, H * D))
        if cache is None:
            keys, values, q_offset = k, v, 0
        elif _blocked(cache, self.layer):
            # A quantised or evicting layer, read block by block (docs/kv-cache.md, "Block reads"); the
            # reference impl attends densely over the materialised keys (the oracle).
            blocks, first = cast(BlockKVCache, cache).update_blocks(self.layer, k, v, start_pos)
            if impl == "fast":
                y = attention_blocks(q, blocks, self.sink_logits(), start_pos - first, self.window)
            else:
                keys, values = blocks.materialize()
                y = attention_reference(q, keys, values, self.sink_logits(), start_pos - first, self.window)
                if blocks.mass is not None:
                    blocks.mass += attention_mass_reference(q, keys, self.sink_logits(), start_pos - first, self.window)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))
        else:
            keys, values, first = cache.update(self.layer, k, v, start_pos)  # (B, K, S, D) each
            q_offset = start_pos - first  # key index of the first new query
        attend = attention_fast if impl == "fast" else attention_reference
        y = attend(q, keys, values, self.sink_logits(), q_offset, self.window)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))
