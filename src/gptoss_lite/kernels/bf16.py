"""bf16 matrix-vector products for one-token steps (`bf16.c`, built on first use by `kernels.build`): AVX-512
BF16 dot products where the CPU has them, else AVX2 + FMA (the weight widened by a shift and a mask).
Without AVX2 `available()` is False and callers keep F.linear."""

from __future__ import annotations

import ctypes

import torch

from gptoss_lite.kernels import cpp_ops
from gptoss_lite.kernels.build import load

MAX_ROWS = 4  # rows that share each weight load; more rows are a GEMM's job


def _library() -> ctypes.CDLL | None:
    lib = load("bf16")
    if lib is not None and not getattr(lib, "_typed", False):
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.gl_bf16_gemv.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr]
        lib.gl_bf16_gemv.restype = None
        lib.usable = bool(lib.gl_has_bf16_gemv())
        lib._typed = True
        if lib.usable:
            cpp_ops.bind("bf16_gemv", lib.gl_bf16_gemv)  # the op's calls stay out of Python from here on
    return lib


@torch.compiler.assume_constant_result  # a trace takes the answer as a constant (it builds or loads a file)
def available() -> bool:
    lib = _library()
    return lib is not None and lib.usable


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemv` computes x · wᵀ here, eagerly: what `traceable` asks, at most MAX_ROWS rows, no
    autograd, not inside a traced graph."""
    return (
        x.numel() <= MAX_ROWS * x.shape[-1]
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and not torch.compiler.is_compiling()
        and traceable(x, w)
    )


def traceable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemv_fp32` serves x · wᵀ: bf16 CPU tensors, an out-major contiguous weight, the kernel
    built here. Also asked inside the compiled decode step, where no autograd runs."""
    return (
        x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and w.dim() == 2
        and w.is_contiguous()
        and available()
    )


@torch.library.custom_op("gptoss_lite::bf16_gemv", mutates_args=())
def gemv_fp32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) · w (R, K)ᵀ (+ b) as fp32 sums, not rounded: (M, R) float32. A torch custom op, so the
    compiled decode step calls it as one node; rows beyond MAX_ROWS are done MAX_ROWS at a time."""
    # The C code trusts its sizes and reads bf16: a wrong one would read outside the tensors.
    ok = x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype == torch.bfloat16 and w.is_contiguous()
    if not ok or w.shape[1] != x.shape[1] or (b is not None and tuple(b.shape) != (w.shape[0],)):
        raise ValueError(
            f"bf16 gemv: x {list(x.shape)} {x.dtype}, w {list(w.shape)} {w.dtype}, "
            f"b {None if b is None else list(b.shape)} must be x (M, K), w (R, K) contiguous, b (R,), bf16"
        )
    M, K = x.shape
    R = w.shape[0]
    flat = x.contiguous()
    out = torch.empty(M, R, dtype=torch.float32)
    bias = None if b is None else b.float().contiguous()
    _library().gl_bf16_gemv(
        flat.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(), M, R, K, out.data_ptr()
    )
    return out


@gemv_fp32.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) · w (R, K)ᵀ + b in fp32, rounded once to bf16: F.linear's result, read at the memory's
    rate (the caller checks `applies`)."""
    lead, K = x.shape[:-1], x.shape[-1]
    return gemv_fp32(x.reshape(-1, K), w, b).to(torch.bfloat16).reshape(*lead, w.shape[0])
