"""The oracles: dense attention with an explicit sink column, and the attention mass it implies.

Slow and obviously correct. Every fast path (`blocks.attend`, `decode.masked_decode`, the compiled
step, the engine's batched decode) is tested against these.

Conventions (docs/model.md#attention-with-sinks): queries (B, H, T, D) whose first row sits at key
index `q_offset` (query i has key-array index i + q_offset), keys/values (B, K, S, D) in chronological
order. Key j is visible to query i iff j <= i + q_offset and, with a window W, (i + q_offset) - j < W.
"""

from __future__ import annotations

import torch


def visible_mask(T: int, S: int, q_offset: int, window: int | None, device=None) -> torch.Tensor:
    """Boolean (T, S) mask: True where query i may see key j."""
    qi = torch.arange(T, device=device)[:, None] + q_offset
    kj = torch.arange(S, device=device)[None, :]
    mask = kj <= qi
    if window is not None:
        mask &= (qi - kj) < window
    return mask


def _probabilities(
    q: torch.Tensor, k: torch.Tensor, sinks: torch.Tensor | None, q_offset: int, window: int | None
) -> torch.Tensor:
    """The (B, H, T, S) fp32 attention probabilities, the sink's share left out."""
    B, H, T, D = q.shape
    S = k.shape[2]
    kr = k.repeat_interleave(H // k.shape[1], dim=1).float()  # (B, H, S, D)
    scores = (q.float() @ kr.transpose(-1, -2)) / D**0.5  # (B, H, T, S)
    scores = scores.masked_fill(~visible_mask(T, S, q_offset, window, q.device), float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink_col = sinks.float().view(1, H, 1, 1).expand(B, H, T, 1)  # (B, H, T, 1)
    return torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, q_offset: int, window: int | None
) -> torch.Tensor:
    """Dense attention with an explicit sink column. q (B,H,T,D), k/v (B,K,S,D) -> (B,H,T,D)."""
    G = q.shape[1] // k.shape[1]
    probs = _probabilities(q, k, sinks, q_offset, window)  # (B, H, T, S)
    return (probs @ v.repeat_interleave(G, dim=1).float()).to(q.dtype)


def attention_mass_reference(
    q: torch.Tensor, k: torch.Tensor, sinks: torch.Tensor | None, q_offset: int, window: int | None
) -> torch.Tensor:
    """The attention each key received: `attention_reference`'s probabilities summed over queries and
    the G heads of each KV head -> (B, K, S) fp32."""
    B, H = q.shape[:2]
    K, S = k.shape[1], k.shape[2]
    probs = _probabilities(q, k, sinks, q_offset, window)
    return probs.sum(dim=2).view(B, K, H // K, S).sum(dim=2)
