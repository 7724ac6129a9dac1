"""Mixture of experts: router, top-k routed experts computed per expert group, shared experts
(docs/model.md#moe-and-the-training-forward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gptoss_lite.config import ModelConfig
from gptoss_lite.model.decode_pack import input_major_for, pack_pair, pack_rows, still_packed, store_for_decode
from gptoss_lite.model.matmul import Linear, decode_linear, linear, rounded


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
        if self.activation == "swiglu":
            return F.silu(gate) * up
        # gpt-oss clamped variant
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * 1.702))

    def mix_one_token(self, x: torch.Tensor, experts: list[int], weights: list[float]) -> torch.Tensor:
        """Σ weights[j] · expert(experts[j], x) for one token x (1, C), on the packed weights when the
        model was packed for decode and gradients are off."""
        packed = None if torch.is_grad_enabled() else self._packed_gate_up()
        down_w, down_b = self.down_proj, self.down_bias
        y = None
        for e, w in zip(experts, weights):
            if packed is None:
                out = self.expert(e, x)
            else:
                buf, bias, input_major = packed
                if input_major:
                    gate_up = torch.mm(x, buf[e]) if bias is None else torch.addmm(bias[e], x, buf[e])  # (1, 2I)
                else:
                    gate_up = linear(x, buf[e], None if bias is None else bias[e])
                gate, up = gate_up.chunk(2, dim=-1)
                out = linear(self._activate(gate, up), down_w[e], None if down_b is None else down_b[e])
            # NOTE: multiplying by the weight as a Python float is exact: it is the fp32/bf16 value
            # itself, and the product is computed in fp32 as with a tensor operand.
            out = out * w
            y = out if y is None else y + out
        return y

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
        return linear(
            self._activate(gate, up), self.down_proj[e], None if self.down_bias is None else self.down_bias[e]
        )

    def decode_step(self, h: torch.Tensor, top_idx: torch.Tensor | None, weights: torch.Tensor | None) -> torch.Tensor:
        """The one-token path: experts top_idx (B, A) of each row h (B, C) (model dtype; None: every
        expert, the shared ones) as `gemv` reductions over the gathered rows of the out-major packed
        weights, nothing copied -> their outputs (B, A, C) rounded to the dtype, each times its weight
        (B, A) when given, rounded again."""
        dt = h.dtype
        packed = self._packed_gate_up()
        if packed is None or packed[2]:
            raise ValueError(
                "decode_step needs out-major expert weights; build the model with "
                "prepare_for_inference(compile_decode=True)"
            )
        buf, bias, down, down_b = packed[0], packed[1], self.down_proj, self.down_bias  # (E, 2I, C), (E, 2I), ...

        def pick(w: torch.Tensor) -> torch.Tensor:  # (B, A, ...) rows of the selected experts, or (1, E, ...)
            return w[None] if top_idx is None else w[top_idx]

        gate_up = (pick(buf).float() * h[:, None, None, :].float()).sum(-1)  # (B, A, 2I)
        if bias is not None:
            gate_up = gate_up + pick(bias).float()
        act = self._activate(*rounded(gate_up, dt).chunk(2, dim=-1)).to(dt)  # (B, A, I)
        out = (pick(down).float() * act[:, :, None, :].float()).sum(-1)  # (B, A, C)
        if down_b is not None:
            out = out + pick(down_b).float()
        out = rounded(out, dt)
        return out if weights is None else rounded(out * weights[..., None], dt)


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
        logits = self.router(flat)  # (N, E)
        top_logits, top_idx = logits.topk(A, dim=-1)  # (N, A)
        weights = torch.softmax(top_logits.float(), dim=-1).to(x.dtype)  # (N, A)
        if flat.shape[0] == 1 and not need_aux:
            # Single-token decode: each selected expert is its own group; skip the sort/scatter.
            y = self.experts.mix_one_token(flat, top_idx.view(-1).tolist(), weights.view(-1).tolist())
            return self._add_shared(flat, y).view(B, T, C), None
        if flat.shape[0] <= FEW_TOKENS and not need_aux:
            # A few tokens (speculative verification, a short chunk): every expert on every token.
            y = self.experts.mix_few_tokens(flat, top_idx, weights)
            if y is not None:
                return self._add_shared(flat, y).view(B, T, C), None

        # Group the N·A (token, expert) assignments by expert: one matmul per expert that has tokens.
        assign_expert = top_idx.reshape(-1)  # (N·A,)
        order = torch.argsort(assign_expert, stable=True)
        token_of = order // A  # token index of each sorted assignment
        counts = torch.bincount(assign_expert, minlength=E)  # (E,)
        sorted_x = flat.index_select(0, token_of)  # (N·A, C)
        sorted_w = weights.reshape(-1).index_select(0, order)  # (N·A,)
        outs = []
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                outs.append(self.experts.expert(e, sorted_x[start : start + n]))
                start += n
        expert_out = torch.cat(outs, dim=0) * sorted_w[:, None]  # (N·A, C)
        y = self._add_shared(flat, torch.zeros_like(flat).index_add_(0, token_of, expert_out))  # (N, C)
        if not need_aux:
            return y.view(B, T, C), None

        # Switch-style load balancing: E · Σ_e f_e · P_e (f: fraction of assignments, P: mean prob).
        frac = counts.float() / assign_expert.numel()  # (E,)
        mean_prob = torch.softmax(logits.float(), dim=-1).mean(dim=0)  # (E,)
        aux = E * (frac * mean_prob).sum()
        return y.view(B, T, C), aux

    def decode_step(self, h: torch.Tensor) -> torch.Tensor:
        """The one-token path of `forward`: h (B, C) in the model's dtype -> (B, C) in it. Router as a
        `gemv`, top-k, the selected experts gathered inside their reductions (`Experts.decode_step`),
        summed in order and rounded each time as `Experts.mix_one_token`, then the shared experts."""
        dt = h.dtype
        logits = decode_linear(h, self.router.weight, self.router.bias).to(dt)  # (B, E)
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)  # (B, A)
        weights = torch.softmax(top_logits.float(), dim=-1).to(dt).float()  # (B, A)
        out = self.experts.decode_step(h, top_idx, weights)  # (B, A, C)
        y = out[:, 0]
        for j in range(1, self.top_k):
            y = rounded(y + out[:, j], dt)
        if self.shared is not None:
            shared = self.shared.decode_step(h, None, None)  # (B, n, C): every shared expert
            for s in range(shared.shape[1]):
                y = rounded(y + shared[:, s], dt)
        return y

    def _add_shared(self, flat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + every shared expert applied to every token."""
        if self.shared is not None:
            for s in range(self.shared.gate_proj.shape[0]):
                y = y + self.shared.expert(s, flat)
        return y
