"""MixedKVCache: ring buffers on sliding layers, growing buffers on full layers (docs/kv-cache.md#mixed-kv-cache).

Storage per layer is (B, K, slots, D) for keys and values. Keys are stored already rotated at their
absolute positions and are never re-rotated. The cache implements `gptoss_lite.kv.base.KVCache`.
"""

from __future__ import annotations

import copy

import torch

from gptoss_lite.config import ModelConfig
from gptoss_lite.kv.base import KVRead, RollbackKVCache, StaticRead, check_rollback, rollback_floor
from gptoss_lite.kvspec import token_bytes
from gptoss_lite.validation import check_int

DEFAULT_FULL_CAP_TOKENS = 4_000_000  # per full layer (docs/kv-cache.md#mixed-kv-cache)


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
            raise ValueError(
                f"KV append: got k {tuple(k.shape)}, v {tuple(v.shape)}; expected (B, K, T, D) = "
                f"({self.batch_size}, {self.kv_heads}, T, {self.head_dim}) for both"
            )
        if self.k is not None and (k.dtype != self.k.dtype or k.device != self.k.device):
            raise ValueError(
                f"KV append: dtype/device {k.dtype}/{k.device} differs from the cache's "
                f"{self.k.dtype}/{self.k.device}; reset() the cache first"
            )
        return k.shape[2]

    def reset(self) -> None:
        self.k = self.v = None
        self.num_tokens = 0

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The allocated K and V storage (both exist once the first append allocated them)."""
        assert self.k is not None and self.v is not None, "KV storage read before the first append"
        return self.k, self.v

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
        if self.k is None:
            return 0
        K, D = self.kv_heads, self.head_dim
        return self.batch_size * token_bytes(K, D, K, D, self.k.element_size())


class RingBuffer(_LayerStore):
    """Ring of W + slack slots: `head` is the next slot to write, `num_resident` the valid slots.

    `slack` (rollback slack R) keeps R tokens more than one window, so `truncate` can take back R
    tokens; with slack 0 the ring is exactly one window (W slots).
    """

    def __init__(self, batch_size: int, kv_heads: int, head_dim: int, window: int, slack: int = 0):
        super().__init__(batch_size, kv_heads, head_dim)
        self.window = window
        self.slack = slack
        self.capacity = window + slack
        self.head = 0
        self.num_resident = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write T new tokens in place, position p at slot p mod capacity (so `head`, the next slot, is
        always num_tokens mod capacity); a write of T >= capacity keeps only the last `capacity`."""
        T = self._check(k, v)
        cap = self.capacity
        if self.k is None:
            shape = (self.batch_size, self.kv_heads, cap, self.head_dim)
            # zeros, not empty: a static decode step reads every slot (masked), and 0 × NaN is NaN
            self.k = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(shape, dtype=v.dtype, device=v.device)
        kb, vb = self._buffers()
        keep = min(T, cap)
        start = (self.num_tokens + T - keep) % cap  # slot of the first token kept
        first = min(keep, cap - start)  # tokens before the wrap point
        kb[:, :, start : start + first] = k[:, :, T - keep : T - keep + first]
        vb[:, :, start : start + first] = v[:, :, T - keep : T - keep + first]
        if first < keep:
            kb[:, :, : keep - first] = k[:, :, T - keep + first :]
            vb[:, :, : keep - first] = v[:, :, T - keep + first :]
        self.advance(T)

    def advance(self, T: int) -> None:
        """Count T tokens whose K/V were written at their slots (by `append`, or by a compiled step)."""
        self.head = (self.head + T) % self.capacity
        self.num_resident = min(self.capacity, self.num_resident + T)
        self.num_tokens += T

    def last(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last n <= num_resident tokens' keys and values in chronological order, each
        (B, K, n, D): a view when they sit in contiguous slots, else a copy of the two pieces."""
        if self.k is None or n == 0:
            return self._empty()
        kb, vb = self._buffers()
        start = (self.head - n) % self.capacity
        if start + n <= self.capacity:
            return kb[:, :, start : start + n], vb[:, :, start : start + n]
        return (
            torch.cat((kb[:, :, start:], kb[:, :, : self.head]), dim=2),
            torch.cat((vb[:, :, start:], vb[:, :, : self.head]), dim=2),
        )

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Valid keys and values in chronological order, each (B, K, num_resident, D)."""
        return self.last(self.num_resident)

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last min(W, num_resident) tokens for a one-token query, whose window they are: the
        whole ring in storage order (no copy) when it is exactly one full window (fine for attention
        once keys carry their rotation, the protocol's one freedom), else chronological (`last`)."""
        if self.k is None:
            return self._empty()
        if self.num_resident == self.capacity == self.window:
            return self.k, self.v
        return self.last(min(self.window, self.num_resident))

    @property
    def first_retained(self) -> int:
        """Absolute position of the oldest token the ring still holds."""
        return self.num_tokens - self.num_resident

    def rollback_floor(self) -> int:
        """Lowest position `truncate` accepts (see `gptoss_lite.kv.base.rollback_floor`)."""
        return rollback_floor(self.first_retained, self.window)

    def truncate(self, position: int) -> None:
        """Forget the tokens at positions >= `position`; the caller checked it is in
        [rollback_floor(), num_tokens]."""
        drop = self.num_tokens - position
        self.head = (self.head - drop) % self.capacity
        self.num_resident -= drop
        self.num_tokens = position

    def reset(self) -> None:
        super().reset()
        self.head = self.num_resident = 0


class GrowingBuffer(_LayerStore):
    """Append-only buffer with 1.5× amortised growth and a hard token cap."""

    def __init__(self, batch_size: int, kv_heads: int, head_dim: int, cap_tokens: int, reserve: int = 0):
        super().__init__(batch_size, kv_heads, head_dim)
        self.cap_tokens = cap_tokens
        self.reserve = min(reserve, cap_tokens)  # slots the first append allocates at least
        self.num_resident = 0  # == num_tokens: a growing buffer forgets nothing
        self.capacity = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        T = self._check(k, v)
        needed = self.num_resident + T
        if needed > self.cap_tokens:
            raise MemoryError(
                f"full-layer KV cache cap exceeded: {self.num_resident} + {T} tokens > cap "
                f"{self.cap_tokens}; raise max_tokens_per_full_layer or shorten the sequence"
            )
        if self.k is None or needed > self.capacity:
            if self.k is None:
                new_cap = max(needed, self.reserve)
            else:
                new_cap = min(self.cap_tokens, max(needed, int(self.capacity * 1.5) + 1))
            shape = (self.batch_size, self.kv_heads, new_cap, self.head_dim)
            new_k = torch.zeros(shape, dtype=k.dtype, device=k.device)  # as RingBuffer's: finite free slots
            new_v = torch.zeros(shape, dtype=v.dtype, device=v.device)
            if self.num_resident:
                old_k, old_v = self._buffers()
                new_k[:, :, : self.num_resident] = old_k[:, :, : self.num_resident]
                new_v[:, :, : self.num_resident] = old_v[:, :, : self.num_resident]
            self.k, self.v, self.capacity = new_k, new_v, new_cap
        kb, vb = self._buffers()
        kb[:, :, self.num_resident : needed] = k
        vb[:, :, self.num_resident : needed] = v
        self.advance(T)

    def check_room(self, T: int) -> None:
        """MemoryError unless T more tokens fit in the allocated slots."""
        if self.num_resident + T > self.capacity:
            raise MemoryError(f"full-layer KV buffer holds {self.capacity} slots; {self.num_resident} + {T} do not fit")

    def advance(self, T: int) -> None:
        """Count T tokens whose K/V were written at their slots (by `append`, or by a compiled step)."""
        self.check_room(T)
        self.num_resident += T
        self.num_tokens += T

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of the valid keys and values, each (B, K, num_resident, D)."""
        if self.k is None:
            return self._empty()
        kb, vb = self._buffers()
        return kb[:, :, : self.num_resident], vb[:, :, : self.num_resident]

    def rollback_floor(self) -> int:
        """A full layer forgets nothing: it can go back to 0."""
        return 0

    def truncate(self, position: int) -> None:
        """Forget the tokens at positions >= `position` (the caller checked 0 <= position <= num_tokens);
        the storage is kept for the next append."""
        self.num_resident = self.num_tokens = position

    def reset(self) -> None:
        super().reset()
        self.num_resident = self.capacity = 0


class MixedKVCache(RollbackKVCache):
    """One cache per generation, indexed by layer: `cache[layer]` is a RingBuffer or GrowingBuffer.

    `rollback_tokens` (R) is the rollback slack: sliding layers keep W + R slots, so `truncate` can
    always take back R tokens (speculative decoding drafts k tokens and needs R >= k - 1).
    `capacity` (N) makes full layers allocate N slots at their first write, so that a generation of
    up to N tokens never moves them: the static state of a compiled decode step (`static_decode`).
    """

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int = 1,
        max_tokens_per_full_layer: int = DEFAULT_FULL_CAP_TOKENS,
        *,
        rollback_tokens: int = 0,
        capacity: int = 0,
    ):
        self.config = config
        self._batch_size = check_int("batch_size", batch_size, minimum=1)
        check_int("max_tokens_per_full_layer", max_tokens_per_full_layer, minimum=1)
        self.rollback_tokens = check_int("rollback_tokens", rollback_tokens, minimum=0)
        check_int("capacity", capacity, minimum=0)
        K, D = config.n_kv_heads, config.head_dim
        self.layers: list[RingBuffer | GrowingBuffer] = [
            RingBuffer(batch_size, K, D, config.sliding_window, rollback_tokens)
            if config.is_sliding(i)
            else GrowingBuffer(batch_size, K, D, max_tokens_per_full_layer, reserve=capacity)
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

    def rollback_floor(self) -> int:
        """Lowest position `truncate` accepts now: the retained interval is [this, num_tokens]."""
        return max(store.rollback_floor() for store in self.layers)

    def truncate(self, position: int) -> None:
        """Keep the first `position` tokens of every row and forget the rest (speculative decoding's
        rejected drafts). Allowed for rollback_floor() <= position <= num_tokens, i.e. while every
        sliding layer still holds the keys the next query at `position` needs; otherwise ValueError
        naming the retained interval, cache unchanged. Also brings back in step a cache whose last
        forward pass raised half way (layers holding different numbers of tokens)."""
        position = check_int("position", position, minimum=0)
        held = min(store.num_tokens for store in self.layers)
        check_rollback(position, held, self.rollback_floor(), self.config.sliding_window)
        for store in self.layers:
            store.truncate(position)

    def reset(self) -> None:
        """Empty every layer (between independent requests); frees the storage."""
        for store in self.layers:
            store.reset()

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> KVRead:
        """Store new rotated (B, K, T, D) keys/values of `layer`; return the dense read the `KVCache`
        protocol says.

        Full layers append and return a view of the whole buffer. Sliding layers: a single decode
        token is written first and the last min(W, held) keys come back (`RingBuffer.slots`: in
        storage order when the ring is exactly one full window, the protocol's one freedom, else
        chronological); a chunk gets the chronological ring past (up to W keys, never the rollback
        slack, which no new query can see) followed by itself, and is written afterwards.
        """
        store = self.layers[layer]
        self._check_start(layer, start_pos)
        T = k.shape[2]
        if isinstance(store, GrowingBuffer):
            store.append(k, v)
            return KVRead.dense(*store.get(), 0)
        if T == 1:
            store.append(k, v)
            keys, values = store.slots()
            return KVRead.dense(keys, values, start_pos + 1 - keys.shape[2])
        past_k, past_v = store.last(min(store.window, store.num_resident))
        keys = torch.cat((past_k.to(k), k), dim=2)  # (B, K, past + T, D), past <= W
        values = torch.cat((past_v.to(v), v), dim=2)
        store.append(k, v)
        return KVRead.dense(keys, values, start_pos - past_k.shape[2])

    def _check_start(self, layer: int, start_pos: int) -> None:
        """ValueError unless start_pos is where `layer` ends."""
        held = self.layers[layer].num_tokens
        if start_pos != held:
            raise ValueError(
                f"layer {layer}: start_pos={start_pos} but the cache holds {held} "
                f"tokens; positions must continue where the cache ends"
            )

    # ---- static decode ---------------------------------------------------------------------------
    def repeat_rows(self, n: int) -> MixedKVCache:
        """A new cache of batch `n` whose every row holds a copy of this batch-1 cache's tokens: a shared
        prompt prefix (a passkey haystack up to its needle) prefilled once, then continued per row. This
        cache is unchanged. Plain rings and growing buffers only (a quantised or evicting layer keeps
        state beside its tensors): TypeError otherwise."""
        n = check_int("n", n, minimum=1)
        if self.batch_size != 1:
            raise ValueError(f"repeat_rows copies a batch-1 cache; this one has batch_size={self.batch_size}")
        if not all(type(s) in (RingBuffer, GrowingBuffer) for s in self.layers):
            kinds = sorted({type(s).__name__ for s in self.layers})
            raise TypeError(f"repeat_rows copies plain ring and growing buffers, not {kinds}")
        out = copy.copy(self)
        out._batch_size = n
        out.layers = []
        for store in self.layers:
            row = copy.copy(store)
            row.batch_size = n
            if store.k is not None:
                kb, vb = store._buffers()
                row.k, row.v = kb.repeat(n, 1, 1, 1), vb.repeat(n, 1, 1, 1)
            out.layers.append(row)
        return out

    def static_decode(self) -> StaticMixed | None:
        """The fixed-shape state of one decode step over this cache's own storage
        (`gptoss_lite.kv.base.StaticKV`), or None where it has none: a layer that is not a plain ring or
        growing buffer (quantised, evicting), nothing stored yet, or a full layer with no free slot.
        After the step, `advance(1)` counts the token the step wrote."""
        stores = self.layers
        if not all(isinstance(s, (RingBuffer, GrowingBuffer)) and s.k is not None for s in stores):
            return None
        if any(isinstance(s, GrowingBuffer) and s.num_resident >= s.capacity for s in stores):
            return None
        return StaticMixed(self)

    def reserve(self, num_tokens: int) -> None:
        """Make full layers hold `num_tokens` tokens without moving again (a no-op where they do)."""
        for store in self.layers:
            if isinstance(store, GrowingBuffer):
                store.reserve = max(store.reserve, min(num_tokens, store.cap_tokens))
                if store.k is not None and store.capacity < store.reserve:
                    kb, vb = store._buffers()
                    shape = (*kb.shape[:2], store.reserve, kb.shape[3])
                    new_k, new_v = kb.new_zeros(shape), vb.new_zeros(shape)
                    new_k[:, :, : store.num_resident] = kb[:, :, : store.num_resident]
                    new_v[:, :, : store.num_resident] = vb[:, :, : store.num_resident]
                    store.k, store.v, store.capacity = new_k, new_v, store.reserve

    def advance(self, T: int) -> None:
        """Count T tokens per row that a static step wrote into every layer's slots. MemoryError (cache
        unchanged) when a full layer has no room for them."""
        for store in self.layers:  # every layer checked before any moves: nothing half-advanced
            if isinstance(store, GrowingBuffer):
                store.check_room(T)
        for store in self.layers:
            store.advance(T)

    # ---- byte accounting -------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes allocated for K and V across layers (ring capacity W + R, global capacity)."""
        return sum(store.nbytes for store in self.layers)

    @property
    def payload_bytes(self) -> int:
        """Bytes of valid K and V across layers."""
        return sum(store.num_resident * store._token_bytes() for store in self.layers)


class StaticMixed:
    """`StaticKV` over a `MixedKVCache`'s storage: every row at position `num_tokens`; a ring slot s
    holds position p - ((p - s) mod size), a full-layer slot s position s (see kv/base.py, "Static
    decode"). Built per step by `MixedKVCache.static_decode`; the full layers' slot count is marked
    dynamic, so one compiled graph serves every capacity."""

    def __init__(self, cache: MixedKVCache) -> None:
        stores = cache.layers
        self.keys = [s._buffers()[0] for s in stores]
        self.values = [s._buffers()[1] for s in stores]
        self.ring = [isinstance(s, RingBuffer) for s in stores]
        self._positions = torch.tensor([cache.num_tokens], device=self.keys[0].device)
        for kb, vb, ring in zip(self.keys, self.values, self.ring):
            if not ring:
                torch._dynamo.maybe_mark_dynamic(kb, 2)
                torch._dynamo.maybe_mark_dynamic(vb, 2)

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    def write_read(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> StaticRead:
        kb, vb = self.keys[layer], self.values[layer]
        pos = self._positions  # (1,)
        slots = kb.shape[2]
        slot = pos % slots
        kb.index_copy_(2, slot, k[:, :, None])
        vb.index_copy_(2, slot, v[:, :, None])
        index = torch.arange(slots, device=pos.device)
        if self.ring[layer]:
            back = torch.remainder(pos - index, slots)  # how far behind the new token each slot is
            distance = torch.where(pos - back >= 0, back, -1)  # -1: not written yet
        else:
            distance = pos - index  # negative past the new token: free slots
        return StaticRead(kb, vb, distance[None, None])  # every row its own group: (1, T=1, S)

    def horizon(self, layer: int) -> int | None:
        return None
