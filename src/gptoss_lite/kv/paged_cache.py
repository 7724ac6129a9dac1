"""Paged KV tensors driven by `PagedKVPool` bookkeeping: the batched engine's block store.

Layout. Every layer owns K and V tensors of shape (K, N, bs, D): for each KV head, N physical blocks
of bs token slots. Head-major, so the blocks of a table gathered with one `index_select` are already
the (K, S, D) keys attention multiplies, with no transposing copy (the batched engine's decode
attention is 1.7-4x faster this way than with token-major (N, bs, K, D) blocks). Block ids are not
per layer: **one pool per layer kind** hands them out, and a block id names the same slots in the
tensors of every layer of that kind. Each kind is a `KVGroup` (`gptoss_lite.kv.groups`: its layer
ids, pool, prefix cache and window rule; `store.groups`, or `store.group(kind)`):

- The full layers are one `KVGroup` (`store.group(LayerKind.FULL).pool`): they see every token, so
  their page tables are identical.
- The sliding layers are another (`store.group(LayerKind.SLIDING).pool`): every sliding
  layer has the same window W (`config.sliding_window`) and sees the same positions, so their page
  tables are identical too; the group releases a sequence's leading blocks once they fall outside
  the window (`release_window`), which is why it cannot share a table with the full-layer pool.

(`LayerKind` is the layer kind of `gptoss_lite.kvspec`, and the groups' names; `store.specs[layer]`
says what each layer stores and its bytes. `store.pools`, `store.prefix` and `store.layers_of` are
read-only views of the groups by kind.)

So a decode step costs one `append` per kind per sequence, not one per layer, and a prefix hit
shares a block across all layers of a kind at once.

The store holds tensors and groups only; the engine's `KVManager` (`gptoss_lite.engine.kv_manager`)
drives the pools (admission, window release, prefix caching, copy-on-write via `apply_copies`) and
its `PagedBatch` (`gptoss_lite.engine.paged_batch`) writes and reads the blocks of a step
(docs/paged.md, docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType

import torch

from gptoss_lite.config import ModelConfig
from gptoss_lite.kv.block_pool import DEFAULT_BLOCK_SIZE, PagedKVPool
from gptoss_lite.kv.groups import KVGroup
from gptoss_lite.kv.prefix import PrefixCache
from gptoss_lite.kvspec import DENSE, KVFormat, LayerKind, model_kv_specs
from gptoss_lite.validation import check_int


class PagedKVStore:
    """Per-layer K/V block tensors (K, N, bs, D) plus one `KVGroup` per layer kind (its layers, pool,
    prefix cache and window: `gptoss_lite.kv.groups`).

    `total_blocks` sizes the full-layer pool, `sliding_blocks` the sliding-layer pool (default: the
    same). `full_window` N gives the full layers a window of their last N keys
    (docs/engine.md#full-layer-window; the batched engine applies it).
    """

    def __init__(
        self,
        config: ModelConfig,
        total_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        sliding_blocks: int | None = None,
        full_window: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        full_format: KVFormat = DENSE,
        value_group: int | None = None,
    ) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        total_blocks = check_int("total_blocks", total_blocks, minimum=0)
        if sliding_blocks is None:
            sliding_blocks = total_blocks
        sliding_blocks = check_int("sliding_blocks", sliding_blocks, minimum=0)
        if full_window is not None and not config.full_layers:
            raise ValueError(f"full_window={full_window}: the model has no full layers")
        self.config = config
        self.block_size = block_size
        self.dtype, self.device = dtype, torch.device(device)
        #: what each layer stores (`gptoss_lite.kvspec`): kind, window, format, bytes
        self.specs = model_kv_specs(
            config, dtype.itemsize, full_format, full_window=full_window, value_group=value_group
        )
        groups: list[KVGroup] = []
        for layers, blocks in ((config.full_layers, total_blocks), (config.sliding_layers, sliding_blocks)):
            if layers:
                groups.append(KVGroup(self.specs[layers[0]], layers, blocks, block_size))
        self.groups: tuple[KVGroup, ...] = tuple(groups)
        self._by_kind = {group.name: group for group in self.groups}
        # read-only views by kind, for callers that index pools or prefix caches directly
        self._pools = MappingProxyType({group.name: group.pool for group in self.groups})
        self._prefix = MappingProxyType({group.name: group.prefix for group in self.groups})
        self._layers_of = MappingProxyType({group.name: group.layers for group in self.groups})
        K, D = config.n_kv_heads, config.head_dim
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for layer in range(config.n_layers):
            group = self.group_of(layer)
            # a layer that stores codes keeps them elsewhere (a subclass's): its dense tensors stay empty
            blocks = 0 if self.specs[layer].format.quantized else group.pool.total_blocks
            shape = (K, blocks, block_size, D)  # (K, N, bs, D)
            self.k.append(torch.zeros(shape, dtype=dtype, device=self.device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=self.device))

    def pool_tensors(self) -> list[torch.Tensor]:
        """Every tensor whose dimension 1 is a pool's blocks: what a compiled step reads and writes."""
        return self.k + self.v

    @property
    def kinds(self) -> tuple[str, ...]:
        """The layer kinds with a group (full first)."""
        return tuple(self._by_kind)

    def group(self, kind: str) -> KVGroup:
        """The group of layer kind `kind`."""
        try:
            return self._by_kind[kind]
        except KeyError:
            raise ValueError(f"no {kind!r} layers in this store; its kinds are {self.kinds}") from None

    def group_of(self, layer: int) -> KVGroup:
        """The group `layer` belongs to."""
        return self._by_kind[self.kind(layer)]

    @property
    def pools(self) -> Mapping[str, PagedKVPool]:
        """{kind: the group's pool}, read-only (the groups own them)."""
        return self._pools

    @property
    def prefix(self) -> Mapping[str, PrefixCache]:
        """{kind: the group's prefix cache}, read-only (the groups own them)."""
        return self._prefix

    @property
    def layers_of(self) -> Mapping[str, tuple[int, ...]]:
        """{kind: the group's layer ids}, read-only."""
        return self._layers_of

    @property
    def full_window(self) -> int | None:
        """The full layers' window (None: they keep every key)."""
        return self._by_kind[LayerKind.FULL].window if LayerKind.FULL in self._by_kind else None

    def kind(self, layer: int) -> str:
        """The layer's kind (its spec's)."""
        return self.specs[layer].kind

    def pool(self, layer: int) -> PagedKVPool:
        """The pool whose page tables index `layer`'s tensors."""
        return self.group_of(layer).pool

    def apply_copies(self, kind: str, copies: Sequence[tuple[int, int, int]]) -> None:
        """Copy-on-write: slots [0, n) of block src -> dst, in every layer of `kind`."""
        for src, dst, n in copies:
            for layer in self.group(kind).layers:
                self.k[layer][:, dst, :n] = self.k[layer][:, src, :n]
                self.v[layer][:, dst, :n] = self.v[layer][:, src, :n]

    def gather(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's resident K and V in `layer`, chronological, each (K, n, D).

        n counts resident tokens: the whole sequence on a full layer; on a sliding layer the
        tokens from `first_block_index * block_size` on.
        """
        pool = self.pool(layer)
        table = torch.tensor(pool.page_table(seq_id), dtype=torch.long, device=self.device)
        n = pool.num_tokens(seq_id) - pool.first_block_index(seq_id) * self.block_size
        K, D = self.config.n_kv_heads, self.config.head_dim
        keys = self.k[layer].index_select(1, table).view(K, -1, D)[:, :n]  # (K, n, D)
        values = self.v[layer].index_select(1, table).view(K, -1, D)[:, :n]
        return keys, values

    def block_bytes(self, kind: str) -> int:
        """Bytes of one block id across every layer of `kind`, K and V."""
        return sum(self.specs[layer].block_bytes(self.block_size) for layer in self.group(kind).layers)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for every layer's block tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
