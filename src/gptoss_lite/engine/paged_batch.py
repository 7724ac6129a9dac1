"""One engine step's flat batch over block tables: metadata, writes and gathers (no attention here).

`PagedBatch` is the `RaggedBatch` (gptoss_lite.kv.base) the runner builds for one engine step. The
step's N new tokens sit in one flat batch; each belongs to a *segment* (one request's run of tokens
at consecutive positions). Per layer, `update`:

1. writes the N new keys and values into their (block, slot) of the layer's head-major block tensors
   (K, blocks, bs, D) with one `index_copy_` each;
2. returns a `RaggedRead`: the *decode* segments (one token each) as `DecodeRows`, whose block tables,
   padded to the longest, gather the keys of all of them at once, with each key's distance to its
   query (built once per layer kind and step); and each *prefill* segment (a chunk of a prompt) as a
   dense `KVRead` of that request's resident blocks.

The layer attends over that read with its own window and sinks (`Attention._attend_ragged`).

On a `QuantizedPagedStore` the full layers differ in storage only: the step's writes are planned once
(`plan_writes`: tail slots, blocks the step completes) and carried out per layer; decode rows read
their complete blocks a chunk of columns at a time, dequantised when the layer reaches that chunk,
then their full-precision tail; prefill segments read a segmented `KVRead` over the same blocks.

Under a full-layer window N (`full_window`) full layers attend like sliding layers with a window of N
keys (the read's `horizon`; their blocks are released the same way, see
docs/engine.md#full-layer-window).

A step whose every row samples also has a fixed-shape form for the compiled step, `static()`: a
`PagedDecode` (engine/paged_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gptoss_lite.engine.paged_decode import PagedDecode, QuantizedStep
from gptoss_lite.kv.base import DecodeChunk, DecodeRows, KVRead, KVSegment, RaggedRead, TensorSegment
from gptoss_lite.kv.paged_cache import PagedKVStore
from gptoss_lite.kv.paged_quant import QuantizedPagedStore
from gptoss_lite.kvspec import LayerKind

QUANT_READ_ELEMENTS = 1 << 22  # dequantised keys held at once by a decode read (per K and V)


@dataclass
class Segment:
    """One request's tokens in the flat batch: rows [offset, offset + length) at positions
    start_pos …; `tables[kind]` = (resident blocks, position of the first resident token)."""

    offset: int
    length: int
    start_pos: int
    tables: dict[str, tuple[tuple[int, ...], int]]


class PagedBatch:
    """One step's flat batch over a `PagedKVStore` (see the module docstring)."""

    def __init__(
        self,
        store: PagedKVStore,
        segments: list[Segment],
        write_slots: dict[str, list[int]],
        logits_index: list[int],
        *,
        full_window: int | None = None,
    ) -> None:
        self.store = store
        self.full_window = full_window  # full layers attend to their last full_window keys (None: all)
        dev = store.device
        self.segments = segments
        self.num_rows = sum(s.length for s in segments)
        positions = [s.start_pos + i for s in segments for i in range(s.length)]
        self._positions = torch.tensor(positions, dtype=torch.long, device=dev)
        self._logits_index = torch.tensor(logits_index, dtype=torch.long, device=dev)
        # flat slot index (block * bs + slot) of each new token, per layer kind
        self.write_slots = {kind: torch.tensor(s, dtype=torch.long, device=dev) for kind, s in write_slots.items()}
        self.decode = [s for s in segments if s.length == 1]
        self.prefill = [s for s in segments if s.length > 1]
        all_decode = not self.prefill and len(self.decode) == self.num_rows
        # every row samples: only decode rows and verified drafts (a prompt chunk samples its last row
        # alone), so the step may run as one fixed-shape row per token (`static`)
        self.all_sampled = logits_index == list(range(self.num_rows))
        rows = [s.offset for s in self.decode]
        self.decode_rows = None if all_decode else torch.tensor(rows, dtype=torch.long, device=dev)
        self.all_decode = all_decode
        # per kind, the decode rows in buckets of similar length (`_buckets`), each gathered padded to its
        # own longest row: (flat-batch rows or None for all, flat block ids row by row (Bb·nb,), distances
        # (Bb, nb·bs), the layers' mask memo)
        self._decode_buckets: dict[str, list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, dict]]] = {}
        self._prefill_tables: dict[tuple[int, str], torch.Tensor] = {}
        self.quant: _QuantReads | None = None
        if isinstance(store, QuantizedPagedStore) and LayerKind.FULL in store.kinds:
            self.quant = _QuantReads(store, self.decode, self.prefill, write_slots[LayerKind.FULL])
        for kind in store.kinds:
            if self.quant is not None and kind == LayerKind.FULL:
                continue  # the quantised blocks have tables of their own
            for i, seg in enumerate(self.prefill):
                self._prefill_tables[(i, kind)] = torch.tensor(seg.tables[kind][0], dtype=torch.long, device=dev)

    # ------------------------------------------------------------------ RaggedBatch

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    @property
    def logits_index(self) -> torch.Tensor:
        return self._logits_index

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int = 0) -> RaggedRead:
        """Write k, v (1, K, N, D) rotated into each token's slot; return what each token may see (see
        `gptoss_lite.kv.base.RaggedBatch`)."""
        store = self.store
        kind = store.kind(layer)
        horizon = self.full_window if kind == LayerKind.FULL else None
        k, v = k[0], v[0]  # (K, N, D)
        if self.quant is not None and kind == LayerKind.FULL:
            return self.quant.update(layer, k, v, self.decode_rows, horizon)
        K, _, D = k.shape
        slots = self.write_slots[kind]
        store.k[layer].view(K, -1, D).index_copy_(1, slots, k)  # (K, blocks·bs, D) <- (K, N, D)
        store.v[layer].view(K, -1, D).index_copy_(1, slots, v)
        decode = []
        for at, flat, distance, memo in self._buckets_of(kind):
            Bb = distance.shape[0]

            def gather(flat: torch.Tensor = flat, Bb: int = Bb) -> tuple[torch.Tensor, torch.Tensor]:
                """A bucket's blocks of the head-major store as (K, Bb, S, D), one index_select each."""
                keys = store.k[layer].index_select(1, flat).view(K, Bb, -1, D)
                return keys, store.v[layer].index_select(1, flat).view(K, Bb, -1, D)

            decode.append(DecodeRows(at, [DecodeChunk(gather, distance, memo)]))
        prefill = []
        for i, s in enumerate(self.prefill):
            table = self._prefill_tables[(i, kind)]
            first = s.tables[kind][1]
            n_keys = s.start_pos + s.length - first
            keys = store.k[layer].index_select(1, table).view(1, K, -1, D)[:, :, :n_keys]  # (1, K, S, D)
            values = store.v[layer].index_select(1, table).view(1, K, -1, D)[:, :, :n_keys]
            prefill.append((s.offset, s.length, s.start_pos, KVRead.dense(keys, values, first)))
        return RaggedRead(decode, prefill, horizon)

    def _buckets_of(self, kind: str) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, dict]]:
        """The decode rows' buckets for `kind`, built on the first layer of that kind that asks (a step
        the compiled decoder runs never does)."""
        if kind not in self._decode_buckets:
            dev = self.store.device
            entries: list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, dict]] = []
            buckets = _buckets([len(seg.tables[kind][0]) for seg in self.decode]) if self.decode else []
            for members in buckets:
                segs = [self.decode[i] for i in members]
                table, distance = _decode_table(segs, kind, self.store.block_size)
                at = None
                if not (self.all_decode and len(buckets) == 1):
                    at = torch.tensor([seg.offset for seg in segs], dtype=torch.long, device=dev)
                entries.append((at, table.view(-1).to(dev), distance.to(dev), {}))
            self._decode_buckets[kind] = entries
        return self._decode_buckets[kind]

    def static(self) -> PagedDecode | None:
        """The fixed-shape form of a step whose every row samples (decode rows and verified drafts) for
        the compiled step (`PagedDecode`); None for a step with prompt chunks, or, on quantised
        blocks, with a segment longer than a block.

        Each request is a group of T rows over its one block table, T the longest segment of the step
        (1 when no request verifies a draft): a draft of k tokens is k + 1 rows at consecutive
        positions, and a shorter segment repeats its last token (same token, position and slot: the
        repeated writes store the same values, and their logits are dropped). Every row's K/V is
        written before any row reads (`write_read`), and keys after a row's own position have
        negative distances (hidden), so each row sees exactly the tokens before it, as in the eager
        step's causal chunk. Groups from 2 on share one graph; a lone request of one row (one request
        decoding) runs a graph of its own, with `decode_linear`'s one-row products (fused reductions,
        not a several-row product per weight); a lone request verifying a draft is padded to two groups by
        repeating it.

        On quantised blocks the full layers write into their tails and read complete blocks as codes
        and the last one from its tail (`_QuantReads.static`)."""
        if not self.all_sampled:
            return None
        if self.quant is not None and max(seg.length for seg in self.segments) > self.store.block_size:
            return None  # a group would complete two blocks in one step
        # Built with numpy and handed over without a copy (torch.from_numpy): one step of a lone request
        # took ~225 µs to build from ~50 small torch ops, beside a 1.2 ms compiled step (20M model).
        dev = self.store.device
        groups = list(self.segments)
        lengths = np.array([seg.length for seg in groups], dtype=np.int64)
        T = int(lengths.max())
        if len(groups) < 2 and T > 1:  # one group of several rows would get a graph of its own: repeat it
            groups.append(groups[0])
            lengths = np.concatenate([lengths, lengths])
        offsets = np.minimum(np.arange(T, dtype=np.int64)[None, :], (lengths - 1)[:, None])  # (R, T)
        firsts = np.array([seg.offset for seg in groups], dtype=np.int64)
        order_t = torch.from_numpy((firsts[:, None] + offsets).reshape(-1)).to(dev)  # flat row per row
        real = [g * T + t for g, seg in enumerate(self.segments) for t in range(seg.length)]  # row per flat row
        tables, slots, distances = {}, {}, {}
        quant = None
        for kind in self.store.kinds:
            if self.quant is not None and kind == LayerKind.FULL:  # codes and tails
                table, distance, slots[kind], quant = self.quant.static(groups, torch.from_numpy(offsets), order_t)
            else:
                table, distance = _decode_table(groups, kind, self.store.block_size, offsets, pad_to=2)
                slots[kind] = self.write_slots[kind][order_t]
            tables[kind], distances[kind] = table.to(dev), distance.to(dev)
        horizon = {kind: self.full_window if kind == LayerKind.FULL else None for kind in tables}
        real_t = torch.tensor(real, dtype=torch.long, device=dev)
        return PagedDecode(
            self.store, self._positions[order_t], tables, slots, distances, horizon, order_t, real_t, quant,
            identity=T == 1,  # one row a segment: the rows in their own order
        )  # fmt: skip


def plain_decode(
    store: PagedKVStore,
    rows: list[tuple[int, dict[str, int], dict[str, tuple[tuple[int, ...], int]]]],
    full_window: int | None = None,
    hidden: int = -1,
) -> PagedDecode:
    """`PagedBatch.static()` of a step of plain decode rows on 16-bit blocks, built straight from them:
    each row (its position, its write slot per layer kind (block · bs + slot), its tables per kind as
    in `Segment.tables`) is a group of one, in order. The same tensors as building the step's
    `PagedBatch` and asking it (tests/engine/test_plain_decode.py) from a few numpy calls: the runner
    builds one of these for every decode step (`ModelRunner.forward`), after the compiled step has
    streamed the weights through the caches, so each call here costs microseconds. `hidden`: the
    distance of the padding columns (`DecodeBurst` hides them further than -1)."""
    bs, dev, kinds = store.block_size, store.device, store.kinds
    # positions and every kind's write slot: one array, a copy of a row of it each (the compiled step's
    # inputs share no storage, as the general path's never do)
    columns = np.array([[position, *(slot[kind] for kind in kinds)] for position, slot, _ in rows], dtype=np.int64).T
    starts = columns[0].copy()
    tables, slots, distances = {}, {}, {}
    for i, kind in enumerate(kinds):
        # at least two columns, as `static()` pads them (one graph for every width)
        table, firsts, used, width = _padded_table([own[kind] for _, _, own in rows], pad_to=2)
        # key j of a row sits at position first + j: its distance to the row's query, hidden where negative
        distance = (starts - firsts)[:, None, None] - np.arange(width * bs, dtype=np.int64)
        if width > used:  # columns added to reach two blocks: -1 as `_decode_table` makes them, or `hidden`
            distance[..., used * bs :] = hidden
        tables[kind], distances[kind] = torch.from_numpy(table).to(dev), torch.from_numpy(distance).to(dev)
        slots[kind] = torch.from_numpy(columns[1 + i].copy()).to(dev)
    horizon = {kind: full_window if kind == LayerKind.FULL else None for kind in tables}
    positions = torch.from_numpy(starts).to(dev)
    return PagedDecode(store, positions, tables, slots, distances, horizon, None, None, identity=True)


class DecodeBurst:
    """Several plain decode steps of the same rows, one after another, each row's blocks allocated for
    every step's token up front (a decode burst, docs/engine.md#decode-bursts). `state` is the first
    step's `plain_decode`; `advance(j)` moves the same tensors on to step j in place: every position
    one further, each row's write slot its j-th, every key one further from its query. So a later
    step's state is what `plain_decode` would build for it (tests/engine/test_decode_burst.py) at the
    price of a few tensor ops, and the compiled step sees the same input tensors every step.

    rows: (position, per layer kind the write slot (block · bs + slot) of each step, tables per kind
    as in `Segment.tables`) for each row, in order, every row with the same number of steps."""

    # Padding columns `plain_decode` hides with -1 would come into view as distances grow; hidden
    # with this they stay hidden for any burst.
    HIDDEN = -(1 << 30)

    def __init__(
        self,
        store: PagedKVStore,
        rows: list[tuple[int, dict[str, list[int]], dict[str, tuple[tuple[int, ...], int]]]],
        full_window: int | None = None,
    ) -> None:
        kinds = store.kinds
        self.steps = len(rows[0][1][kinds[0]])
        first = [(position, {kind: own[0] for kind, own in slots.items()}, tables) for position, slots, tables in rows]
        self.state = plain_decode(store, first, full_window, hidden=self.HIDDEN)
        every = np.array([[slots[kind] for kind in kinds] for _, slots, _ in rows], dtype=np.int64)  # (R, kinds, K)
        self._slots = {kind: torch.from_numpy(every[:, i].T.copy()).to(store.device) for i, kind in enumerate(kinds)}

    def advance(self, step: int) -> None:
        """The state of step `step` (1 … steps - 1), from the state of the step before it."""
        state = self.state
        state.positions.add_(1)
        for kind, slots in state.slots.items():
            slots.copy_(self._slots[kind][step])
            state.distances[kind].add_(1)


# Decode rows are gathered in at most this many buckets of similar length, each padded to its own
# longest row, and only from this many rows on: each bucket costs a few more ops per layer, and the
# padding a bucket saves is gathered and multiplied by every layer.
MAX_DECODE_BUCKETS = 4
ROWS_PER_BUCKET = 8


def _buckets(widths: list[int]) -> list[list[int]]:
    """Indices of the decode rows (their block-table widths) in buckets of similar width: sorted by
    width and cut into equal counts, at most MAX_DECODE_BUCKETS and ROWS_PER_BUCKET rows or more each;
    one bucket, in the rows' own order, when that is all there is."""
    n = min(MAX_DECODE_BUCKETS, len(widths) // ROWS_PER_BUCKET)
    if n <= 1 or min(widths) == max(widths):
        return [list(range(len(widths)))]
    order = sorted(range(len(widths)), key=widths.__getitem__)
    return [order[i * len(order) // n : (i + 1) * len(order) // n] for i in range(n)]


def _padded_table(tables: list[tuple[tuple[int, ...], int]], pad_to: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Rows given as (resident blocks, first resident position) -> (their block table (B, width), padded
    with block 0, which the distances hide; their first positions (B,); the longest row's blocks; the
    width, at least `pad_to`), from one array call."""
    used = max(len(blocks) for blocks, _ in tables)
    width = max(used, pad_to)
    table = np.array([[*blocks, *[0] * (width - len(blocks))] for blocks, _ in tables], dtype=np.int64)
    return table, np.array([first for _, first in tables], dtype=np.int64), used, width


def _decode_table(
    segments: list[Segment], kind: str, bs: int, offsets: np.ndarray | None = None, pad_to: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block table (B, nb) of the segments, padded with block 0 to the longest row (and to at
    least `pad_to` blocks, the padding hidden), and each key's distance to each query: key j of row b
    sits at position first_b + j. Without `offsets`, one query per segment at its start_pos: distances
    (B, nb·bs); with offsets (B, T), T queries per segment at start_pos + offsets[b, t]: distances
    (B, T, nb·bs). Padding columns past a row's blocks hold block 0; where a row's distance there is
    not already negative (the compiled step's extra columns) it is made -1."""
    table, firsts, used, width = _padded_table([seg.tables[kind] for seg in segments], pad_to)
    key_pos = firsts[:, None] + np.arange(width * bs, dtype=np.int64)[None, :]  # (B, S)
    query_pos = np.array([seg.start_pos for seg in segments], dtype=np.int64)[:, None]
    if offsets is None:
        distance = query_pos - key_pos
    else:
        distance = (query_pos + offsets)[:, :, None] - key_pos[:, None, :]
    if width > used:  # columns added to reach pad_to: hidden
        distance[..., used * bs :] = -1
    return torch.from_numpy(table), torch.from_numpy(distance)


class _QuantReads:
    """The full layers of one step on a `QuantizedPagedStore`: the write plan, and per decode row /
    prefill segment its complete blocks and its tail (see the module docstring)."""

    def __init__(
        self, store: QuantizedPagedStore, decode: list[Segment], prefill: list[Segment], write_slots: list[int]
    ) -> None:
        self.store = store
        self.plan = store.plan_writes(write_slots)
        self.decode, self.prefill = decode, prefill
        self.num_decode = len(decode)
        self._reads_built = False  # the eager step's tables, built by its first full layer (`_build_reads`)

    def _split(self, s: Segment) -> tuple[tuple[int, ...], int, int]:
        """(complete blocks, tokens in the tail, tail index) of the segment after this step."""
        blocks, first = s.tables[LayerKind.FULL]
        assert first == 0, "full layers release nothing"
        complete, fill = divmod(s.start_pos + s.length, self.store.block_size)
        tail = self.store.tail_of[blocks[complete]] if fill else 0
        return blocks[:complete], fill, tail

    def _build_reads(self) -> None:
        """The eager step's reads: decode rows' complete blocks in chunks of columns, each with each
        key's distance to its query (padding columns lie past the row's blocks, so their distance is
        negative: hidden), and their tails; each prefill segment's blocks and tail."""
        store, decode = self.store, self.decode
        dev, bs = store.device, store.block_size
        K, D = store.config.n_kv_heads, store.config.head_dim
        self.decode_chunks: list[tuple[torch.Tensor, torch.Tensor, dict]] = []
        if decode:
            parts = [self._split(s) for s in decode]
            Bd = len(decode)
            width = max(len(p[0]) for p in parts)
            table = torch.zeros(Bd, max(width, 1), dtype=torch.long)
            for row, (blocks, _, _) in enumerate(parts):
                table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            query_pos = torch.tensor([s.start_pos for s in decode], dtype=torch.long)[:, None]
            counts = torch.tensor([len(p[0]) * bs for p in parts], dtype=torch.long)[:, None]
            cols = max(1, QUANT_READ_ELEMENTS // (K * Bd * bs * D))
            for c0 in range(0, width, cols):
                c1 = min(width, c0 + cols)
                key_pos = torch.arange(c0 * bs, c1 * bs)[None, :].expand(Bd, -1)
                distance = torch.where(key_pos < counts, query_pos - key_pos, -1)  # (Bd, C·bs)
                self.decode_chunks.append((table[:, c0:c1].reshape(-1).to(dev), distance.to(dev), {}))
            # the tail: slot j holds position counts + j, valid while j < fill
            fills = torch.tensor([p[1] for p in parts], dtype=torch.long)[:, None]
            slot = torch.arange(bs)[None, :]
            self.tail_distance = torch.where(slot < fills, query_pos - counts - slot, -1).to(dev)  # (Bd, bs)
            self.tail_memo: dict = {}
            self.decode_tails = torch.tensor([p[2] for p in parts], dtype=torch.long, device=dev)
        self.prefill_parts = []
        for s in self.prefill:
            blocks, fill, tail = self._split(s)
            self.prefill_parts.append((s, torch.tensor(blocks, dtype=torch.long, device=dev), fill, tail))
        self._reads_built = True

    def static(
        self, groups: list[Segment], offsets: torch.Tensor, order: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, QuantizedStep]:
        """The full layers of `PagedBatch.static`'s groups (each at most a block long): (the tables of
        their complete blocks after this step (R, nb ≥ 2, padded with hidden columns), each slot's
        distance to each row (R, T, (nb + 1) · bs): the blocks' slots, then the tail's, every row's
        tail write slot (R·T,), and the step's `QuantizedStep`). Each group quantises the tail of
        the first block it writes into that block's codes: the block it completes, if any (then its
        tokens read as codes from this step on, as in the eager step), else a block still being
        filled, whose codes nothing reads until it completes and is quantised again."""
        store, bs = self.store, self.store.block_size
        done = dict(zip(self.plan.blocks.tolist(), self.plan.tails.tolist()))  # completed: block -> tail
        width = max(2, max((seg.start_pos + seg.length) // bs for seg in groups))
        table = torch.zeros(len(groups), width, dtype=torch.long)  # padding reads block 0, hidden
        firsts, completes, read_tails, counts, fills = [], [], [], [], []
        for row, seg in enumerate(groups):
            blocks = seg.tables[LayerKind.FULL][0]
            complete, fill = divmod(seg.start_pos + seg.length, bs)
            table[row, :complete] = torch.tensor(blocks[:complete], dtype=torch.long)
            first = blocks[seg.start_pos // bs]
            firsts.append((first, done[first] if first in done else store.tail_of[first]))
            completes.append(first in done)
            read_tails.append(store.tail_of[blocks[complete]] if fill else 0)
            counts.append(complete * bs)
            fills.append(fill)
        query = torch.tensor([seg.start_pos for seg in groups], dtype=torch.long)[:, None] + offsets  # (R, T)
        key, slot = torch.arange(width * bs)[None, :], torch.arange(bs)[None, :]
        counts_t, fills_t = torch.tensor(counts)[:, None], torch.tensor(fills)[:, None]
        key_pos = torch.cat((key.expand(len(groups), -1), counts_t + slot), dim=1)  # (R, S): blocks, then tail
        written = torch.cat((key < counts_t, slot < fills_t), dim=1)
        distance = torch.where(written[:, None, :], query[:, :, None] - key_pos[:, None, :], -1)  # (R, T, S)
        dev = store.device
        step = QuantizedStep(
            first_blocks=torch.tensor([f[0] for f in firsts], dtype=torch.long, device=dev),
            first_tails=torch.tensor([f[1] for f in firsts], dtype=torch.long, device=dev),
            completes=torch.tensor(completes, dtype=torch.bool, device=dev),
            read_tails=torch.tensor(read_tails, dtype=torch.long, device=dev),
        )
        return table, distance, self.plan.tail_slots[order], step

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, decode_rows: torch.Tensor | None, horizon: int | None
    ) -> RaggedRead:
        if horizon is not None:
            raise ValueError("quantised paged blocks hold every full-layer key (no full-layer window)")
        if not self._reads_built:
            self._build_reads()
        store = self.store
        store.write_planned(layer, self.plan, k, v)
        K, _, D = k.shape
        decode = []
        if self.num_decode:
            Bd = self.num_decode

            def dequantised(flat: torch.Tensor):
                def load() -> tuple[torch.Tensor, torch.Tensor]:
                    keys, values = store.dequantize_blocks(layer, flat)  # (K, Bd·C, bs, D)
                    return keys.view(K, Bd, -1, D), values.view(K, Bd, -1, D)

                return load

            def tails() -> tuple[torch.Tensor, torch.Tensor]:
                keys = store.tk[layer].index_select(1, self.decode_tails)  # (K, Bd, bs, D)
                return keys, store.tv[layer].index_select(1, self.decode_tails)

            chunks = [DecodeChunk(dequantised(flat), distance, memo) for flat, distance, memo in self.decode_chunks]
            chunks.append(DecodeChunk(tails, self.tail_distance, self.tail_memo))
            decode.append(DecodeRows(decode_rows, chunks))
        prefill = []
        for s, blocks, fill, tail in self.prefill_parts:
            segments: list[KVSegment] = [_QuantBlocksSegment(store, layer, blocks)]
            if fill:
                segments.append(
                    TensorSegment(store.tk[layer][None, :, tail, :fill], store.tv[layer][None, :, tail, :fill])
                )
            prefill.append((s.offset, s.length, s.start_pos, KVRead(segments, 0, K, block_tokens=store.block_size)))
        return RaggedRead(decode, prefill)


class _QuantBlocksSegment:
    """A sequence's complete quantised blocks as a `KVSegment` (B = 1); `read` dequantises only the
    blocks covering the range asked for."""

    def __init__(self, store: QuantizedPagedStore, layer: int, blocks: torch.Tensor) -> None:
        self.store, self.layer, self.blocks = store, layer, blocks

    @property
    def num_tokens(self) -> int:
        return self.blocks.numel() * self.store.block_size

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.store.block_size
        b0, b1 = start // bs, -(-end // bs)
        k, v = self.store.dequantize_blocks(self.layer, self.blocks[b0:b1])  # (K, nb, bs, D)
        K, _, _, D = k.shape
        lo = start - b0 * bs
        return k.reshape(1, K, -1, D)[:, :, lo : lo + end - start], v.reshape(1, K, -1, D)[:, :, lo : lo + end - start]
