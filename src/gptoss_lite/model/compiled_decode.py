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

Dynamo's own call of the step costs more than its guards: its frame reads ~135 inputs off the model and
the state, enters and leaves its context managers, and calls the graph through its wrappers (a fifth of
the 20M model's one-row step). So a step first asks the guards of the graph the step before ran
(`Replay`): where they hold, the graph runs on the inputs read as dynamo reads them (from dynamo's own
names for their sources); where not, the step goes through dynamo, which picks or compiles a graph.
"""

from __future__ import annotations

import os
import re
import time
import types
from typing import NamedTuple

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


class Graphs:
    """The backend of a decoder's `torch.compile`: inductor with `options`, each graph it compiles wrapped in
    a `Graph` that names where dynamo takes each of its inputs from, and that tells the backend when it
    runs (`take_last`), so that the decoder knows which graph dynamo's guards chose for a step."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self._last: tuple[Graph, tuple, object] | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Graph:
        from torch._inductor.compile_fx import compile_fx

        sources = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                arg = node.meta.get("grapharg")
                sources.append(None if arg is None else arg.source.name)
        return Graph(compile_fx(gm, example_inputs, config_patches=self.options), sources, self)

    def ran(self, graph: Graph, args: tuple, out) -> None:
        self._last = (graph, args, out)

    def take_last(self) -> tuple[Graph, tuple, object] | None:
        """The graph that ran last, the inputs dynamo passed it and what it returned, once (nothing is
        kept after)."""
        last, self._last = self._last, None
        return last


class Graph:
    """One compiled graph of the step: `compiled(*inputs)`, and the expression dynamo read each input from
    (`sources`, such as `L['kv'].keys[3]`, `L['self']._modules['embed']._parameters['weight']` or
    `L['kv'].keys[1].size()[2]`)."""

    def __init__(self, compiled, sources: list[str | None], backend: Graphs) -> None:
        self.compiled, self.sources, self._backend = compiled, sources, backend
        self._reader: tuple | None = None  # (input_reader's answer,) once built: a graph serves one model

    def __call__(self, *args):
        out = self.compiled(*args)
        self._backend.ran(self, args, out)
        return out

    def inputs_from(self, model) -> types.FunctionType | None:
        """`input_reader(self.sources, model)`, built on first use."""
        if self._reader is None:
            self._reader = (input_reader(self.sources, model),)
        return self._reader[0]


def input_reader(sources: list[str | None], model) -> types.FunctionType | None:
    """A function of a step's locals {"self", "tokens", "kv"} -> the graph's inputs, in order: the model's
    tensors read once, now, and the rest read from the step's arguments as dynamo reads them; None where
    an input comes from anywhere else (a global, say) or has no source."""
    consts: dict[str, object] = {}
    items = []
    for i, name in enumerate(sources):
        if name is not None and name.startswith("L['self']"):
            consts[f"_c{i}"] = eval(name, {"L": {"self": model}})  # a source: dynamo's own expression
            items.append(f"_c{i}")
        elif name is not None and name.startswith(("L['tokens']", "L['kv']")):
            items.append(name)
        else:
            return None
    return eval("lambda L: (" + ", ".join(items) + ",)", consts)


class Replay:
    """A graph of the step to call again without dynamo's frame: `graph` over the inputs `inputs` reads
    from the step's arguments, where `guards` (dynamo's own, for the entry that ran it) hold on them."""

    def __init__(self, graph: Graph, inputs, guards, mode: tuple) -> None:
        self.graph, self.inputs, self.guards, self.mode = graph, inputs, guards, mode

    @classmethod
    def of(cls, ran: tuple, logits: Tensor, code, frame: dict, mode: tuple) -> Replay | None:
        """The replay of the graph that dynamo just ran (`ran`: the graph, its inputs, its outputs) for the
        locals `frame` of `code` ({"self", "tokens", "kv"}) and returned `logits` from; None where the
        step's result is not the graph's one output as it is, where no entry of `code` has guards that
        hold for `frame`, or where reading the inputs again does not give back those very inputs (the
        same tensors, the same ints)."""
        graph, args, out = ran
        if not (isinstance(out, (list, tuple)) and len(out) == 1 and out[0] is logits):
            return None
        inputs = graph.inputs_from(frame["self"])
        if inputs is None:
            return None
        try:
            again = inputs(frame)
        except Exception:  # a source that does not read back here: no replay
            return None
        if len(again) != len(args) or not all(
            a is b if isinstance(b, Tensor) else (type(a) is type(b) and a == b) for a, b in zip(again, args)
        ):
            return None
        try:
            # dynamo tries its entries in order and runs the first whose guards hold: the one that just ran
            entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)
            guards = next((e.guard_manager for e in entries if e.guard_manager.check(frame)), None)
        except (AttributeError, TypeError):  # a torch without these: no replay
            return None
        return None if guards is None else cls(graph, inputs, guards, mode)

    def run(self, frame: dict) -> Tensor | None:
        """The logits, or None (nothing run) where the guards do not hold for `frame`."""
        if not self.guards.check(frame):
            return None
        return self.graph.compiled(*self.inputs(frame))[0]


class ModeStep(NamedTuple):
    """A decoder's compiled step for one activation mode: the compiled function, its backend, and the
    code object dynamo keeps the step's entries on."""

    fn: object
    backend: Graphs
    code: types.CodeType


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
        self._by_mode: dict[tuple[str, ...], ModeStep] = {}  # the experts' activation modes -> the compiled step
        self._replay: Replay | None = None  # the graph the last step through dynamo ran
        self.replay = True  # whether a step may skip dynamo's frame (`Replay`); False: every step through dynamo
        self.replayed = 0  # steps that did
        self.compile_seconds: float | None = None  # wall time of the first compiled call
        self.calls = 0

    def _mode_step(self, mode: tuple) -> ModeStep:
        """The compiled step of the experts' activation `mode`, made on first use."""
        made = self._by_mode.get(mode)
        if made is None:
            f = type(self._model).decode_step
            own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
            # cpp_wrapper: the ~40 kernel calls of a step are made from generated C++, not Python (bf16
            # step of the 20M model 3.13 -> 2.66 ms, medians of 6 alternating runs in one process).
            backend = Graphs({"cpp_wrapper": True})
            options = {"guard_filter_fn": guards_off_the_model}
            method = types.MethodType(own, self._model)
            fn = torch.compile(method, backend=backend, dynamic=False, fullgraph=True, options=options)
            made = self._by_mode[mode] = ModeStep(fn, backend, own.__code__)
        return made

    def __deepcopy__(self, memo: dict) -> None:
        """A copy of the model has weights of its own, which this decoder does not read (and dynamo's
        guards cannot be copied): the copy has no compiled decoder until `prepare_for_inference(...,
        compile_decode=True)` gives it one."""
        return None

    @staticmethod
    def _weights_key(model) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in model.parameters())

    def current(self, model) -> bool:
        """Whether `model`'s parameters are still the tensors (and versions) this decoder was built over."""
        return self._weights_key(model) == self._captured

    def step(self, kv: StaticKV, tokens: Tensor) -> Tensor:
        """Run tokens (B,) through the compiled step over `kv`; the logits (B, V) in the model's dtype: by
        the graph the step before ran where its guards hold (`Replay`), else through dynamo."""
        mode = tuple(experts.activations for experts in self._mxfp4)
        frame = {"self": self._model, "tokens": tokens, "kv": kv}
        replay = self._replay if self.replay else None
        logits = replay.run(frame) if replay is not None and replay.mode == mode else None
        if logits is not None:
            self.replayed += 1
        else:
            made = self._mode_step(mode)
            t0 = time.perf_counter() if self.compile_seconds is None else 0.0
            logits = made.fn(tokens, kv)
            if self.compile_seconds is None:
                self.compile_seconds = time.perf_counter() - t0
            ran = made.backend.take_last()
            self._replay = None if ran is None else Replay.of(ran, logits, made.code, frame, mode)
        self.calls += 1
        return logits
