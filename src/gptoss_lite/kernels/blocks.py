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
        lib._typed = True
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
