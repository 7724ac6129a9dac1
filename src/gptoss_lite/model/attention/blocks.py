"""The block loop: attention of a block of queries over any `KVRead`, one key block at a time.

Queries of one KV group are stacked as rows (B, K, G·T, D), row = g·T + t, so KV heads are never
repeated. Key blocks come from the planner (`plan.key_blocks`) for a dense read, or from the read
itself (`KVRead.spans`: whole storage granules, never across a segment) for a segmented one (quantised
codes dequantised a block at a time, an evicting cache's kept past). Only the blocks at the band's
edges get a mask. No (T, S) matrix larger than one block is ever built, and no full-history
full-precision copy of a segmented read.

Two accumulators, both starting from the sink state, so the sink costs nothing extra:
- `OnlineSoftmax`: running (max, sum, weighted values), starting at max = sink logit, sum = exp(0)
  = 1, values 0 (any device and dtype; also what the attention mass of H2O needs, the probabilities);
- `FlashMerge`: PyTorch's fused CPU flash kernel per block, each call returning its log-sum-exp, merged
  exactly by log-sum-exp; the sink is a first "block" of lse = sink logit and value 0.

One query that sees every key of a dense read goes to the decode kernel (`decode.masked_decode`);
many queries over a dense read, on CPUs with AVX-512, to the prefill kernel (`kernels.prefill`: all
of a KV head's query heads per key tile, masked work only on the tiles at the edges), which replaces
the block loop there.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gptoss_lite.kernels import prefill as prefill_kernel
from gptoss_lite.kv.base import KVRead
from gptoss_lite.model.attention.decode import masked_decode
from gptoss_lite.model.attention.plan import (
    FLASH_BLOCK_KEYS,
    SCORE_BLOCK_ELEMENTS,
    block_mask,
    causal_blocks,
    flash_block_mask,
    fully_visible,
    key_blocks,
    query_range,
)

# From this many queries on, a dense read on CPU goes through the fused flash kernel.
FLASH_MIN_QUERIES = 16
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_DTYPES = (torch.float32, torch.bfloat16)


def flash_applies(q: torch.Tensor, *kv: torch.Tensor) -> bool:
    """Whether PyTorch's CPU flash-attention kernel takes these tensors (CPU, one float dtype)."""
    return (
        _FLASH is not None
        and q.device.type == "cpu"
        and q.dtype in _FLASH_DTYPES
        and all(t.dtype == q.dtype for t in kv)
    )


class OnlineSoftmax:
    """Running softmax state of rows (..., R) over key blocks. `start` is the sink logit of each row,
    broadcastable to (..., R, 1), or None (then max = -1e30, finite: a row whose first block is fully
    masked must not become NaN, and sum = 0)."""

    def __init__(self, start: torch.Tensor | None, rows: tuple[int, ...], D: int, device) -> None:
        shape = (*rows, 1)
        if start is None:
            self.m = torch.full(shape, -1e30, device=device)
            self.l = torch.zeros(shape, device=device)
        else:
            self.m = start.float().expand(shape)
            self.l = torch.ones(shape, device=device)
        self.acc = torch.zeros(*rows, D, device=device)

    def absorb(self, s: torch.Tensor, v: torch.Tensor) -> None:
        """s (..., R, Sb) fp32 scores (-inf where hidden), v (..., Sb, D) the block's values."""
        m_new = torch.maximum(self.m, s.amax(dim=-1, keepdim=True))
        p = torch.exp(s - m_new)
        corr = torch.exp(self.m - m_new)
        self.l = self.l * corr + p.sum(dim=-1, keepdim=True)
        self.acc = self.acc * corr + (p.to(v.dtype) @ v).float()
        self.m = m_new

    def probabilities(self, s: torch.Tensor) -> torch.Tensor:
        """The final probabilities of a block's scores s, once every block was absorbed."""
        return torch.exp(s - self.m) / self.l

    def result(self) -> torch.Tensor:
        return self.acc / self.l


class FlashMerge:
    """Running (log-sum-exp, output) of rows (B, K, R) merged over fused-kernel calls, starting from
    the sink (`start`, broadcastable to (B, K, R)) or from an empty start (lse = -1e30)."""

    def __init__(self, start: torch.Tensor | None, rows: tuple[int, int, int], D: int, device) -> None:
        self.lse = torch.full(rows, -1e30, device=device) if start is None else start.float().expand(rows)
        self.acc = torch.zeros(*rows, D, device=device)

    def absorb(
        self,
        rows: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """One fused call of rows (B, K, R, D) over a key block; `mask` is `plan.flash_block_mask`'s
        (additive mask, hidden rows) or None when every key is visible. A row the mask hides entirely
        is reported by the kernel as lse = 0 and is set to -inf here."""
        assert _FLASH is not None, "flash_applies() was checked"
        additive = None if mask is None else mask[0]
        out_b, lse_b = _FLASH(rows, k, v, 0.0, False, attn_mask=additive, scale=rows.shape[-1] ** -0.5)
        if mask is not None:
            lse_b = lse_b.masked_fill(mask[1], float("-inf"))
        self._merge(out_b, lse_b)

    def absorb_causal(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, G: int) -> None:
        """One fused call in the kernel's causal mode: query t of each head sees keys 0 … t of the block
        (the block starts at the first query's own key). The G stacked heads of rows (B, K, G·T, D)
        become heads of their own, each over its group's keys (repeated G times for this one block),
        since the causal mode lines query t up with key t of one head."""
        assert _FLASH is not None, "flash_applies() was checked"
        B, K, R, D = rows.shape
        S = k.shape[2]
        q = rows.view(B, K * G, R // G, D)
        kh = k[:, :, None].expand(B, K, G, S, D).reshape(B, K * G, S, D)
        vh = v[:, :, None].expand(B, K, G, S, D).reshape(B, K * G, S, D)
        out_b, lse_b = _FLASH(q, kh, vh, 0.0, True, scale=D**-0.5)
        self._merge(out_b.reshape(B, K, R, D), lse_b.reshape(B, K, R))

    def _merge(self, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        new = torch.logaddexp(self.lse, lse_b)
        self.acc = self.acc * torch.exp(self.lse - new)[..., None] + out_b.float() * torch.exp(lse_b - new)[..., None]
        self.lse = new

    def result(self) -> torch.Tensor:
        return self.acc


def attend(
    q: torch.Tensor,
    read: KVRead,
    sinks: torch.Tensor | None,
    q_offset: int,
    window: int | None,
    q_block: int | None = None,
    k_block: int | None = None,
) -> torch.Tensor:
    """Attention of q (B, H, T, D), query i at key index q_offset + i, over the keys of `read`, with
    this window and these sinks -> (B, H, T, D); the same result as `attention_reference` over
    `read.materialize()`. When `read.mass` is set, also adds to it the attention each key received.
    q_block / k_block force block sizes (tests); by default they follow SCORE_BLOCK_ELEMENTS."""
    B, H, T, D = q.shape
    K = read.kv_heads
    G = H // K
    S = read.num_keys
    dense = read.tensors()
    forced = q_block is not None or k_block is not None
    if dense is not None and T == 1 and q_offset == S - 1 and (window is None or S <= window) and not forced:
        sink = None if sinks is None else sinks.view(1, K, G, 1)
        return masked_decode(q.view(B, K, G, D), dense[0], dense[1], None, sink).view(B, H, 1, D)
    if (
        dense is not None
        and read.mass is None
        and not forced
        and prefill_kernel.applies(q, *dense)
        and not _records_gradients(q, sinks, *dense)
    ):
        return prefill_kernel.attention(q, dense[0], dense[1], sinks, q_offset, window)
    flash = (
        read.mass is None
        and not forced
        and flash_applies(q, *(dense or ()))
        and (T >= FLASH_MIN_QUERIES or dense is None)
        and not _records_gradients(q, sinks, *(dense or ()))
    )
    if q_block is None:
        if dense is None:
            q_block = T
        elif flash:
            q_block = T if G * T <= 4096 else max(1, 4096 // G)
            if window is not None:
                q_block = min(q_block, window)  # a query block spans at most 2W - 1 keys, not its length + W
        else:
            q_block = T if T * G <= 2048 else max(1, 2048 // G)
    qg = q.view(B, K, G, T, D)
    outs = []
    for qs in range(0, T, q_block):
        Tb = min(T, qs + q_block) - qs
        rows = qg[:, :, :, qs : qs + Tb].reshape(B, K, G * Tb, D)  # row = g·Tb + t
        start = None if sinks is None else sinks.view(1, K, G, 1).expand(B, K, G, Tb).reshape(B, K, G * Tb)
        out = _query_block(rows, read, dense, start, qs + q_offset, Tb, G, window, flash, k_block)
        outs.append(out.view(B, K, G, Tb, D))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)  # (B, K, G, T, D)
    return out.view(B, H, T, D).to(q.dtype)


def _records_gradients(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records this call. The fused kernel's log-sum-exp, which merges blocks and the
    sink, carries no gradient in its backward, so a training forward takes the online softmax, whose
    every op does (the fused path gave q and k gradients off by up to half their size)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _query_block(
    rows: torch.Tensor,
    read: KVRead,
    dense: tuple[torch.Tensor, torch.Tensor] | None,
    start: torch.Tensor | None,
    first_q: int,
    Tb: int,
    G: int,
    window: int | None,
    flash: bool,
    k_block: int | None,
) -> torch.Tensor:
    """One block of Tb queries (rows (B, K, G·Tb, D), at key indices first_q …) over its key blocks
    -> (B, K, G·Tb, D) fp32."""
    B, K, R, D = rows.shape
    last_q = first_q + Tb - 1
    lo, hi = query_range(first_q, last_q, window, read.num_keys)
    if k_block is None:
        per_block = R if flash else B * K * R  # elements of one score row of keys
        floor = 128 if dense is not None else 64
        k_block = max(floor, SCORE_BLOCK_ELEMENTS // max(1, per_block))
        if dense is None and flash:
            k_block = min(k_block, FLASH_BLOCK_KEYS)
    # Without a window, the fused kernel's own causal mode serves the block that starts at the first
    # query: it skips the keys above the diagonal where an additive mask makes it compute them all
    diagonal = flash and dense is not None and window is None and lo < hi and first_q < hi
    if diagonal:
        spans = causal_blocks(lo, hi, k_block, first_q)
    elif dense is not None:
        spans = key_blocks(lo, hi, k_block, first_q, last_q, window, band_block=None if flash else k_block)
    else:
        spans = [(ks, ke) for ks, ke in read.spans(k_block) if ke > lo and ks <= last_q]

    def keys(ks: int, ke: int) -> tuple[torch.Tensor, torch.Tensor]:
        if dense is not None:
            return dense[0][:, :, ks:ke], dense[1][:, :, ks:ke]
        k, v = read.read(ks, ke)
        return (k.to(rows.dtype), v.to(rows.dtype)) if flash else (k.float(), v.float())

    if flash:
        merge = FlashMerge(start, (B, K, R), D, rows.device)
        for ks, ke in spans:
            if diagonal and ks == first_q:
                merge.absorb_causal(rows, *keys(ks, ke), G)
                continue
            mask = None
            if not fully_visible(ks, ke, first_q, last_q, window):
                mask = flash_block_mask(Tb, ke - ks, first_q - ks, window, G, rows.dtype, rows.device)
            merge.absorb(rows, *keys(ks, ke), mask)
        return merge.result()

    scaled = rows * D**-0.5 if dense is not None else rows.float() * D**-0.5

    def scores(ks: int, k: torch.Tensor) -> torch.Tensor:
        s = (scaled @ k.transpose(-1, -2)).float()  # (B, K, G·Tb, Sb)
        ke = ks + k.shape[2]
        if not fully_visible(ks, ke, first_q, last_q, window):
            s = s.masked_fill(~block_mask(Tb, ke - ks, first_q - ks, window, G, rows.device), float("-inf"))
        return s

    state = OnlineSoftmax(None if start is None else start[..., None], (B, K, R), D, rows.device)
    for ks, ke in spans:
        k, v = keys(ks, ke)
        state.absorb(scores(ks, k), v)
    if read.mass is not None:  # H2O: a second pass adds each key's final probability
        for ks, ke in spans:
            p = state.probabilities(scores(ks, keys(ks, ke)[0]))  # (B, K, G·Tb, Sb)
            read.mass[:, :, ks:ke] += p.sum(dim=2)
    return state.result()


def chunked_decode(
    rows: torch.Tensor,
    chunks: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    sink: torch.Tensor | None,
) -> torch.Tensor:
    """`masked_decode` over keys that come a chunk at a time (dequantised blocks): (keys, values, bias)
    per chunk, merged by an online softmax in fp32 -> (X, Y, G, D) in the rows' dtype."""
    X, Y, G, D = rows.shape
    scaled = rows.float() * D**-0.5
    state = OnlineSoftmax(sink, (X, Y, G), D, rows.device)
    for keys, values, bias in chunks:
        s = torch.matmul(scaled, keys.float().transpose(-1, -2))  # (X, Y, G, S)
        state.absorb(s if bias is None else s + bias, values.float())
    return state.result().to(rows.dtype)


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
    """`attend` over dense keys/values (B, K, S, D); the contract of `attention_reference`."""
    return attend(q, KVRead.dense(k, v, 0), sinks, q_offset, window, q_block, k_block)
