"""RMSNorm of a prompt's rows in one pass (`norm.c`, built on first use by `kernels.build`, for every
CPU with a C compiler): `model.transformer.RMSNorm`'s value, to float rounding (the sum of squares is
added in another order than PyTorch's). `F.rms_norm` stays for the compiled step, a few rows,
training, and machines without the build (`GPTOSS_LITE_NO_KERNELS=1`)."""

from __future__ import annotations

import ctypes

import torch

from gptoss_lite.kernels.build import load

MIN_ROWS = 16  # fewer rows (a decode step's) stay with F.rms_norm
MAX_WIDTH = 8192  # the kernel's row buffer
PART = 16  # widths are a multiple of this (the kernel's partial sums)


def _library() -> ctypes.CDLL | None:
    lib = load("norm")
    if lib is not None and not getattr(lib, "_typed", False):
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.gl_rms_norm.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, ctypes.c_float, ptr]
        lib.gl_rms_norm.restype = ctypes.c_int
        lib._typed = True
    return lib


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm` serves x (..., C) with weight (C,): eager, CPU, fp32 or bf16 x, at least
    MIN_ROWS rows, C a multiple of PART up to MAX_WIDTH, nothing recording gradients, the library built."""
    C = x.shape[-1] if x.dim() else 0
    return (  # the row count first: it turns away a decode step's call at once
        x.dim() >= 2
        and x.numel() >= MIN_ROWS * C
        and not torch.compiler.is_compiling()
        and C % PART == 0
        and 0 < C <= MAX_WIDTH
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.shape == (C,)
        and x.device.type == weight.device.type == "cpu"
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and _library() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) · weight in fp32 -> x's shape and dtype (the caller checks `applies`)."""
    C = x.shape[-1]
    xc, w = x.contiguous(), weight.float().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    code = _library().gl_rms_norm(
        xc.data_ptr(), int(x.dtype == torch.bfloat16), xc.numel() // C, C, w.data_ptr(), eps, out.data_ptr()
    )
    if code != 0:
        raise ValueError(f"rms_norm: rows of {C} values are wider than the kernel's {MAX_WIDTH}")
    return out
