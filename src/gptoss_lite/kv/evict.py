"""Token eviction under a KV budget (docs/kv-cache.md#compression-and-eviction): which cached positions to keep.

The two rules, written once here and used by every cache that evicts:

- **StreamingLLM**: the first `sink_tokens` positions and everything from `recent_start(length,
  budget, sink_tokens)` on. The evicting cache keeps that (`streaming_priority`), and the engine's
  full-layer window is the same rule with no sink tokens (gpt-oss's sinks are logits, not tokens):
  its blocks before `recent_start` are released (`kv.groups.KVGroup.release_target`).
- **H2O** (heavy hitters): the `recent` most recent positions, and of the rest the largest
  accumulated attention (`h2o_priority`; `heavy_hitter_indices` on a plain list).

`streaming_keep_indices` and `heavy_hitter_indices` return sorted tuples of kept indices of plain
Python sequences (a torch tensor or numpy array is converted with `.tolist()`); the `*_priority`
functions score a cache's held tokens (tensors: +inf is never evicted, the lowest goes first) with
tensor methods only. Nothing here imports torch.

NOTE: neither rule can know the future. A later query that needs a token past attention ignored
loses it under both; measure quality (docs/kv-cache.md#compression-and-eviction) rather than assuming it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gptoss_lite.validation import check_int as _check_int


def _as_masses(attention_mass: Any) -> list[float]:
    """A 1-D list of finite, non-negative floats from a sequence, tensor or array."""
    if hasattr(attention_mass, "tolist") and not isinstance(attention_mass, (list, tuple)):
        attention_mass = attention_mass.tolist()  # tensor / ndarray -> Python floats, no torch import
    if isinstance(attention_mass, (str, bytes)) or not isinstance(attention_mass, Sequence):
        raise TypeError(f"attention_mass: expected a 1-D sequence of floats, got {type(attention_mass).__name__}")
    masses = []
    for i, m in enumerate(attention_mass):
        if isinstance(m, bool) or not isinstance(m, (int, float)):
            raise TypeError(f"attention_mass[{i}]={m!r}: must be a real number (the input must be 1-D)")
        if not math.isfinite(m) or m < 0:
            raise ValueError(f"attention_mass[{i}]={m!r}: must be finite and >= 0 (accumulated attention)")
        masses.append(float(m))
    return masses


def heavy_hitter_indices(attention_mass: Sequence[float], budget: int) -> tuple[int, ...]:
    """Keep the `budget` tokens with the largest accumulated attention (H2O-style).

    attention_mass: (S,) accumulated attention each cached token has received.
    Returns (budget,) sorted indices; equal masses are broken toward the lower index.
    A budget larger than S is an error (the masses do not describe that many tokens).
    """
    masses = _as_masses(attention_mass)
    _check_int("budget", budget, 1)
    if budget > len(masses):
        raise ValueError(
            f"budget={budget}: larger than the {len(masses)} tokens in attention_mass; "
            f"use budget <= {len(masses)} (or skip eviction until the cache exceeds the budget)"
        )
    ranked = sorted(range(len(masses)), key=lambda i: (-masses[i], i))
    return tuple(sorted(ranked[:budget]))


def recent_start(length: int, budget: int, sink_tokens: int = 0) -> int:
    """StreamingLLM over `length` tokens: the first kept position after the `sink_tokens` sinks, so
    that sinks and recent tokens together fill `budget` (every token is kept when `length <= budget`).
    A sink count above the budget is an error."""
    _check_int("length", length, 0)
    _check_int("budget", budget, 1)
    _check_int("sink_tokens", sink_tokens, 0)
    if sink_tokens > budget:
        raise ValueError(f"sink_tokens={sink_tokens}: must be <= budget={budget} (sinks are part of the budget)")
    return max(sink_tokens, length - (budget - sink_tokens))


def streaming_keep_indices(length: int, budget: int, sink_tokens: int) -> tuple[int, ...]:
    """Keep the first `sink_tokens` tokens plus the most recent `budget - sink_tokens` (StreamingLLM).

    Returns min(length, budget) sorted indices in [0, length); every token when `length <= budget`.
    """
    start = recent_start(length, budget, sink_tokens)
    return tuple(range(min(sink_tokens, length))) + tuple(range(start, length))


def streaming_priority(pos: Any, length: int, budget: int, sink_tokens: int) -> Any:
    """StreamingLLM's keep priority of held tokens at positions `pos` (an int64 tensor) of a sequence
    now `length` long: +inf where `streaming_keep_indices` keeps them, else their position (the
    oldest goes first)."""
    keep = (pos < sink_tokens) | (pos >= recent_start(length, budget, sink_tokens))
    return pos.float().masked_fill(keep, math.inf)


def h2o_priority(pos: Any, mass: Any, length: int, recent: int) -> Any:
    """H2O's keep priority of held tokens at positions `pos` with accumulated attention `mass` (tensors
    of one shape) of a sequence now `length` long: +inf for the `recent` most recent positions, else
    the mass (the lightest goes first)."""
    return mass.masked_fill(pos >= length - recent, math.inf)
