"""The key-block planner: which keys a block of queries reads, in which blocks, and with which masks.

A block of queries at key indices first_q … last_q sees keys in [lo, hi): lo = 0 (or, with a window
W, first_q - W + 1), hi = last_q + 1. Inside that range lies the *band* that every one of those
queries sees: keys <= first_q and, with a window, >= last_q - W + 1. A key block inside the band
needs no mask; only the blocks at its two edges do. Everything here is about that one rule:

- `query_range` / `band` / `fully_visible`: the range, the band, and the edge test;
- `key_blocks`: the blocks, cut at the band's edges when the band is long enough to pay for the
  extra calls;
- `block_mask` / `flash_block_mask`: the masks of an edge block (boolean for the online softmax,
  additive for the fused kernel), kept in a small cache without autograd;
- `distance_bias`: the additive mask of one-query rows given each key's distance to its query (the
  engine's padded block tables, the compiled step's ring), built once per step and window.
"""

from __future__ import annotations

import functools

import torch

from gptoss_lite.model.attention.reference import visible_mask

# A band of keys every query sees gets its own unmasked blocks only from this length on: below it, the
# ops of the extra blocks cost more than masking (a sliding window of 128 stays one block).
MIN_UNMASKED_KEYS = 256
# Budget for one score block (elements of B·H·Tq·Sk); 4M fp32 elements = 16 MiB.
SCORE_BLOCK_ELEMENTS = 1 << 22
# Keys per dequantised block a segmented read hands the fused kernel.
FLASH_BLOCK_KEYS = 1024


def query_range(first_q: int, last_q: int, window: int | None, num_keys: int) -> tuple[int, int]:
    """[lo, hi): the keys any query at key indices first_q … last_q may see."""
    return (0 if window is None else max(0, first_q - window + 1)), min(num_keys, last_q + 1)


def band(lo: int, hi: int, first_q: int, last_q: int, window: int | None) -> tuple[int, int]:
    """[band_lo, band_hi): the keys of [lo, hi) that every query at first_q … last_q sees (may be empty)."""
    return (lo if window is None else max(lo, last_q - window + 1)), min(hi, first_q + 1)


def fully_visible(ks: int, ke: int, first_q: int, last_q: int, window: int | None) -> bool:
    """Whether every query at first_q … last_q sees every key of [ks, ke) (the block needs no mask)."""
    return ke - 1 <= first_q and (window is None or last_q - ks < window)


def key_blocks(
    lo: int,
    hi: int,
    k_block: int,
    first_q: int,
    last_q: int,
    window: int | None,
    band_block: int | None = None,
) -> list[tuple[int, int]]:
    """Key blocks [ks, ke) tiling [lo, hi). Outside the band, blocks of at most k_block keys; a band of
    at least MIN_UNMASKED_KEYS keys is cut out at its edges and tiled with blocks of at most
    `band_block` keys (None: the band is one block, which the fused kernel tiles itself). A shorter
    band is not cut out: one masked block costs fewer ops than three. A handful of queries over a long
    past (a speculative verification, a prefill chunk after a long prompt) so masks only the keys at
    the edges, not the whole history."""
    band_lo, band_hi = band(lo, hi, first_q, last_q, window)
    if band_hi - band_lo < MIN_UNMASKED_KEYS:
        return _tile(lo, hi, k_block)
    inner = band_hi - band_lo if band_block is None else band_block
    return _tile(lo, band_lo, k_block) + _tile(band_lo, band_hi, inner) + _tile(band_hi, hi, k_block)


def causal_blocks(lo: int, hi: int, k_block: int, first_q: int) -> list[tuple[int, int]]:
    """Key blocks [ks, ke) tiling [lo, hi) for a query block without a window whose diagonal the fused
    kernel's causal mode serves: the keys before the first query as one unmasked block (every query
    sees them), then blocks of at most k_block keys from the first query's own key on, the first of
    which lines query t up with key t."""
    return ([(lo, first_q)] if first_q > lo else []) + _tile(first_q, hi, k_block)


def _tile(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(ks, min(end, ks + size)) for ks in range(start, end, size)]


def block_mask(T: int, S: int, q_offset: int, window: int | None, G: int, device) -> torch.Tensor:
    """Boolean (G·T, S) visibility of an edge block for the G stacked heads (row = g·T + t)."""
    if torch.is_grad_enabled():
        return visible_mask(T, S, q_offset, window, device).repeat(G, 1)
    return _cached_visible(T, S, q_offset, window, G, torch.device(device))


def flash_block_mask(
    T: int, S: int, q_offset: int, window: int | None, G: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's inputs for an edge block: an additive (G·T, S) mask (0 where visible, -1e30
    where not) and the (G·T,) rows it hides entirely. Without autograd the pair is built once per
    shape and offset and reused: every layer of a kind, and every query block of a long prompt, masks
    the same edges, and building the masks was a fifth of a 2,048-token fp32 prefill of the 20M model."""
    if torch.is_grad_enabled():
        return _build_flash_mask(T, S, q_offset, window, G, dtype, device)
    return _cached_block_mask(T, S, q_offset, window, G, dtype, torch.device(device))


def _build_flash_mask(
    T: int, S: int, q_offset: int, window: int | None, G: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    visible = visible_mask(T, S, q_offset, window, device).repeat(G, 1)  # (G·T, S)
    additive = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, -1e30)
    return additive, ~visible.any(dim=-1)


def _build_visible(T: int, S: int, q_offset: int, window: int | None, G: int, device) -> torch.Tensor:
    return visible_mask(T, S, q_offset, window, device).repeat(G, 1)


# At most 8 masks of each kind, each <= SCORE_BLOCK_ELEMENTS elements (16 MiB in fp32). Only used with
# autograd off, where nothing is saved for backward, so a mask made in inference mode may serve a
# later no-grad call.
_cached_block_mask = functools.lru_cache(maxsize=8)(_build_flash_mask)
_cached_visible = functools.lru_cache(maxsize=8)(_build_visible)


def distance_bias(distance: torch.Tensor, window: int | None, memo: dict | None = None) -> torch.Tensor:
    """Additive fp32 mask (same shape as `distance`) of one-query rows: `distance` is each key's query
    position minus its own position (negative for a future key or padding); 0 where 0 <= distance
    (< window), -inf elsewhere. `memo`, a dict owned by whoever owns `distance` (one engine step),
    keeps one mask per window for the layers that share it."""
    if memo is not None and window in memo:
        return memo[window]
    visible = distance >= 0
    if window is not None:
        visible &= distance < window
    bias = torch.zeros(distance.shape, dtype=torch.float32, device=distance.device).masked_fill_(
        ~visible, float("-inf")
    )
    if memo is not None:
        memo[window] = bias
    return bias
