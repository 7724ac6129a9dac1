"""bf16 matrix-vector products for one-token steps on CPUs with AVX-512 BF16 (`bf16.c`, built on first
use by `kernels.build`). Elsewhere `available()` is False and callers keep F.linear."""

from __future__ import annotations

import ctypes

import torch

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
    return lib


def available() -> bool:
    lib = _library()
    return lib is not None and lib.usable


def applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemv` computes x · wᵀ here: bf16 CPU tensors, at most MAX_ROWS rows, an out-major
    contiguous weight, no autograd, not inside a traced graph."""
    return (
        x.dtype == torch.bfloat16
        and w.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and w.dim() == 2
        and w.is_contiguous()
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and not torch.compiler.is_compiling()
        and available()
    )


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) · w (R, K)ᵀ + b in fp32, rounded once to bf16: F.linear's result, read at the memory's
    rate (the caller checks `applies`)."""
    lead, K = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, K).contiguous()
    R = w.shape[0]
    out = torch.empty(flat.shape[0], R, dtype=torch.float32)
    bias = None if b is None else b.float().contiguous()
    _library().gl_bf16_gemv(
        flat.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(), flat.shape[0], R, K, out.data_ptr()
    )
    return out.to(torch.bfloat16).reshape(*lead, R)
