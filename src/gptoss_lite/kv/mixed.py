"""MixedKVCache: ring buffers on sliding layers, growing buffers on full layers (SPEC §3.1).

Storage per layer is (B, K, slots, D) for keys and values. Keys are stored already rotated at their
absolute positions and are never re-rotated. The cache implements `gptoss_lite.kv.base.KVCache`.
"""

from __future__ import annotations

import torch

from gptoss_lite.config import ModelConfig
from gptoss_lite.kv.base import KVCache
from gptoss_lite.validation import check_int

DEFAULT_FULL_CAP_TOKENS = 4_000_000  # per full layer (SPEC §3.1)


class _LayerStore:
    """Common state: geometry checks and the count of tokens appended since the last reset."""

    def __init__(self, batch_size: int, kv_heads: int, head_dim: int):
        self.batch_size, self.kv_heads, self.head_dim = batch_size, kv_heads, head_dim
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.num_tokens = 0  # tokens appended since the last reset (the next absolute position)

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> int:
        expected = (self.batch_size, self.kv_heads, k.shape[2], self.head_dim)
        if k.dim() != 4 or tuple(k.shape) != expected or v.shape != k.shape:
            raise ValueError(f"KV append: got k {tuple(k.shape)}, v {tuple(v.shape)}; expected (B, K, T, D) = "
                             f"({self.batch_size}, {self.kv_heads}, T, {self.head_dim}) for both")
        if self.k is not None and (k.dtype != self.k.dtype or k.device != self.k.device):
            raise ValueError(f"KV append: dtype/device {k.dtype}/{k.device} differs from the cache's "
                             f"{self.k.dtype}/{self.k.device}; reset() the cache first")
        return k.shape[2]

    def reset(self) -> None:
        self.k = self.v = None
        self.num_tokens = 0

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated for K and V (capacity, not just the valid part)."""
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() * 2

    def _empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-length (B, K, 0, D) keys and values, for a layer with nothing stored."""
        z = torch.empty(self.batch_size, self.kv_heads, 0, self.head_dim)
        return z, z

    def _token_bytes(self) -> int:
        return 0 if self.k is None else 2 * self.batch_size * self.kv_heads * self.head_dim * self.k.element_size()


class RingBuffer(_LayerStore):
    """Capacity-W ring: `head` is the next slot to write, `num_resident` the valid slots (<= W)."""

    def __init__(self, batch_size: int, kv_heads: int, head_dim: int, window: int):
        super().__init__(batch_size, kv_heads, head_dim)
        self.window = window
        self.head = 0
        self.num_resident = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write T new slots in place; a write of T >= W keeps only the last W (chronological from 0)."""
        T = self._check(k, v)
        W = self.window
        if self.k is None:
            shape = (self.batch_size, self.kv_heads, W, self.head_dim)
            self.k = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.v = torch.empty(shape, dtype=v.dtype, device=v.device)
        if T >= W:
            self.k.copy_(k[:, :, T - W:])
            self.v.copy_(v[:, :, T - W:])
            self.head, self.num_resident = 0, W
        else:
            first = min(T, W - self.head)  # slots before the wrap point
            self.k[:, :, self.head:self.head + first] = k[:, :, :first]
            self.v[:, :, self.head:self.head + first] = v[:, :, :first]
            if first < T:
                self.k[:, :, :T - first] = k[:, :, first:]
                self.v[:, :, :T - first] = v[:, :, first:]
            self.head = (self.head + T) % W
            self.num_resident = min(W, self.num_resident + T)
        self.num_tokens += T

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Valid keys and values in chronological order, each (B, K, num_resident, D)."""
        if self.k is None or self.num_resident == 0:
            return self._empty()
        if self.num_resident < self.window:  # not yet wrapped: slots 0 … num_resident-1 are in order
            return self.k[:, :, :self.num_resident], self.v[:, :, :self.num_resident]
        order = lambda t: torch.cat((t[:, :, self.head:], t[:, :, :self.head]), dim=2)  # noqa: E731
        return order(self.k), order(self.v)

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Valid slots in storage order (no copy); fine for attention once keys carry their rotation."""
        if self.k is None:
            return self._empty()
        return self.k[:, :, :self.num_resident], self.v[:, :, :self.num_resident]

    def reset(self) -> None:
        super().reset()
        self.head = self.num_resident = 0


class GrowingBuffer(_LayerStore):
    """Append-only buffer with 1.5× amortised growth and a hard token cap."""

    def __init__(self, batch_size: int, kv_heads: int, head_dim: int, cap_tokens: int):
        super().__init__(batch_size, kv_heads, head_dim)
        self.cap_tokens = cap_tokens
        self.num_resident = 0  # == num_tokens: a growing buffer forgets nothing
        self.capacity = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        T = self._check(k, v)
        needed = self.num_resident + T
        if needed > self.cap_tokens:
            raise MemoryError(f"full-layer KV cache cap exceeded: {self.num_resident} + {T} tokens > cap "
                              f"{self.cap_tokens}; raise max_tokens_per_full_layer or shorten the sequence")
        if self.k is None or needed > self.capacity:
            new_cap = needed if self.k is None else min(self.cap_tokens, max(needed, int(self.capacity * 1.5) + 1))
            shape = (self.batch_size, self.kv_heads, new_cap, self.head_dim)
            new_k = torch.empty(shape, dtype=k.dtype, device=k.device)
            new_v = torch.empty(shape, dtype=v.dtype, device=v.device)
            if self.num_resident:
                new_k[:, :, :self.num_resident] = self.k[:, :, :self.num_resident]
                new_v[:, :, :self.num_resident] = self.v[:, :, :self.num_resident]
            self.k, self.v, self.capacity = new_k, new_v, new_cap
        self.k[:, :, self.num_resident:needed] = k
        self.v[:, :, self.num_resident:needed] = v
        self.num_resident = needed
        self.num_tokens += T

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of the valid keys and values, each (B, K, num_resident, D)."""
        if self.k is None:
            return self._empty()
        return self.k[:, :, :self.num_resident], self.v[:, :, :self.num_resident]

    def reset(self) -> None:
        super().reset()
        self.num_resident = self.capacity = 0


class MixedKVCache(KVCache):
    """One cache per generation, indexed by layer: `cache[layer]` is a RingBuffer or GrowingBuffer."""

    def __init__(self, config: ModelConfig, batch_size: int = 1,
                 max_tokens_per_full_layer: int = DEFAULT_FULL_CAP_TOKENS):
        self.config = config
        self._batch_size = check_int("batch_size", batch_size, minimum=1)
        check_int("max_tokens_per_full_layer", max_tokens_per_full_layer, minimum=1)
        K, D = config.n_kv_heads, config.head_dim
        self.layers: list[RingBuffer | GrowingBuffer] = [
            RingBuffer(batch_size, K, D, config.sliding_window) if config.is_sliding(i)
            else GrowingBuffer(batch_size, K, D, max_tokens_per_full_layer)
            for i in range(config.n_layers)
        ]

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> RingBuffer | GrowingBuffer:
        return self.layers[layer]

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def num_tokens(self) -> int:
        """Tokens held per row: the absolute position of the next token."""
        return self.layers[0].num_tokens

    def num_resident(self, layer: int) -> int:
        """Tokens whose K/V `layer` holds: the ring's (<= W) or the full layer's; 0 if never written."""
        return self.layers[layer].num_resident

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chronological (K, V) of the valid part of `layer`, each (B, K, n, D)."""
        return self.layers[layer].get()

    def reset(self) -> None:
        """Empty every layer (between independent requests); frees the storage."""
        for store in self.layers:
            store.reset()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int
               ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store new rotated (B, K, T, D) keys/values of `layer`; return (keys, values, first) as the
        `KVCache` protocol says.

        Full layers append and return a view of the whole buffer. Sliding layers: a single decode
        token is written first and the ring's slots come back in storage order (the protocol's one
        freedom: all of them are inside the token's window); a chunk gets the chronological ring past
        followed by itself, and is written afterwards.
        """
        store = self.layers[layer]
        if start_pos != store.num_tokens:
            raise ValueError(f"layer {layer}: start_pos={start_pos} but the cache holds {store.num_tokens} "
                             f"tokens; positions must continue where the cache ends")
        T = k.shape[2]
        if isinstance(store, GrowingBuffer):
            store.append(k, v)
            keys, values = store.get()
            return keys, values, 0
        if T == 1:
            store.append(k, v)
            keys, values = store.slots()
            return keys, values, start_pos + 1 - keys.shape[2]
        past_k, past_v = store.get()
        keys = torch.cat((past_k.to(k), k), dim=2)  # (B, K, past + T, D), past <= W
        values = torch.cat((past_v.to(v), v), dim=2)
        store.append(k, v)
        return keys, values, start_pos - past_k.shape[2]

    # ---- byte accounting -------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V across layers (ring capacity W, global capacity)."""
        return sum(store.nbytes for store in self.layers)

    @property
    def payload_bytes(self) -> int:
        """Bytes of valid K and V across layers."""
        return sum(store.num_resident * store._token_bytes() for store in self.layers)
