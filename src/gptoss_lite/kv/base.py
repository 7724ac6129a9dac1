"""The contract between an attention layer and its KV cache: what a layer may call, and nothing more.

A cache holds the keys and values of the first `num_tokens` tokens of each of its `batch_size`
sequences (every row has the same number of tokens). A forward pass over T new tokens, at absolute
positions `start_pos … start_pos + T - 1` with `start_pos == num_tokens`, calls `update` exactly once
per layer; when every layer has been updated, `num_tokens` is `start_pos + T`.

Division of labour:
- The **layer** owns attention semantics: its window (None on full layers, W on sliding layers), its
  sink logits, rotary embedding and the kernel. It rotates keys before handing them over.
- The **cache** stores rotated K/V and returns the keys the new queries may need. It decides what to
  keep from the layer kind in the model config (a sliding layer's cache may forget keys that fell out
  of every future window), but it never changes which keys a query sees: the layer masks with its own
  window.

Shapes (legend of `gptoss_lite.model`): new keys and values are (B, K, T, D); `update` returns keys
and values of shape (B, K, S, D) with S >= T, the last T being the new tokens, and `first`, the
position of key 0. Key j is the token at position `first + j`, so new query i (position
`start_pos + i`) sits at key index `start_pos - first + i`, and on a sliding layer sees keys j with
`0 <= (start_pos + i) - (first + j) < W`. The returned keys include every key that any new query may
see: all positions `0 …` on a full layer, at least `start_pos - W + 1 …` on a sliding layer.

One freedom: when T == 1 and the returned keys are exactly the last S <= W positions (a ring buffer
holding one window), the cache may return them in storage order rather than by position. The single
query sees every one of them, and attention is a sum over keys that carry their own rotation, so the
order cannot change the result. `first` is then `start_pos - S + 1`, as if they were in order.

Rollback (`RollbackKVCache`, a caller-side protocol; the model never calls it): `truncate(position)`
forgets every token at or after `position`. It is allowed back to any position whose K/V every layer
still holds: on a sliding layer, the next query at `position` needs the keys from
`position - W + 1`, so the lowest allowed position is `first_retained + W - 1` once the layer has
forgotten tokens (`first_retained > 0`), and 0 before. The allowed positions form the *retained
interval* `[lowest, num_tokens]`; anything outside raises ValueError naming the position and the
interval, and leaves the cache unchanged (`check_rollback`). A cache built with rollback slack R
keeps R tokens more than one window on sliding layers, so a rollback of R tokens is always allowed.

Block-read caches (`BlockKVCache`, optional; docs/kv-cache.md#block-reads-quantised-and-evicting-caches):
a cache that stores a layer in a form other than one (B, K, S, D) tensor (quantised codes, or a subset
of the past under a token budget) may say so with `is_blocked(layer)`. The layer then calls
`update_blocks` instead of `update` and gets a `KVBlocks`: the same keys and values as `update`
would return, in segments that are read (dequantised) one block at a time, so no full-history
full-precision copy is ever built. `update` keeps working on such a cache (it returns the
materialised tensors), so every consumer of the plain protocol still runs on it.

A second freedom, for full layers (window None) only: the past keys returned may be a subset of the
earlier positions (an evicting cache), as long as the new tokens come last and in order; `first` is
then `start_pos - P` with P past keys returned. Every past key is visible to every new query on a
full layer, so which positions they were does not change the mask, and each key carries its own
rotation (RoPE at its original position).

Ragged batches (`RaggedBatch`, continuous batching). A serving engine runs the new tokens of many
sequences, each at its own position and with its own history, as one flat batch of N tokens. There
is no common `start_pos` and no rectangular (B, K, S, D) key tensor to return, so such a batch does
not implement `update`; it carries the per-token `positions` explicitly and `attend`s for the layer:
the layer still rotates (at `positions`) and still supplies its own window and sinks, and the batch
applies exactly the visibility rule above to each token against its own sequence's keys. Tests pin
every ragged kernel to `attention_reference` run on each sequence alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVCache(Protocol):
    """What a model layer may call on any KV cache (see the module docstring for the conventions)."""

    @property
    def batch_size(self) -> int:
        """Sequences (rows) the cache holds; the model's batch dimension B."""
        ...

    @property
    def num_tokens(self) -> int:
        """Tokens held per row: the absolute position of the next token."""
        ...

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store `layer`'s rotated keys and values of T new tokens, k and v (B, K, T, D), at positions
        start_pos … start_pos + T - 1; return (keys, values, first): (B, K, S, D) each, key j at
        position first + j, covering every key the new queries may see.

        Raises ValueError (cache unchanged) when start_pos is not where `layer` ends or the shapes,
        dtype or device do not match the cache.
        """
        ...


@runtime_checkable
class RollbackKVCache(KVCache, Protocol):
    """A KV cache that can take tokens back (speculative decoding): see "Rollback" above."""

    def truncate(self, position: int) -> None:
        """Keep the first `position` tokens of every row and forget the rest.

        Raises ValueError (cache unchanged) when `position` lies outside the retained interval:
        past `num_tokens`, or so early that a sliding layer already forgot keys the next query needs.
        """
        ...


def rollback_floor(first_retained: int, window: int) -> int:
    """Lowest position a sliding layer (window W) whose first held token is `first_retained` can be
    truncated to: 0 while it has forgotten nothing, else `first_retained + W - 1` (the next query at
    that position needs the keys from `position - W + 1`)."""
    return 0 if first_retained <= 0 else first_retained + window - 1


def check_rollback(position: int, num_tokens: int, lowest: int, window: int | None = None) -> None:
    """Raise ValueError unless lowest <= position <= num_tokens (the retained interval), saying which
    limit was crossed and how to fix it. The caller has checked that position is an int >= 0."""
    if position > num_tokens:
        raise ValueError(
            f"truncate(position={position}): outside the retained interval [{lowest}, "
            f"{num_tokens}]: the cache holds {num_tokens} tokens and truncate can only shorten"
        )
    if position < lowest:
        needs = (
            ""
            if window is None
            else (f"; the next query at {position} needs sliding-layer keys from {max(0, position - window + 1)}")
        )
        raise ValueError(
            f"truncate(position={position}): before the retained interval [{lowest}, "
            f"{num_tokens}] (outside it): sliding layers no longer hold the keys before "
            f"{lowest - (window or 1) + 1}{needs}; truncate to >= {lowest}, or build the "
            "cache with a larger rollback_tokens"
        )


class KVSegment(Protocol):
    """A run of consecutive keys of one layer that can be read as full-precision tensors."""

    @property
    def num_tokens(self) -> int:
        """Keys in the segment."""
        ...

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values start … end - 1 of the segment, each (B, K, end - start, D), full precision."""
        ...


class TensorSegment:
    """A segment that already is full precision: (B, K, n, D) keys and values; `read` returns views."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        assert k.shape == v.shape and k.dim() == 4, f"TensorSegment: k {tuple(k.shape)} / v {tuple(v.shape)}"
        self.k, self.v = k, v

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, start:end], self.v[:, :, start:end]


class KVBlocks:
    """The keys and values `update` would return for one layer, as consecutive segments read block by
    block: key j of the concatenation is key j of what `update` returns (position `first + j`, or
    under the full-layer freedom the j-th kept key).

    `block_tokens` is the storage granule (a quantised cache's group); readers should cut blocks at
    multiples of it. `mass`, when the cache sets it to a zero (B, K, S) fp32 tensor, asks the kernel
    to add the attention each key received, summed over the new queries and the G query heads of its
    KV head (H2O's accumulated attention); None (the default) asks for nothing.
    """

    def __init__(
        self, segments: list[KVSegment], kv_heads: int, block_tokens: int = 1, mass: torch.Tensor | None = None
    ):
        self.segments = [s for s in segments if s.num_tokens > 0]
        self.kv_heads = kv_heads  # K
        self.block_tokens = block_tokens
        self.num_keys = sum(s.num_tokens for s in self.segments)
        self.mass = mass

    def blocks(self, max_tokens: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(first key index, keys, values) of consecutive blocks of at most max(max_tokens, block_tokens)
        keys, each (B, K, n, D) full precision, never crossing a segment's end."""
        step = max(self.block_tokens, max_tokens // self.block_tokens * self.block_tokens)
        offset = 0
        for seg in self.segments:
            n = seg.num_tokens
            for s in range(0, n, step):
                e = min(n, s + step)
                k, v = seg.read(s, e)
                yield offset + s, k, v
            offset += n

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys and values as one (B, K, S, D) pair each: the dequantise-then-attend oracle (this is
        the full-history copy the blocked kernel avoids)."""
        parts = [seg.read(0, seg.num_tokens) for seg in self.segments]
        return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)


@runtime_checkable
class BlockKVCache(KVCache, Protocol):
    """A cache whose layers may be read block by block (see "Block-read caches" above)."""

    def is_blocked(self, layer: int) -> bool:
        """Whether `layer` is stored in blocks (the layer then calls `update_blocks`)."""
        ...

    def update_blocks(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[KVBlocks, int]:
        """`update` for a blocked layer: store the new tokens and return (KVBlocks, first), the same
        keys and values `update` would return, unmaterialised."""


@runtime_checkable
class RaggedBatch(Protocol):
    """The new tokens of several sequences as one flat batch of N tokens (see "Ragged batches")."""

    @property
    def positions(self) -> torch.Tensor:
        """(N,) int64: the absolute position of each token of the flat batch in its own sequence."""
        ...

    @property
    def logits_index(self) -> torch.Tensor:
        """(M,) int64: the flat-batch rows whose next-token logits the caller wants."""
        ...

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        window: int | None,
    ) -> torch.Tensor:
        """Store `layer`'s rotated k, v (K, N, D) and return the attention output (H, N, D) of the
        rotated queries q (H, N, D): token i of sequence s attends over the keys of s at positions
        <= its own (and > its own - `window`), with `sinks` as the layer would apply them."""
        ...
