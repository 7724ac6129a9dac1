"""fp32 products of a few rows by an out-major weight, x (M, K) · w (R, K)ᵀ (+ b), for the batched
decode step (`rows.c`, built on first use by `kernels.build`). MKL's sgemm is slow at this shape (a
few rows against a wide weight); this kernel keeps a tile of sums in registers and reads the weight
once, in order. `available()` is True where it built with its AVX2 or AVX-512 path; elsewhere (no
compiler, `GPTOSS_LITE_NO_KERNELS=1`, a CPU without AVX2, where only its plain-C path would build)
it is False and `model.matmul.decode_linear` keeps F.linear."""

from __future__ import annotations

import ctypes

import torch

from gptoss_lite.kernels import cpp_ops
from gptoss_lite.kernels.build import load

ISA_NAMES = ("plain C", "AVX2", "AVX-512")  # gl_rows_isa(): the path this build takes (plain C is slow)
# Weights of fewer elements stay with F.linear: the op's call from a compiled graph (dispatcher, Python,
# ctypes) costs about 10 µs more than F.linear's, more than the kernel saves on the 20M model's router
# (8 x 256: 24 µs against 14 µs per call at 16 rows), while the 256 x 256 o_proj already gains a little.
MIN_WEIGHT = 1 << 14


def _library() -> ctypes.CDLL | None:
    lib = load("rows")
    if lib is not None and not getattr(lib, "_typed", False):
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.gl_rows_mm.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr]
        lib.gl_rows_mm.restype = None
        lib.gl_rows_argmax.argtypes = [ptr, i64, i64, i64, ptr]
        lib.gl_rows_argmax.restype = None
        lib.isa = ISA_NAMES[lib.gl_rows_isa()]
        lib._typed = True
        cpp_ops.bind("rows_mm", lib.gl_rows_mm)  # the op's calls stay out of Python from here on
    return lib


@torch.compiler.assume_constant_result  # a trace takes the answer as a constant (it builds or loads a file)
def available() -> bool:
    """Whether the kernel built and loaded here with a vector path (AVX2 + FMA, or AVX-512)."""
    lib = _library()
    return lib is not None and lib.isa != ISA_NAMES[0]


def traceable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `rows_mm` serves x · wᵀ: fp32 CPU tensors, x (M, K), an out-major contiguous weight (R, K)
    of at least MIN_WEIGHT elements, no autograd (the op has no backward), the kernel built here. Asked
    inside the compiled decode step; it depends on shapes, never on M, so one graph serves every M."""
    return (
        w.numel() >= MIN_WEIGHT
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and x.device.type == "cpu"
        and w.device.type == "cpu"
        and x.dim() == 2
        and w.dim() == 2
        and w.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        and available()
    )


@torch.library.custom_op("gptoss_lite::rows_mm", mutates_args=())
def rows_mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) · w (R, K)ᵀ (+ b (R,)) -> (M, R) float32: F.linear's result, the fp32 sums in another
    order. x may be strided (it is made contiguous); w must be a contiguous fp32 (R, K) (`traceable`).
    A torch custom op, so the compiled decode step calls it as one node."""
    M, K = x.shape
    R = w.shape[0]
    # The C code trusts its sizes: a wrong one would read outside the tensors.
    if (
        x.dtype != torch.float32
        or w.dtype != torch.float32
        or w.dim() != 2
        or w.shape[1] != K
        or not w.is_contiguous()
        or (b is not None and tuple(b.shape) != (R,))
    ):
        raise ValueError(
            f"rows_mm: x {list(x.shape)} {x.dtype}, w {list(w.shape)} {w.dtype}, "
            f"b {None if b is None else list(b.shape)} must be x (M, K), w (R, K) contiguous, b (R,), fp32"
        )
    bias = None if b is None else b.float().contiguous()
    lib = _library()
    if lib is None:  # called directly where the kernel is not built: the same product by PyTorch
        return torch.nn.functional.linear(x, w, bias)
    xc = x.contiguous()
    out = torch.empty(M, R, dtype=torch.float32)
    lib.gl_rows_mm(xc.data_ptr(), w.data_ptr(), None if bias is None else bias.data_ptr(), M, R, K, out.data_ptr())
    return out


@rows_mm.register_fake
def _(x, w, b):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """The index of each row's largest value of x (M, V), fp32 on the CPU with unit stride along V and
    V >= 1: torch.argmax(x, -1)'s answer (the first of equals, the first NaN where a row holds one),
    by `gl_rows_argmax`, a vectorised pass where torch's compares one element at a time; None where it
    does not serve (the caller takes torch.argmax): another dtype or device, other strides, autograd
    or tracing, or no kernel built here."""
    if (
        x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.dim() != 2
        or x.shape[1] == 0
        or (x.shape[0] > 1 and x.stride(0) < x.shape[1])
        or x.stride(1) != 1
        or x.requires_grad
        or torch.compiler.is_compiling()
        or not available()
    ):
        return None
    out = torch.empty(x.shape[0], dtype=torch.long)
    _library().gl_rows_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out
