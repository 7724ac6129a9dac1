"""Prefill attention over dense keys on CPUs with AVX-512 (`prefill.c`, built on first use by
`kernels.build`): sinks, the causal rule, a sliding window and grouped KV heads in one call, for head
sizes 32 and 64. Elsewhere `available()` is False and `blocks.attend` keeps PyTorch's fused kernel."""

from __future__ import annotations

import ctypes

import torch

from gptoss_lite.kernels.build import load

HEAD_DIMS = (32, 64)
MAX_GROUP = 8  # query heads per KV head (the task's rows: 32 queries of each)
MIN_QUERIES = 16  # fewer queries are decode-like steps, which other paths serve


def _library() -> ctypes.CDLL | None:
    lib = load("prefill")
    if lib is not None and not getattr(lib, "_typed", False):
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.gl_prefill_attention.argtypes = [ptr, ptr, ptr, ctypes.c_int, *[i64] * 17, ptr, ctypes.c_float, ptr]
        lib.gl_prefill_attention.restype = None
        lib.usable = bool(lib.gl_has_prefill_attention())
        lib._typed = True
    return lib


def available() -> bool:
    lib = _library()
    return lib is not None and lib.usable


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `attention` serves q (B, H, T, D) over k, v (B, K, S, D): CPU tensors of one dtype,
    fp32 or bf16, D of HEAD_DIMS, at most MAX_GROUP heads per KV head, at least MIN_QUERIES queries,
    nothing recording gradients, the kernel built here."""
    B, H, T, D = q.shape
    K = k.shape[1]
    return (
        T >= MIN_QUERIES
        and D in HEAD_DIMS
        and q.dtype in (torch.float32, torch.bfloat16)
        and q.dtype == k.dtype == v.dtype
        and q.device.type == k.device.type == v.device.type == "cpu"
        and H % K == 0
        and H // K <= MAX_GROUP
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
        and available()
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    q_offset: int,
    window: int | None,
) -> torch.Tensor:
    """`attention_reference`'s result, q (B, H, T, D) with query i at key index q_offset + i, over k, v
    (B, K, S, D) -> (B, H, T, D) in q's dtype (a view of a (B, T, H, D) tensor, so the layer's
    transpose back to tokens is free). The caller checks `applies`."""
    sink = None if sinks is None else sinks.detach().float().contiguous()
    out = prefill_attention(q, k, v, sink, q_offset, -1 if window is None else window)
    return (out if q.dtype == torch.float32 else out.to(q.dtype)).transpose(1, 2)


@torch.library.custom_op("gptoss_lite::prefill_attention", mutates_args=())
def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, q_offset: int, window: int
) -> torch.Tensor:
    """The kernel's call (an op, so profiles name it): fp32 (B, T, H, D); window -1 for none."""
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(B, T, H, D, dtype=torch.float32)
    _library().gl_prefill_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), int(q.dtype == torch.bfloat16),
        B, K, H // K, T, S, D,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        q_offset, window, None if sinks is None else sinks.data_ptr(), D**-0.5, out.data_ptr(),
    )  # fmt: skip
    return out


@prefill_attention.register_fake
def _(q, k, v, sinks, q_offset, window):
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D, dtype=torch.float32)
