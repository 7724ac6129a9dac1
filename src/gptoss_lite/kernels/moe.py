"""The routed experts of a batched decode step, grouped by expert (`moe.c`, built on first use by
`kernels.build`): each expert's weights read once for all the rows that chose it, where the compiled
step's gathered reduction reads them once per row. `MoE.decode_step` calls it for two rows or more
where it serves (`serves`); elsewhere (one row, MXFP4 experts, no AVX-512, no compiler,
`GPTOSS_LITE_NO_KERNELS=1`) the reduction stays, and the tests hold the kernel to it.

Prefill's grouped experts (`MoE.forward` over many tokens) use passes of the same library around
PyTorch's GEMMs: `topk` (the router's top k, plain C; torch.topk for a row where its tie order decides),
`group` (the tokens' rows sorted by expert, a counting sort and a gather, plain C),
`activate` (the gated activation of a packed gate|up product, one pass) and `combine` (each token's
weighted sum of its experts' outputs, one pass). Each has a PyTorch version, the reference, which runs
where the library does not."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence

import torch

from gptoss_lite.kernels import cpp_ops
from gptoss_lite.kernels.build import load

ISA_NAMES = ("none", "AVX-512 (fp32)", "AVX-512 BF16 (fp32 and bf16)")  # gl_moe_isa()


def _library() -> ctypes.CDLL | None:
    lib = load("moe")
    if lib is not None and not getattr(lib, "_typed", False):
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.gl_moe_experts.argtypes = [ptr, i32, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i32,
                                       ctypes.c_float, ptr]  # fmt: skip
        lib.gl_moe_experts.restype = ctypes.c_int
        lib.gl_moe_activate.argtypes = [ptr, i32, i64, i64, i32, ctypes.c_float, ptr]
        lib.gl_moe_activate.restype = ctypes.c_int
        lib.gl_moe_combine.argtypes = [ptr, ptr, i64, i32, ptr, ptr, i64, i64, i64, ptr]
        lib.gl_moe_combine.restype = ctypes.c_int
        lib.gl_moe_group.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr]
        lib.gl_moe_group.restype = ctypes.c_int
        lib.gl_moe_topk.argtypes = [ptr, i32, i64, i64, i64, ptr, ptr, ptr]
        lib.gl_moe_topk.restype = ctypes.c_int64
        lib.isa = lib.gl_moe_isa()
        lib._typed = True
        cpp_ops.bind("moe_experts", lib.gl_moe_experts, lib.isa)  # the op's calls stay out of Python from here on
    return lib


@torch.compiler.assume_constant_result  # a trace takes the answer as a constant (it builds or loads a file)
def dtypes() -> tuple[str, ...]:
    """The model dtypes the kernel serves on this machine ("float32", "bfloat16"), none where not built."""
    lib = _library()
    isa = 0 if lib is None else lib.isa
    return ("float32", "bfloat16")[:isa]


def serves(h: torch.Tensor, gate_up: torch.Tensor | None, down: torch.Tensor) -> bool:
    """Whether `experts` computes the routed experts of rows h (B, C) here: two rows or more (one row
    reads each of its experts once anyway, in the step's own fused loop), CPU tensors of one dtype the
    build serves, the packed out-major gate_up buffer (E, 2I, C) (None: not packed) and down (E, C, I),
    both contiguous, no autograd. Asked inside the compiled step too."""
    return (
        gate_up is not None
        and h.dim() == 2
        and h.shape[0] >= 2
        and h.device.type == "cpu"
        and str(h.dtype).removeprefix("torch.") in dtypes()
        and gate_up.dtype == down.dtype == h.dtype
        and gate_up.dim() == 3
        and gate_up.is_contiguous()
        and down.is_contiguous()
        and tuple(down.shape) == (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2)
        and not (torch.is_grad_enabled() and (h.requires_grad or gate_up.requires_grad or down.requires_grad))
    )


@torch.library.custom_op("gptoss_lite::moe_experts", mutates_args=())
def experts(
    h: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down: torch.Tensor,
    down_bias: torch.Tensor | None,
    swiglu: bool,
    limit: float,
) -> torch.Tensor:
    """Σ_a weights[b, a] · expert(idx[b, a], h[b]) -> (B, C) fp32, each expert's output rounded to h's
    dtype as `Experts.decode_step` rounds it: h (B, C), idx (B, A) int64, weights (B, A) fp32 (holding
    values of h's dtype), gate_up (E, 2I, C) gate rows then up rows, down (E, C, I), biases (E, 2I) and
    (E, C) or None, all in h's dtype; swiglu, else gpt-oss's clamped activation with this limit."""
    B, C = h.shape
    E, two_i, _ = gate_up.shape
    A = idx.shape[1] if idx.dim() == 2 else 0
    biases_ok = (gate_up_bias is None or tuple(gate_up_bias.shape) == (E, two_i)) and (
        down_bias is None or tuple(down_bias.shape) == (E, C)
    )
    # The C code trusts its sizes: a wrong one would read outside the tensors.
    if (
        idx.dim() != 2
        or idx.shape[0] != B
        or tuple(weights.shape) != (B, A)
        or gate_up.shape[2] != C
        or two_i % 2
        or tuple(down.shape) != (E, C, two_i // 2)
        or not biases_ok
        or any(t.dtype != h.dtype for t in (gate_up, down, gate_up_bias, down_bias) if t is not None)
        or str(h.dtype).removeprefix("torch.") not in dtypes()
    ):
        raise ValueError(
            f"moe_experts: h {list(h.shape)} {h.dtype}, idx {list(idx.shape)}, weights {list(weights.shape)}, "
            f"gate_up {list(gate_up.shape)}, down {list(down.shape)}: not one expert layout this build serves"
        )
    x, ix, w = h.contiguous(), idx.to(torch.int64).contiguous(), weights.float().contiguous()
    gu, dn = gate_up.contiguous(), down.contiguous()
    gb = None if gate_up_bias is None else gate_up_bias.contiguous()
    db = None if down_bias is None else down_bias.contiguous()
    out = torch.empty(B, C, dtype=torch.float32)
    code = _library().gl_moe_experts(
        x.data_ptr(), int(h.dtype == torch.bfloat16), ix.data_ptr(), w.data_ptr(), B, A, gu.data_ptr(),
        None if gb is None else gb.data_ptr(), dn.data_ptr(), None if db is None else db.data_ptr(), E, C,
        two_i // 2, int(swiglu), limit, out.data_ptr(),
    )  # fmt: skip
    if code == -1:
        raise ValueError(f"moe_experts: an expert id lies outside [0, {E})")
    if code != 0:
        raise MemoryError("moe_experts: no memory for the grouped rows")
    return out


@experts.register_fake
def _(h, idx, weights, gate_up, gate_up_bias, down, down_bias, swiglu, limit):
    return h.new_empty(h.shape, dtype=torch.float32)


def _eager_library(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library where its eager passes serve these tensors: CPU tensors of fp32 or bf16, nothing
    recording gradients, not inside a trace, the library built (any ISA: `topk` and `group` are plain C)."""
    if torch.compiler.is_compiling() or any(
        t.device.type != "cpu" or t.dtype not in (torch.float32, torch.bfloat16) or t.requires_grad for t in tensors
    ):
        return None
    return _library()


def _prefill_library(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """`_eager_library` where the build has AVX-512 (isa >= 1): `activate` and `combine`."""
    lib = _eager_library(*tensors)
    return lib if lib is not None and lib.isa >= 1 else None


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits.topk(k, dim=-1) of router logits (N, E), fp32 or bf16, in one pass: the same values and
    indices, in the same order. The rows whose answer torch.topk's own way of breaking ties decides (two
    of the row's k + 1 largest equal, or a NaN) are asked of torch.topk, which treats each row alone.
    None where the library does not serve."""
    lib = _eager_library(logits)
    if lib is None or logits.dim() != 2 or not 0 < k <= logits.shape[1]:
        return None
    x = logits.contiguous()
    N, E = x.shape
    vals, idx, tied = x.new_empty(N, k), torch.empty(N, k, dtype=torch.int64), torch.empty(N, dtype=torch.uint8)
    n_tied = lib.gl_moe_topk(
        x.data_ptr(), int(x.dtype == torch.bfloat16), N, E, k, vals.data_ptr(), idx.data_ptr(), tied.data_ptr()
    )
    if n_tied < 0:
        return None
    if n_tied:
        rows = tied.nonzero().view(-1)
        vals[rows], idx[rows] = x.index_select(0, rows).topk(k, dim=-1)
    return vals, idx


def group(x: torch.Tensor, idx: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int], torch.Tensor] | None:
    """Tokens x (N, C) and their experts idx (N, A) grouped by expert, in one pass: -> sorted (N·A, C),
    each assignment's token row in the order a stable argsort of idx.reshape(-1) gives; counts[e], the
    assignments of expert e; at (N, A), each (token, slot)'s place in that order. What `MoE.forward`
    builds from argsort, bincount, index_select and a scatter (the reference, where the library is not
    built, and while gradients are recorded). None where the library does not serve; IndexError for an
    expert outside [0, n_experts)."""
    lib = _eager_library(x)
    if lib is None or x.dim() != 2 or idx.dim() != 2 or idx.shape[0] != x.shape[0]:
        return None
    rows, ix = x.contiguous(), idx.to(torch.int64).contiguous()
    N, A = ix.shape
    counts = torch.empty(n_experts, dtype=torch.int64)
    at = torch.empty(N, A, dtype=torch.int64)
    out = rows.new_empty(N * A, rows.shape[1])
    code = lib.gl_moe_group(rows.data_ptr(), rows.element_size(), ix.data_ptr(), N, A, rows.shape[1], n_experts,
                            counts.data_ptr(), at.data_ptr(), out.data_ptr())  # fmt: skip
    if code == -1:
        raise IndexError(f"moe group: an expert lies outside [0, {n_experts})")
    if code != 0:
        raise MemoryError("moe group: no memory for the order")
    return out, counts.tolist(), at


def activate(gate_up: torch.Tensor, swiglu: bool, limit: float) -> torch.Tensor | None:
    """The gated activation of gate_up (n, 2I), gate half then up half -> (n, I), in one pass: fp32
    arithmetic, rounded once to bf16 (`model.moe.activate_halves`, the reference); None where the
    library does not serve."""
    lib = _prefill_library(gate_up)
    if lib is None or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        return None
    x = gate_up.contiguous()
    n, two_i = x.shape
    out = x.new_empty(n, two_i // 2)
    code = lib.gl_moe_activate(x.data_ptr(), int(x.dtype == torch.bfloat16), n, two_i // 2, int(swiglu), limit,
                               out.data_ptr())  # fmt: skip
    if code == -2:
        raise MemoryError("moe activate: no memory for a row")
    return out if code == 0 else None


def combine(pieces: Sequence[torch.Tensor], at: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """Σ_a weights[t, a] · rows[at[t, a]] -> (N, C) in the rows' dtype, in one pass, where rows (P, C) are
    the pieces one after another (each expert's outputs where its product wrote them, not concatenated);
    at (N, A), weights (N, A); fp32 products summed in slot order, rounded once
    (`model.moe.combine_reference`, the reference). None where the library does not serve; IndexError for
    a place outside the rows."""
    lib = _prefill_library(*pieces, weights) if pieces else None
    N, A = at.shape
    if lib is None or tuple(weights.shape) != (N, A):
        return None
    C, dtype = pieces[0].shape[-1], pieces[0].dtype
    if any(p.dim() != 2 or p.shape[1] != C or p.dtype != dtype for p in pieces):
        return None
    held = [p.contiguous() for p in pieces]  # kept alive until the call returns
    bases = torch.tensor([p.data_ptr() for p in held], dtype=torch.int64)
    starts = torch.tensor([0, *itertools.accumulate(p.shape[0] for p in held)], dtype=torch.int64)
    ix, w = at.to(torch.int64).contiguous(), weights.float().contiguous()
    out = held[0].new_empty(N, C)
    code = lib.gl_moe_combine(bases.data_ptr(), starts.data_ptr(), len(held), int(dtype == torch.bfloat16),
                              ix.data_ptr(), w.data_ptr(), N, A, C, out.data_ptr())  # fmt: skip
    if code != 0:  # the library has the path (`_prefill_library`): -1 is a bad place
        raise IndexError(f"moe combine: a place lies outside the {int(starts[-1])} rows")
    return out
