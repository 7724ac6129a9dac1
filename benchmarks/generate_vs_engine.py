"""Single-request decode: compiled `generate()` against the compiled engine, interleaved in one sitting.

    python benchmarks/generate_vs_engine.py MODEL_DIR --dtype float32 --threads 2 --rounds 5

One random prompt of `--prompt` tokens (`numpy.random.default_rng(1)`), greedy, EOS ignored. Each path
runs the prompt with 1 new token and with 1 + `--new` new tokens; the decode rate is `--new` divided by
the difference of the two wall times, so the prefill (the same work in both runs) cancels. `generate()`
runs the model's compiled decode step over its `MixedKVCache` (one row); the engine (`LLM`,
`compile_decode=True`, prefix caching off) runs it over block tables (a lone request on a one-row
graph of its own), plus its scheduler and sampler each step. Paths alternate within a round and the order
alternates between rounds; the table gives medians and the ratio generate / engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model directory (HF gpt-oss or native layout)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--out", type=Path, default=None, help="write every sample as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from gptoss_lite.checkpoint import load_model
    from gptoss_lite.engine import LLM, SamplingParams
    from gptoss_lite.generation import generate

    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, dtype=dtype).prepare_for_inference(compile_decode=True)
    llm = LLM(args.model, dtype=dtype, compile_decode=True, enable_prefix_caching=False)
    prompt = np.random.default_rng(1).integers(1, model.config.vocab_size, args.prompt).tolist()
    ids = torch.tensor([prompt])

    def run_generate(n: int) -> float:
        t0 = time.perf_counter()
        out = generate(model, ids, max_new_tokens=n, temperature=0.0, stop_tokens=[])
        wall = time.perf_counter() - t0
        assert out.shape[1] == args.prompt + n, "generate() stopped early"
        return wall

    def run_engine(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)
        wall = time.perf_counter() - t0
        assert len(out[0].token_ids) == n
        return wall

    paths = {"generate() compiled": run_generate, "engine compiled": run_engine}
    for fn in paths.values():  # compile (or load) and warm up, untimed
        fn(1), fn(1 + args.new)
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(args.rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for name in order:
            short, long = paths[name](1), paths[name](1 + args.new)
            samples[name].append(args.new / (long - short))
        print(f"[generate_vs_engine] round {r + 1}: " + ", ".join(f"{n} {samples[n][-1]:.0f}" for n in order),
              file=sys.stderr)  # fmt: skip
    med = {name: statistics.median(v) for name, v in samples.items()}
    print(f"# Single-request decode, {args.dtype}, {args.threads} threads, {args.prompt}-token prompt, "
          f"median of {args.rounds} rounds\n")  # fmt: skip
    print("| path | decode tok/s | rounds |")
    print("|---|---:|---|")
    for name, value in med.items():
        print(f"| {name} | {value:,.0f} | {' / '.join(f'{v:.0f}' for v in samples[name])} |")
    print(f"\ngenerate() / engine: {med['generate() compiled'] / med['engine compiled']:.2f}")
    if args.out is not None:
        info = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "prompt": args.prompt}
        args.out.write_text(json.dumps({**info, "new": args.new, "samples": samples, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
