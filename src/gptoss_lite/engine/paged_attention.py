"""Attention over block tables for a ragged batch: one forward serves every scheduled request.

`PagedBatch` is the `RaggedBatch` (gptoss_lite.kv.base) the runner builds for one engine step. The
step's N new tokens sit in one flat batch; each belongs to a *segment* (one request's run of tokens
at consecutive positions). Per layer, `attend`:

1. writes the N new keys and values into their (block, slot) of the layer's head-major block tensors
   (K, blocks, bs, D) with one `index_copy_` each;
2. attends the *decode* segments (one token each) together: their block tables, padded to the
   longest, gather the keys of all of them at once, and one additive mask per (layer kind, window)
   and step hides padding, future and out-of-window keys; scores, sinks, softmax and the weighted sum
   are a handful of batched ops whatever the number of requests;
3. attends each *prefill* segment (a chunk of a prompt) with the blocked kernel
   `attention_fast` over that request's resident blocks.

On a `QuantizedPagedStore` the full layers differ in storage only: the step's writes are planned once
(`plan_writes`: tail slots, blocks the step completes) and carried out per layer; decode rows read
their complete blocks a chunk of columns at a time, dequantised, with an online softmax (no
full-history dequantised copy), then their full-precision tail; prefill segments go through
`attention_blocks` over the same blocks.

Under a KV budget N (`full_window`) full layers attend like sliding layers with a window of N keys
(their blocks are released the same way, see docs/engine.md#kv-budget). The layer supplies its
window and sink logits; the rule is the model's (query at position p sees
keys at positions p - W < j <= p, plus the sink). Tests pin both paths to `attention_reference` run
on each request alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptoss_lite.config import FULL
from gptoss_lite.kv.base import KVBlocks, TensorSegment
from gptoss_lite.kv.paged_cache import PagedKVStore
from gptoss_lite.kv.paged_quant import QuantizedPagedStore
from gptoss_lite.model.attention import attention_blocks, attention_fast

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
        self.full_window = full_window  # a KV budget: full layers attend to the last full_window keys
        dev = store.device
        self.segments = segments
        self.num_rows = sum(s.length for s in segments)
        positions = [s.start_pos + i for s in segments for i in range(s.length)]
        self._positions = torch.tensor(positions, dtype=torch.long, device=dev)
        self._logits_index = torch.tensor(logits_index, dtype=torch.long, device=dev)
        bs = store.block_size
        # flat slot index (block * bs + slot) of each new token, per layer kind
        self.write_slots = {kind: torch.tensor(s, dtype=torch.long, device=dev) for kind, s in write_slots.items()}
        self.decode = [s for s in segments if s.length == 1]
        self.prefill = [s for s in segments if s.length > 1]
        self.decode_rows = torch.tensor([s.offset for s in self.decode], dtype=torch.long, device=dev)
        self.all_decode = not self.prefill and self.decode_rows.numel() == self.num_rows
        self._decode_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._masks: dict[tuple[str, int | None], torch.Tensor] = {}
        self._prefill_tables: dict[tuple[int, str], torch.Tensor] = {}
        self.quant: _QuantReads | None = None
        if isinstance(store, QuantizedPagedStore) and FULL in store.pools:
            self.quant = _QuantReads(store, self.decode, self.prefill, write_slots[FULL])
        for kind in store.pools:
            if self.quant is not None and kind == FULL:
                continue  # the quantised blocks have tables of their own
            if self.decode:
                width = max(len(s.tables[kind][0]) for s in self.decode)
                table = torch.zeros(len(self.decode), width, dtype=torch.long)  # padding reads block 0, masked
                for row, s in enumerate(self.decode):
                    blocks = s.tables[kind][0]
                    table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
                # key j of row b sits at position first_b + j; the query at start_pos
                firsts = torch.tensor([s.tables[kind][1] for s in self.decode], dtype=torch.long)
                key_pos = firsts[:, None] + torch.arange(width * bs)[None, :]  # (Bd, S)
                query_pos = torch.tensor([s.start_pos for s in self.decode], dtype=torch.long)[:, None]
                self._decode_tables[kind] = (table.view(-1).to(dev), (query_pos - key_pos).to(dev))  # distance (Bd, S)
            for i, s in enumerate(self.prefill):
                self._prefill_tables[(i, kind)] = torch.tensor(s.tables[kind][0], dtype=torch.long, device=dev)

    # ------------------------------------------------------------------ RaggedBatch

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    @property
    def logits_index(self) -> torch.Tensor:
        return self._logits_index

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        window: int | None,
    ) -> torch.Tensor:
        """q (H, N, D), k/v (K, N, D) rotated -> (H, N, D); see `gptoss_lite.kv.base.RaggedBatch`."""
        store = self.store
        kind = store.kind(layer)
        if kind == FULL and self.full_window is not None:
            window = self.full_window
        H, N, D = q.shape
        K = k.shape[0]
        if self.quant is not None and kind == FULL:
            return self.quant.attend(layer, q, k, v, sinks, window, self.decode_rows, self.all_decode)
        slots = self.write_slots[kind]
        store.k[layer].view(K, -1, D).index_copy_(1, slots, k)  # (K, blocks·bs, D) <- (K, N, D)
        store.v[layer].view(K, -1, D).index_copy_(1, slots, v)
        if self.all_decode:
            return self._attend_decode(layer, kind, q, sinks, window)
        out = q.new_empty(H, N, D)
        if self.decode:
            out[:, self.decode_rows] = self._attend_decode(layer, kind, q[:, self.decode_rows], sinks, window)
        for i, s in enumerate(self.prefill):
            table = self._prefill_tables[(i, kind)]
            first = s.tables[kind][1]
            n_keys = s.start_pos + s.length - first
            keys = store.k[layer].index_select(1, table).view(1, K, -1, D)[:, :, :n_keys]  # (1, K, S, D)
            values = store.v[layer].index_select(1, table).view(1, K, -1, D)[:, :, :n_keys]
            rows = q[None, :, s.offset : s.offset + s.length]  # (1, H, T, D)
            out[:, s.offset : s.offset + s.length] = attention_fast(
                rows, keys, values, sinks, s.start_pos - first, window
            )[0]
        return out

    def _mask(self, kind: str, window: int | None) -> torch.Tensor:
        """Additive (1, Bd, 1, S) mask of the decode rows: 0 where visible, -inf elsewhere (built once
        per layer kind and window per step, shared by the layers)."""
        key = (kind, window)
        if key not in self._masks:
            distance = self._decode_tables[kind][1]  # query position - key position
            visible = distance >= 0
            if window is not None:
                visible &= distance < window
            bias = torch.zeros(distance.shape, dtype=torch.float32, device=distance.device)
            self._masks[key] = bias.masked_fill_(~visible, float("-inf"))[None, :, None, :]
        return self._masks[key]

    def _attend_decode(
        self, layer: int, kind: str, q: torch.Tensor, sinks: torch.Tensor | None, window: int | None
    ) -> torch.Tensor:
        """The decode segments: q (H, Bd, D) -> (H, Bd, D), one query each over its padded blocks.

        One `index_select` per tensor gathers every row's blocks of the head-major store as (K, Bd, S, D);
        the G query heads of a KV head are rows of one matmul per (KV head, request)."""
        H, Bd, D = q.shape
        store = self.store
        K = store.config.n_kv_heads
        G = H // K
        flat = self._decode_tables[kind][0]  # (Bd·nb,) block ids, row by row
        keys = store.k[layer].index_select(1, flat).view(K, Bd, -1, D)  # (K, Bd, S, D)
        values = store.v[layer].index_select(1, flat).view(K, Bd, -1, D)
        rows = q.view(K, G, Bd, D).transpose(1, 2)  # (K, Bd, G, D): head h = kv head h // G
        scores = torch.matmul(rows, keys.transpose(-1, -2))  # (K, Bd, G, S)
        scores = scores.float() * D**-0.5 + self._mask(kind, window)
        m = scores.amax(dim=-1, keepdim=True)
        if sinks is not None:
            sink = sinks.float().view(K, 1, G, 1)
            m = torch.maximum(m, sink)
        p = torch.exp(scores - m)
        denom = p.sum(dim=-1, keepdim=True)
        if sinks is not None:
            denom = denom + torch.exp(sink - m)
        out = torch.matmul(p.to(values.dtype), values).float() / denom  # (K, Bd, G, D)
        return out.to(q.dtype).transpose(1, 2).reshape(H, Bd, D)


class _QuantReads:
    """The full layers of one step on a `QuantizedPagedStore`: the write plan, and per decode row /
    prefill segment its complete blocks and its tail (see the module docstring)."""

    def __init__(
        self, store: QuantizedPagedStore, decode: list[Segment], prefill: list[Segment], write_slots: list[int]
    ) -> None:
        self.store = store
        dev = store.device
        bs = store.block_size
        K, D = store.config.n_kv_heads, store.config.head_dim
        self.plan = store.plan_writes(write_slots)

        def split(s: Segment) -> tuple[tuple[int, ...], int, int]:
            """(complete blocks, tokens in the tail, tail index) of the segment after this step."""
            blocks, first = s.tables[FULL]
            assert first == 0, "full layers release nothing"
            n = s.start_pos + s.length
            complete, fill = divmod(n, bs)
            tail = store.tail_of[blocks[complete]] if fill else 0
            return blocks[:complete], fill, tail

        # decode rows: complete blocks in chunks of columns, each with its additive validity mask
        self.decode_chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        if decode:
            parts = [split(s) for s in decode]
            Bd = len(decode)
            width = max(len(p[0]) for p in parts)
            table = torch.zeros(Bd, max(width, 1), dtype=torch.long)
            for row, (blocks, _, _) in enumerate(parts):
                table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            counts = torch.tensor([len(p[0]) * bs for p in parts], dtype=torch.long)[:, None]
            cols = max(1, QUANT_READ_ELEMENTS // (K * Bd * bs * D))
            for c0 in range(0, width, cols):
                c1 = min(width, c0 + cols)
                key_index = torch.arange(c0 * bs, c1 * bs)[None, :]
                bias = torch.zeros(Bd, (c1 - c0) * bs).masked_fill_(key_index >= counts, float("-inf"))
                self.decode_chunks.append((table[:, c0:c1].reshape(-1).to(dev), bias[None, :, None, :].to(dev)))
            fills = torch.tensor([p[1] for p in parts], dtype=torch.long)[:, None]
            self.decode_tails = torch.tensor([p[2] for p in parts], dtype=torch.long, device=dev)
            tail_bias = torch.zeros(Bd, bs).masked_fill_(torch.arange(bs)[None, :] >= fills, float("-inf"))
            self.decode_tail_bias = tail_bias[None, :, None, :].to(dev)  # (1, Bd, 1, bs)
        self.prefill_parts = []
        for s in prefill:
            blocks, fill, tail = split(s)
            self.prefill_parts.append((s, torch.tensor(blocks, dtype=torch.long, device=dev), fill, tail))

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        window: int | None,
        decode_rows: torch.Tensor,
        all_decode: bool,
    ) -> torch.Tensor:
        if window is not None:
            raise ValueError("quantised paged blocks hold full layers only (window=None)")
        store = self.store
        store.write_planned(layer, self.plan, k, v)
        if all_decode:
            return self._decode(layer, q, sinks)
        H, N, D = q.shape
        out = q.new_empty(H, N, D)
        if decode_rows.numel():
            out[:, decode_rows] = self._decode(layer, q[:, decode_rows], sinks)
        K = store.config.n_kv_heads
        for s, blocks, fill, tail in self.prefill_parts:
            segments = [_QuantBlocksSegment(store, layer, blocks)]
            if fill:
                segments.append(
                    TensorSegment(store.tk[layer][None, :, tail, :fill], store.tv[layer][None, :, tail, :fill])
                )
            rows = q[None, :, s.offset : s.offset + s.length]  # (1, H, T, D)
            kv = KVBlocks(segments, K, block_tokens=store.block_size)
            out[:, s.offset : s.offset + s.length] = attention_blocks(rows, kv, sinks, s.start_pos, None)[0]
        return out

    def _decode(self, layer: int, q: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """q (H, Bd, D) -> (H, Bd, D): online softmax over chunks of dequantised blocks, then the tails."""
        store = self.store
        H, Bd, D = q.shape
        K = store.config.n_kv_heads
        G = H // K
        rows = q.view(K, G, Bd, D).transpose(1, 2).float() * D**-0.5  # (K, Bd, G, D)
        if sinks is None:
            m = torch.full((K, Bd, G, 1), -1e30, device=q.device)
            l = torch.zeros_like(m)
        else:
            m = sinks.float().view(K, 1, G, 1).expand(K, Bd, G, 1).clone()
            l = torch.ones_like(m)
        acc = torch.zeros(K, Bd, G, D, device=q.device)

        def absorb(keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> None:
            nonlocal m, l, acc
            scores = torch.matmul(rows, keys.float().transpose(-1, -2)) + bias  # (K, Bd, G, S)
            m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
            p = torch.exp(scores - m_new)
            corr = torch.exp(m - m_new)
            l = l * corr + p.sum(dim=-1, keepdim=True)
            acc = acc * corr + torch.matmul(p, values.float())
            m = m_new

        for flat, bias in self.decode_chunks:
            keys, values = store.dequantize_blocks(layer, flat)  # (K, Bd·C, bs, D)
            absorb(keys.view(K, Bd, -1, D), values.view(K, Bd, -1, D), bias)
        keys = store.tk[layer].index_select(1, self.decode_tails)  # (K, Bd, bs, D)
        values = store.tv[layer].index_select(1, self.decode_tails)
        absorb(keys, values, self.decode_tail_bias)
        return (acc / l).to(q.dtype).transpose(1, 2).reshape(H, Bd, D)


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
