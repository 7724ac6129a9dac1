"""The kernels' ops called from C++ (`kernels/ops.cpp`) against their Python implementations, on the
compiled paths that call them: the engine's batch-16 cell, one request through the engine, and one
request through compiled `generate()`.

    python benchmarks/engine_cpp_ops.py MODEL_DIR --dtype float32 --rounds 6

One process, one model and one engine (`LLM`, `compile_decode=True`, prefix caching off); the two
implementations are switched through the dispatcher (`cpp_ops.use_cpp`), so the same compiled graphs
run both, and they take turns cell by cell, the order alternating between rounds:

- batch-16: 16 random `--prompt`-token prompts (256 by default), 128 new tokens each, greedy, EOS
  ignored: generated tokens over wall time;
- engine 1 and generate() 1: one such prompt decoded with 1 and 1 + `--new` new tokens; the
  decode rate is `--new` over the difference of the two wall times (the prefill cancels).

The table gives medians over rounds and the median of the per-round ratios (C++ / Python).
`--ops` switches only the named ops (the others stay C++: one op's share), `--cells` times only some
cells, `--prompt` sets the prompts' length; for gpt-oss-20b's one-token products:

    python benchmarks/engine_cpp_ops.py ~/.cache/gptoss-lite/gpt-oss-20b-random --dtype bfloat16 \
        --cells "engine 1" "generate() 1" --new 16 --rounds 5 --ops bf16_gemv mxfp4_matvec
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

CELLS = ("batch-16", "engine 1", "generate() 1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model directory (HF gpt-oss or native layout)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (the batch's and the single request's)")
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS), help="which cells to time")
    ap.add_argument(
        "--ops", nargs="+", default=None, help="switch only these ops (the others stay C++); default: every bound op"
    )
    ap.add_argument("--out", type=Path, default=None, help="write every sample as JSON")
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from gptoss_lite.checkpoint import load_model
    from gptoss_lite.engine import LLM, SamplingParams
    from gptoss_lite.generation import generate
    from gptoss_lite.kernels import cpp_ops

    model = load_model(args.model, dtype=getattr(torch, args.dtype))
    model.prepare_for_inference(compile_decode=True)
    llm = LLM(model, enable_prefix_caching=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.config.vocab_size, args.prompt).tolist() for _ in range(16)]
    one = torch.tensor([prompts[0]])

    def batch() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
        assert all(len(o.token_ids) == 128 for o in outs)
        return 16 * 128 / (time.perf_counter() - t0)

    def engine_one(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([prompts[0]], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - t0

    def generate_one(n: int) -> float:
        t0 = time.perf_counter()
        generate(model, one, max_new_tokens=n, temperature=0)
        return time.perf_counter() - t0

    every = {
        "batch-16": batch,
        "engine 1": lambda: args.new / (engine_one(1 + args.new) - engine_one(1)),
        "generate() 1": lambda: args.new / (generate_one(1 + args.new) - generate_one(1)),
    }
    cells = {name: every[name] for name in args.cells}
    for cell in cells.values():  # warm-up: graphs compiled or loaded, kernels built and bound
        cell()
    served = cpp_ops.bound()
    if not served:
        print("no op is served from C++ here (no C++ compiler, or GPTOSS_LITE_NO_CPP_OPS=1)", file=sys.stderr)
        return 1
    switched = served if args.ops is None else served & set(args.ops)
    if args.ops is not None and switched != set(args.ops):
        print(f"not served from C++ here: {', '.join(sorted(set(args.ops) - served))}", file=sys.stderr)
        return 1
    samples: dict[str, dict[str, list[float]]] = {"C++": {c: [] for c in cells}, "Python": {c: [] for c in cells}}
    for r in range(args.rounds):
        for name, cell in cells.items():
            for path in ["C++", "Python"] if r % 2 == 0 else ["Python", "C++"]:
                cpp_ops.use_cpp(path == "C++", switched)
                samples[path][name].append(cell())
        print(f"round {r + 1}: " + ", ".join(
            f"{c} {samples['C++'][c][-1]:,.0f} / {samples['Python'][c][-1]:,.0f}" for c in cells
        ), file=sys.stderr, flush=True)  # fmt: skip
    cpp_ops.use_cpp(True)
    print(f"# Kernel ops from C++ against Python, {args.dtype}, {args.threads} threads, {args.rounds} rounds")
    print(f"\nC++ ops here: {', '.join(sorted(served))}; switched: {', '.join(sorted(switched))}\n")
    print("| cell (tok/s) | C++ ops | Python ops | C++ / Python (median of rounds) |")
    print("|---|---:|---:|---:|")
    for c in cells:
        cpp, py = samples["C++"][c], samples["Python"][c]
        ratio = statistics.median(a / b for a, b in zip(cpp, py))
        print(f"| {c} | {statistics.median(cpp):,.0f} | {statistics.median(py):,.0f} | {ratio:.2f} |")
    if args.out:
        record = {
            "dtype": args.dtype,
            "rounds": args.rounds,
            "prompt": args.prompt,
            "new": args.new,
            "cpp_ops": sorted(served),
            "switched": sorted(switched),
            "samples": samples,
        }
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
