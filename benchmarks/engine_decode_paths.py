"""The engine's decode fast paths, each switched off and on in turns in one process.

    python benchmarks/engine_decode_paths.py MODEL_DIR --dtype float32 --rounds 20 \\
        [--paths plain_decode,append_in_place,argmax|bursts] [--out benchmarks/results/engine_decode_paths.json]

Workload: the batch of `serve_vs_vllm.py` and the peers' batch cell (16 requests of 256 random prompt
tokens, `numpy.random.default_rng(10_000 + i)`, 128 new tokens each, greedy, EOS ignored, all submitted
at once) through one `LLM` with the compiled decode step and prefix caching off. The paths (see
docs/engine.md, "The decode step's own fast paths"):

- `plain_decode`: the runner builds a plain decode step's `PagedDecode` straight from it
  (`ModelRunner.plain_decode`), where off it builds a `PagedBatch` and asks its `static()`;
- `append_in_place`: the scheduler's allocation appends a decode token in place
  (`KVManager._in_place`), where off it takes the general path;
- `argmax`: greedy rows through `kernels.rows.argmax`, where off torch.argmax;
- `bursts` (not in the default set): decode bursts of up to the engine's `decode_steps` (docs/engine.md,
  "Decode bursts"), where off one token a scheduling round. Without it in `--paths` the engine runs one
  token a round throughout (the single-step paths above are what a burst bypasses).

Before timing, the batch runs once with the chosen paths off and once on, and the tokens must be the
same. Then each round runs the batch with them off and on, in an order that alternates between rounds.
Figure: wall seconds of one `generate` call; the table gives each side's median and the median of the
per-round ratios off / on (> 1: the paths make the batch faster).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from gptoss_lite.checkpoint import load_model
from gptoss_lite.engine import LLM, SamplingParams, kv_manager
from gptoss_lite.kernels import rows as rows_kernel

PATHS = ("plain_decode", "append_in_place", "argmax", "bursts")
DEFAULT_PATHS = PATHS[:3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    choices = ", ".join(PATHS)
    ap.add_argument("--paths", default=",".join(DEFAULT_PATHS), help=f"comma-separated, of {choices} (default: 1st 3)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown or not paths:
        ap.error(f"--paths: unknown {unknown}; choose from {', '.join(PATHS)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=getattr(torch, args.dtype))
    model.prepare_for_inference(compile_decode=True)
    llm = LLM(model, enable_prefix_caching=False)
    vocab = model.config.vocab_size
    prompts = [np.random.default_rng(10_000 + i).integers(1, vocab, 256).tolist() for i in range(16)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)

    on = {
        "plain_decode": llm.runner.plain_decode,
        "append_in_place": kv_manager.KVManager._in_place,
        "argmax": rows_kernel.argmax,
        "bursts": llm.scheduler.decode_steps,
    }
    if "bursts" not in paths:
        llm.scheduler.decode_steps = 1
    off = {
        "plain_decode": lambda step: None,
        "append_in_place": lambda *a: False,
        "argmax": lambda x: None,
        "bursts": 1,
    }

    def use(fast: bool) -> None:
        for path in paths:
            fn = (on if fast else off)[path]
            if path == "plain_decode":
                llm.runner.plain_decode = fn
            elif path == "append_in_place":
                kv_manager.KVManager._in_place = fn
            elif path == "bursts":
                llm.scheduler.decode_steps = fn
            else:
                rows_kernel.argmax = fn

    tokens = {}
    for fast in (False, True):
        use(fast)
        tokens[fast] = [out.token_ids for out in llm.generate(prompts, params)]
    if tokens[False] != tokens[True]:
        raise SystemExit("the fast paths changed the tokens")

    walls: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.rounds):
        for fast in (False, True) if r % 2 == 0 else (True, False):
            use(fast)
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            walls[fast].append(time.perf_counter() - t0)
    use(True)
    ratios = [a / b for a, b in zip(walls[False], walls[True])]
    result = {
        "model": str(args.model),
        "dtype": args.dtype,
        "threads": args.threads,
        "paths": paths,
        "rounds": args.rounds,
        "machine": platform.machine(),
        "lscpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "off_s": walls[False],
        "on_s": walls[True],
        "median_off_s": statistics.median(walls[False]),
        "median_on_s": statistics.median(walls[True]),
        "median_ratio": statistics.median(ratios),
        "same_tokens": True,
    }
    print(
        f"{args.dtype}, paths {'+'.join(paths)}: off {result['median_off_s'] * 1e3:.0f} ms, "
        f"on {result['median_on_s'] * 1e3:.0f} ms, off/on {result['median_ratio']:.3f} "
        f"(median of {args.rounds} rounds); the same tokens"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
