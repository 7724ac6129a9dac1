"""Mixture of experts: router, top-k routed experts computed per expert group, shared experts
(docs/model.md#moe-and-the-training-forward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gptoss_lite.config import ModelConfig
from gptoss_lite.kernels import moe as moe_kernel
from gptoss_lite.kernels.mxfp4 import (
    BLOCK,
    dequantize_rows,
    gate_up_act,
    gate_up_act_available,
    matvec,
    matvec_int8,
    quantize_mxfp4,
    reference_rows,
)
from gptoss_lite.model.decode_pack import input_major_for, pack_pair, pack_rows, still_packed, store_for_decode
from gptoss_lite.model.matmul import (
    Linear,
    PromptPack,
    decode_linear,
    linear,
    packs,
    rounded,
    select_linear,
)


def activate(gate: torch.Tensor, up: torch.Tensor, activation: str, limit: float) -> torch.Tensor:
    """The expert MLP's gated activation: SwiGLU, or gpt-oss's clamped variant. Computed in fp32 and
    rounded once to the inputs' dtype, in every path (the decode step, prefill, few tokens, MXFP4)."""
    dt = gate.dtype
    gate, up = gate.float(), up.float()
    if activation == "swiglu":
        return (F.silu(gate) * up).to(dt)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * 1.702))).to(dt)


def activate_halves(gate_up: torch.Tensor, activation: str, limit: float) -> torch.Tensor:
    """`activate` of one gate|up product (n, 2I), gate half then up half -> (n, I): `kernels.moe.activate`
    in one pass where built, else PyTorch's ops."""
    out = moe_kernel.activate(gate_up, activation == "swiglu", float(limit))
    return out if out is not None else activate_halves_reference(gate_up, activation, limit)


def activate_halves_reference(gate_up: torch.Tensor, activation: str, limit: float) -> torch.Tensor:
    """`activate_halves` in PyTorch's ops, the reference."""
    return activate(*gate_up.chunk(2, dim=-1), activation, limit)


def combine(pieces: list[torch.Tensor], at: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_a weights[t, a] · rows[at[t, a]] -> (N, C) in the rows' dtype: rows (P, C) the experts' outputs,
    the pieces (each expert's, in expert order) one after another; at (N, A) int64 each (token, slot)'s
    row, weights (N, A); fp32 products summed in slot order and rounded once. `kernels.moe.combine` in one
    pass over the pieces where built, else `combine_reference` over their concatenation."""
    out = moe_kernel.combine(pieces, at, weights)
    return out if out is not None else combine_reference(torch.cat(pieces), at, weights)


def group(x: torch.Tensor, idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Tokens x (N, C) and their experts idx (N, A) grouped by expert: -> the rows (N·A, C) of each
    (token, slot) in the order of a stable sort by expert, counts[e] the assignments of expert e, at
    (N, A) each (token, slot)'s place in that order. `kernels.moe.group` in one pass where it serves,
    else `group_reference`."""
    out = moe_kernel.group(x, idx, n_experts)
    return out if out is not None else group_reference(x, idx, n_experts)


def group_reference(x: torch.Tensor, idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """`group` in PyTorch's ops (a stable argsort, bincount, index_select and a scatter), the reference."""
    assign = idx.reshape(-1)  # (N·A,)
    order = torch.argsort(assign, stable=True)
    at = torch.empty_like(order)
    at[order] = torch.arange(order.numel(), device=order.device)  # (token, slot) -> its sorted place
    counts = torch.bincount(assign, minlength=n_experts).tolist()
    return x.index_select(0, order // idx.shape[1]), counts, at.view(idx.shape)


def combine_reference(rows: torch.Tensor, at: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`combine` in PyTorch's ops, the reference."""
    picked = rows.index_select(0, at.reshape(-1)).view(*at.shape, rows.shape[1]).float()  # (N, A, C)
    total = picked[:, 0] * weights[:, :1].float()
    for a in range(1, at.shape[1]):
        total = total + picked[:, a] * weights[:, a : a + 1].float()
    return total.to(rows.dtype)


class Experts(nn.Module):
    """E expert MLPs stored as stacked weights (nn.Linear convention: out × in).

    gate_proj, up_proj (E, I, C); down_proj (E, C, I); optional biases gate_bias, up_bias (E, I),
    down_bias (E, C).
    """

    def __init__(self, n: int, d_model: int, hidden: int, activation: str, limit: float, bias: bool):
        super().__init__()
        self.activation, self.limit = activation, limit
        self.gate_proj = nn.Parameter(torch.empty(n, hidden, d_model))
        self.up_proj = nn.Parameter(torch.empty(n, hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(n, d_model, hidden))
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(w, std=0.02)  # GPTOSS.reset_parameters re-initialises with the config's std
        if bias:
            self.gate_bias = nn.Parameter(torch.zeros(n, hidden))
            self.up_bias = nn.Parameter(torch.zeros(n, hidden))
            self.down_bias = nn.Parameter(torch.zeros(n, d_model))
        else:
            self.gate_bias = self.up_bias = self.down_bias = None
        self._gate_up: tuple[torch.Tensor, torch.Tensor | None, bool] | None = None  # see pack_for_decode
        self._prompt_packs: list[tuple[PromptPack, PromptPack]] | None = None  # see pack_for_prompts

    @torch.no_grad()
    def pack_for_decode(self, input_major: bool | None = None) -> None:
        """Re-store the weights for one-token GEMVs: gate_proj and up_proj become views of one
        buffer (so an expert's gate and up are one GEMV), input-major (E, C, 2I) or out-major
        (E, 2I, C); None picks the dtype's layout (`decode_pack.input_major_for`: input-major for
        fp32, out-major for 16-bit weights). down_proj is stored in the same layout, and the gate/up
        biases are views of one (E, 2I) buffer. Same shapes and values; the parameters stay separate
        for training and checkpoints. Idempotent; asking for the other layout re-packs.
        """
        if input_major is None:
            input_major = input_major_for(self.gate_proj.dtype)
        packed = self._packed_gate_up()
        if packed is None or packed[2] != input_major:
            bias = None if self.gate_bias is None else pack_pair(self.gate_bias, self.up_bias, transposed=False)
            if input_major:
                buf = pack_pair(self.gate_proj, self.up_proj, transposed=True)  # (E, C, 2I)
            else:
                buf = pack_rows(self.gate_proj, self.up_proj)  # (E, 2I, C)
            self._gate_up = (buf, bias, input_major)
        store_for_decode(self.down_proj, input_major)

    def is_packed(self) -> bool:
        """Whether gate_proj and up_proj still live in the buffer `pack_for_decode` made."""
        return self._packed_gate_up() is not None

    def prompt_weights(self) -> list[torch.Tensor]:
        """The weights whose prompt products `pack_for_prompts` can pack: each expert's packed gate|up
        (after `pack_for_decode`) and down-projection."""
        packed = self._packed_gate_up()
        return [] if packed is None else [packed[0], self.down_proj]

    @torch.no_grad()
    def pack_for_prompts(self, on: bool) -> None:
        """Give each expert's gate|up and down-projection a `PromptPack` (on) or drop them, for
        `grouped`; `GPTOSS.pack_for_prompts`."""
        packed = self._packed_gate_up()
        self._prompt_packs = None
        if on and packed is not None and packs(packed[0]) and packs(self.down_proj):
            buf, _, input_major = packed
            self._prompt_packs = [
                (PromptPack(buf[e].t() if input_major else buf[e]), PromptPack(self.down_proj[e]))
                for e in range(buf.shape[0])
            ]

    def _packed_gate_up(self) -> tuple[torch.Tensor, torch.Tensor | None, bool] | None:
        """The packed (weight, bias, input_major) while the parameters still live in it (e.g. not after
        .to(dtype)); not re-checked when traced, as `Attention._packed_qkv`."""
        if torch.compiler.is_compiling():
            return self._gate_up
        if self._gate_up is not None:
            buf, bias, input_major = self._gate_up
            split = self.gate_proj.shape[1]
            offset = split if input_major else split * self.gate_proj.shape[2]
            if still_packed(buf, self.gate_proj, self.up_proj, offset) and (
                bias is None or still_packed(bias, self.gate_bias, self.up_bias, split)
            ):
                return self._gate_up
            self._gate_up = None
        return None

    def _activate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return activate(gate, up, self.activation, self.limit)

    def mix_few_tokens(self, x: torch.Tensor, top_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """Σ_j weights[n, j] · expert(top_idx[n, j], x[n]) for a few tokens x (N, C), by running every
        expert on every token in two batched matmuls on the packed weights (E·N rows: cheap for small
        N, and a handful of ops instead of three per expert plus the grouping). Only the selected
        experts' outputs are summed. None when the weights are not packed (or gradients are on)."""
        packed = None if torch.is_grad_enabled() else self._packed_gate_up()
        if packed is None:
            return None
        buf, bias, input_major = packed  # (E, C, 2I) or (E, 2I, C); (E, 2I)
        gate_up = torch.matmul(x, buf if input_major else buf.transpose(1, 2))  # (E, N, 2I)
        if bias is not None:
            gate_up = gate_up + bias[:, None]
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.matmul(self._activate(gate, up), self.down_proj.transpose(1, 2))  # (E, N, C)
        if self.down_bias is not None:
            out = out + self.down_bias[:, None]
        tokens = torch.arange(x.shape[0], device=x.device)[:, None]  # (N, 1)
        return (out[top_idx, tokens] * weights[..., None]).sum(dim=1)  # (N, A, C) -> (N, C)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Apply expert e to x (N, C) -> (N, C), down-projection bias included."""
        gate = linear(x, self.gate_proj[e], None if self.gate_bias is None else self.gate_bias[e])  # (N, I)
        up = linear(x, self.up_proj[e], None if self.up_bias is None else self.up_bias[e])  # (N, I)
        act = self._activate(gate, up)
        return linear(act, self.down_proj[e], None if self.down_bias is None else self.down_bias[e])

    def grouped(self, xs: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        """Rows xs (P, C) sorted by expert, counts[e] of them for expert e, each group through its
        expert -> the outputs (counts[e], C) in xs's dtype of each expert with rows, in expert order
        (`combine` reads them where they are; one empty piece when no expert has rows). For inference
        on packed weights, one GEMM per expert for gate and up together and the activation in one pass
        (`kernels.moe.activate`), where `expert` makes two GEMMs and six elementwise passes."""
        packed = None if torch.is_grad_enabled() else self._packed_gate_up()
        if packed is None:
            return _grouped_by_expert(self, xs, counts)
        buf, bias, input_major = packed  # (E, C, 2I) or (E, 2I, C); (E, 2I)
        packs = self._prompt_packs
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                rows = xs[start : start + n]
                gu_pack, down_pack = (None, None) if packs is None else packs[e]
                gu_w = buf[e].t() if input_major else buf[e]
                gate_up = linear(rows, gu_w, None if bias is None else bias[e], gu_pack)
                act = activate_halves(gate_up, self.activation, self.limit)  # (n, I)
                db = None if self.down_bias is None else self.down_bias[e]
                outs.append(linear(act, self.down_proj[e], db, down_pack))
                start += n
        return outs or [xs.new_empty(0, xs.shape[1])]

    def _gate_up_stacks(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """gate and up as out-major stacks (E, ·, C) whose outputs, side by side, are (gate, up): the
        packed buffer (a transposed view when input-major), else the two parameters. The compiled step
        needs the packed out-major buffer."""
        packed = None if torch.is_grad_enabled() else self._packed_gate_up()
        if torch.compiler.is_compiling() and (packed is None or packed[2]):
            raise ValueError(
                "decode_step needs out-major expert weights; build the model with "
                "prepare_for_inference(compile_decode=True)"
            )
        if packed is None:
            return [(self.gate_proj, self.gate_bias), (self.up_proj, self.up_bias)]
        buf, bias, input_major = packed  # (E, C, 2I) or (E, 2I, C); (E, 2I)
        return [(buf.transpose(1, 2) if input_major else buf, bias)]

    def decode_step(self, h: torch.Tensor, top_idx: torch.Tensor | None) -> torch.Tensor:
        """The one-token expert math, eager and compiled alike (`MoE.decode_step` runs it for a single
        token either way): experts top_idx (B, A) of each row h (B, C) (model dtype; None: every expert,
        the shared ones) -> their outputs (B, A, C), fp32 holding values of the dtype. The products are
        `select_linear`'s, which alone differs between the compiled step and the eager path."""
        dt = h.dtype
        gate_up = rounded(select_linear(h[:, None], self._gate_up_stacks(), top_idx), dt)  # (B, A, 2I)
        act = self._activate(*gate_up.chunk(2, dim=-1)).to(dt)  # (B, A, I)
        return rounded(select_linear(act, [(self.down_proj, self.down_bias)], top_idx), dt)  # (B, A, C)

    def weighted_sum(self, h: torch.Tensor, top_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_a weights[b, a] · expert(top_idx[b, a], h[b]) -> (B, C) fp32 (`decode_step`'s outputs, each
        rounded to the dtype, summed in fp32): by the grouped kernel, which reads each expert once for
        all its rows, where it serves (two rows or more, `kernels.moe.serves`), else the reduction."""
        packed = None if torch.is_grad_enabled() else self._packed_gate_up()
        gate_up = None if packed is None or packed[2] else packed[0]
        if moe_kernel.serves(h, gate_up, self.down_proj):
            return moe_kernel.experts(
                h, top_idx, weights, gate_up, packed[1], self.down_proj, self.down_bias,
                self.activation == "swiglu", float(self.limit),
            )  # fmt: skip
        return (self.decode_step(h, top_idx) * weights[..., None]).sum(dim=1)


MATVEC_ROWS = 16  # MXFP4Experts: up to this many rows per expert read the codes; more dequantise a copy


class MXFP4Experts(nn.Module):
    """E expert MLPs whose weights stay packed in MXFP4, as gpt-oss checkpoints store them
    (docs/mxfp4.md): 4.25 bits per weight where `Experts` holds 16 or 32.

    The tensors are the checkpoint's own, in its layout, so loading copies nothing: gate_up_blocks
    (E, 2I, C/32, 16) and gate_up_scales (E, 2I, C/32) uint8 with gate and up rows INTERLEAVED (row 2j
    is gate j, row 2j+1 up j); down_blocks (E, C, I/32, 16) and down_scales (E, C, I/32); biases
    gate_up_bias (E, 2I, interleaved the same way) and down_bias (E, C) in the model's dtype.

    Same methods as `Experts`, so `MoE` routes the same way: a few rows per expert go through
    `kernels.mxfp4.matvec`, which reads the codes directly (the decode case; where built, the gate|up
    product and its activation are one op, `kernels.mxfp4.gate_up_act`); more rows dequantise
    one expert at a time into a scratch copy for one matmul (prefill). Products are fp32 and every
    value the eager `Experts` holds in the model's dtype is rounded to it, so this equals
    `dequantized()` to accumulation order. Inference only.

    `activations` is "exact" (the default, above) or "int8" (opt-in, `GPTOSS.set_mxfp4_activations`):
    the rows that read the codes are rounded to int8 per block of 32 first (`kernels.mxfp4.matvec_int8`,
    as llama.cpp does), which changes results by that rounding; the prefill path is exact either way.
    """

    ACTIVATIONS = ("exact", "int8")

    def __init__(self, n: int, d_model: int, hidden: int, activation: str, limit: float, bias: bool):
        super().__init__()
        if d_model % BLOCK or hidden % BLOCK:
            raise ValueError(
                f"MXFP4 experts need d_model and expert_hidden divisible by {BLOCK}; got {d_model}, {hidden}"
            )
        self.activation, self.limit, self.hidden = activation, limit, hidden
        self.activations = "exact"
        codes = dict(dtype=torch.uint8)
        self.register_buffer("gate_up_blocks", torch.zeros(n, 2 * hidden, d_model // BLOCK, BLOCK // 2, **codes))
        self.register_buffer("gate_up_scales", torch.zeros(n, 2 * hidden, d_model // BLOCK, **codes))
        self.register_buffer("down_blocks", torch.zeros(n, d_model, hidden // BLOCK, BLOCK // 2, **codes))
        self.register_buffer("down_scales", torch.zeros(n, d_model, hidden // BLOCK, **codes))
        self.gate_up_bias = nn.Parameter(torch.zeros(n, 2 * hidden), requires_grad=False) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(n, d_model), requires_grad=False) if bias else None

    @classmethod
    @torch.no_grad()
    def quantize(cls, experts: Experts) -> MXFP4Experts:
        """`experts` rounded to MXFP4 (`kernels.mxfp4.quantize_mxfp4`); biases kept, in their dtype."""
        E, hidden, d_model = experts.gate_proj.shape
        out = cls(E, d_model, hidden, experts.activation, experts.limit, experts.gate_bias is not None)
        out.to(device=experts.gate_proj.device, dtype=experts.gate_proj.dtype)
        if experts.gate_proj.is_meta:
            return out
        gate_up = torch.stack((experts.gate_proj, experts.up_proj), dim=2).reshape(E, 2 * hidden, d_model)
        gate_up = gate_up.transpose(1, 2)  # (E, C, 2I), the (in, out) layout quantize_mxfp4 takes
        out.gate_up_blocks, out.gate_up_scales = quantize_mxfp4(gate_up)
        out.down_blocks, out.down_scales = quantize_mxfp4(experts.down_proj.transpose(1, 2))  # from (E, I, C)
        if out.gate_up_bias is not None:
            out.gate_up_bias.copy_(torch.stack((experts.gate_bias, experts.up_bias), dim=2).reshape(E, 2 * hidden))
            out.down_bias.copy_(experts.down_bias)
        return out

    @torch.no_grad()
    def dequantized(self) -> Experts:
        """The same weights as a plain `Experts`, in the biases' dtype: the reference this is tested against."""
        E, R, G, _ = self.gate_up_blocks.shape
        dt = self.down_bias.dtype if self.down_bias is not None else torch.float32
        dense = Experts(E, G * BLOCK, self.hidden, self.activation, self.limit, self.gate_up_bias is not None)
        gate_up = reference_rows(self.gate_up_blocks, self.gate_up_scales)  # (E, 2I, C)
        dense.gate_proj.data, dense.up_proj.data = gate_up[:, 0::2].contiguous(), gate_up[:, 1::2].contiguous()
        dense.down_proj.data = reference_rows(self.down_blocks, self.down_scales)  # (E, C, I)
        if self.gate_up_bias is not None:
            dense.gate_bias.data = self.gate_up_bias[:, 0::2].contiguous()
            dense.up_bias.data = self.gate_up_bias[:, 1::2].contiguous()
            dense.down_bias.data = self.down_bias.clone()
        return dense.to(dt).eval()

    def pack_for_decode(self, input_major: bool | None = None) -> None:
        """Nothing to do: the codes are read as stored by every path."""

    def is_packed(self) -> bool:
        return True

    def _kernel(self):
        """The matvec op of `activations`: exact products, or int8-rounded inputs."""
        return matvec_int8 if self.activations == "int8" else matvec

    def _gate_up(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Row m of x (M, C) through expert experts[m]'s gate/up matrix, bias added: (M, 2I) fp32, interleaved."""
        out = self._kernel()(x, self.gate_up_blocks, self.gate_up_scales, experts, None)
        return out if self.gate_up_bias is None else out + self.gate_up_bias[experts].float()

    def _down(self, act: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Row m of act (M, I) through expert experts[m]'s down matrix, bias added: (M, C) fp32."""
        out = self._kernel()(act, self.down_blocks, self.down_scales, experts, None)
        return out if self.down_bias is None else out + self.down_bias[experts].float()

    def _activated(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Row m of x (M, C) through expert experts[m]'s gate|up matrix, bias added, rounded to x's dtype,
        activated -> (M, I) in x's dtype: `kernels.mxfp4.gate_up_act` in one pass over the codes where it
        is built (fp32 and bf16 rows), else the products and then PyTorch's ops (which the compiled step
        fuses); the same values up to e^x's last bits."""
        if x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu" and gate_up_act_available():
            return gate_up_act(
                x, self.gate_up_blocks, self.gate_up_scales, experts, self.gate_up_bias,
                self.activation == "swiglu", float(self.limit), self.activations == "int8",
            )  # fmt: skip
        gate_up = self._gate_up(x, experts).to(x.dtype)
        return activate(gate_up[:, 0::2], gate_up[:, 1::2], self.activation, self.limit)

    def _run(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Row m of x (M, C) through expert experts[m] -> (M, C) in x's dtype, on the codes."""
        return self._down(self._activated(x, experts), experts).to(x.dtype)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Apply expert e to x (N, C) -> (N, C), down-projection bias included."""
        if x.shape[0] <= MATVEC_ROWS:
            return self._run(x, torch.full((x.shape[0],), e, dtype=torch.int64, device=x.device))
        wdt = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        gate_up_w = dequantize_rows(self.gate_up_blocks[e], self.gate_up_scales[e], wdt).to(x.dtype)  # (2I, C)
        bias = None if self.gate_up_bias is None else self.gate_up_bias[e]
        gate_up = linear(x, gate_up_w, bias)  # (N, 2I)
        del gate_up_w
        act = activate(gate_up[:, 0::2], gate_up[:, 1::2], self.activation, self.limit)
        down_w = dequantize_rows(self.down_blocks[e], self.down_scales[e], wdt).to(x.dtype)  # (C, I)
        return linear(act, down_w, None if self.down_bias is None else self.down_bias[e])

    def grouped(self, xs: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        """`Experts.grouped`: each group of rows through its expert (`expert`)."""
        return _grouped_by_expert(self, xs, counts)

    def weighted_sum(self, h: torch.Tensor, top_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_a weights[b, a] · expert(top_idx[b, a], h[b]) -> (B, C) fp32, from `decode_step`'s outputs (the
        MXFP4 kernel reads each row's blocks itself; there is no grouped path for codes)."""
        return (self.decode_step(h, top_idx) * weights[..., None]).sum(dim=1)

    def mix_few_tokens(self, x: torch.Tensor, top_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_j weights[n, j] · expert(top_idx[n, j], x[n]) for a few tokens x (N, C): every (token,
        expert) pair in one pass over the codes."""
        N, A = top_idx.shape
        out = self._run(x.repeat_interleave(A, dim=0), top_idx.reshape(-1)).view(N, A, -1)
        return (out * weights[..., None]).sum(dim=1)

    def decode_step(self, h: torch.Tensor, top_idx: torch.Tensor | None) -> torch.Tensor:
        """`Experts.decode_step` on the codes: rows h (B, C), experts top_idx (B, A) -> (B, A, C), fp32
        holding values of h's dtype; eager and compiled alike (`matvec` is one op either way)."""
        if top_idx is None:
            raise ValueError("MXFP4 experts are routed experts; shared experts are stored unpacked")
        dt = h.dtype
        B, A = top_idx.shape
        experts = top_idx.reshape(-1)
        rows = h[:, None].expand(B, A, h.shape[-1]).reshape(B * A, -1)
        act = self._activated(rows, experts)  # (B·A, I) in dt
        return rounded(self._down(act, experts), dt).view(B, A, -1)


def _grouped_by_expert(experts: Experts | MXFP4Experts, xs: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """Rows xs (P, C) sorted by expert, counts[e] of them for expert e, each group through
    `experts.expert` -> the outputs of the experts with rows, in expert order (one empty piece where
    none has rows)."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(experts.expert(e, xs[start : start + n]))
            start += n
    return outs or [xs.new_empty(0, xs.shape[1])]


FEW_TOKENS = 16  # up to this many tokens (inference), `Experts.mix_few_tokens` replaces the grouping


class MoE(nn.Module):
    """Router -> top-k -> softmax over the k logits -> weighted expert sum, plus shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = Linear(cfg.d_model, cfg.n_experts, bias=cfg.router_bias)
        self.experts = Experts(
            cfg.n_experts, cfg.d_model, cfg.expert_hidden, cfg.activation, cfg.swiglu_limit, cfg.expert_bias
        )
        self.shared = (
            Experts(
                cfg.n_shared_experts, cfg.d_model, cfg.expert_hidden, cfg.activation, cfg.swiglu_limit, cfg.expert_bias
            )
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor, need_aux: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, C) -> (y (B, T, C), aux loss scalar or None). Only selected experts run, grouped by expert."""
        B, T, C = x.shape
        E, A = self.n_experts, self.top_k
        flat = x.reshape(B * T, C)  # (N, C)
        if flat.shape[0] == 1 and not need_aux:  # one token: the compiled step's own function, run eagerly
            return self.decode_step(flat).to(x.dtype).view(B, T, C), None
        logits = self.router(flat)  # (N, E)
        top = moe_kernel.topk(logits, A)  # torch.topk's answer in one pass, where it serves
        top_logits, top_idx = top if top is not None else logits.topk(A, dim=-1)  # (N, A)
        weights = torch.softmax(top_logits.float(), dim=-1).to(x.dtype)  # (N, A)
        if flat.shape[0] <= FEW_TOKENS and not need_aux:
            # A few tokens (speculative verification, a short chunk): every expert on every token.
            y = self.experts.mix_few_tokens(flat, top_idx, weights)
            if y is not None:
                return self._add_shared(flat, y).view(B, T, C), None

        # Group the N·A (token, expert) assignments by expert: one matmul per expert that has tokens.
        sorted_x, counts, at = group(flat, top_idx, E)  # at: each (token, slot)'s place among the sorted
        pieces = self.experts.grouped(sorted_x, counts)  # each expert's (counts[e], C)
        if torch.is_grad_enabled():  # training: index_add_, which has a backward
            order = torch.empty_like(at.view(-1))
            order[at.view(-1)] = torch.arange(order.numel(), device=order.device)  # sorted place -> (token, slot)
            sorted_w = weights.reshape(-1).index_select(0, order)  # (N·A,)
            routed = torch.zeros_like(flat).index_add_(0, order // A, torch.cat(pieces) * sorted_w[:, None])
        else:  # each token's A outputs gathered and weighted in one pass, summed in fp32
            routed = combine(pieces, at, weights)
        y = self._add_shared(flat, routed)  # (N, C)
        if not need_aux:
            return y.view(B, T, C), None

        # Switch-style load balancing: E · Σ_e f_e · P_e (f: fraction of assignments, P: mean prob).
        frac = torch.as_tensor(counts, dtype=torch.float32) / top_idx.numel()  # (E,)
        mean_prob = torch.softmax(logits.float(), dim=-1).mean(dim=0)  # (E,)
        aux = E * (frac * mean_prob).sum()
        return y.view(B, T, C), aux

    def decode_step(self, h: torch.Tensor) -> torch.Tensor:
        """The one-token MoE, the same function in the compiled step and in an eager `forward` of one
        token: h (B, C) in the model's dtype -> (B, C) fp32 holding values of that dtype. Router
        (`decode_linear`), top-k, the selected experts (`Experts.decode_step`, outputs in the dtype),
        their weighted sum plus the shared experts' outputs in fp32, rounded once."""
        dt = h.dtype
        logits = decode_linear(h, self.router.weight, self.router.bias).to(dt)  # (B, E)
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)  # (B, A)
        weights = torch.softmax(top_logits.float(), dim=-1).to(dt).float()  # (B, A)
        y = self.experts.weighted_sum(h, top_idx, weights)  # (B, C)
        if self.shared is not None:
            y = y + self.shared.decode_step(h, None).sum(dim=1)  # every shared expert, weight 1
        return rounded(y, dt)

    def use_mxfp4(self) -> None:
        """Store the routed experts packed in MXFP4 (`MXFP4Experts.quantize`; on the meta device an
        empty module for a checkpoint to fill)."""
        if isinstance(self.experts, Experts):
            self.experts = MXFP4Experts.quantize(self.experts)

    def _add_shared(self, flat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + every shared expert applied to every token."""
        if self.shared is not None:
            for s in range(self.shared.gate_proj.shape[0]):
                y = y + self.shared.expert(s, flat)
        return y
