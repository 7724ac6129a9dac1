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

The seam is one call. A forward pass over T new tokens calls `update(layer, k, v, start_pos)` once
per layer: the cache *writes* the new rotated keys and values and *returns a read*, a `KVRead` of
the keys the new queries may see. The layer then attends over the read itself
(`gptoss_lite.model.attention`): the cache never computes attention.

Shapes (legend of `gptoss_lite.model`): new keys and values are (B, K, T, D). A `KVRead` holds S >= T
keys, the last T being the new tokens, in one or more *segments*, and `first`, the position of key
0. Key j is the token at position `first + j`, so new query i (position `start_pos + i`) sits at key
index `start_pos - first + i`, and on a sliding layer sees keys j with
`0 <= (start_pos + i) - (first + j) < W`. The read includes every key that any new query may see: all
positions `0 …` on a full layer, at least `start_pos - W + 1 …` on a sliding layer.

A read is either *dense* (one full-precision (B, K, S, D) tensor pair, `tensors()`) or *segmented*:
segments read one block at a time (quantised codes dequantised on demand, an evicting cache's kept
past), so no full-history full-precision copy is ever built. `block_tokens` is the storage granule
(a quantised cache's key group); `spans` cuts blocks at multiples of it. `mass`, when a cache sets it
to a zero (B, K, S) fp32 tensor, asks the layer to add the attention each key received, summed over
the new queries and the G query heads of its KV head (H2O's accumulated attention).

One freedom: when T == 1 and the returned keys are exactly the last S <= W positions (a ring buffer
holding one window), the cache may return them in storage order rather than by position. The single
query sees every one of them, and attention is a sum over keys that carry their own rotation, so the
order cannot change the result. `first` is then `start_pos - S + 1`, as if they were in order.

A second freedom, for full layers (window None) only: the past keys returned may be a subset of the
earlier positions (an evicting cache), as long as the new tokens come last and in order; `first` is
then `start_pos - P` with P past keys returned. Every past key is visible to every new query on a
full layer, so which positions they were does not change the mask, and each key carries its own
rotation (RoPE at its original position).

Rollback (`RollbackKVCache`, a caller-side protocol; the model never calls it): `truncate(position)`
forgets every token at or after `position`. It is allowed back to any position whose K/V every layer
still holds: on a sliding layer, the next query at `position` needs the keys from
`position - W + 1`, so the lowest allowed position is `first_retained + W - 1` once the layer has
forgotten tokens (`first_retained > 0`), and 0 before. The allowed positions form the *retained
interval* `[lowest, num_tokens]`; anything outside raises ValueError naming the position and the
interval, and leaves the cache unchanged (`check_rollback`). A cache built with rollback slack R
keeps R tokens more than one window on sliding layers, so a rollback of R tokens is always allowed.

Ragged batches (`RaggedBatch`, continuous batching). A serving engine runs the new tokens of many
sequences, each at its own position and with its own history, as one flat batch (1, ·, N, ·) of N
tokens. It carries the per-token `positions` explicitly (the layer rotates at them), and its
`update` returns a `RaggedRead`: the one-token rows together (`DecodeRows`: fixed-shape keys per row
and each key's distance to its query, which the layer turns into a mask with its own window), and
each prompt chunk as a `KVRead` of its own sequence. A batch under a full-layer window N keeps only
the last N keys of a full layer and says so with `horizon`: the layer then attends as if its window were N.
Tests pin every ragged path to `attention_reference` run on each sequence alone.

Static decode (`StaticKV`, what a compiled decode step runs over). One new token per row, and
every tensor of a fixed shape from one step to the next, so that one compiled graph serves them all:
`write_read(layer, k, v)` writes every row's new key at its slot of the storage tensors and returns
the storage the rows read, (R, K, S, D), with each slot's `distance` to each row's query, (R or 1,
T, S) (query position minus the slot's position; negative for an empty, padding or future slot).
The B rows come in R groups of T = B / R consecutive rows that read the same keys: one row per
group (T = 1) for plain decode; a request verifying a draft of T - 1 tokens is one group of T rows
at consecutive positions, so its keys are read once, not once per token (every row's key is
written before any row reads). The layer masks with its own window, as for a ragged batch.
`MixedKVCache.static_decode()` gives one over its own storage (rings written at position mod their
size), the engine's paged batch one over block tables. A read over block tables (`StaticRead` with a
`table`) hands the layer the block storage itself, (K, blocks, bs, D), and each group's blocks, (R,
nb): slot j of group r is block table[r, j // bs], slot j % bs, so attention reads the blocks in
place (`kernels.blocks`) instead of a gathered copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, runtime_checkable

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

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> KVRead:
        """Store `layer`'s rotated keys and values of T new tokens, k and v (B, K, T, D), at positions
        start_pos … start_pos + T - 1; return the read of every key the new queries may see (key j at
        position read.first + j).

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


class KVRead:
    """The keys and values a layer's new queries may see, returned by `KVCache.update`: consecutive
    segments, key j of the concatenation at position `first + j` (or, under the full-layer freedom,
    the j-th kept key). See "The seam is one call" in the module docstring."""

    def __init__(
        self,
        segments: list[KVSegment],
        first: int,
        kv_heads: int,
        block_tokens: int = 1,
        mass: torch.Tensor | None = None,
    ):
        self.segments = [s for s in segments if s.num_tokens > 0]
        self.first = first
        self.kv_heads = kv_heads  # K
        self.block_tokens = block_tokens
        self.num_keys = sum(s.num_tokens for s in self.segments)
        self.mass = mass

    @classmethod
    def dense(cls, k: torch.Tensor, v: torch.Tensor, first: int) -> KVRead:
        """A read of full-precision (B, K, S, D) keys and values."""
        return cls([TensorSegment(k, v)], first, k.shape[1])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys, values) when the read is dense (one full-precision segment), else None."""
        if len(self.segments) == 1 and isinstance(self.segments[0], TensorSegment) and self.block_tokens == 1:
            seg = self.segments[0]
            return seg.k, seg.v
        return None

    def spans(self, max_tokens: int) -> list[tuple[int, int]]:
        """Key ranges [start, end) of consecutive blocks of at most max(max_tokens, block_tokens) keys,
        at multiples of block_tokens, never crossing a segment's end."""
        step = max(self.block_tokens, max_tokens // self.block_tokens * self.block_tokens)
        out, offset = [], 0
        for seg in self.segments:
            n = seg.num_tokens
            out += [(offset + s, offset + min(n, s + step)) for s in range(0, n, step)]
            offset += n
        return out

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values start … end - 1, each (B, K, end - start, D) full precision (dequantised if
        need be); a range within one segment is that segment's read, otherwise the pieces joined."""
        parts, offset = [], 0
        for seg in self.segments:
            n = seg.num_tokens
            lo, hi = max(start, offset), min(end, offset + n)
            if lo < hi:
                parts.append(seg.read(lo - offset, hi - offset))
            offset += n
        if len(parts) == 1:
            return parts[0]
        return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)

    def blocks(self, max_tokens: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(first key index, keys, values) of each block of `spans(max_tokens)`."""
        for start, end in self.spans(max_tokens):
            yield (start, *self.read(start, end))

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys and values as one (B, K, S, D) pair each: the dequantise-then-attend oracle (this is
        the full-history copy a segmented read avoids)."""
        return self.read(0, self.num_keys)


@dataclass
class DecodeChunk:
    """Keys of the one-token rows of a ragged batch, in the engine's head-major layout: `load()` gives
    keys and values (K, Bd, S, D) (gathered, or dequantised when called), and `distance` (Bd, S) is
    each key's query position minus its own (negative for padding or a future key). `memo` is shared
    by the layers that read the same distances (one step, one layer kind), so the layer builds each
    window's mask once."""

    load: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    distance: torch.Tensor
    memo: dict = field(default_factory=dict)


@dataclass
class DecodeRows:
    """The one-token rows of a ragged batch: `rows` (Bd,) their flat-batch rows (None: every row of
    the batch), and their keys as chunks (one for full-precision blocks; several, dequantised one
    after the other, for quantised ones)."""

    rows: torch.Tensor | None
    chunks: list[DecodeChunk]


@dataclass
class RaggedRead:
    """What `RaggedBatch.update` returns: the decode rows (in buckets of similar length, each with its
    own fixed shape), and each prompt chunk as (flat-batch offset, length, start position, read of its
    sequence's keys). `horizon`, under a full-layer window N, says the layer keeps only the last N
    keys: it attends as with a window of N."""

    decode: list[DecodeRows]
    prefill: list[tuple[int, int, int, KVRead]]
    horizon: int | None = None


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

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> RaggedRead:
        """Store `layer`'s rotated k, v (1, K, N, D) in each token's sequence; return what each token
        may see. `start_pos` is unused (every token has its own position)."""
        ...


class QuantizedBlocks(NamedTuple):
    """Quantised block storage of one layer, read in place (`StaticRead.quantized`): the layer's
    `codes` (key codes, key scales, key zeros, value codes, value scales, value zeros) of a
    `QuantizedPagedStore`, their `format` name and `value_group`, and `tails` (R,): the
    full-precision tail each group reads after its complete blocks; `dequantize(read, dtype)`, the keys
    and values (R, K, S, D) a read stands for, dequantised as the store does (the reference of the
    kernel that reads the codes in place, and the read where it is not built)."""

    codes: tuple[torch.Tensor, ...]
    format: str
    value_group: int
    tails: torch.Tensor
    dequantize: Callable[[StaticRead, torch.dtype], tuple[torch.Tensor, torch.Tensor]]


class StaticRead(NamedTuple):
    """What one layer of a static decode step reads (see "Static decode"): `keys` and `values` are
    (R, K, S, D), or with a `table` (R, nb) the layer's block storage (K, blocks, bs, D) that the
    groups' blocks index; `distance` (R or 1, T, S) is each slot's distance to each row's query.
    With `quantized`, the table's blocks are codes and `keys` / `values` the full-precision tails
    (K, tails, bs, D): group r reads its nb blocks, then tail `quantized.tails[r]` (S = (nb + 1) · bs)."""

    keys: torch.Tensor
    values: torch.Tensor
    distance: torch.Tensor
    table: torch.Tensor | None = None
    quantized: QuantizedBlocks | None = None


@runtime_checkable
class StaticKV(Protocol):
    """Fixed-shape K/V state of one decode step (see "Static decode")."""

    @property
    def positions(self) -> torch.Tensor:
        """(B,) int64 (or (1,) when every row is at the same position): each row's new token's position."""
        ...

    def write_read(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> StaticRead:
        """Write the rotated k, v (B, K, D) of one token per row; return the read: the storage each
        group of T = B / R rows reads (dense, or block storage and a table) and the (R or 1, T, S)
        distances, as "Static decode" says."""
        ...

    def horizon(self, layer: int) -> int | None:
        """Under a full-layer window N, N for a full layer (it attends as with a window of N); else None."""
        ...
