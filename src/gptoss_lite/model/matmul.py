"""The model's one linear map, `linear(x, w, b)`: F.linear, except where 16-bit matmuls are slow.

On a CPU without native 16-bit matrix instructions (no AVX-512-BF16, no AMX), PyTorch's bf16/fp16
GEMMs run generic loops: a (2048, 256) x (256, 1024) bf16 product took 182 ms where the same product
in fp32, conversions included, took 20 ms (AMD EPYC, AVX2, one thread). A one-row GEMV is the other
way round: the bf16 kernel reads half the bytes and is as fast as fp32 or faster. So `linear` computes
16-bit inputs with at least `UPCAST_ROWS` rows in fp32 (inputs, weight and bias widened, the result
rounded once back to the input's dtype: the rounding a native bf16 GEMM with fp32 accumulation does
too) and leaves everything else to F.linear. Weights stay stored in 16 bits.

A prompt's products (many rows) can also go to oneDNN with the weight re-laid once in its own blocked
format (`PromptPack`, made by `GPTOSS.prepare_for_inference` within a memory budget): a copy of each
such weight, held beside the one decode steps read, which saves the GEMM re-laying it on every call.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from gptoss_lite.kernels import bf16 as bf16_kernel
from gptoss_lite.kernels import rows as rows_kernel
from gptoss_lite.kernels.build import cpu_flags

# Rows (tokens) from which a 16-bit product is computed in fp32 on such CPUs. Measured on the
# 12,288 x 256 output head (one thread): bf16 is faster up to 4 rows, even at 8, 2.3x slower at 16.
UPCAST_ROWS = 8
_NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")


@cache
def _cpu_flags() -> str | None:
    return cpu_flags()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (Linux /proc/cpuinfo flags, as `GPTOSS_LITE_CPU`
    leaves them); True where it cannot tell, so that nothing changes on machines this rule was not
    measured on."""
    flags = _cpu_flags()
    return flags is None or any(flag in flags for flag in _NATIVE_FLAGS)


def cpu_has_avx512() -> bool:
    """Whether this CPU has AVX-512 (Linux /proc/cpuinfo flags, as `GPTOSS_LITE_CPU` leaves them); False
    where it cannot tell."""
    flags = _cpu_flags()
    return flags is not None and "avx512f" in flags


def upcasts(x: torch.Tensor) -> bool:
    """Whether `linear` computes this input in fp32 (see the module docstring)."""
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and x.device.type == "cpu"
        and x.numel() >= UPCAST_ROWS * x.shape[-1]
        and not torch.is_autocast_enabled("cpu")
        and not cpu_has_native_bf16()
    )


# Rows from which a product with a `PromptPack` goes through it, and the row count it is laid out for
# (docs/model.md#a-prompts-products-weights-packed-for-onednn has the measurements: on the Zen 5 the
# packed product of 256 inputs is level with F.linear at 4-16 rows and up to twice as fast above; the
# experts of a short prompt see a few dozen rows each).
PACKED_ROWS = 16
PACK_ROWS_HINT = 512
# `GPTOSS.prepare_for_inference` packs a model's prompt weights when the copies take at most this: the
# small and mid-sized models whose prompts are bound by arithmetic, not gpt-oss-20b (1.3 GB of bf16
# attention weights) or the 502M preset in fp32, where the memory is worth more.
PROMPT_PACK_BYTES = 512 << 20


def packs_dtype(dtype: torch.dtype) -> bool:
    """Whether weights of this dtype get a `PromptPack` here: on CPUs with AVX-512 (where it was
    measured; an AVX2-only CPU keeps MKL's sgemm) and PyTorch's oneDNN, fp32, and bf16 with native bf16
    instructions (elsewhere `linear` computes bf16 in fp32, see above)."""
    if not (torch.backends.mkldnn.is_available() and cpu_has_avx512()):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())


def packs(w: torch.Tensor) -> bool:
    """Whether w can have a `PromptPack`: a CPU weight of a dtype `packs_dtype` takes, made outside
    inference mode (an inference tensor keeps no version counter, so a pack could not tell that it
    changed)."""
    return w.device.type == "cpu" and not w.is_inference() and packs_dtype(w.dtype)


class PromptPack:
    """A weight w (out, in) re-laid once for oneDNN's GEMM, for the products of many rows (prompts,
    prefill chunks). It serves only the tensor it copies, unchanged: the same storage, shape and
    strides and no in-place write since (the version counter PyTorch keeps per storage); anything else
    (a .to(dtype), a load_state_dict, training) and `linear` takes its ordinary path. Inference only."""

    def __init__(self, w: torch.Tensor) -> None:
        self.key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype)
        self.version = w._version
        self.packed: torch.Tensor | None = None  # made by the first product it serves

    def serves(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        return (
            x.device.type == "cpu"
            and x.dtype == w.dtype
            and x.dim() == 2
            and x.shape[0] >= PACKED_ROWS
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and not w.is_inference()
            and w._version == self.version
            and (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype) == self.key
        )

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor:
        """x · wᵀ (+ b) for an x and w that `serves` accepted; the first call lays w out (so a model that
        only decodes never holds the copies)."""
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_ROWS_HINT)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, b, "none", [], "")

    def __deepcopy__(self, memo: dict) -> PromptPack:
        """A copy of a model has weights of its own, which this pack does not copy: its copy serves
        nothing (oneDNN's packed tensor cannot be copied either)."""
        dead = PromptPack.__new__(PromptPack)
        dead.key, dead.version, dead.packed = None, -1, None
        return dead


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, pack: PromptPack | None = None
) -> torch.Tensor:
    """F.linear(x, w, b), computed in fp32 for 16-bit inputs of many rows on CPUs without native bf16,
    and by `kernels.bf16.gemv` for a few bf16 rows where it is built (AVX2 + FMA, or AVX-512 BF16: the
    same fp32 sums, read at the memory's rate where oneDNN's GEMV reads at about 60% of it). With a `pack` of w, an x
    of many rows (across its leading dims) goes through it (the same product, summed in another order)."""
    if pack is not None:
        flat = x.reshape(-1, x.shape[-1])
        if pack.serves(flat, w):
            return pack(flat, b, w).view(*x.shape[:-1], w.shape[0])
    if upcasts(x):
        return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    if bf16_kernel.applies(x, w):
        return bf16_kernel.gemv(x, w, b)
    return F.linear(x, w, b)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) whose product is `linear`."""

    prompt_pack: PromptPack | None = None  # see GPTOSS.pack_for_prompts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.prompt_pack)


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (B, in) · w (out, in)ᵀ (+ b) in fp32, written as one reduction: the one-token path of the
    compiled decode step. Inductor turns it into one vectorised loop that reads an out-major weight
    once in its own dtype (a bf16 weight moves half the bytes of fp32) and fuses the bias, and, for
    experts, the gather of the selected rows. Eager, it is slow; use `linear`."""
    y = (x[:, None, :].float() * w.float()).sum(-1)
    return y if b is None else y + b.float()


# One bf16 row by a weight of at most this many bytes is the fused reduction in the compiled step, not
# the bf16 GEMV op: there the op's dispatch costs more than its faster read (Zen 4, compiled, one row:
# 384 x 256 took 46 µs fused against 64 µs through the op; 12,288 x 256 took 283 µs against 201 µs, and
# 20b-sized weights of 24-30 MB 10-20% longer fused). A condition on a shape splits no graph.
FUSED_ROW_BYTES = 1 << 20


def decode_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The one-token projection of the compiled step, x (B, in) · w (out, in)ᵀ (+ b) in fp32: one row
    is a `gemv` reduction (bandwidth-bound: the weight read once, in its own dtype); several rows (the
    engine's batched decode) are one fp32 matrix product, which reads the weight once for all rows where
    a reduction per row would read it B times. For fp32 rows that product is `kernels.rows.rows_mm`
    where it is built (MKL's sgemm runs this shape, a few rows by a wide weight, at a third of the
    cores' rate), else F.linear. Where the bf16 GEMV is built (AVX2 + FMA, or AVX-512 BF16), several bf16
    rows go to `kernels.bf16.gemv_fp32` instead: the same fp32 sums, the weight read at the memory's rate, once
    per four rows, and so does one bf16 row by a weight of more than FUSED_ROW_BYTES; one row by a
    smaller weight is the reduction in every dtype (see FUSED_ROW_BYTES)."""
    one_traced_row = x.shape[0] == 1 and torch.compiler.is_compiling()
    if bf16_kernel.traceable(x, w) and not (one_traced_row and w.numel() * w.element_size() <= FUSED_ROW_BYTES):
        return bf16_kernel.gemv_fp32(x, w, b)
    if x.shape[0] == 1:  # eagerly the reduction is slow (see `gemv`): `linear`, then the same widening
        return gemv(x, w, b) if one_traced_row else linear(x, w, b).float()
    if rows_kernel.traceable(x, w):
        return rows_kernel.rows_mm(x, w, b)
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def select_linear(
    x: torch.Tensor, mats: list[tuple[torch.Tensor, torch.Tensor | None]], idx: torch.Tensor | None
) -> torch.Tensor:
    """The experts' one-token projection: row x[b, a] (x (B, 1 or A, K)) through matrix idx[b, a] of
    every stack (w (E, N, K), b (E, N) or None) in `mats`, their outputs side by side -> (B, A, ΣN)
    fp32 sums; idx None: every matrix of the stack (A = E, the shared experts). The one place where
    the compiled step and the eager path differ in how, never in what: compiled, a `gemv` reduction
    over the gathered rows of each out-major stack, which inductor fuses so that nothing is copied;
    eager, one `linear` per (row, expert) on a view of its matrix (a gather would copy the weights),
    whose result for 16-bit rows is already rounded to their dtype, as every caller rounds it
    (`rounded` widens it)."""
    if torch.compiler.is_compiling():
        outs = []
        for w, b in mats:
            pick = w[None] if idx is None else w[idx]  # (B or 1, A, N, K)
            y = (pick.float() * x[:, :, None, :].float()).sum(-1)
            outs.append(y if b is None else y + (b[None] if idx is None else b[idx]).float())
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    B, E = x.shape[0], mats[0][0].shape[0]
    A = E if idx is None else idx.shape[1]
    experts = list(range(E)) * B if idx is None else idx.view(-1).tolist()
    rows = x.reshape(-1, x.shape[-1]).split(1)  # (1, K) views: one per (row, expert), or per row
    shared = x.shape[1] == 1
    parts = []
    for i, e in enumerate(experts):
        xa = rows[i // A if shared else i]
        for w, b in mats:
            parts.append(linear(xa, w[e]) if b is None else linear(xa, w[e], b[e]))
    return torch.cat(parts, dim=0).view(B, A, -1)


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype` and widened back to fp32 (nothing for fp32): where the eager path would
    hold a value in the model's dtype, the fp32 one-token path rounds it the same way."""
    return x.float() if x.dtype == dtype or dtype == torch.float32 else x.to(dtype).float()
