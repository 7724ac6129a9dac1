"""Memory layouts for one-token decode (GPTOSS.pack_for_decode): input-major or out-major, and packed weights.

Nothing here changes a tensor's shape or values, only where its elements live.

Which layout is fast depends on the dtype (`input_major_for`). On this project's CPUs, with one
(1, in) row against a weight that does not fit in cache (benchmarks/gemv_layout.py --dtype):
- fp32: `x @ W` over an input-major weight (stored (in, out)) streams about twice as fast as
  nn.Linear's row-major (out, in) one;
- bf16 / fp16: the opposite, by far: `F.linear(x, W)` over the row-major weight (a GEMV kernel that
  widens 16-bit values in registers) streams 6.5 GB/s where `x @ W` input-major falls back to a
  generic loop at 0.3 GB/s (AVX2 machine, one thread).
"""

from __future__ import annotations

import torch
from torch import nn


def input_major_for(dtype: torch.dtype) -> bool:
    """The decode layout rule: input-major weights for fp32 (and fp64), out-major (nn.Linear's own,
    (out, in) contiguous) for 16-bit floats; see the module docstring for the measurement."""
    return dtype not in (torch.bfloat16, torch.float16)


def store_out_major(p: nn.Parameter) -> None:
    """Make p contiguous (nn.Linear's row-major (out, in) layout), in place, unless it already is."""
    if not p.is_contiguous():
        p.data = p.data.contiguous()


def store_for_decode(p: nn.Parameter, input_major: bool | None = None) -> None:
    """Store a matmul weight input-major or out-major; None: the layout of its dtype (`input_major_for`)."""
    if input_major is None:
        input_major = input_major_for(p.dtype)
    (store_input_major if input_major else store_out_major)(p)


def pack_rows(first: nn.Parameter, second: nn.Parameter) -> torch.Tensor:
    """Make out-major weights `first` (..., N1, C) and `second` (..., N2, C) views of one contiguous
    (..., N1 + N2, C) buffer, their concatenation along the output dim, so that both projections of
    an input are one GEMV. Shapes and values are unchanged. Returns the buffer."""
    n = first.shape[-2]
    buf = torch.cat((first.data, second.data), dim=-2)
    first.data, second.data = buf[..., :n, :], buf[..., n:, :]
    return buf


def store_input_major(p: nn.Parameter) -> None:
    """Make the last two dims of p column-major in memory (p.transpose(-1, -2) contiguous), in place,
    unless they already are."""
    if p.dim() >= 2 and p.stride(-2) != 1:
        p.data = p.data.transpose(-1, -2).contiguous().transpose(-1, -2)


def joined_view(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The contiguous tensor whose last dim is a's then b's, if a and b already are those two blocks
    of one buffer (as a loader that packed them leaves them); else None. A view, never a copy."""
    if a.shape[:-1] != b.shape[:-1] or a.dtype != b.dtype or a.device != b.device:
        return None
    shape = (*a.shape[:-1], a.shape[-1] + b.shape[-1])
    strides = torch.empty(shape, device="meta").stride()
    if a.stride() != strides or b.stride() != strides:
        return None
    if (
        a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        or b.storage_offset() != a.storage_offset() + a.shape[-1]
    ):
        return None
    return a.as_strided(shape, strides, a.storage_offset())


def join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`joined_view(a, b)` when a and b already share one buffer, else a new concatenated buffer."""
    view = joined_view(a, b)
    return torch.cat((a, b), dim=-1) if view is None else view


def pack_pair(first: nn.Parameter, second: nn.Parameter, transposed: bool) -> torch.Tensor:
    """Make `first` and `second` views of one contiguous buffer, their concatenation along the last
    dim (of their transposes when `transposed`, i.e. input-major weights), re-using a buffer they
    already share. Shapes and values are unchanged. Returns the buffer."""
    flip = (lambda t: t.transpose(-1, -2)) if transposed else (lambda t: t)  # noqa: E731
    a, b = flip(first.data), flip(second.data)
    buf = join(a, b)
    split = a.shape[-1]
    first.data, second.data = flip(buf[..., :split]), flip(buf[..., split:])
    return buf


def still_packed(buf: torch.Tensor, first: torch.Tensor, second: torch.Tensor, split: int) -> bool:
    """Whether `first` and `second` still start at buf's element 0 and element `split`, as
    `pack_pair` / `pack_rows` left them (a later .to(dtype) or .data assignment moves them out)."""
    base = buf.data_ptr()
    return first.data_ptr() == base and second.data_ptr() == base + split * buf.element_size()
