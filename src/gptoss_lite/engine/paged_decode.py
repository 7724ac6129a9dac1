"""One engine step as fixed-shape tensors over the block tables: what the compiled decode step runs.

`PagedBatch.static` (engine/paged_batch.py) turns a step whose every row samples (decode rows and
verified drafts) into a `PagedDecode`, a `StaticKV` (gptoss_lite.kv.base): per layer kind the groups'
block tables, write slots and distances, marked dynamic, so one compiled graph serves every batch
size and context length. On quantised full-layer blocks (`QuantizedPagedStore`) a `QuantizedStep`
says which tails each group writes, quantises and reads (docs/kv-cache.md#quantised-paged-blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptoss_lite.kv.base import StaticRead
from gptoss_lite.kv.paged_cache import PagedKVStore
from gptoss_lite.kv.paged_quant import QuantizedPagedStore
from gptoss_lite.kvspec import LayerKind


class PagedDecode:
    """`StaticKV` (gptoss_lite.kv.base) over the paged store for one step of sampled rows, in R groups
    of T rows (a request and its draft): per layer kind the groups' block tables (R, nb), each row's
    write slot (R·T,) (flat block · bs + slot) and each key's distance to each row's query (R, T,
    nb · bs). `order` (R·T,) is the flat-batch row each row runs, `real` the row of each flat-batch row
    (the logits to keep). The group, table and row dimensions are marked dynamic, so one compiled graph
    serves every batch size from 2 and every context length (one more serves a lone row, and one more
    every draft length). `identity`: each flat-batch row is its own group, in order (plain decode rows),
    so the caller runs the step's ids as they are and keeps every row (order and real may be None)."""

    def __init__(
        self,
        store: PagedKVStore,
        positions: torch.Tensor,
        tables: dict[str, torch.Tensor],
        slots: dict[str, torch.Tensor],
        distances: dict[str, torch.Tensor],
        horizon: dict[str, int | None],
        order: torch.Tensor | None,
        real: torch.Tensor | None,
        quantized: QuantizedStep | None = None,
        identity: bool = False,
    ) -> None:
        self.k, self.v = store.k, store.v
        self.kinds = [store.kind(layer) for layer in range(len(store.k))]
        self._positions, self._horizon = positions, horizon
        self.tables, self.slots, self.distances = tables, slots, distances
        self.order, self.real, self.identity = order, real, identity
        self.quantized = quantized
        # the codes' owner, which quantises the tails (None: 16-bit blocks)
        self.store = store if quantized is not None and isinstance(store, QuantizedPagedStore) else None
        extra = () if quantized is None else quantized.tensors()
        for t in (positions, *tables.values(), *slots.values(), *distances.values(), *extra):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for t in tables.values():
            torch._dynamo.maybe_mark_dynamic(t, 1)
        # the pools' block counts too: one compiled graph (and one entry of inductor's disk cache) serves
        # every pool size, so an engine given another KV budget compiles nothing new. The pools live as
        # long as the store: marked once (a mark is a Python call, ~1 µs, and there are two per layer)
        pools = store.pool_tensors()
        if getattr(store, "_marked_pools", None) != [id(t) for t in pools]:
            for t in pools:
                if t.shape[1] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, 1)
            store._marked_pools = [id(t) for t in pools]
        for t in distances.values():
            if t.shape[1] > 1:  # a size of 1 is specialised anyway: plain decode has a graph of its own
                torch._dynamo.maybe_mark_dynamic(t, 1)
            torch._dynamo.maybe_mark_dynamic(t, 2)

    @classmethod
    def warm_up(cls, store: PagedKVStore, groups: int, per_group: int) -> PagedDecode:
        """A dummy state of `groups` groups of `per_group` rows at position 0 of block 0 of each pool,
        for compiling the decode step before the first request: the caller makes sure no request
        holds a block yet (this writes block 0)."""
        bs, device = store.block_size, store.device
        kinds = store.kinds
        # distinct sizes (groups, rows per group, a table width per kind): sizes equal at trace time
        # would be taken for one symbol, and a later step where they differ would compile again
        widths = {kind: 3 + i for i, kind in enumerate(kinds)}
        rows = groups * per_group
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        quantized = None
        slots = {kind: widths[kind] * bs for kind in kinds}  # slots a group reads
        if isinstance(store, QuantizedPagedStore) and LayerKind.FULL in kinds:  # tail 0 and the codes of block 0
            group_zeros = torch.zeros(groups, dtype=torch.long, device=device)
            completes = torch.ones(groups, dtype=torch.bool, device=device)
            quantized = QuantizedStep(group_zeros, group_zeros.clone(), completes, group_zeros.clone())
            slots[LayerKind.FULL] += bs
        return cls(
            store,
            zeros.clone(),
            {kind: torch.zeros(groups, w, dtype=torch.long, device=device) for kind, w in widths.items()},
            {kind: zeros.clone() for kind in kinds},
            # only slot 0 (position 0) is visible
            {
                kind: -torch.arange(slots[kind], device=device).expand(groups, per_group, -1).contiguous()
                for kind in kinds
            },
            {kind: None for kind in kinds},
            torch.zeros(rows, dtype=torch.long, device=device),
            torch.arange(rows, device=device),
            quantized,
        )

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    def write_read(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> StaticRead:
        """k, v (R·T, K, D) into each row's slot; the read is the layer's block storage (K, blocks, bs,
        D) and the groups' block tables (R, nb), which attention reads in place."""
        kind = self.kinds[layer]
        slots, distance, table = self.slots[kind], self.distances[kind], self.tables[kind]
        store, step = self.store, self.quantized
        if store is None or step is None or kind != LayerKind.FULL:
            _write(self.k[layer], self.v[layer], slots, k, v)
            return StaticRead(self.k[layer], self.v[layer], distance, table)
        # quantised full layer: into the tails, then the blocks the step completes into their codes
        _write(store.tk[layer], store.tv[layer], slots, k, v)
        store.quantize_tails(layer, step.first_blocks, step.first_tails, step.completes)
        return StaticRead(
            store.tk[layer], store.tv[layer], distance, table, store.read_in_place(layer, step.read_tails)
        )

    def horizon(self, layer: int) -> int | None:
        return self._horizon[self.kinds[layer]]


@dataclass
class QuantizedStep:
    """What a static step does on quantised full-layer blocks, per group (R,): `first_blocks` /
    `first_tails`, the first block it writes and that block's tail, quantised into it after the
    write where `completes` (the step writes its last slot); `read_tails`, the tail it reads after
    its complete blocks."""

    first_blocks: torch.Tensor
    first_tails: torch.Tensor
    completes: torch.Tensor
    read_tails: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.first_blocks, self.first_tails, self.completes, self.read_tails)


def _write(kb: torch.Tensor, vb: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v (R·T, K, D) into flat slots (R·T,) of block storage kb, vb (K, blocks, bs, D)."""
    K, D = kb.shape[0], kb.shape[3]
    kb.view(K, -1, D).index_copy_(1, slots, k.transpose(0, 1))
    vb.view(K, -1, D).index_copy_(1, slots, v.transpose(0, 1))
