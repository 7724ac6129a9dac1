"""Where one decode step of a model's time goes: torch.profiler over `generate()`'s steps, by op.

    python benchmarks/decode_profile.py ~/.cache/gptoss-lite/gpt-oss-20b-random --compiled
    python benchmarks/decode_profile.py gptoss-lite-502m --dtype float32 --context 2048

Loads the model (a directory or a preset) in `--dtype`, with the compiled decode step when `--compiled`,
prefills a seeded random `--context`-token prompt through `stream_generate`, then times `--steps`
greedy decode steps without the profiler (median and fastest, ms) and profiles `--profiled` more. The
table is the ops with the most self time per step. The weight kernels' rows also give GB/s (the bytes
one step reads through them, from the model's own shapes, over their time): `bf16_gemv` over
the dense bf16 weights, `mxfp4_gate_up_act` over the routed experts' gate|up codes and `mxfp4_matvec`
(or `mxfp4_matvec_int8`, with `--mxfp4-activations int8`) over the rest of their codes.
`--ab-ops OP...` then times `--ab-pairs` pairs of steps with those kernel ops served from C++
(`kernels/ops.cpp`) and from Python, alternating; `--ab-gate-up-act PAIRS` times pairs of steps with the
MXFP4 experts' gate|up activation in the product's pass and as separate passes; `--ab-bf16-gemv PAIRS`
pairs of steps with the dense bf16 projections through the bf16 GEMV op and through the graph a CPU
without it compiles; `--ab-replay PAIRS` pairs of compiled steps run straight where the guards of the
graph the step before ran hold and through dynamo's frame; `--ab-base REV` times
`--ab-pairs` pairs of steps with the weight kernels (`kernels/bf16.c`, `kernels/mxfp4.c`) as this
checkout has them and as git revision REV had them, both built here, the C++ ops rebound between the
two builds step by step (the same compiled graph calls either). Threads: `--threads`
(default 2). The first decode step includes compiling (or loading the compiled step from inductor's
cache) and is not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gptoss_lite.checkpoint import load_model
from gptoss_lite.generation import stream_generate
from gptoss_lite.kernels import mxfp4
from gptoss_lite.model.moe import MXFP4Experts


def weight_bytes(model) -> dict[str, int]:
    """Bytes a one-token step reads through each weight kernel: the dense bf16/fp32 matrices of every
    layer's attention and router plus the output head, and top_k routed experts' MXFP4 codes per layer
    (with the one-pass gate|up activation, `mxfp4_gate_up_act` reads the gate|up codes and the product
    ops the down codes only)."""
    dense = model.head_weight().numel() * model.head_weight().element_size()
    gate_up = down = 0
    for block in model.blocks:
        for p in (*block.attn.parameters(), block.moe.router.weight):
            if p.dim() == 2:
                dense += p.numel() * p.element_size()
        ex = block.moe.experts
        if isinstance(ex, MXFP4Experts):
            gate_up += block.moe.top_k * (ex.gate_up_blocks[0].numel() + ex.gate_up_scales[0].numel())
            down += block.moe.top_k * (ex.down_blocks[0].numel() + ex.down_scales[0].numel())
    products = down if gate_up and mxfp4.gate_up_act_available() else gate_up + down
    return {"bf16_gemv": dense, "mxfp4_matvec": products, "mxfp4_matvec_int8": products, "mxfp4_gate_up_act": gate_up}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model directory or a preset name")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--compiled", action="store_true", help="the compiled decode step")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profiled", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument(
        "--ab-ops",
        nargs="+",
        default=None,
        help="then time these kernel ops from C++ against their Python implementations, step by step",
    )
    ap.add_argument(
        "--ab-base",
        metavar="REV",
        help="then time the weight kernels (bf16.c, mxfp4.c) of this checkout against git revision REV's",
    )
    ap.add_argument("--ab-pairs", type=int, default=40, help="pairs of steps for --ab-ops and --ab-base")
    ap.add_argument(
        "--ab-gate-up-act",
        type=int,
        default=0,
        metavar="PAIRS",
        help="then time PAIRS pairs of steps with the MXFP4 experts' one-pass gate|up activation and without",
    )
    ap.add_argument(
        "--ab-bf16-gemv",
        type=int,
        default=0,
        metavar="PAIRS",
        help="then time PAIRS pairs of steps with the dense bf16 projections through the bf16 GEMV op and without",
    )
    ap.add_argument(
        "--ab-replay",
        type=int,
        default=0,
        metavar="PAIRS",
        help="then time PAIRS pairs of compiled steps run straight where the guards hold and through dynamo",
    )
    ap.add_argument("--mxfp4-activations", default="exact", choices=["exact", "int8"], help="packed experts' path")
    args = ap.parse_args()
    if min(args.context, args.steps, args.profiled, args.threads, args.top) < 1:
        ap.error("--context, --steps, --profiled, --threads and --top must be at least 1")
    if args.ab_replay and not args.compiled:
        ap.error("--ab-replay times the compiled step: add --compiled")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model = load_model(args.model, dtype=getattr(torch, args.dtype), mxfp4_activations=args.mxfp4_activations)
    if args.compiled:
        model.prepare_for_inference(compile_decode=True)
    print(f"loaded {args.model} ({args.dtype}) in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (1, args.context), generator=torch.Generator().manual_seed(args.context))
    # the A/B steps: --ab-ops' and --ab-base's pairs; --ab-gate-up-act's pairs and 4 untimed (each setting
    # compiled, checked)
    ab = 2 * args.ab_pairs * (bool(args.ab_ops) + bool(args.ab_base))
    ab += sum(2 * n + 4 for n in (args.ab_gate_up_act, args.ab_bf16_gemv) if n) + 2 * args.ab_replay
    steps = stream_generate(model, ids, 2 + args.steps + args.profiled + ab, temperature=0)
    t0 = time.perf_counter()
    next(steps)
    print(f"prefill of {args.context} tokens: {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    next(steps)
    print(f"first decode step (compiles or loads the step when --compiled): {time.perf_counter() - t0:.1f} s")
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        next(steps)
        walls.append(time.perf_counter() - t0)
    step_ms = 1e3 * statistics.median(walls)
    print(f"decode step: median {step_ms:.1f} ms, fastest {1e3 * min(walls):.1f} ms over {args.steps} steps")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profiled):
            next(steps)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / args.profiled / 1e3
    nbytes = weight_bytes(model)
    print(f"profiled {args.profiled} steps, {total:.1f} ms of self time a step:")
    print(f"  {'op':<60} {'ms/step':>8} {'calls/step':>10} {'GB/s':>6}")
    for e in rows:
        ms = e.self_cpu_time_total / args.profiled / 1e3
        kernel = e.key.split("::")[-1]
        rate = f"{nbytes[kernel] / ms / 1e6:6.1f}" if nbytes.get(kernel) else ""
        print(f"  {e.key[:60]:<60} {ms:8.1f} {e.count / args.profiled:10.0f} {rate:>6}")
    if args.ab_ops:
        ab_cpp_ops(steps, args.ab_ops, args.ab_pairs)
    if args.ab_gate_up_act:
        ab_gate_up_act(steps, args.ab_gate_up_act)
    if args.ab_bf16_gemv:
        ab_bf16_gemv(steps, args.ab_bf16_gemv)
    if args.ab_base:
        ab_base(steps, args.ab_base, args.ab_pairs)
    if args.ab_replay:
        ab_replay(steps, model.compiled_decoder, args.ab_replay)


def alternate(steps, pairs: int, switch) -> tuple[float, float, float]:
    """Steps in pairs, one with `switch(True)` and one with `switch(False)`, the order swapped every pair:
    the median step of each setting and the median of the pairs' ratios, off / on (seconds, seconds, ratio)."""
    walls: dict[bool, list[float]] = {True: [], False: []}
    for p in range(pairs):
        for on in (True, False) if p % 2 == 0 else (False, True):
            switch(on)
            t0 = time.perf_counter()
            next(steps)
            walls[on].append(time.perf_counter() - t0)
    ratio = statistics.median(off / on for on, off in zip(walls[True], walls[False]))
    return statistics.median(walls[True]), statistics.median(walls[False]), ratio


def ab_replay(steps, decoder, pairs: int) -> None:
    """`alternate` with the compiled step run straight where the guards of the graph the step before ran
    hold (on: `CompiledDecoder.replay`) and through dynamo's frame every step (off)."""
    before = decoder.replayed
    try:
        straight, dynamo, ratio = alternate(steps, pairs, lambda on: setattr(decoder, "replay", on))
    finally:
        decoder.replay = True
    print(
        f"compiled step run straight: median step {1e3 * straight:.3f} ms, through dynamo {1e3 * dynamo:.3f} ms; "
        f"dynamo / straight over {pairs} pairs: median {ratio:.4f} ({decoder.replayed - before} steps run straight)"
    )


def ab_cpp_ops(steps, ops: list[str], pairs: int) -> None:
    """`alternate` with `ops` served from C++ (on) and from Python (off), the other ops left as they are."""
    from gptoss_lite.kernels import cpp_ops

    missing = set(ops) - cpp_ops.bound()
    if missing:
        print(f"--ab-ops: not served from C++ here: {', '.join(sorted(missing))}")
        return
    try:
        cpp, python, ratio = alternate(steps, pairs, lambda on: cpp_ops.use_cpp(on, ops))
    finally:
        cpp_ops.use_cpp(True, ops)
    print(
        f"{', '.join(ops)} from C++: median step {1e3 * cpp:.2f} ms, from Python {1e3 * python:.2f} ms; "
        f"Python / C++ over {pairs} pairs: median {ratio:.4f}"
    )


def ab_graphs(steps, pairs: int, owner: object, name: str, op: str, label: str) -> None:
    """`alternate` with the kernel op `op` in the compiled step (on) and without it (off: the graph a CPU
    without the kernel compiles), switched through owner.`name` (`kernel_versions.switched`). Each
    setting's first step compiles or loads its graph, untimed, and is checked to follow the switch."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernel_versions import switched

    with switched(owner, name) as use:
        for on in (True, False):
            use(on)
            next(steps)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                next(steps)
            called = any(e.key == f"gptoss_lite::{op}" for e in prof.key_averages())
            assert called == on, "the compiled step did not follow the switch"
        with_op, without, ratio = alternate(steps, pairs, use)
    print(
        f"{label}: median step {1e3 * with_op:.2f} ms, without {1e3 * without:.2f} ms; "
        f"without / with over {pairs} pairs: median {ratio:.4f}"
    )


def ab_gate_up_act(steps, pairs: int) -> None:
    """The MXFP4 experts' gate|up product, bias, rounding and activation in one pass
    (`kernels.mxfp4.gate_up_act`, on) against the product followed by the separate passes (what every
    CPU without AVX-512 runs)."""
    from gptoss_lite.model import moe

    if not mxfp4.gate_up_act_available():
        print("--ab-gate-up-act: the one-pass activation is not built here (it needs AVX-512)")
        return
    ab_graphs(steps, pairs, moe, "gate_up_act_available", "mxfp4_gate_up_act", "gate|up activation in one pass")


def ab_bf16_gemv(steps, pairs: int) -> None:
    """The dense bf16 projections through the bf16 GEMV op (`kernels/bf16.c`, on) against the graph
    without it (inductor's reductions for one row, fp32 products for several: what a CPU without the
    kernel runs)."""
    from gptoss_lite.kernels import bf16

    if not bf16.available():
        print("--ab-bf16-gemv: the bf16 GEMV is not built here (it needs AVX2 and FMA)")
        return
    ab_graphs(steps, pairs, bf16, "traceable", "bf16_gemv", "dense bf16 projections through the bf16 GEMV")


# the C++ ops each weight kernel's library serves: (op, C function, whether its flags say bf16 dot products)
KERNEL_OPS = {
    "bf16": [("bf16_gemv", "gl_bf16_gemv", False)],
    "mxfp4": [
        ("mxfp4_matvec", "gl_mxfp4_matvec", True),
        ("mxfp4_matvec_int8", "gl_mxfp4_matvec_q8", False),
        ("mxfp4_gate_up_act", "gl_mxfp4_gate_up_act", True),
    ],
}


def ab_base(steps, revision: str, pairs: int) -> None:
    """`alternate` with the weight kernels' ops bound to this checkout's build (on) and to `revision`'s
    (off); the ops bound before are bound again after."""
    from gptoss_lite.kernels import cpp_ops

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernel_versions import base_and_here  # built as the project builds here (GPTOSS_LITE_CPU too)

    bound = cpp_ops.bound()
    with tempfile.TemporaryDirectory() as tmp:
        builds: list[tuple[str, list, list]] = []  # (op, [base function, this checkout's], flags of each)
        loaded = []  # the libraries, alive while their functions are bound
        for kernel, ops in KERNEL_OPS.items():
            (Path(tmp) / kernel).mkdir()
            libs = base_and_here(revision, kernel, Path(tmp) / kernel)
            loaded += libs
            for op, name, dot in ops:
                if op in bound:
                    flags = [int(bool(lib.gl_has_bf16_dot())) if dot else 0 for lib in libs]
                    builds.append((op, [getattr(lib, name) for lib in libs], flags))
        if not builds:
            print("--ab-base: no weight kernel op is served from C++ here")
            return
        before = {op: cpp_ops._functions[op] for op, _, _ in builds}  # bound again after

        def use(on: bool) -> None:
            for op, fns, flags in builds:
                cpp_ops.rebind(op, fns[on], flags[on])

        try:
            here, base, ratio = alternate(steps, pairs, use)
        finally:
            for op, (fn, flags) in before.items():
                cpp_ops.rebind(op, fn, flags)
    ops = ", ".join(op for op, _, _ in builds)
    print(
        f"weight kernels ({ops}) of this checkout: median step {1e3 * here:.2f} ms, of {revision} "
        f"{1e3 * base:.2f} ms; {revision} / this over {pairs} pairs: median {ratio:.4f}"
    )


if __name__ == "__main__":
    main()
