"""MXFP4 expert weights, as stored by the released gpt-oss checkpoints (docs/mxfp4.md): the format,
the reference dequantise/quantise, and the kernels the packed experts run on.

`*_blocks` uint8 (E, out, in/32, 16): 32 E2M1 4-bit codes per block, two per byte, the LOW nibble
holding the even element. `*_scales` uint8 (E, out, in/32): one power-of-two exponent per block,
biased by 127 (value = code_value · 2^(scale - 127)).

The blocks run along the INPUT dimension of an (out, in) matrix; the HF parameter layout is
input-major (E, in, out), hence the transpose in `dequantize_mxfp4`.

`matvec` and `dequantize_rows` read the codes directly: a small C library (`mxfp4.c`, built on first
use by `kernels.build`) where a C compiler exists, else the same arithmetic in PyTorch. `matvec` is a
torch custom op, so the compiled decode step calls it as one opaque node.
"""

from __future__ import annotations

import ctypes

import torch

from gptoss_lite.kernels import cpp_ops
from gptoss_lite.kernels.build import load

BLOCK = 32  # values per scale (OCP MX spec)
# E2M1 code -> value. Source: OCP Microscaling Formats spec, FP4 E2M1 table; codes 8-15 are the negatives.
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_BIAS = 127
NAN_SCALE = 255  # the E8M0 scale code that means NaN (OCP MX spec); refused at load
_MAX_CODE_VALUE = 6.0


def check_packed(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless blocks (..., R, G, 16) and scales (..., R, G) are uint8 MXFP4 of matching shape."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8; got {blocks.dtype} / {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"MXFP4 shapes: blocks {list(blocks.shape)} must be (..., out, G, 16) and scales "
            f"{list(scales.shape)} must be (..., out, G)"
        )


def reference_rows(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (..., R, G, 16) + scales (..., R, G) -> weights (..., R, 32·G) in `dtype`, out-major as
    stored: the obviously correct table lookup every kernel is tested against."""
    check_packed(blocks, scales)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # (..., R, G, 16, 2): low nibble first
    values = lut[codes].reshape(*scales.shape, BLOCK)  # (..., R, G, 32)
    exponent = scales.to(torch.int32) - _SCALE_BIAS  # (..., R, G)
    values = torch.ldexp(values, exponent[..., None].to(torch.float32))
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks (E, out, G, 16) uint8 + scales (E, out, G) uint8 -> weights (E, in = 32·G, out) in `dtype`.

    The result is in the HF input-major layout (transposed from the stored (out, in)).
    """
    check_packed(blocks, scales)
    if blocks.dim() != 4:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} must be (E, out, G, 16)")
    return reference_rows(blocks, scales).transpose(1, 2).contiguous().to(dtype)  # (E, in, out)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weights (E, in, out) in the HF layout -> (blocks (E, out, in/32, 16), scales (E, out, in/32)) uint8.

    Each block's scale is the smallest power of two that brings its max |value| to <= 6; every value
    is then rounded to the nearest E2M1 code. Values that are already code·2^k within a block pack
    exactly. Intended for tests and for writing compact checkpoints.
    """
    if weight.dim() != 3 or weight.shape[1] % BLOCK:
        raise ValueError(f"quantize_mxfp4: weight {list(weight.shape)} must be (E, in, out) with in % {BLOCK} == 0")
    E, n_in, out = weight.shape
    w = weight.detach().float().transpose(1, 2).reshape(E, out, n_in // BLOCK, BLOCK)  # (E, out, G, 32)
    amax = w.abs().amax(dim=-1)  # (E, out, G)
    # exponent k with amax / 2^k <= 6, smallest such k; all-zero blocks get k = -127 (scale code 0).
    k = torch.ceil(torch.log2(amax.clamp_min(1e-38) / _MAX_CODE_VALUE))
    k = torch.where(amax > 0, k, torch.full_like(k, -_SCALE_BIAS)).clamp(-_SCALE_BIAS, 255 - _SCALE_BIAS)
    scaled = w / torch.exp2(k)[..., None]  # (E, out, G, 32), |scaled| <= 6
    lut = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    magnitude_code = (scaled.abs()[..., None] - lut).abs().argmin(dim=-1)  # nearest |value|, (E, out, G, 32)
    codes = (magnitude_code | ((scaled < 0).long() << 3)).to(torch.uint8)
    codes = codes.reshape(E, out, n_in // BLOCK, BLOCK // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)  # even element in the low nibble
    scales = (k + _SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


# ---- kernels -----------------------------------------------------------------------------------------


def _library() -> ctypes.CDLL | None:
    lib = load("mxfp4")
    if lib is not None and not getattr(lib, "_typed", False):
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.gl_mxfp4_matvec.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ptr]
        lib.gl_mxfp4_matvec.restype = None
        lib.gl_mxfp4_matvec_q8.argtypes = lib.gl_mxfp4_matvec.argtypes
        lib.gl_mxfp4_matvec_q8.restype = None
        lib.gl_q8_quantize.argtypes = [ptr, ctypes.c_int, i64, i64, ptr, ptr]
        lib.gl_q8_quantize.restype = None
        lib.gl_mxfp4_dequant.argtypes = [ptr, ptr, i64, i64, ptr, ctypes.c_int]
        lib.gl_mxfp4_dequant.restype = None
        lib.gl_mxfp4_gate_up_act.argtypes = [ptr, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr, ptr, ctypes.c_int]
        lib.gl_mxfp4_gate_up_act.argtypes += [i64, i64, i64, i64, ctypes.c_int, ctypes.c_float, ctypes.c_int, ptr]
        lib.gl_mxfp4_gate_up_act.restype = ctypes.c_int
        lib.bf16_dot = bool(lib.gl_has_bf16_dot())
        lib.gate_up_act = bool(lib.gl_mxfp4_has_gate_up_act())
        lib._typed = True
        # the ops' calls stay out of Python from here on (flags: the exact kernel takes bf16 inputs)
        cpp_ops.bind("mxfp4_matvec", lib.gl_mxfp4_matvec, int(lib.bf16_dot))
        cpp_ops.bind("mxfp4_matvec_int8", lib.gl_mxfp4_matvec_q8)
        if lib.gate_up_act:
            cpp_ops.bind("mxfp4_gate_up_act", lib.gl_mxfp4_gate_up_act, int(lib.bf16_dot))
    return lib


def native_available() -> bool:
    """Whether the C kernels built and loaded here (else the PyTorch fallback runs)."""
    return _library() is not None


def _on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, 32·G) -> (q (M, 32·G) int8, d (M, G) float32): each block of 32 inputs as int8 codes times
    one step d = max|x| / 127, q = x · (127 / max|x|) rounded to nearest even (all zeros for an
    all-zero block). The rounding of the opt-in int8-activation path (`matvec_int8`), in fp32 as the C
    kernel does it: the reference that path is tested against."""
    M, K = x.shape
    if K % BLOCK:
        raise ValueError(f"quantize_activations: x {list(x.shape)} must have a multiple of {BLOCK} columns")
    xb = x.float().reshape(M, K // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1)  # (M, G)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).to(torch.int8).reshape(M, K)
    return q, amax / 127.0


def _check_matvec_args(x, blocks, scales, experts, bias) -> None:
    M, K = x.shape
    E, R, G = scales.shape
    # The C code trusts its indices and sizes: a bad one would read outside the tensors.
    packed = blocks.dtype == scales.dtype == torch.uint8 and x.dtype.is_floating_point
    if not packed or K != G * BLOCK or tuple(blocks.shape) != (E, R, G, BLOCK // 2) or experts.shape != (M,):
        raise ValueError(
            f"mxfp4 matvec: x {list(x.shape)}, blocks {list(blocks.shape)}, scales {list(scales.shape)} and "
            f"experts {list(experts.shape)} do not fit (x (M, 32·G), blocks (E, R, G, 16) and scales (E, R, G) "
            "uint8, experts (M,))"
        )
    if M and (int(experts.min()) < 0 or int(experts.max()) >= E):
        raise ValueError(f"mxfp4 matvec: expert ids must be in [0, {E}); got {experts.min()}..{experts.max()}")
    if bias is not None and tuple(bias.shape) != (E, R):
        raise ValueError(f"mxfp4 matvec: bias {list(bias.shape)} must be (E, R) = {[E, R]}")


def _kernel_input(x: torch.Tensor, int8: bool, lib: ctypes.CDLL) -> tuple[torch.Tensor, bool]:
    """x as the C kernels read it, and whether that is bf16: bf16 inputs go to the bf16 dot products
    where the CPU has them (the same exact products; the int8 path reads bf16 on every build), else fp32."""
    x_bf16 = x.dtype == torch.bfloat16 and (int8 or lib.bf16_dot)
    return (x.contiguous() if x_bf16 else x.float().contiguous()), x_bf16


def _matvec(x, blocks, scales, experts, bias, int8: bool) -> torch.Tensor:
    """`matvec` (int8=False) and `matvec_int8`: the C kernel where it runs, else PyTorch."""
    _check_matvec_args(x, blocks, scales, experts, bias)
    M, K = x.shape
    E, R, G = scales.shape
    bf = None if bias is None else bias.float().contiguous()
    lib = _library()
    if lib is not None and _on_cpu(blocks, scales, experts) and experts.dtype == torch.int64:
        xc, x_bf16 = _kernel_input(x, int8, lib)
        out = torch.empty(M, R, dtype=torch.float32)
        kernel = lib.gl_mxfp4_matvec_q8 if int8 else lib.gl_mxfp4_matvec
        kernel(
            xc.data_ptr(),
            int(x_bf16),
            blocks.data_ptr(),
            scales.data_ptr(),
            experts.data_ptr(),
            None if bf is None else bf.data_ptr(),
            M,
            E,
            R,
            G,
            out.data_ptr(),
        )
        return out
    if int8:  # the same rounding, then the products in fp32
        q, d = quantize_activations(x)
        xf = (q.float().view(M, G, BLOCK) * d[..., None]).view(M, K)
    else:
        xf = x.float()
    out = xf.new_empty(M, R)
    for e in experts.unique().tolist():  # the fallback: one expert's rows dequantised at a time
        rows = (experts == e).nonzero().view(-1)
        w = reference_rows(blocks[e], scales[e])  # (R, K)
        out[rows] = torch.mm(xf[rows], w.t()) + (0 if bf is None else bf[e])
    return out


@torch.library.custom_op("gptoss_lite::mxfp4_matvec", mutates_args=())
def matvec(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """out[m] = W[experts[m]] · x[m] (+ bias[experts[m]]) in fp32: x (M, K) any float dtype, blocks
    (E, R, K/32, 16) and scales (E, R, K/32) uint8, experts (M,) int64 in [0, E), bias (E, R) or None
    -> (M, R) float32. Rows that share an expert share each decoded block of its codes."""
    return _matvec(x, blocks, scales, experts, bias, int8=False)


@matvec.register_fake
def _(x, blocks, scales, experts, bias):
    return x.new_empty(x.shape[0], scales.shape[1], dtype=torch.float32)


@torch.library.custom_op("gptoss_lite::mxfp4_matvec_int8", mutates_args=())
def matvec_int8(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`matvec` with x rounded to int8 per block of 32 first (`quantize_activations`), as llama.cpp's
    Q8 activations are: integer products, fewer instructions per weight, and results that differ from
    the exact `matvec` by that rounding. Opt-in (`GPTOSS.set_mxfp4_activations("int8")`)."""
    return _matvec(x, blocks, scales, experts, bias, int8=True)


@matvec_int8.register_fake
def _(x, blocks, scales, experts, bias):
    return x.new_empty(x.shape[0], scales.shape[1], dtype=torch.float32)


@torch.compiler.assume_constant_result  # a trace takes the answer as a constant (it builds or loads a file)
def gate_up_act_available() -> bool:
    """Whether `gate_up_act` is built here (the C kernel with AVX-512). Elsewhere its callers keep the
    products and PyTorch's passes after them (`MXFP4Experts._activated`), which a compiled step fuses."""
    lib = _library()
    return lib is not None and lib.gate_up_act


def _gate_up_act(x, blocks, scales, experts, bias, swiglu: bool, limit: float, int8: bool) -> torch.Tensor:
    _check_matvec_args(x, blocks, scales, experts, bias)
    M, R = x.shape[0], scales.shape[1]
    if x.dtype not in (torch.float32, torch.bfloat16) or R % 2:
        raise ValueError(
            f"mxfp4 gate_up_act: x must be fp32 or bf16 (got {x.dtype}) and the rows (gate, up) pairs (got {R})"
        )
    tensors = (x, blocks, scales, experts) + (() if bias is None else (bias,))
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("mxfp4 gate_up_act: a CPU kernel; the tensors must be on the CPU")
    lib = _library()
    if lib is None or not lib.gate_up_act:
        raise RuntimeError("mxfp4 gate_up_act is not built here (it needs AVX-512): see gate_up_act_available()")
    xc, x_bf16 = _kernel_input(x, int8, lib)
    bc = None if bias is None else bias.contiguous() if bias.dtype == torch.bfloat16 else bias.float().contiguous()
    ids, codes, sc = experts.long().contiguous(), blocks.contiguous(), scales.contiguous()
    out = torch.empty(M, R // 2, dtype=x.dtype)
    code = lib.gl_mxfp4_gate_up_act(
        xc.data_ptr(), int(x_bf16), int(int8), codes.data_ptr(), sc.data_ptr(), ids.data_ptr(),
        None if bc is None else bc.data_ptr(), int(bc is not None and bc.dtype == torch.bfloat16),
        M, scales.shape[0], R, scales.shape[2], int(swiglu), limit, int(x.dtype == torch.bfloat16), out.data_ptr(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError("mxfp4 gate_up_act: the kernel refused its arguments")
    return out


@torch.library.custom_op("gptoss_lite::mxfp4_gate_up_act", mutates_args=())
def gate_up_act(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    experts: torch.Tensor,
    bias: torch.Tensor | None,
    swiglu: bool,
    limit: float,
    int8: bool,
) -> torch.Tensor:
    """gpt-oss's experts up to the down projection, for rows that read the codes: x (M, C) fp32 or bf16,
    the gate|up codes blocks (E, 2I, C/32, 16) and scales (E, 2I, C/32) with gate and up rows interleaved
    (row 2i gate i, 2i + 1 up i, as the checkpoints store them), experts (M,) int64, bias (E, 2I) or None
    -> act (M, I) in x's dtype: the products (`matvec`, or `matvec_int8` with `int8`) plus the bias,
    rounded to x's dtype, then the activation (SwiGLU with `swiglu`, else gpt-oss's clamped variant at
    `limit`) in fp32, rounded once. One pass over the codes, each task activating the rows it has just
    summed; built with AVX-512 only (`gate_up_act_available()`, else RuntimeError). Its reference is
    those steps one by one (`MXFP4Experts._activated` with the kernel off)."""
    return _gate_up_act(x, blocks, scales, experts, bias, swiglu, limit, int8=int8)


@gate_up_act.register_fake
def _(x, blocks, scales, experts, bias, swiglu, limit, int8):
    return x.new_empty(x.shape[0], scales.shape[1] // 2)


def native_quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activations` by the C kernel's own code (for tests: the two must agree bit for bit)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the mxfp4 kernels are not built here")
    M, K = x.shape
    x_bf16 = x.dtype == torch.bfloat16
    xc = x.contiguous() if x_bf16 else x.float().contiguous()
    q, d = torch.empty(M, K, dtype=torch.int8), torch.empty(M, K // BLOCK, dtype=torch.float32)
    lib.gl_q8_quantize(xc.data_ptr(), int(x_bf16), M, K // BLOCK, q.data_ptr(), d.data_ptr())
    return q, d


def dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One matrix: blocks (R, G, 16) + scales (R, G) -> (R, 32·G) in `dtype`, out-major (the
    nn.Linear weight), by the C kernel for fp32 and bf16 (both exact), else `reference_rows`."""
    check_packed(blocks, scales)
    if blocks.dim() != 3:
        raise ValueError(f"dequantize_rows: blocks {list(blocks.shape)} must be one matrix (R, G, 16)")
    lib = _library()
    if lib is None or dtype not in (torch.float32, torch.bfloat16) or not _on_cpu(blocks, scales):
        return reference_rows(blocks, scales, dtype)
    R, G = scales.shape
    out = torch.empty(R, G * BLOCK, dtype=dtype)
    lib.gl_mxfp4_dequant(blocks.data_ptr(), scales.data_ptr(), R, G, out.data_ptr(), int(dtype == torch.bfloat16))
    return out
