"""Token eviction under a KV budget (docs/kv-cache.md#compression-and-eviction): which cached positions to keep.

Both rules return a sorted tuple of kept token indices; applying it to a cache is the caller's job.
Pure Python: a sequence of floats goes in (a torch tensor or numpy array is converted with
`.tolist()`), so nothing here imports torch.

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


def streaming_keep_indices(length: int, budget: int, sink_tokens: int) -> tuple[int, ...]:
    """Keep the first `sink_tokens` tokens plus the most recent `budget - sink_tokens` (StreamingLLM).

    Returns min(length, budget) sorted indices in [0, length); every token when `length <= budget`.
    A sink count above the budget is an error.
    """
    _check_int("length", length, 0)
    _check_int("budget", budget, 1)
    _check_int("sink_tokens", sink_tokens, 0)
    if sink_tokens > budget:
        raise ValueError(f"sink_tokens={sink_tokens}: must be <= budget={budget} (sinks are part of the budget)")
    if length <= budget:
        return tuple(range(length))
    recent = budget - sink_tokens
    return tuple(range(sink_tokens)) + tuple(range(length - recent, length))
