"""A decode step as one compiled graph over static KV buffers (docs/model.md#the-compiled-decode-step).

The eager decode step of `GPTOSS.forward` dispatches several hundred small ops per token (norms,
rotary, projections, a router, each selected expert, attention), and on a CPU most of a small
model's step is that dispatch, not arithmetic. `CompiledDecoder` writes the same step as one pure
tensor function of (tokens, position, KV buffers) and hands it to `torch.compile` (inductor's CPU
backend, which emits C++/OpenMP loops): the step becomes a few dozen fused kernels.

What the graph needs, and why:
- **Static buffers.** Sliding layers keep a ring of exactly W slots (position p in slot p mod W);
  global layers a buffer of `capacity` slots (position p in slot p), sized once per generation.
  The new key is written in place at its slot and attention runs over the whole buffer with a mask,
  so no shape changes from one step to the next. The global capacity is a dynamic dimension, so one
  compiled graph serves every prompt length.
- **GEMVs as reductions.** Every projection is written as `(w * x).sum(-1)` over an out-major
  (out, in) weight, computed in fp32. Inductor turns each into one vectorised loop that reads the
  weight once in its own dtype (so bf16 weights move half the bytes of fp32) and fuses the bias,
  the activation and, for the experts, the gather of the two selected experts' rows: nothing is
  copied. An input-major weight is twice as slow this way, so a model meant for this path is packed
  out-major in every dtype (`GPTOSS.prepare_for_inference(compile_decode=True)`).
- **The same roundings as eager.** Values the eager path rounds to the model's dtype (the normed
  input of each projection, keys and values, the router logits before top-k, the expert weights, the
  activation) are rounded here at the same points; everything else is fp32.

The eager path stays the reference: `step_eager` is this function without compilation (the tests
run both against `GPTOSS.forward`). Compilation takes tens of seconds the first time for a model
shape and dtype; inductor caches the result on disk (`TORCHINDUCTOR_CACHE_DIR`, by default under
the system's temp directory), so later processes load it in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptoss_lite.kv.mixed import MixedKVCache, RingBuffer
from gptoss_lite.model.attention.layer import Attention
from gptoss_lite.model.moe import Experts
from gptoss_lite.model.rope import apply_rotary_tables, rotary_tables


@dataclass(frozen=True)
class _Layer:
    """One block's weights as the graph reads them: every matmul weight out-major (..., out, in)."""

    sliding: bool
    norm1: nn.Module  # the block's RMSNorms (fp32 statistics)
    norm2: nn.Module
    qkv_w: Tensor  # (H·D + 2·K·D, C): q then k then v
    qkv_b: Tensor | None
    o_w: Tensor  # (C, H·D)
    o_b: Tensor | None
    sinks: Tensor | None  # (H,) fp32, clamped as configured
    router_w: Tensor  # (E, C)
    router_b: Tensor | None
    gate_up_w: Tensor  # (E, 2I, C): gate rows then up rows
    gate_up_b: Tensor | None  # (E, 2I)
    down_w: Tensor  # (E, C, I)
    down_b: Tensor | None  # (E, C)
    activate: Callable[[Tensor, Tensor], Tensor]  # `Experts._activate` (gate, up) -> hidden
    # one (gate|up weight, its bias, down weight, its bias) per shared expert
    shared: tuple[tuple[Tensor, Tensor | None, Tensor, Tensor | None], ...]


_NOT_OUT_MAJOR = (
    "compiled decode needs out-major weights ({}); build the model with prepare_for_inference(compile_decode=True)"
)


def _packed_out_major(packed: tuple[Tensor, Tensor | None, bool] | None, what: str) -> tuple[Tensor, Tensor | None]:
    """The (weight, bias) of a decode-packed pair (`Attention._packed_qkv`, `Experts._packed_gate_up`),
    which must be packed out-major."""
    if packed is None or packed[2]:
        raise ValueError(_NOT_OUT_MAJOR.format(f"{what} are not packed out-major"))
    return packed[0], packed[1]


class DecodeState:
    """The static KV buffers of one generation: `keys[l]`, `values[l]` (B, K, slots, D) and the
    position of the next token. Built by `CompiledDecoder.start` from a prefilled cache."""

    def __init__(self, keys: list[Tensor], values: list[Tensor], position: int, capacity: int):
        self.keys, self.values = keys, values
        self.position = position
        self.capacity = capacity  # slots of each global layer: positions 0 … capacity - 1


class CompiledDecoder:
    """The decode step of `model` as one compiled graph (see the module docstring).

    Built by `GPTOSS.prepare_for_inference(compile_decode=True)`; `generate()` uses it for the decode
    steps of a generation on a plain `MixedKVCache` (`start` seeds the static buffers from it,
    `write_back` catches it up). The decoder reads the model's weights in place (nothing is copied);
    `current()` tells whether they are still the ones it captured.
    """

    def __init__(self, model) -> None:
        cfg = model.config
        self.config = cfg
        self.dtype = model.embed.weight.dtype
        self.embed = model.embed.weight
        self.norm = model.norm
        self.head = model.head_weight()
        if self.head.stride(-1) != 1:
            raise ValueError(_NOT_OUT_MAJOR.format("the output head is input-major"))
        self.layers = tuple(self._layer(block) for block in model.blocks)
        self.rope_sliding, self.rope_full = model.rope_sliding, model.rope_full
        self._captured = self._weights_key(model)
        # cpp_wrapper: the ~40 kernel calls of a step are made from generated C++, not Python (bf16
        # step of the 20M model 3.13 -> 2.66 ms, medians of 6 alternating runs in one process).
        self._compiled = torch.compile(self.step_eager, dynamic=False, fullgraph=True, options={"cpp_wrapper": True})
        self.compile_seconds: float | None = None  # wall time of the first compiled call

    def _layer(self, block) -> _Layer:
        attn: Attention = block.attn
        experts: Experts = block.moe.experts
        qkv_w, qkv_b = _packed_out_major(attn._packed_qkv(), "q/kv")
        gate_up_w, gate_up_b = _packed_out_major(experts._packed_gate_up(), "the experts' gate/up")
        shared = ()
        if block.moe.shared is not None:
            s = block.moe.shared
            w, b = _packed_out_major(s._packed_gate_up(), "the shared experts' gate/up")
            shared = tuple(
                (w[e], None if b is None else b[e], s.down_proj[e], None if s.down_bias is None else s.down_bias[e])
                for e in range(w.shape[0])
            )
        sinks = attn.sink_logits()
        return _Layer(
            sliding=block.sliding,
            norm1=block.norm1,
            norm2=block.norm2,
            qkv_w=qkv_w,
            qkv_b=qkv_b,
            o_w=attn.o_proj.weight,
            o_b=attn.o_proj.bias,
            sinks=None if sinks is None else sinks.detach().float(),
            router_w=block.moe.router.weight,
            router_b=block.moe.router.bias,
            gate_up_w=gate_up_w,
            gate_up_b=gate_up_b,
            down_w=experts.down_proj,
            down_b=experts.down_bias,
            activate=experts._activate,
            shared=shared,
        )

    @staticmethod
    def _weights_key(model) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in model.parameters())

    def current(self, model) -> bool:
        """Whether `model`'s parameters are still the tensors (and versions) this decoder captured."""
        return self._weights_key(model) == self._captured

    # ---- state -----------------------------------------------------------------------------------
    def start(self, cache: MixedKVCache, capacity: int) -> DecodeState:
        """Static buffers holding what `cache` (a prefilled `MixedKVCache`) holds, with room for
        global positions up to `capacity` - 1. The cache is only read (`write_back` catches it up)."""
        cfg = self.config
        n = cache.num_tokens
        if capacity < n + 1:
            raise ValueError(f"capacity={capacity}: must exceed the {n} tokens the cache holds")
        B, K, D, W = cache.batch_size, cfg.n_kv_heads, cfg.head_dim, cfg.sliding_window
        keys, values = [], []
        for store in cache.layers:
            ring = isinstance(store, RingBuffer)
            slots = W if ring else capacity
            kb = torch.zeros(B, K, slots, D, dtype=self.dtype, device=self.embed.device)
            vb = torch.zeros_like(kb)
            k, v = store.last(min(W, store.num_resident)) if ring else store.get()
            where = torch.arange(n - k.shape[2], n, device=kb.device) % slots
            kb[:, :, where] = k.to(self.dtype)
            vb[:, :, where] = v.to(self.dtype)
            if not ring:
                torch._dynamo.maybe_mark_dynamic(kb, 2)  # one graph for every capacity
                torch._dynamo.maybe_mark_dynamic(vb, 2)
            keys.append(kb)
            values.append(vb)
        return DecodeState(keys, values, n, capacity)

    def step(self, state: DecodeState, tokens: Tensor) -> Tensor:
        """Run tokens (B,) at `state.position` through the compiled graph; write their K/V into the
        state and advance it. Returns the logits (B, V) in the model's dtype."""
        if state.position >= state.capacity:
            raise ValueError(f"decode state is full: capacity {state.capacity} positions")
        pos = torch.tensor([state.position], device=tokens.device)
        t0 = time.perf_counter() if self.compile_seconds is None else 0.0
        logits = self._compiled(tokens, pos, state.keys, state.values)
        if self.compile_seconds is None:
            self.compile_seconds = time.perf_counter() - t0
        state.position += 1
        return logits

    def write_back(self, state: DecodeState, cache: MixedKVCache) -> None:
        """Append to `cache` (the one `start` read) the K/V of the tokens decoded since, so that it
        ends as the eager path would leave it. Sliding layers get the last W of them (a ring keeps no
        more; older slots of the appended block are zeros it drops)."""
        first = cache.num_tokens  # read once: each append below moves it
        n = state.position - first
        if n <= 0:
            return
        W = self.config.sliding_window
        for store, kb, vb in zip(cache.layers, state.keys, state.values):
            if isinstance(store, RingBuffer):
                keep = min(n, W)
                where = torch.arange(state.position - keep, state.position, device=kb.device) % W
                k, v = kb.new_zeros((*kb.shape[:2], n, kb.shape[3])), vb.new_zeros((*vb.shape[:2], n, vb.shape[3]))
                k[:, :, n - keep :], v[:, :, n - keep :] = kb[:, :, where], vb[:, :, where]
            else:
                k, v = kb[:, :, first : state.position], vb[:, :, first : state.position]
            store.append(k.to(store.k.dtype), v.to(store.v.dtype))

    # ---- the graph -------------------------------------------------------------------------------
    def step_eager(self, tokens: Tensor, pos: Tensor, keys: list[Tensor], values: list[Tensor]) -> Tensor:
        """The step as plain tensor code (what is compiled). tokens (B,), pos (1,) int64; writes the
        new K/V into keys/values in place; returns logits (B, V) in the model's dtype."""
        cfg = self.config
        dt = self.dtype
        B = tokens.shape[0]
        H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        G = H // K
        x = F.embedding(tokens, self.embed).float()  # (B, C)
        tables = {  # (1, D) each
            True: rotary_tables(*self.rope_sliding.at(pos)),
            False: rotary_tables(*self.rope_full.at(pos)),
        }
        for i, L in enumerate(self.layers):
            h = L.norm1(x).to(dt)
            qkv = _gemv(h, L.qkv_w, L.qkv_b).to(dt)  # (B, H·D + 2·K·D)
            q, k, v = qkv.split((H * D, K * D, K * D), dim=-1)
            cos, sin = tables[L.sliding]
            q = apply_rotary_tables(q.view(B, H, D), cos, sin)
            k = apply_rotary_tables(k.view(B, K, D), cos, sin)
            v = v.view(B, K, D)
            kb, vb = keys[i], values[i]
            slots = kb.shape[2]
            slot = pos % slots
            kb.index_copy_(2, slot, k[:, :, None])
            vb.index_copy_(2, slot, v[:, :, None])
            index = torch.arange(slots, device=pos.device)
            if L.sliding:  # slot s holds position pos - ((pos - s) mod W); empty while that is negative
                visible = pos - torch.remainder(pos - index, slots) >= 0
            else:
                visible = index <= pos
            # As `attention._attend_one_query`: scores rounded to the dtype, then scaled; the
            # unnormalised probabilities weight the values, and the sum is divided once.
            # Two batched matmuls in fp32, which inductor hands to the BLAS kernel: at 2,048 keys the
            # 20M model's fp32 step took 3.6 ms this way against 7.7 ms with fused reductions, and
            # widening a bf16 cache first beats PyTorch's bf16 matmul on CPUs without bf16 instructions.
            scores = torch.matmul(q.float().view(B, K, G, D), kb.float().transpose(-1, -2))  # (B, K, G, S)
            scores = _round(scores, dt) * D**-0.5
            scores = scores.masked_fill(~visible, float("-inf"))
            top = scores.amax(dim=-1, keepdim=True)
            if L.sinks is not None:
                sink = L.sinks.view(1, K, G, 1)
                top = torch.maximum(top, sink)
            p = torch.exp(scores - top)
            denom = p.sum(dim=-1, keepdim=True)
            if L.sinks is not None:
                denom = denom + torch.exp(sink - top)
            att = torch.matmul(_round(p, dt), vb.float())  # (B, K, G, D)
            att = (_round(att, dt) / denom).to(dt).reshape(B, H * D)
            x = _round(x + _round(_gemv(att, L.o_w, L.o_b), dt), dt)
            h = L.norm2(x).to(dt)
            x = _round(x + self._moe(L, h).float(), dt)
        h = self.norm(x).to(dt)
        return _gemv(h, self.head, None).to(dt)

    def _moe(self, L: _Layer, h: Tensor) -> Tensor:
        """Router, top-k, the selected experts gathered inside one reduction each, and the shared
        experts; h (B, C) in the model's dtype -> (B, C) in the model's dtype."""
        cfg = self.config
        dt = self.dtype
        logits = _gemv(h, L.router_w, L.router_b).to(dt)  # (B, E)
        top_logits, top_idx = logits.topk(cfg.top_k, dim=-1)  # (B, A)
        weights = torch.softmax(top_logits.float(), dim=-1).to(dt).float()  # (B, A)
        gate_up = (L.gate_up_w[top_idx].float() * h[:, None, None, :].float()).sum(-1)  # (B, A, 2I)
        if L.gate_up_b is not None:
            gate_up = gate_up + L.gate_up_b[top_idx].float()
        act = L.activate(*_round(gate_up, dt).chunk(2, dim=-1)).to(dt)  # (B, A, I)
        out = (L.down_w[top_idx].float() * act[:, :, None, :].float()).sum(-1)  # (B, A, C)
        if L.down_b is not None:
            out = out + L.down_b[top_idx].float()
        out = _round(_round(out, dt) * weights[..., None], dt)  # (B, A, C)
        y = out[:, 0]
        for j in range(1, cfg.top_k):  # summed in order, rounded each time, as `Experts.mix_one_token`
            y = _round(y + out[:, j], dt)
        for gate_up_w, gate_up_b, down_w, down_b in L.shared:
            gu = _round(_gemv(h, gate_up_w, gate_up_b), dt)
            s = _gemv(L.activate(*gu.chunk(2, dim=-1)).to(dt), down_w, down_b)
            y = _round(y + _round(s, dt), dt)
        return y


def _gemv(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x (B, in) · w (out, in)ᵀ (+ b) in fp32 as one reduction (see the module docstring)."""
    y = (x[:, None, :].float() * w.float()).sum(-1)
    return y if b is None else y + b.float()


def _round(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x rounded to `dtype` and widened back to fp32 (nothing for fp32)."""
    return x if dtype == torch.float32 else x.to(dtype).float()
