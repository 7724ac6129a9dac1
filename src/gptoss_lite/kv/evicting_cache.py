"""Token eviction during generation on full layers under a budget (docs/kv-cache.md#eviction-during-generation).

`EvictingKVCache` is a `MixedKVCache` whose full layers are `EvictingBuffer`s of exactly `budget`
slots; sliding layers keep their rings (they already hold only W tokens). The policies are the rules
of `gptoss_lite.kv.evict`, applied to the cache while it generates:

- `streaming` (StreamingLLM): keep the first `sink_tokens` positions and the most recent
  `budget - sink_tokens`.
- `h2o` (H2O, heavy hitters): keep the most recent `recent` positions and, of the rest, the ones with
  the largest accumulated attention, per KV head. The attention mass comes from the attention kernel
  (`KVRead.mass`, filled block by block, no dense score matrix).

Keys are stored already rotated at their original positions and never re-rotated, so positions stay
exact; `positions(layer)` says which positions each head holds. A forward pass of T new tokens
attends to the kept past (<= budget keys) plus its own T tokens; the eviction happens when the next
forward pass reaches the layer (by then the kernel has added the new tokens' attention mass), so the
stored K/V never exceed the budget.
"""

from __future__ import annotations

import torch

from gptoss_lite.config import ModelConfig
from gptoss_lite.kv.base import KVRead, TensorSegment
from gptoss_lite.kv.evict import h2o_priority, streaming_priority
from gptoss_lite.kv.mixed import DEFAULT_FULL_CAP_TOKENS, MixedKVCache, _LayerStore
from gptoss_lite.validation import check_int

POLICIES = ("streaming", "h2o")
DEFAULT_SINK_TOKENS = 4  # StreamingLLM keeps 4 initial tokens as attention sinks


class EvictingBuffer(_LayerStore):
    """A full layer holding at most `budget` tokens per (row, KV head), chosen by `policy`.

    `nbytes` counts the K and V slots (`budget` of them); the bookkeeping beside them, an int64
    position per slot and under h2o an fp32 mass, adds 8 or 12 bytes per slot and head and is not in it.
    """

    def __init__(
        self, batch_size: int, kv_heads: int, head_dim: int, budget: int, policy: str, sink_tokens: int, recent: int
    ):
        super().__init__(batch_size, kv_heads, head_dim)
        self.budget, self.policy, self.sink_tokens, self.recent = budget, policy, sink_tokens, recent
        self._held = 0  # committed tokens per (row, head), <= budget
        self.pos: torch.Tensor | None = None  # (B, K, budget) int64 position of each slot
        self.mass: torch.Tensor | None = None  # (B, K, budget) fp32 accumulated attention (h2o)
        self._pending: tuple[KVRead, torch.Tensor, torch.Tensor, int] | None = None

    @property
    def num_resident(self) -> int:
        """Tokens stored per (row, head): at most the budget."""
        self.commit()
        return self._held

    def stage(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> KVRead:
        """Return the kept past followed by the T new tokens as a `KVRead` (asking for attention mass
        under h2o); the new tokens are stored, and the layer evicted down to the budget, by `commit`."""
        self.commit()
        T = self._check(k, v)
        if self.k is None:
            B, K, D = self.batch_size, self.kv_heads, self.head_dim
            self.k = torch.empty(B, K, self.budget, D, dtype=k.dtype, device=k.device)
            self.v = torch.empty(B, K, self.budget, D, dtype=v.dtype, device=v.device)
            self.pos = torch.empty(B, K, self.budget, dtype=torch.long, device=k.device)
            if self.policy == "h2o":
                self.mass = torch.zeros(B, K, self.budget, device=k.device)
        kb, vb = self._buffers()
        n = self._held
        mass = None
        if self.policy == "h2o":
            mass = torch.zeros(self.batch_size, self.kv_heads, n + T, device=k.device)
        segments = [TensorSegment(kb[:, :, :n], vb[:, :, :n]), TensorSegment(k, v)]
        blocks = KVRead(segments, start_pos - n, self.kv_heads, 1, mass)
        self._pending = (blocks, k, v, start_pos)
        self.num_tokens += T
        return blocks

    def _scores(self, pos: torch.Tensor, mass: torch.Tensor | None, end: int) -> torch.Tensor:
        """Keep-priority of candidates (B, K, c) of a sequence `end` tokens long, by the policy's rule
        (`kv.evict`): the lowest goes first, +inf is never evicted."""
        if self.policy == "streaming":
            return streaming_priority(pos, end, self.budget, self.sink_tokens)
        assert mass is not None
        return h2o_priority(pos, mass, end, self.recent)

    def commit(self) -> None:
        """Store the staged tokens, evicting the lowest-priority ones beyond the budget."""
        if self._pending is None:
            return
        kb, _ = self._buffers()
        # NOTE: storage made under torch.inference_mode (generation) can only be written inside it, and a
        # commit may be triggered outside (an accessor after generate returned).
        with torch.inference_mode(kb.is_inference()):
            self._commit()

    def _commit(self) -> None:
        assert self._pending is not None and self.pos is not None
        blocks, k, v, start = self._pending
        self._pending = None
        kb, vb = self._buffers()
        B, K, T, D = k.shape
        n, end = self._held, start + T
        new_pos = torch.arange(start, end, device=k.device).expand(B, K, T)
        new_mass = None
        if self.mass is not None:
            assert blocks.mass is not None
            self.mass[:, :, :n] += blocks.mass[:, :, :n]
            new_mass = blocks.mass[:, :, n:]
        if n + T <= self.budget:
            kb[:, :, n : n + T], vb[:, :, n : n + T], self.pos[:, :, n : n + T] = k, v, new_pos
            if self.mass is not None:
                self.mass[:, :, n : n + T] = new_mass
            self._held = n + T
            return
        if T == 1:  # decode step: the new token is always kept; it takes the slot of the lowest-priority one
            mass = None if self.mass is None else self.mass[:, :, :n]
            slot = self._scores(self.pos[:, :, :n], mass, end).argmin(dim=-1, keepdim=True)  # (B, K, 1)
            kb.scatter_(2, slot[..., None].expand(B, K, 1, D), k)
            vb.scatter_(2, slot[..., None].expand(B, K, 1, D), v)
            self.pos.scatter_(2, slot, new_pos)
            if self.mass is not None:
                assert new_mass is not None
                self.mass.scatter_(2, slot, new_mass)
            return
        cand_pos = torch.cat((self.pos[:, :, :n], new_pos), dim=2)  # (B, K, n + T)
        cand_mass = None if self.mass is None else torch.cat((self.mass[:, :, :n], new_mass), dim=2)
        keep = self._scores(cand_pos, cand_mass, end).topk(self.budget, dim=-1).indices  # (B, K, budget)
        keep = keep.gather(2, cand_pos.gather(2, keep).argsort(dim=-1))  # slots in position order
        idx = keep[..., None].expand(B, K, self.budget, D)
        kb.copy_(torch.cat((kb[:, :, :n], k), dim=2).gather(2, idx))
        vb.copy_(torch.cat((vb[:, :, :n], v), dim=2).gather(2, idx))
        self.pos.copy_(cand_pos.gather(2, keep))
        if self.mass is not None and cand_mass is not None:
            self.mass.copy_(cand_mass.gather(2, keep))
        self._held = self.budget

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored keys and values (slot order), each (B, K, held, D)."""
        self.commit()
        if self.k is None:
            return self._empty()
        kb, vb = self._buffers()
        return kb[:, :, : self._held], vb[:, :, : self._held]

    def positions(self) -> torch.Tensor:
        """(B, K, held) positions of the stored tokens, in slot order."""
        self.commit()
        if self.pos is None:
            return torch.empty(self.batch_size, self.kv_heads, 0, dtype=torch.long)
        return self.pos[:, :, : self._held]

    def rollback_floor(self) -> int:
        """An evicting layer cannot take tokens back (they may be gone): only `truncate(num_tokens)`."""
        return self.num_tokens

    def truncate(self, position: int) -> None:
        assert position == self.num_tokens, "EvictingBuffer.truncate: only to num_tokens"

    def reset(self) -> None:
        super().reset()
        self._held, self.pos, self.mass, self._pending = 0, None, None, None


class EvictingKVCache(MixedKVCache):
    """A MixedKVCache whose full layers hold at most `budget` tokens (per row and KV head), evicted by
    `policy` ('streaming' or 'h2o'; module docstring). `recent` (h2o) defaults to budget // 2."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int = 1,
        max_tokens_per_full_layer: int = DEFAULT_FULL_CAP_TOKENS,
        *,
        budget: int,
        policy: str = "streaming",
        sink_tokens: int = DEFAULT_SINK_TOKENS,
        recent: int | None = None,
        rollback_tokens: int = 0,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: must be one of {POLICIES}")
        check_int("budget", budget, minimum=2)
        check_int("sink_tokens", sink_tokens, minimum=0)
        if policy == "streaming" and sink_tokens >= budget:
            raise ValueError(
                f"sink_tokens={sink_tokens}: must be < budget={budget} (the budget also keeps recent tokens)"
            )
        recent = budget // 2 if recent is None else recent
        check_int("recent", recent, minimum=1, maximum=budget)
        if rollback_tokens:
            raise ValueError(
                "rollback_tokens: an evicting cache cannot take tokens back (speculative decoding needs a "
                "cache without a KV budget)"
            )
        super().__init__(config, batch_size, max_tokens_per_full_layer)
        self.budget, self.policy, self.sink_tokens, self.recent = budget, policy, sink_tokens, recent
        for i in range(config.n_layers):
            if not config.is_sliding(i):
                self.layers[i] = EvictingBuffer(  # type: ignore[call-overload]
                    batch_size, config.n_kv_heads, config.head_dim, budget, policy, sink_tokens, recent
                )

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> KVRead:
        """An evicting layer returns the kept past (<= budget keys, any order: the full-layer freedom of
        the protocol) then the new tokens, first = start_pos - (past keys), asking for the attention
        mass under h2o; a sliding layer is the mixed cache's ring."""
        store = self.layers[layer]
        if not isinstance(store, EvictingBuffer):
            return super().update(layer, k, v, start_pos)
        self._check_start(layer, start_pos)
        return store.stage(k, v, start_pos)

    def positions(self, layer: int) -> torch.Tensor:
        """(B, K, held) original positions of the tokens a full layer holds (slot order)."""
        store = self.layers[layer]
        assert isinstance(store, EvictingBuffer), f"layer {layer} does not evict"
        return store.positions()
