"""The model's decode step, compiled (docs/model.md#the-compiled-decode-step).

The eager decode step of `GPTOSS.forward` dispatches several hundred small ops per token (norms,
rotary, projections, a router, each selected expert, attention), and on a CPU most of a small
model's step is that dispatch, not arithmetic. `GPTOSS.decode_step` is the same step written as
fixed-shape tensor code over a `StaticKV` (the cache's own storage: a preallocated `MixedKVCache`,
or the engine's block tables), from the one-token paths of the model's own modules. `CompiledDecoder`
hands it to `torch.compile` (inductor's CPU backend, which emits C++/OpenMP loops): the step becomes
a few dozen fused kernels. Nothing is seeded or written back: the graph writes each new key into the
cache's storage, and the caller counts it (`MixedKVCache.advance`).

Compilation takes tens of seconds the first time for a model shape and dtype (and, in the engine, per
batch-size bucket); inductor caches the result on disk (`TORCHINDUCTOR_CACHE_DIR`), so later processes
load it in seconds. `compile_seconds` reports the first call's wall time.

The cache is a folder per vector ISA, inside `TORCHINDUCTOR_CACHE_DIR` or inductor's default
(`use_inductor_cache_per_isa`): torch 2.13's FX graph cache key leaves out the ISA its C++ was
generated for, so a graph cached under AVX-512 and loaded where `ATEN_CPU_CAPABILITY=avx2` (or on
another CPU sharing the folder) computed wrong values, in AVX-512-wide steps over AVX2-wide vectors.
"""

from __future__ import annotations

import os
import re
import time
import types

import torch
from torch import Tensor

from gptoss_lite.kv.base import StaticKV
from gptoss_lite.model.moe import MXFP4Experts

RECOMPILE_LIMIT = 256  # compiled entries of the decode step per process (see CompiledDecoder)

_ON_THE_MODEL = re.compile(r"^(\w+\()*self\b")  # a guard source rooted at decode_step's `self`


def guards_off_the_model(entries: list) -> list[bool]:
    """Dynamo's `guard_filter_fn` for a decoder's own step: keep every guard on the step's inputs
    (`tokens`, `kv`) and on module globals, drop those on the model (`self`): its ~700 guards (each
    parameter's shape and strides, every module's settings) cost ~150 µs a call, a tenth of the 20M
    model's one-row step. The model they would check is always the decoder's own (`CompiledDecoder`
    compiles a code object of its own per model and per MXFP4 activation mode), and `generate()`
    refuses a model whose parameters changed (`CompiledDecoder.current`)."""
    return [not _ON_THE_MODEL.match(entry.name) for entry in entries]


def use_inductor_cache_per_isa() -> str:
    """Point inductor's on-disk cache at a folder of the vector ISA it generates for (an AVX-512, AVX2 or
    AMX CPU, or `ATEN_CPU_CAPABILITY`), inside `TORCHINDUCTOR_CACHE_DIR` where the user names one, else
    inside inductor's default; the folder used.

    Works around torch's FX graph cache, whose key does not hold that ISA (docstring above): a graph cached
    for one ISA must not be loaded for another, whoever chose the folder."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    named = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    ours = os.environ.get("GPTOSS_LITE_INDUCTOR_BASE")  # the folder a call here keyed, for later calls and children
    if named is None:
        base = default_cache_dir()
    elif ours and os.path.dirname(named) == ours and os.path.basename(named).startswith("isa-"):
        base = ours  # keyed here (or by a parent) already: key it again, for this process's ISA
    else:
        base = named
    isa = "-".join(str(pick_vec_isa()).split()) or "novec"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"isa-{isa}")
    os.environ["GPTOSS_LITE_INDUCTOR_BASE"] = base
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


class CompiledDecoder:
    """`GPTOSS.decode_step` of `model`, compiled. Built by
    `GPTOSS.prepare_for_inference(compile_decode=True)`; it reads the model's weights in place (nothing
    is copied), and `current()` tells whether they are still the ones it was built over.

    Dynamo keeps its compiled entries on a code object, under guards that tell which entry a call may
    run. Each decoder compiles its own copy of `decode_step`'s code, one per MXFP4 activation mode
    (the one setting of a prepared model that changes the graph), so its entries only ever see its own
    model and the guards on the model can go (`guards_off_the_model`); those on the K/V storage and
    the tokens stay, and pick the entry for a batch size or a cache's form."""

    def __init__(self, model) -> None:
        if model.head_weight().stride(-1) != 1:
            raise ValueError(
                "compiled decode needs out-major weights (the output head is input-major); build the "
                "model with prepare_for_inference(compile_decode=True)"
            )
        self._captured = self._weights_key(model)
        # A decoder's code object keeps an entry per form of its K/V storage (a cache's static form, the
        # engine's block tables) and per batch size generate() is called with; dynamo's default limit
        # of 8 entries would fail a long-lived process.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        use_inductor_cache_per_isa()
        self._model = model
        # the packed experts whose activation mode picks the graph (read each call: a plain attribute each)
        self._mxfp4 = [m for m in model.modules() if isinstance(m, MXFP4Experts)]
        self._by_mode: dict[tuple[str, ...], object] = {}  # the experts' activation modes -> the compiled step
        self.compile_seconds: float | None = None  # wall time of the first compiled call
        self.calls = 0

    def _compiled(self, tokens: Tensor, kv: StaticKV) -> Tensor:
        mode = tuple(experts.activations for experts in self._mxfp4)
        fn = self._by_mode.get(mode)
        if fn is None:
            f = type(self._model).decode_step
            own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
            # cpp_wrapper: the ~40 kernel calls of a step are made from generated C++, not Python (bf16
            # step of the 20M model 3.13 -> 2.66 ms, medians of 6 alternating runs in one process).
            options = {"cpp_wrapper": True, "guard_filter_fn": guards_off_the_model}
            fn = torch.compile(types.MethodType(own, self._model), dynamic=False, fullgraph=True, options=options)
            self._by_mode[mode] = fn
        return fn(tokens, kv)

    @staticmethod
    def _weights_key(model) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in model.parameters())

    def current(self, model) -> bool:
        """Whether `model`'s parameters are still the tensors (and versions) this decoder was built over."""
        return self._weights_key(model) == self._captured

    def step(self, kv: StaticKV, tokens: Tensor) -> Tensor:
        """Run tokens (B,) through the compiled step over `kv`; the logits (B, V) in the model's dtype."""
        t0 = time.perf_counter() if self.compile_seconds is None else 0.0
        logits = self._compiled(tokens, kv)
        if self.compile_seconds is None:
            self.compile_seconds = time.perf_counter() - t0
        self.calls += 1
        return logits
