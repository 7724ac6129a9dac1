"""The kernels' torch ops dispatched from C++ (`ops.cpp`, built by `build.load_torch_ops`).

`rows_mm`, `moe_experts`, `block_attention`, `bf16_gemv`, `mxfp4_matvec`, `mxfp4_matvec_int8` and
`mxfp4_gate_up_act` are torch custom ops defined in Python: their Python
implementations check the arguments and call the C kernels through ctypes. Once a kernel's library
has loaded, its module hands the C function's address to `bind`, which registers a CPU
implementation in C++ doing the same checks and the same call; torch's dispatcher then prefers it to
the Python one, and a compiled step's call never enters Python (~20 µs a call less). Where the C++
file cannot be built (no C++ compiler, `GPTOSS_LITE_NO_CPP_OPS=1`) the Python implementations stay,
with the same results: both call the same C function on the same arguments.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

from gptoss_lite.kernels.build import load_torch_ops

_bound: set[str] = set()
_functions: dict[str, tuple[ctypes._CFuncPtr, int]] = {}  # what each op was bound to, to bind it again


def bind(op: str, fn: ctypes._CFuncPtr, flags: int = 0) -> bool:
    """Make `gptoss_lite::OP`'s CPU implementation the C++ one calling `fn` (a C function of a loaded
    kernel library; `flags`: the moe kernel's ISA number); whether it is (False: the Python one stays)."""
    if op in _bound:
        return True
    lib = load_torch_ops("ops")
    if lib is None:
        return False
    if not getattr(lib, "_typed", False):
        lib.gl_ops_bind.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]
        lib.gl_ops_bind.restype = ctypes.c_int
        lib.gl_ops_unbind.argtypes = [ctypes.c_char_p]
        lib.gl_ops_unbind.restype = ctypes.c_int
        lib._typed = True
    if lib.gl_ops_bind(op.encode(), ctypes.cast(fn, ctypes.c_void_p), flags) != 0:
        return False
    _bound.add(op)
    _functions[op] = (fn, flags)
    return True


def rebind(op: str, fn: ctypes._CFuncPtr, flags: int = 0) -> bool:
    """`bind` op to another C function where it is bound already: for timing two builds of one kernel
    in one process (`benchmarks/block_attention_ab.py`); not while another thread runs a step."""
    lib = load_torch_ops("ops")
    if lib is not None and op in _bound:
        lib.gl_ops_unbind(op.encode())
        _bound.discard(op)
    return bind(op, fn, flags)


def use_cpp(on: bool, ops: Iterable[str] | None = None) -> frozenset[str]:
    """Switch every op bound so far (or those of them named in `ops`) between its C++ (True) and its
    Python implementation (False), in this process and for graphs already compiled (they call the op
    through the dispatcher); the ops now served from C++. For in-process comparisons
    (`benchmarks/engine_cpp_ops.py`); not while another thread runs a step."""
    lib = load_torch_ops("ops")
    chosen = None if ops is None else set(ops)
    for op, (fn, flags) in list(_functions.items()):
        if chosen is not None and op not in chosen:
            continue
        if on:
            bind(op, fn, flags)
        elif lib is not None and op in _bound:
            lib.gl_ops_unbind(op.encode())
            _bound.discard(op)
    return bound()


def bound() -> frozenset[str]:
    """The ops whose CPU implementation is the C++ one in this process."""
    return frozenset(_bound)
