"""GPTOSS: embedding, pre-norm blocks (attention + MoE), final norm, tied or untied head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gptoss_lite.config import ModelConfig
from gptoss_lite.kernels import norm as norm_kernel
from gptoss_lite.kv.base import KVCache, RaggedBatch, StaticKV
from gptoss_lite.model.attention import Attention
from gptoss_lite.model.compiled_decode import CompiledDecoder
from gptoss_lite.model.decode_pack import store_for_decode
from gptoss_lite.model.matmul import PROMPT_PACK_BYTES, Linear, PromptPack, decode_linear, linear, packs, rounded
from gptoss_lite.model.moe import Experts, MoE, MXFP4Experts
from gptoss_lite.model.rope import RotaryEmbedding, rotary_tables


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; the weight is applied after normalising, then cast back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm computes x * rsqrt(mean(x²) + eps) * weight; we feed it fp32 (bit-identical to the
        # spelled-out formula in fp32, and one op instead of six on the decode path). A prompt's rows
        # take `kernels.norm`: the same arithmetic in one pass (PyTorch's CPU op makes six).
        if norm_kernel.applies(x, self.weight):
            return norm_kernel.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # no cast ops on the fp32 path
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then + moe(norm2(x))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer)
        self.sliding = cfg.is_sliding(layer)  # picks the rotary table (the window is the attention's)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe = MoE(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin, cache=None, start_pos=0, impl="fast", need_aux=True):
        h = self.attn(self.norm1(x), cos, sin, cache, start_pos, impl)
        x = x + (self.drop(h) if self.training else h)
        h, aux = self.moe(self.norm2(x), need_aux)
        return x + (self.drop(h) if self.training else h), aux

    def decode_step(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: StaticKV, dt: torch.dtype):
        """The one-token path: x (B, C) fp32 holding model-dtype values -> the same. Every value the
        eager path holds in the model's dtype is rounded to it here."""
        x = rounded(x + rounded(self.attn.decode_step(self.norm1(x).to(dt), cos, sin, kv), dt), dt)
        return rounded(x + self.moe.decode_step(self.norm2(x).to(dt)).float(), dt)


@dataclass
class ModelOutput:
    """logits (B, T, V) (or (B, 1, V) with last_only); loss: mean next-token CE or None; aux_loss: summed
    over layers (zero in cached inference, which does not compute it)."""

    logits: torch.Tensor
    loss: torch.Tensor | None
    aux_loss: torch.Tensor


class GPTOSS(nn.Module):
    """The GPT-OSS-Lite / gpt-oss model. One code path for every preset; knobs live in ModelConfig."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else Linear(config.d_model, config.vocab_size, bias=False)
        self.rope_sliding = RotaryEmbedding(config, pruned_pairs=0)
        self.rope_full = RotaryEmbedding(config, pruned_pairs=config.rope_pruned_pairs)
        self.gradient_checkpointing = False
        self.compiled_decoder: CompiledDecoder | None = None  # see prepare_for_inference(compile_decode=True)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Initialise weights N(0, initializer_range), biases and sinks 0, norms 1."""
        gen = None
        if seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(seed)
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif "bias" in name.rsplit(".", 1)[-1] or name.endswith("sinks"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    @torch.no_grad()
    def pack_for_decode(self, input_major: bool | None = None) -> GPTOSS:
        """Re-store the weights for one-token decode steps; same shapes, names and values. Returns self.

        A decode step multiplies one (1, in) row by each weight. In fp32, PyTorch's CPU GEMV streams
        an input-major weight (stride 1 along `out`) about twice as fast as nn.Linear's row-major one
        once weights no longer fit in cache (benchmarks/gemv_layout.py); prefill GEMMs are no slower.
        In bf16/fp16 it is the other way round, by 20x (`decode_pack.input_major_for`). So every
        matmul weight is stored in its dtype's layout, and weights that read the same input are packed
        side by side (q with kv, each expert's gate with up) so that each pair is one GEMV. Parameters
        become views of the packed buffers: training and checkpoints see the same tensors (the saved
        bytes are identical), and a later .to(dtype) just falls back to the unpacked path.
        `input_major` forces one layout for every dtype (the compiled decode step wants out-major).
        Idempotent; `prepare_for_inference` calls it.
        """
        for module in self.modules():
            if isinstance(module, (Attention, Experts, MXFP4Experts)):
                module.pack_for_decode(input_major)
            elif isinstance(module, nn.Linear):
                store_for_decode(module.weight, input_major)  # o_proj, router, lm_head (q/kv are packed above)
        store_for_decode(self.embed.weight, input_major)  # the output head when tied
        return self

    @torch.no_grad()
    def use_mxfp4_experts(self) -> GPTOSS:
        """Store every routed expert packed in MXFP4, as gpt-oss checkpoints do (`MXFP4Experts`):
        the dense weights are rounded to MXFP4 (on the meta device: empty, for a checkpoint to fill).
        Inference only: the codes are buffers, not trainable. Returns self."""
        for block in self.blocks:
            block.moe.use_mxfp4()
        return self

    def set_mxfp4_activations(self, mode: str) -> GPTOSS:
        """How the packed MXFP4 experts multiply the rows that read their codes (decode, a few tokens):
        "exact" (the default: every product exact, fp32 sums) or "int8" (opt-in: each block of 32
        inputs rounded to int8 first, as llama.cpp's Q8 activations are; integer products, faster where
        the expert kernel is bound by instructions, results that differ by that rounding). Set it before
        the decode step is compiled. Returns self."""
        if mode not in MXFP4Experts.ACTIVATIONS:
            raise ValueError(f"mxfp4 activations {mode!r}: must be one of {MXFP4Experts.ACTIVATIONS}")
        packed = [b.moe.experts for b in self.blocks if isinstance(b.moe.experts, MXFP4Experts)]
        if mode != "exact" and not packed:
            raise ValueError(
                f"mxfp4 activations {mode!r} apply to packed MXFP4 experts, and this model has none "
                "(a gpt-oss checkpoint loaded on a CPU with mxfp4='packed' or 'auto' has them)"
            )
        for experts in packed:
            experts.activations = mode
        return self

    @property
    def mxfp4_activations(self) -> str:
        """ "exact" or "int8": what `set_mxfp4_activations` chose ("exact" for a model without MXFP4 experts)."""
        modes = {b.moe.experts.activations for b in self.blocks if isinstance(b.moe.experts, MXFP4Experts)}
        return modes.pop() if len(modes) == 1 else "exact" if not modes else "mixed"

    @property
    def mxfp4_experts(self) -> bool:
        return any(isinstance(block.moe.experts, MXFP4Experts) for block in self.blocks)

    @torch.no_grad()
    def pack_for_prompts(self, max_bytes: int | None = PROMPT_PACK_BYTES) -> int:
        """Give the weights of a prompt's products (attention q|kv and o, the router, each expert's
        gate|up and down) a `matmul.PromptPack` each: a copy re-laid for oneDNN's GEMM, used by products
        of many rows (prompts, prefill chunks) while the weight is unchanged. Only where the copies take
        at most `max_bytes` in all (None: no limit; 0: drop every pack), since they add that much memory
        beside the weights decode steps read. Call after `pack_for_decode` (the packs copy its
        buffers); `prepare_for_inference` does. Each copy is made by the first product it serves, so a
        model that only decodes never holds them. Returns the bytes the packs take once made (0 if none)."""
        weights = []
        for module in self.modules():
            if isinstance(module, (Attention, Experts)):
                weights += module.prompt_weights()
            elif isinstance(module, MoE):
                weights.append(module.router.weight)
        weights = [w for w in weights if packs(w)]
        total = sum(w.nbytes for w in weights)  # each pack holds its weight's values once more
        on = bool(weights) and (max_bytes is None or total <= max_bytes)
        for module in self.modules():
            if isinstance(module, (Attention, Experts)):
                module.pack_for_prompts(on)
            elif isinstance(module, MoE):
                w = module.router.weight
                module.router.prompt_pack = PromptPack(w) if on and packs(w) else None
        return total if on else 0

    @torch.no_grad()
    def prepare_for_inference(
        self,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        compile_decode: bool = False,
        prompt_packs: int | None = PROMPT_PACK_BYTES,
    ) -> GPTOSS:
        """The one place a model is made ready to generate: weights moved to `device` / `dtype` (None
        keeps them), eval mode (no dropout), then `pack_for_decode`. `load_model` calls it;
        `generate()` checks `inference_ready` and never changes the model itself. Returns self.

        `compile_decode=True` packs every weight out-major and attaches a `CompiledDecoder`
        (`gptoss_lite.model.compiled_decode`) as `self.compiled_decoder`: `generate()` then runs its
        decode steps as one compiled graph (compiled on first use, cached on disk by inductor).

        `prompt_packs` is `pack_for_prompts`'s memory budget in bytes (None: no limit, 0: no packs).
        """
        self.to(device=device, dtype=dtype)
        self.eval()
        self.compiled_decoder = None
        if not compile_decode:
            self.pack_for_decode()
        else:
            self.pack_for_decode(input_major=False)
            self.compiled_decoder = CompiledDecoder(self)
        self.pack_for_prompts(prompt_packs)
        return self

    @property
    def inference_ready(self) -> bool:
        """Eval mode with decode-packed weights, as `prepare_for_inference` leaves the model; a later
        .train() or .to(dtype) undoes it."""
        return not self.training and all(
            m.is_packed() for m in self.modules() if isinstance(m, (Attention, Experts, MXFP4Experts))
        )

    def prefill(self, input_ids: torch.Tensor, cache: KVCache, chunk: int, attn_impl: str = "fast") -> torch.Tensor:
        """Run the part of input_ids (B, T) that `cache` does not hold yet (positions cache.num_tokens
        … T - 1) through the model in pieces of at most `chunk` tokens; the last position's logits
        (B, 1, V). The caller makes sure at least one token is left to run."""
        logits = None
        for start in range(cache.num_tokens, input_ids.shape[1], chunk):  # skip what the cache holds
            piece = input_ids[:, start : start + chunk]
            logits = self(piece, cache=cache, start_pos=start, last_only=True, attn_impl=attn_impl).logits
        assert logits is not None, f"prefill: the cache already holds all {input_ids.shape[1]} tokens"
        return logits

    def forward_batch(self, input_ids: torch.Tensor, batch: RaggedBatch) -> torch.Tensor:
        """One forward over a ragged batch (continuous batching, `gptoss_lite.kv.base.RaggedBatch`):
        input_ids (N,) are the new tokens of several sequences at `batch.positions`; returns the
        logits (M, V) of the rows `batch.logits_index`. Inference only. The batch is the layers' cache:
        it stores the keys and returns what each token may see."""
        x = self.embed(input_ids)[None]  # (1, N, C)
        rope_w = rotary_tables(*self.rope_sliding.at(batch.positions))  # (N, D) each
        rope_g = rotary_tables(*self.rope_full.at(batch.positions))
        for block in self.blocks:
            cos, sin = rope_w if block.sliding else rope_g
            x, _ = block(x, cos, sin, batch, 0, "fast", False)
        x = self.norm(x[0, batch.logits_index])  # (M, C)
        return linear(x, self.head_weight())  # (M, V)

    def decode_step(self, tokens: torch.Tensor, kv: StaticKV) -> torch.Tensor:
        """One decode step as fixed-shape tensor code: tokens (B,), one per row at `kv.positions`, their
        K/V written into `kv` -> logits (B, V) in the model's dtype. The one-token paths of the
        model's own modules (`Block.decode_step`, `Attention.decode_step`, `MoE.decode_step`), equal
        to `forward` to rounding; what `prepare_for_inference(compile_decode=True)` compiles."""
        dt = self.embed.weight.dtype
        x = F.embedding(tokens, self.embed.weight).float()  # (B, C)
        pos = kv.positions
        tables = {}
        for sliding, rope in ((True, self.rope_sliding), (False, self.rope_full)):
            cos, sin = rotary_tables(*rope.at(pos))  # (B or 1, D)
            tables[sliding] = (cos[:, None], sin[:, None])
        for block in self.blocks:
            x = block.decode_step(x, *tables[block.sliding], kv, dt)
        return decode_linear(self.norm(x).to(dt), self.head_weight()).to(dt)

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        start_pos: int = 0,
        last_only: bool = False,
        attn_impl: str = "fast",
        full_positions: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids (B, T) at absolute positions start_pos… -> ModelOutput.

        targets (B, T) are next-token labels aligned with input positions; -100 is ignored.
        With a cache, new K/V are appended and attention covers the cached past.
        full_positions (T,), training only (no cache): the positions the full layers rotate the tokens
        at instead of 0 … T-1 (PoSE-style skipping, docs/training.md#position-skipping); which keys a
        query sees is still decided by token order, and the sliding layers keep 0 … T-1.
        """
        B, T = input_ids.shape
        if attn_impl not in ("fast", "reference"):
            raise ValueError(f"attn_impl={attn_impl!r}: must be 'fast' or 'reference'")
        x = self.embed(input_ids)  # (B, T, C)
        rope_w = rotary_tables(*self.rope_sliding(start_pos, T))  # (cos|cos, -sin|sin) each (T, D)
        if full_positions is None:
            rope_g = rotary_tables(*self.rope_full(start_pos, T))
        else:
            if cache is not None or start_pos or tuple(full_positions.shape) != (T,):
                raise ValueError(
                    f"full_positions: expected shape ({T},) and no cache, got {tuple(full_positions.shape)}"
                )
            rope_g = rotary_tables(*self.rope_full.at(full_positions))
        aux_total = x.new_zeros((), dtype=torch.float32)
        # The load-balancing loss is a training quantity; cached inference skips computing it.
        need_aux = cache is None
        use_ckpt = self.gradient_checkpointing and self.training and cache is None and torch.is_grad_enabled()
        for block in self.blocks:
            cos, sin = rope_w if block.sliding else rope_g
            if use_ckpt:
                x, aux = checkpoint(block, x, cos, sin, None, start_pos, attn_impl, use_reentrant=False)
            else:
                x, aux = block(x, cos, sin, cache, start_pos, attn_impl, need_aux)
            if need_aux:
                aux_total = aux_total + aux
        if last_only:
            x = x[:, -1:]
        x = self.norm(x)
        logits = linear(x, self.head_weight())  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        return ModelOutput(logits=logits, loss=loss, aux_loss=aux_total)
