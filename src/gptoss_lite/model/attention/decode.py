"""The decode kernel: one query per row over a fixed-shape key tensor with an additive mask.

Used by every one-token path: eager decode over a dense cache (no mask: the query sees every key),
the engine's batched decode over padded block tables (mask from each key's distance to its query),
and the compiled step over its static ring and full buffers. (Over quantised blocks, which come a
chunk at a time, the block loop's `blocks.chunked_decode` does the same with an online softmax.
Over the engine's block tables the compiled step calls the C form of this function,
`gptoss_lite.kernels.blocks.attention`, which reads the blocks in place; this one is its oracle.)

Rows are any (X, Y, G, D) batch of the G query heads of a KV head: (B, K, G, D) for a dense cache,
(K, Bd, G, D) for the engine's head-major blocks. Keys and values are (X, Y, S, D), the mask
broadcasts to (X, Y, G, S) and the sink logits to (X, Y, G, 1).

About ten tensor ops, no blocking: one score row per head.
"""

from __future__ import annotations

import torch


def masked_decode(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    sink: torch.Tensor | None,
    round_to: torch.dtype | None = None,
) -> torch.Tensor:
    """rows (X, Y, G, D), keys/values (X, Y, S, D), bias additive fp32 (0 visible, -inf hidden) or
    None, sink logits or None -> (X, Y, G, D) in `round_to` (default: the rows' dtype).

    The matmuls run in the dtype of the inputs. `round_to` rounds the scores and the weighted values
    to that dtype where eager 16-bit matmuls would (the compiled step widens a 16-bit cache to fp32
    for the matmul, which is faster on CPUs without 16-bit instructions, and rounds as eager does)."""
    out_dtype = rows.dtype if round_to is None else round_to
    D = rows.shape[-1]
    if keys.dtype == torch.float32:
        s = torch.matmul(rows, keys.transpose(-1, -2))  # (X, Y, G, S)
    else:
        # 16-bit keys as the left operand, untransposed: CPU bf16 matmul copies a transposed key slice
        # of a cache buffer first (gpt-oss-20b, 567 keys: 170 -> 77 us a layer; 4,096: 1,323 -> 349)
        s = torch.matmul(keys, rows.transpose(-1, -2)).transpose(-1, -2)  # (X, Y, G, S), a view
    if round_to is not None and round_to != s.dtype:
        s = s.to(round_to)
    s = (s if s.dtype == torch.float32 else s.float()) * D**-0.5  # skip no-op casts: each is a dispatch
    if bias is not None:
        s = s + bias
    m = s.amax(dim=-1, keepdim=True)
    if sink is not None:
        sink = sink if sink.dtype == torch.float32 else sink.float()
        m = torch.maximum(m, sink)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    if p.dtype != out_dtype:
        p = p.to(out_dtype)
    if p.dtype != values.dtype:
        p = p.to(values.dtype)
    out = torch.matmul(p, values)
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    if out.dtype == torch.float32:
        return out / denom
    return (out.float() / denom).to(out_dtype)
