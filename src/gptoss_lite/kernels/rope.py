"""The rotary embedding of a prompt's queries and keys in one pass (`rope.c`, built on first use by
`kernels.build`, for every CPU with a C compiler): `model.rope.apply_rotary_tables`'s value, bit for
bit. PyTorch's four ops stay for the compiled step, training, other layouts and machines without the
build (`GPTOSS_LITE_NO_KERNELS=1`)."""

from __future__ import annotations

import ctypes

import torch

from gptoss_lite.kernels.build import load

MAX_HEAD_DIM = 1024  # rope.c's MAX_D


def _library() -> ctypes.CDLL | None:
    lib = load("rope")
    if lib is not None and not getattr(lib, "_typed", False):
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.gl_rotary.argtypes = [ptr, ctypes.c_int, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr]
        lib.gl_rotary.restype = ctypes.c_int
        lib._typed = True
    return lib


def rotate(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor | None:
    """x (B, H, T, D) rotated by the full-width tables (T, D) of `rope.rotary_tables` -> (B, H, T, D),
    contiguous, in x's dtype; None where the kernel does not serve (traced or recording gradients, not
    fp32 or bf16 on the CPU, another shape of tables, D along a stride, the library not built)."""
    if (
        torch.compiler.is_compiling()
        or x.dim() != 4
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.device.type != "cpu"
        or cos_full.shape != x.shape[2:]
        or sin_signed.shape != x.shape[2:]
        or x.stride(-1) != 1
        or x.shape[-1] % 2
        or not 0 < x.shape[-1] <= MAX_HEAD_DIM
        or (torch.is_grad_enabled() and (x.requires_grad or cos_full.requires_grad or sin_signed.requires_grad))
    ):
        return None
    lib = _library()
    if lib is None:
        return None
    B, H, T, D = x.shape
    c, s = cos_full.float().contiguous(), sin_signed.float().contiguous()
    out = torch.empty(B, H, T, D, dtype=x.dtype)
    code = lib.gl_rotary(x.data_ptr(), int(x.dtype == torch.bfloat16), B, H, T, D, x.stride(0), x.stride(1),
                         x.stride(2), c.data_ptr(), s.data_ptr(), out.data_ptr())  # fmt: skip
    return out if code == 0 else None
