"""The attention layer: projections, rotary, sinks, and the call into the cache seam.

The layer owns attention semantics: its window (W on sliding layers, None on full ones), its sink
logits, its rotary tables and the kernel. It rotates new keys, hands them to the cache
(`KVCache.update`), and attends over the read it gets back (docs/model.md#attention-with-sinks).
"""

from __future__ import annotations

import torch
from torch import nn

from gptoss_lite.config import ModelConfig
from gptoss_lite.kernels import blocks as block_kernels
from gptoss_lite.kv.base import DecodeChunk, KVCache, KVRead, RaggedRead, StaticKV
from gptoss_lite.model.attention.blocks import attend, chunked_decode
from gptoss_lite.model.attention.decode import masked_decode
from gptoss_lite.model.attention.plan import distance_bias
from gptoss_lite.model.attention.reference import attention_mass_reference, attention_reference
from gptoss_lite.model.decode_pack import input_major_for, pack_pair, pack_rows, still_packed
from gptoss_lite.model.matmul import Linear, PromptPack, decode_linear, linear, packs
from gptoss_lite.model.rope import apply_rotary_tables


class Attention(nn.Module):
    """GQA attention block: q_proj, fused kv_proj (K then V), o_proj, per-head sink logits."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        C, H, K, D = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = H, K, D
        self.window = cfg.sliding_window if cfg.is_sliding(layer) else None
        self.sink_clamp = cfg.sink_clamp
        self.q_proj = Linear(C, H * D, bias=cfg.attention_bias)
        self.kv_proj = Linear(C, 2 * K * D, bias=cfg.attention_bias)
        self.o_proj = Linear(H * D, C, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.zeros(H))  # learned sink logit per query head
        self._qkv: tuple[torch.Tensor, torch.Tensor | None, bool] | None = None  # see pack_for_decode
        self._qkv_pack: PromptPack | None = None  # see pack_for_prompts
        self._clamped_sinks: tuple[tuple[int, int], torch.Tensor] | None = None  # see sink_logits

    @torch.no_grad()
    def pack_for_decode(self, input_major: bool | None = None) -> None:
        """Make q_proj and kv_proj views of one buffer (and their biases views of one vector), so the
        projections of a token are a single GEMV: input-major (C, H·D + 2·K·D) or out-major
        (H·D + 2·K·D, C); None picks the dtype's layout (`decode_pack.input_major_for`: input-major
        for fp32, out-major for 16-bit weights). Same shapes and values; the parameters stay separate
        for training and checkpoints. Idempotent; asking for the other layout re-packs.
        """
        q, kv = self.q_proj, self.kv_proj
        if input_major is None:
            input_major = input_major_for(q.weight.dtype)
        packed = self._packed_qkv()
        if packed is None or packed[2] != input_major:
            bias = None if q.bias is None else pack_pair(q.bias, kv.bias, transposed=False)
            buf = pack_pair(q.weight, kv.weight, transposed=True) if input_major else pack_rows(q.weight, kv.weight)
            self._qkv = (buf, bias, input_major)  # (C, Nq + Nkv) or (Nq + Nkv, C); (Nq + Nkv,)

    def is_packed(self) -> bool:
        """Whether q_proj and kv_proj still live in the buffer `pack_for_decode` made."""
        return self._packed_qkv() is not None

    def _qkv_out_major(self) -> torch.Tensor | None:
        """The packed q|kv weight as (out, in), a view (None before `pack_for_decode`)."""
        packed = self._packed_qkv()
        return None if packed is None else packed[0].t() if packed[2] else packed[0]

    def prompt_weights(self) -> list[torch.Tensor]:
        """The (out, in) weights whose prompt products `pack_for_prompts` can pack: the packed q|kv
        (after `pack_for_decode`) and o_proj."""
        qkv = self._qkv_out_major()
        return ([] if qkv is None else [qkv]) + [self.o_proj.weight]

    @torch.no_grad()
    def pack_for_prompts(self, on: bool) -> None:
        """Give q|kv and o_proj a `PromptPack` each (on) or drop them; `GPTOSS.pack_for_prompts`."""
        qkv, o = self._qkv_out_major(), self.o_proj.weight
        self._qkv_pack = PromptPack(qkv) if on and qkv is not None and packs(qkv) else None
        self.o_proj.prompt_pack = PromptPack(o) if on and packs(o) else None

    def _packed_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None, bool] | None:
        """The packed (weight, bias, input_major) while the parameters still live in it (e.g. not after
        .to(dtype)). Traced by torch.compile the check is skipped (data_ptr cannot be traced):
        `CompiledDecoder.current` refuses weights that moved since the model was prepared."""
        if torch.compiler.is_compiling():
            return self._qkv
        if self._qkv is not None:
            buf, bias, input_major = self._qkv
            q, kv, split = self.q_proj, self.kv_proj, self.q_proj.weight.shape[0]
            offset = split if input_major else split * self.q_proj.weight.shape[1]
            if still_packed(buf, q.weight, kv.weight, offset) and (
                bias is None or still_packed(bias, q.bias, kv.bias, split)
            ):
                return self._qkv
            self._qkv = None
        return None

    def sink_logits(self) -> torch.Tensor:
        """The sink logits as used in the softmax (clamped where configured), shape (H,).

        Without autograd the clamped tensor is kept and reused until the weights change: a decode
        step then spends no op on it. The key is the parameter's storage and version counter, which
        every in-place write (optimiser step, load_state_dict, copy_) and every re-assignment
        (.to(), .data =) changes.
        """
        if self.sink_clamp is None:
            return self.sinks
        if torch.is_grad_enabled() or torch.compiler.is_compiling():  # a traced step clamps in its graph
            return self.sinks.clamp(*self.sink_clamp)
        key = (self.sinks.data_ptr(), self.sinks._version)
        if self._clamped_sinks is None or self._clamped_sinks[0] != key:
            self._clamped_sinks = (key, self.sinks.detach().clamp(*self.sink_clamp))
        return self._clamped_sinks[1]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        start_pos: int = 0,
        impl: str = "fast",
    ) -> torch.Tensor:
        """x (B, T, C) at absolute positions start_pos…start_pos+T-1 -> (B, T, C); cos, sin are the
        (T, D) tables of `rope.rotary_tables` for this layer's kind (at each token's own position in a
        ragged batch).

        New keys are rotated once at their absolute positions and handed to the cache, which returns
        the read of what the new queries may see; the layer attends over it with its own window and
        sinks. `impl="reference"` attends densely over the materialised read (the oracle).
        """
        B, T, C = x.shape
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        packed = None if torch.is_grad_enabled() else self._packed_qkv()  # the buffer carries no gradient
        if packed is None:
            q = self.q_proj(x)  # (B, T, H·D)
            kv = self.kv_proj(x)  # (B, T, 2·K·D)
        else:
            w, b, input_major = packed
            flat = x.view(B * T, C)
            pack, out_major = self._qkv_pack, w.t() if input_major else w
            if pack is not None and pack.serves(flat, out_major):
                qkv = pack(flat, b, out_major)
            elif input_major:
                qkv = torch.mm(flat, w) if b is None else torch.addmm(b, flat, w)
            else:
                qkv = linear(flat, w, b)
            q, kv = qkv.view(B, T, -1).split((H * D, 2 * K * D), dim=-1)
        q = q.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        kv = kv.reshape(B, T, 2, K, D)
        k = kv[:, :, 0].transpose(1, 2)  # (B, K, T, D)
        v = kv[:, :, 1].transpose(1, 2).contiguous()  # (B, K, T, D)
        q = apply_rotary_tables(q, cos, sin)
        k = apply_rotary_tables(k, cos, sin)
        read = KVRead.dense(k, v, start_pos) if cache is None else cache.update(self.layer, k, v, start_pos)
        sinks = self.sink_logits()
        if isinstance(read, RaggedRead):  # B == 1: the flat batch of several sequences
            y = attend_ragged(q[0], read, sinks, self.window, K)[None]
        elif impl == "fast":
            y = attend(q, read, sinks, start_pos - read.first, self.window)  # (B, H, T, D)
        else:
            keys, values = read.materialize()
            y = attention_reference(q, keys, values, sinks, start_pos - read.first, self.window)
            if read.mass is not None:
                read.mass += attention_mass_reference(q, keys, sinks, start_pos - read.first, self.window)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))

    def decode_step(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: StaticKV) -> torch.Tensor:
        """The one-token path (what the compiled decode step traces): h (B, C) in the model's dtype,
        one new token per row at `kv.positions`, cos/sin (B or 1, 1, D) -> the attention output after
        o_proj (B, C), fp32. Projections are `decode_linear` (a reduction for one row) over out-major weights
        (`prepare_for_inference(compile_decode=True)`); the new K/V go into `kv`'s fixed-shape
        storage; attention is `masked_decode` over all of it, widened to fp32 and rounded where eager
        16-bit matmuls round, or, over block storage, the kernel that reads the blocks in place
        (`kernels.blocks.attention`, the same arithmetic; `quantized_attention` over quantised blocks,
        which it dequantises as the store does)."""
        B = h.shape[0]
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        dt = h.dtype
        packed = self._packed_qkv()
        if packed is None or packed[2]:
            raise ValueError(
                "decode_step needs out-major q/kv weights; build the model with "
                "prepare_for_inference(compile_decode=True)"
            )
        qkv = decode_linear(h, packed[0], packed[1]).to(dt)  # (B, H·D + 2·K·D)
        q, k, v = qkv.split((H * D, K * D, K * D), dim=-1)
        q = apply_rotary_tables(q.view(B, H, D), cos, sin)
        k = apply_rotary_tables(k.view(B, K, D), cos, sin)
        read = kv.write_read(self.layer, k, v.view(B, K, D))
        distance, table = read.distance, read.table
        window = self.window
        horizon = kv.horizon(self.layer)
        if horizon is not None:
            window = horizon if window is None else min(window, horizon)
        R, G = read.keys.shape[0] if table is None else table.shape[0], H // K
        T = B // R  # rows per group of shared keys (1: plain decode)
        # the T rows of a group and their G query heads are one (T·G)-row query block per KV head
        rows = q.float().view(R, T, K, G, D).transpose(1, 2).reshape(R, K, T * G, D)
        quant = read.quantized
        if quant is not None:
            in_place = block_kernels.applies_quantized(read.keys, quant.format, dt)
        else:
            in_place = table is not None and block_kernels.applies(read.keys, read.values, dt)
        if in_place:  # the blocks (their codes, and the tails) where they lie
            sinks = self.sink_logits().float().view(K, G)
            w, round16 = -1 if window is None else window, dt != torch.float32
            if quant is None:
                att = block_kernels.attention(rows, read.keys, read.values, table, distance, w, sinks, round16)
            else:
                att = block_kernels.quantized_attention(
                    rows, list(quant.codes), quant.format, quant.value_group, read.keys, read.values, table,
                    quant.tails, distance, w, sinks, round16,
                )  # fmt: skip
        else:  # dense storage, or a copy of the groups' blocks (dequantised), widened for the fp32 products
            if quant is not None:
                keys, values = quant.dequantize(read, read.keys.dtype)
            elif table is None:
                keys, values = read.keys, read.values
            else:
                keys, values = gathered(read.keys, table), gathered(read.values, table)
            sink = self.sink_logits().float().view(1, K, 1, G, 1)
            if T == 1:  # one query row per KV head and row: the bias broadcasts over the G heads
                bias, sink = distance_bias(distance, window)[:, None], sink[:, :, 0]  # (R or 1, 1, 1, S)
            else:
                S = distance.shape[-1]
                bias = distance_bias(distance, window)[:, None, :, None, :]  # (R or 1, 1, T, 1, S)
                bias = bias.expand(-1, -1, -1, G, -1).reshape(bias.shape[0], 1, T * G, S)
                sink = sink.expand(-1, -1, T, -1, -1).reshape(1, K, T * G, 1)
            att = masked_decode(rows, keys.float(), values.float(), bias, sink, round_to=dt)  # (R, K, T·G, D)
        att = att.view(R, K, T, G, D).transpose(1, 2).reshape(B, H * D)
        return decode_linear(att, self.o_proj.weight, self.o_proj.bias)


def gathered(store: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The blocks table (R, nb) of block storage (K, blocks, bs, D) copied out as (R, K, nb · bs, D)."""
    K, D = store.shape[0], store.shape[-1]
    return store.index_select(1, table.reshape(-1)).view(K, table.shape[0], -1, D).transpose(0, 1)


def attend_ragged(
    q: torch.Tensor, read: RaggedRead, sinks: torch.Tensor | None, window: int | None, kv_heads: int
) -> torch.Tensor:
    """q (H, N, D) of a flat batch -> (H, N, D): each bucket of decode rows in one masked kernel (one
    call per chunk of quantised keys), each prompt chunk over its own sequence's read. `window` is the layer's;
    the read's horizon (a full-layer window) narrows it."""
    H, N, D = q.shape
    if read.horizon is not None:
        window = read.horizon if window is None else min(window, read.horizon)
    decode = read.decode
    if len(decode) == 1 and decode[0].rows is None and not read.prefill:
        return _attend_decode(q, decode[0].chunks, sinks, window, kv_heads)
    out = q.new_empty(H, N, D)
    for rows in decode:  # a bucket of one-token rows of similar length
        out[:, rows.rows] = _attend_decode(q[:, rows.rows], rows.chunks, sinks, window, kv_heads)
    for offset, length, start_pos, part in read.prefill:
        rows = q[None, :, offset : offset + length]  # (1, H, T, D)
        out[:, offset : offset + length] = attend(rows, part, sinks, start_pos - part.first, window)[0]
    return out


def _attend_decode(
    q: torch.Tensor, chunks: list[DecodeChunk], sinks: torch.Tensor | None, window: int | None, K: int
) -> torch.Tensor:
    """q (H, Bd, D), one query per row, over head-major (K, Bd, S, D) chunks -> (H, Bd, D)."""
    H, Bd, D = q.shape
    G = H // K
    rows = q.view(K, G, Bd, D).transpose(1, 2)  # (K, Bd, G, D): head h = kv head h // G
    sink = None if sinks is None else sinks.view(K, 1, G, 1)

    def bias(chunk: DecodeChunk) -> torch.Tensor:
        return distance_bias(chunk.distance, window, chunk.memo)[None, :, None, :]  # (1, Bd, 1, S)

    if len(chunks) == 1:
        out = masked_decode(rows, *chunks[0].load(), bias(chunks[0]), sink)  # (K, Bd, G, D)
    else:  # quantised blocks, dequantised one chunk at a time
        out = chunked_decode(rows, ((*c.load(), bias(c)) for c in chunks), sink)
    return out.transpose(1, 2).reshape(H, Bd, D)
