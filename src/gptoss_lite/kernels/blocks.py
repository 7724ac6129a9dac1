"""Decode attention over paged K/V, read in place (`blocks.c`, built on first use by `kernels.build`):
what the engine's compiled decode step calls instead of gathering a copy of every group's blocks.

Block storage is one layer's (K, N, bs, D) tensor of the engine's paged store. Group r reads the
blocks table[r] (R, nb), so its slot j is block table[r, j // bs], slot j % bs (S = nb · bs slots).
`attention` is `masked_decode` (gptoss_lite.model.attention.decode) over that read, with the mask
given as distances and a window: the same products, sink, softmax and rounding points, fp32 sums in
another order. It is a torch custom op, so a compiled graph calls it as one node. Where the library
cannot be built (no compiler, `GPTOSS_LITE_NO_KERNELS=1`), `available()` is False and the layer
gathers the blocks and calls `masked_decode`, the oracle the tests hold this kernel to.
"""

from __future__ import annotations

import ctypes

import torch

from gptoss_lite.kernels import cpp_ops
from gptoss_lite.kernels.build import load

MAX_HEAD_DIM = 1024  # blocks.c's MAX_D


def _library() -> ctypes.CDLL | None:
    lib = load("blocks")
    if lib is not None and not getattr(lib, "_typed", False):
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.gl_block_attention.argtypes = [
            ptr, i64, i64, i64, i64, ptr, ptr, i32, i64, i64, ptr, i64, ptr, i64, i64, i64, ptr, i64,
            ctypes.c_float, i32, ptr,
        ]  # fmt: skip
        lib.gl_block_attention.restype = ctypes.c_int
        lib.gl_block_attention_quant.argtypes = [
            ptr, i64, i64, i64, i64, i32, ptr, ptr, ptr, ptr, ptr, ptr, i64, i32, i64, i64, ptr, i64, ptr, ptr,
            i32, i64, ptr, ptr, i64, i64, i64, ptr, i64, ctypes.c_float, i32, ptr,
        ]  # fmt: skip
        lib.gl_block_attention_quant.restype = ctypes.c_int
        lib._typed = True
        cpp_ops.bind("block_attention", lib.gl_block_attention)  # the op's calls stay out of Python from here on
    return lib


@torch.compiler.assume_constant_result  # a trace takes the answer as a constant (it builds or loads a file)
def available() -> bool:
    return _library() is not None


def applies(keys: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `attention` reads this block storage in place for a model of `dtype`: contiguous fp32
    or bf16 CPU tensors of one shape and a head size it takes, rounding (if any) to bf16, and the
    library built here. Also asked inside the compiled step."""
    return (
        dtype in (torch.float32, torch.bfloat16)
        and keys.device.type == "cpu"
        and keys.dtype in (torch.float32, torch.bfloat16)
        and values.dtype == keys.dtype
        and keys.dim() == 4
        and keys.shape == values.shape
        and keys.is_contiguous()
        and values.is_contiguous()
        and keys.shape[-1] <= MAX_HEAD_DIM
        and available()
    )


@torch.library.custom_op("gptoss_lite::block_attention", mutates_args=())
def attention(
    rows: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    distance: torch.Tensor,
    window: int,
    sinks: torch.Tensor,
    round_bf16: bool,
) -> torch.Tensor:
    """rows (R, K, M, D) fp32, the queries of R groups of T = distance.shape[1] rows × G = M / T heads
    per KV head; keys, values the block storage (K, N, bs, D); table (R, nb) int64; distance (R or 1,
    T, nb · bs) int64; window (-1: none); sinks (K, G) fp32 sink logits; round_bf16: round where eager
    bf16 matmuls round -> (R, K, M, D) fp32 (holding bf16 values when round_bf16)."""
    R, K, M, D = rows.shape
    T = distance.shape[1]
    if (
        keys.dim() != 4
        or keys.shape[0] != K
        or keys.shape[-1] != D
        or table.dim() != 2
        or table.shape[0] != R
        or distance.dim() != 3
        or distance.shape[0] not in (1, R)
        or distance.shape[2] != table.shape[1] * keys.shape[2]
        or M % T
        or tuple(sinks.shape) != (K, M // T)
    ):
        raise ValueError(
            f"block attention: rows {list(rows.shape)}, keys {list(keys.shape)}, table {list(table.shape)}, "
            f"distance {list(distance.shape)}, sinks {list(sinks.shape)}"
        )
    x, t, dist, sk = (a.contiguous() for a in (rows.float(), table, distance, sinks.float()))
    out = torch.empty(R, K, M, D, dtype=torch.float32)
    _, N, bs, _ = keys.shape
    code = _library().gl_block_attention(
        x.data_ptr(), R, K, M, D, keys.data_ptr(), values.data_ptr(), int(keys.dtype == torch.bfloat16), N, bs,
        t.data_ptr(), t.shape[1], dist.data_ptr(), dist.shape[0], T, window, sk.data_ptr(), M // T, D**-0.5,
        int(round_bf16), out.data_ptr(),
    )  # fmt: skip
    if code == -1:
        raise ValueError(f"block attention: a block id lies outside [0, {N}) or the head size exceeds {MAX_HEAD_DIM}")
    if code != 0:
        raise MemoryError("block attention: no memory for the scores")
    return out


@attention.register_fake
def _(rows, keys, values, table, distance, window, sinks, round_bf16):
    return rows.new_empty(rows.shape, dtype=torch.float32)


#: the block kernel's number for each quantised format it reads (`kv.quant.CODECS`)
QUANT_FORMATS = {"int8": 0, "int4": 1, "fp8": 2}


def applies_quantized(tails: torch.Tensor, fmt: str, dtype: torch.dtype) -> bool:
    """Whether `quantized_attention` reads quantised blocks of format `fmt` with tails like `tails` (K, NT,
    bs, D) for a model of `dtype`; also asked inside the compiled step."""
    return (
        fmt in QUANT_FORMATS
        and dtype in (torch.float32, torch.bfloat16)
        and tails.device.type == "cpu"
        and tails.dtype in (torch.float32, torch.bfloat16)
        and tails.dim() == 4
        and tails.is_contiguous()
        and tails.shape[-1] <= MAX_HEAD_DIM
        and available()
    )


@torch.library.custom_op("gptoss_lite::block_attention_quant", mutates_args=())
def quantized_attention(
    rows: torch.Tensor,
    codes: list[torch.Tensor],
    fmt: str,
    value_group: int,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    table: torch.Tensor,
    tails: torch.Tensor,
    distance: torch.Tensor,
    window: int,
    sinks: torch.Tensor,
    round_bf16: bool,
) -> torch.Tensor:
    """`attention` over quantised blocks read in place: codes = (key codes, key scales, key zeros, value
    codes, value scales, value zeros) of one layer of a `QuantizedPagedStore` ((K, N, bs, Dc) uint8,
    (K, N, 1, D), (K, N, 1, D), (K, N, bs, Dc), (K, N, bs, D / value_group) twice, float16) in format
    `fmt`; each group r reads its complete blocks table[r] (R, nb), then the full-precision tail
    tails[r] of tail_keys / tail_values (K, NT, bs, D): distance (R or 1, T, (nb + 1) · bs). A slot
    is dequantised as the store dequantises (to the tails' dtype) -> (R, K, M, D) fp32."""
    R, K, M, D = rows.shape
    T = distance.shape[1]
    kq, ks, kz, vq, vs, vz = codes
    _, N, bs, _ = kq.shape
    if (
        fmt not in QUANT_FORMATS
        or kq.shape[0] != K
        or tuple(ks.shape) != (K, N, 1, D)
        or vq.shape != kq.shape
        or tuple(vs.shape) != (K, N, bs, D // value_group)
        or tail_keys.dim() != 4
        or tail_keys.shape[0] != K
        or tail_keys.shape[2:] != (bs, D)
        or tail_values.shape != tail_keys.shape
        or table.dim() != 2
        or table.shape[0] != R
        or tuple(tails.shape) != (R,)
        or distance.dim() != 3
        or distance.shape[0] not in (1, R)
        or distance.shape[2] != (table.shape[1] + 1) * bs
        or M % T
        or tuple(sinks.shape) != (K, M // T)
    ):
        raise ValueError(
            f"quantised block attention: rows {list(rows.shape)}, codes {list(kq.shape)}, tails "
            f"{list(tail_keys.shape)}, table {list(table.shape)}, distance {list(distance.shape)}"
        )
    x, t, tl, dist, sk = (a.contiguous() for a in (rows.float(), table, tails, distance, sinks.float()))
    stored = [c.contiguous() for c in codes]
    out = torch.empty(R, K, M, D, dtype=torch.float32)
    code = _library().gl_block_attention_quant(
        x.data_ptr(), R, K, M, D, QUANT_FORMATS[fmt], *(c.data_ptr() for c in stored), value_group,
        int(tail_keys.dtype == torch.bfloat16), N, bs, t.data_ptr(), t.shape[1], tail_keys.data_ptr(),
        tail_values.data_ptr(), int(tail_keys.dtype == torch.bfloat16), tail_keys.shape[1], tl.data_ptr(),
        dist.data_ptr(), dist.shape[0], T, window, sk.data_ptr(), M // T, D**-0.5, int(round_bf16), out.data_ptr(),
    )  # fmt: skip
    if code == -1:
        raise ValueError(f"quantised block attention: a block id outside [0, {N}) or a tail outside the tails")
    if code != 0:
        raise MemoryError("quantised block attention: no memory for the scores")
    return out


@quantized_attention.register_fake
def _(rows, codes, fmt, value_group, tail_keys, tail_values, table, tails, distance, window, sinks, round_bf16):
    return rows.new_empty(rows.shape, dtype=torch.float32)
