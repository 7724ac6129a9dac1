"""Quantised blocks for the engine's full layers: codes per block (`kv.quant.CODECS`), full-precision tails
(docs/kv-cache.md#quantised-paged-blocks).

`QuantizedPagedStore` is a `PagedKVStore` whose full-layer blocks hold codes instead of the model's
dtype; sliding layers keep their dense blocks (O(W) per request, quantising them would save little).
Only the storage differs: the full layers' `KVGroup` (`gptoss_lite.kv.groups`) owns their pool,
prefix cache and window rule as in the 16-bit store, while the codes, scales and tails below are the
store's, per full layer. Quantised blocks hold every key, so the group has no full-layer window.

- A *complete* block (all bs slots written) stores KIVI-style codes: keys per channel over the
  block's bs tokens (one float16 scale and zero point per channel per block), values per token over
  groups of `value_group` channels; int4 packs two codes per byte. The key group is the block, so a
  block is quantised once, when its last slot is written, and never again.
- A block still being filled lives in a full-precision *tail* (K, bs, D) of the model's dtype, taken
  from a small pool of tails (`tail_blocks`); it is quantised from the tail when it completes, and the
  tail goes back to the pool at the start of the next step. So the residual window of full-precision
  tokens is a sequence's unfilled last block (0 to bs - 1 tokens).
- A step is planned once for all full layers (`plan_writes`: which tail slot each new token goes to,
  which blocks complete) and then carried out per layer (`write_planned`): tokens go into their tails, the
  completed tails are quantised in one batched call into their blocks.
- Reads dequantise only the blocks asked for (`dequantize_blocks`); `gather` (the reference path)
  dequantises a whole sequence.

A block's tail leaves `tail_of` as soon as a plan completes it (from then on it is read from its
codes) and returns to the free list at the next plan. Tails of blocks that no sequence holds any more
(a finished, aborted or preempted request's partial last block) are reclaimed at the next plan too.
Copy-on-write (`apply_copies`) copies codes for a whole block and dequantises into the destination's
tail for a partial one.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from gptoss_lite.config import ModelConfig
from gptoss_lite.kv.base import QuantizedBlocks, StaticRead
from gptoss_lite.kv.block_pool import DEFAULT_BLOCK_SIZE
from gptoss_lite.kv.paged_cache import PagedKVStore
from gptoss_lite.kv.quant import (
    SCALE_DTYPE,
    QuantSpec,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
)
from gptoss_lite.kvspec import INT8, KVFormat, LayerKind, default_value_group, kv_format
from gptoss_lite.validation import check_int


@dataclass
class WritePlan:
    """Where one step's new full-layer tokens go: `tail_slots` (N,) flat index tail · bs + slot of
    every token; `blocks` / `tails` (nc,) the blocks completed by the step and the tails they are
    quantised from."""

    tail_slots: torch.Tensor
    blocks: torch.Tensor
    tails: torch.Tensor


class QuantizedPagedStore(PagedKVStore):
    """A `PagedKVStore` with quantised full-layer blocks, `full_format` codes (a format of
    `kv.quant.CODECS`; see the module docstring)."""

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
        full_format: KVFormat | str | int = INT8,
        value_group: int | None = None,
        tail_blocks: int = 64,
    ) -> None:
        if full_window is not None:
            raise ValueError(
                f"full_window={full_window}: quantised full-layer blocks hold every key; a full-layer window "
                "needs 16-bit blocks (PagedKVStore)"
            )
        K, D = config.n_kv_heads, config.head_dim
        vg = default_value_group(D) if value_group is None else value_group
        super().__init__(
            config,
            total_blocks,
            block_size,
            sliding_blocks=sliding_blocks,
            dtype=dtype,
            device=device,
            full_format=kv_format(full_format),
            value_group=vg,
        )
        self.spec = QuantSpec(full_format, key_group=block_size, value_group=vg, residual=0)
        self.spec.check_head_dim(D)
        self.tail_blocks = check_int("tail_blocks", tail_blocks, minimum=1)
        full = self.group(LayerKind.FULL) if LayerKind.FULL in self.kinds else None
        n = full.pool.total_blocks if full is not None else 0
        bs, Dc = block_size, D * self.spec.bits // 8
        dev = self.device
        self.kq: dict[int, torch.Tensor] = {}
        self.ks: dict[int, torch.Tensor] = {}
        self.kz: dict[int, torch.Tensor] = {}
        self.vq: dict[int, torch.Tensor] = {}
        self.vs: dict[int, torch.Tensor] = {}
        self.vz: dict[int, torch.Tensor] = {}
        self.tk: dict[int, torch.Tensor] = {}
        self.tv: dict[int, torch.Tensor] = {}
        for layer in full.layers if full is not None else ():
            self.kq[layer] = torch.zeros(K, n, bs, Dc, dtype=torch.uint8, device=dev)
            self.vq[layer] = torch.zeros(K, n, bs, Dc, dtype=torch.uint8, device=dev)
            self.ks[layer] = torch.zeros(K, n, 1, D, dtype=SCALE_DTYPE, device=dev)
            self.kz[layer] = torch.zeros(K, n, 1, D, dtype=SCALE_DTYPE, device=dev)
            self.vs[layer] = torch.zeros(K, n, bs, D // vg, dtype=SCALE_DTYPE, device=dev)
            self.vz[layer] = torch.zeros(K, n, bs, D // vg, dtype=SCALE_DTYPE, device=dev)
            self.tk[layer] = torch.zeros(K, self.tail_blocks, bs, D, dtype=dtype, device=dev)
            self.tv[layer] = torch.zeros(K, self.tail_blocks, bs, D, dtype=dtype, device=dev)
        self.tail_of: dict[int, int] = {}  # block id -> tail index, for blocks being filled
        self._free_tails = list(range(self.tail_blocks - 1, -1, -1))
        self._pending_tails: list[int] = []  # tails of blocks completed by the last plan: free from the next one

    # ------------------------------------------------------------------ tails

    def _take_tail(self, block: int) -> int:
        tail = self.tail_of.get(block)
        if tail is None:
            if not self._free_tails:
                raise RuntimeError(
                    f"quantised KV: all {self.tail_blocks} full-precision tail blocks are in use; "
                    "build the store with more tail_blocks (running requests + one step's blocks)"
                )
            tail = self._free_tails.pop()
            self.tail_of[block] = tail
        return tail

    def _drop_tail(self, block: int) -> None:
        tail = self.tail_of.pop(block, None)
        if tail is not None:
            self._free_tails.append(tail)

    def _reclaim_tails(self) -> None:
        """Tails of blocks completed by the previous step, or that no sequence holds any more."""
        self._free_tails.extend(self._pending_tails)
        self._pending_tails = []
        pool = self.group(LayerKind.FULL).pool
        for block in [b for b in self.tail_of if pool.refcount(b) == 0]:
            self._drop_tail(block)

    @property
    def tails_in_use(self) -> int:
        return len(self.tail_of)

    # ------------------------------------------------------------------ writes

    def plan_writes(self, flat_slots: Sequence[int]) -> WritePlan:
        """Plan one step's full-layer writes (flat slot = block · bs + slot, in write order)."""
        self._reclaim_tails()
        bs = self.block_size
        tail_slots: list[int] = []
        completed: list[int] = []
        for flat in flat_slots:
            block, slot = divmod(flat, bs)
            if slot and block not in self.tail_of:
                raise RuntimeError(f"quantised KV: block {block} is written at slot {slot} but has no tail")
            tail_slots.append(self._take_tail(block) * bs + slot)
            if slot == bs - 1:
                completed.append(block)
        tails = [self.tail_of.pop(b) for b in completed]  # complete blocks are read from their codes
        self._pending_tails.extend(tails)  # ... but every layer quantises from the tail during this step
        dev = self.device
        return WritePlan(
            tail_slots=torch.tensor(tail_slots, dtype=torch.long, device=dev),
            blocks=torch.tensor(completed, dtype=torch.long, device=dev),
            tails=torch.tensor(tails, dtype=torch.long, device=dev),
        )

    def write_planned(self, layer: int, plan: WritePlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Carry out `plan` on a full layer: k / v (K, N, D) into their tails, then quantise the tails of
        the completed blocks into them."""
        K, _, D = k.shape
        self.tk[layer].view(K, -1, D).index_copy_(1, plan.tail_slots, k)
        self.tv[layer].view(K, -1, D).index_copy_(1, plan.tail_slots, v)
        if plan.blocks.numel():
            self._quantize_into(layer, plan.blocks, self.tk[layer][:, plan.tails], self.tv[layer][:, plan.tails])

    def quantize_tails(self, layer: int, blocks: torch.Tensor, tails: torch.Tensor, chosen: torch.Tensor) -> None:
        """Quantise tails (n,) of a full layer into the codes of blocks (n,) where chosen (n,) is true: the
        static step's completed blocks (`PagedDecode`), given at a fixed shape. One op, opaque to
        inductor, so that a compiled step writes the codes this eager function writes (inductor's
        compiled copy of the quantiser gave other codes for about 3% of the elements of random blocks:
        the same formula with other roundings), and skips the work in steps that complete no block."""
        quantize_tails_op(
            self.tk[layer], self.tv[layer], tails, blocks, chosen, *self.layer_codes(layer), self.format_name,
            self.spec.value_group,
        )  # fmt: skip

    @property
    def format_name(self) -> str:
        """The full-layer blocks' format ('int8', 'int4', 'fp8')."""
        return kv_format(self.spec.format).name

    def read_in_place(self, layer: int, tails: torch.Tensor) -> QuantizedBlocks:
        """What a static step's read of a full layer says about its codes (`StaticRead.quantized`), each
        group r reading tail tails[r] after its blocks."""
        return QuantizedBlocks(
            self.layer_codes(layer), self.format_name, self.spec.value_group, tails, static_keys_values
        )

    def layer_codes(self, layer: int) -> tuple[torch.Tensor, ...]:
        """A full layer's key codes, scales, zeros, value codes, scales, zeros (`QuantizedBlocks.codes`)."""
        return tuple(store[layer] for store in self._code_stores())

    def _quantize_into(self, layer: int, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k / v (K, nb, bs, D) full precision -> the codes, scales and zeros of `blocks` (nb,)."""
        _quantize_blocks(self.spec, blocks, k, v, self.layer_codes(layer))

    def apply_copies(self, kind: str, copies: Sequence[tuple[int, int, int]]) -> None:
        if kind != LayerKind.FULL:
            super().apply_copies(kind, copies)
            return
        bs = self.block_size
        full_layers = self.group(LayerKind.FULL).layers
        for src, dst, n in copies:
            if n == bs and src not in self.tail_of:  # a complete block: copy its codes
                for layer in full_layers:
                    for store in self._code_stores():
                        store[layer][:, dst] = store[layer][:, src]
                continue
            tail = self._take_tail(dst)
            for layer in full_layers:
                k, v = self._block_contents(layer, src)
                self.tk[layer][:, tail, :n] = k[:, :n]
                self.tv[layer][:, tail, :n] = v[:, :n]
            if n == bs:  # a complete copy of a block being filled: quantise it now
                blocks = torch.tensor([dst], dtype=torch.long, device=self.device)
                for layer in full_layers:
                    self._quantize_into(
                        layer, blocks, self.tk[layer][:, tail : tail + 1], self.tv[layer][:, tail : tail + 1]
                    )
                self._drop_tail(dst)

    # ------------------------------------------------------------------ reads

    def _block_contents(self, layer: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One full-layer block as (K, bs, D) full precision: its tail while it has one, else its codes."""
        tail = self.tail_of.get(block)
        if tail is not None:
            return self.tk[layer][:, tail], self.tv[layer][:, tail]
        k, v = self.dequantize_blocks(layer, torch.tensor([block], dtype=torch.long, device=self.device))
        return k[:, 0], v[:, 0]

    def dequantize_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Complete blocks (nb,) of a full layer -> keys and values (K, nb, bs, D) in the store's dtype."""
        kq, ks, kz, vq, vs, vz = (store[layer].index_select(1, blocks) for store in self._code_stores())
        return dequantize_keys(kq, ks, kz, self.spec, self.dtype), dequantize_values(vq, vs, vz, self.spec, self.dtype)

    def _code_stores(self) -> tuple[dict[int, torch.Tensor], ...]:
        """Per-layer codes, scales and zeros: kq, ks, kz, vq, vs, vz."""
        return (self.kq, self.ks, self.kz, self.vq, self.vs, self.vz)

    def pool_tensors(self) -> list[torch.Tensor]:
        """The dense pools, the codes, scales and zeros of the full layers and their tails (dimension 1
        the tails' count)."""
        codes = [t for store in self._code_stores() for t in store.values()]
        return super().pool_tensors() + codes + list(self.tk.values()) + list(self.tv.values())

    def gather(self, seq_id: Hashable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's resident K and V, each (K, n, D); full layers dequantised (the reference read)."""
        if self.kind(layer) != LayerKind.FULL:
            return super().gather(seq_id, layer)
        pool = self.group(LayerKind.FULL).pool
        table = pool.page_table(seq_id)
        n = pool.num_tokens(seq_id)
        parts = [self._block_contents(layer, block) for block in table]
        K, D = self.config.n_kv_heads, self.config.head_dim
        if not parts:
            empty = torch.zeros(K, 0, D, dtype=self.dtype, device=self.device)
            return empty, empty.clone()
        keys = torch.cat([k for k, _ in parts], dim=1)[:, :n]
        values = torch.cat([v for _, v in parts], dim=1)[:, :n]
        return keys, values

    # ------------------------------------------------------------------ bytes

    @property
    def tail_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in list(self.tk.values()) + list(self.tv.values()))

    @property
    def nbytes(self) -> int:
        codes = sum(t.numel() * t.element_size() for store in self._code_stores() for t in store.values())
        return super().nbytes + codes + self.tail_bytes


def _quantize_blocks(
    spec: QuantSpec, blocks: torch.Tensor, k: torch.Tensor, v: torch.Tensor, codes: Sequence[torch.Tensor]
) -> None:
    """k / v (K, nb, bs, D) full precision -> `codes` (a layer's kq, ks, kz, vq, vs, vz) of `blocks` (nb,);
    the key group is the block's bs tokens, so ks, kz are (K, nb, 1, D)."""
    parts = (*quantize_keys(k, spec), *quantize_values(v, spec))
    for store, x in zip(codes, parts):
        store.index_copy_(1, blocks, x)


def _quantize_tails(
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    tails: torch.Tensor,
    blocks: torch.Tensor,
    chosen: torch.Tensor,
    kq: torch.Tensor,
    ks: torch.Tensor,
    kz: torch.Tensor,
    vq: torch.Tensor,
    vs: torch.Tensor,
    vz: torch.Tensor,
    fmt: str,
    value_group: int,
) -> None:
    """`QuantizedPagedStore.quantize_tails` as one op: the chosen tails (n,) of tail_keys / tail_values (K,
    NT, bs, D) quantised into their blocks (n,) of the layer's codes, in place."""
    at = chosen.nonzero().view(-1)
    if at.numel():
        tails, blocks = tails[at], blocks[at]
        spec = QuantSpec(fmt, key_group=tail_keys.shape[2], value_group=value_group, residual=0)
        _quantize_blocks(spec, blocks, tail_keys[:, tails], tail_values[:, tails], (kq, ks, kz, vq, vs, vz))


# Registered through torch.library's low-level API: a call costs about 3 µs where a
# `torch.library.custom_op` with mutated arguments costs about 50 µs of Python dispatch.
_OPS = torch.library.Library("gptoss_lite", "FRAGMENT")
_OPS.define(
    "quantize_tails(Tensor tail_keys, Tensor tail_values, Tensor tails, Tensor blocks, Tensor chosen, "
    "Tensor(a!) kq, Tensor(b!) ks, Tensor(c!) kz, Tensor(d!) vq, Tensor(e!) vs, Tensor(f!) vz, str fmt, "
    "int value_group) -> ()"
)
_OPS.impl("quantize_tails", _quantize_tails, "CPU")
_OPS.impl("quantize_tails", _quantize_tails, "CUDA")
_OPS.impl("quantize_tails", lambda *args: None, "Meta")  # shapes only: nothing to write
quantize_tails_op = torch.ops.gptoss_lite.quantize_tails


def static_keys_values(read: StaticRead, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values (R, K, S, D) in `dtype` that a quantised `StaticRead` stands for: each
    group's blocks dequantised as the store does, then its tail. The reference the block kernel's
    in-place read is tested against, and the read where that kernel is not built."""
    q = read.quantized
    assert q is not None and read.table is not None
    kq = q.codes[0]
    K, _, bs, _ = kq.shape
    R, nb = read.table.shape
    spec = QuantSpec(q.format, key_group=bs, value_group=q.value_group, residual=0)
    flat = read.table.reshape(-1)
    kq, ks, kz, vq, vs, vz = (c.index_select(1, flat) for c in q.codes)  # (K, R·nb, ...)
    keys = dequantize_keys(kq, ks, kz, spec, dtype).view(K, R, nb * bs, -1)
    values = dequantize_values(vq, vs, vz, spec, dtype).view(K, R, nb * bs, -1)
    tail_k, tail_v = read.keys.index_select(1, q.tails), read.values.index_select(1, q.tails)  # (K, R, bs, D)
    keys = torch.cat((keys, tail_k.to(dtype)), dim=2).transpose(0, 1)
    values = torch.cat((values, tail_v.to(dtype)), dim=2).transpose(0, 1)
    return keys, values
