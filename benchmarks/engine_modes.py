"""The compiled engine against the eager engine, in one process, on bench-serve's chat-like workload and the batch cell.

    python benchmarks/engine_modes.py MODEL_DIR --dtype float32 --rounds 3 --workloads chat batch16

One model (prepared with the compiled decode step), one engine per mode over it (`LLM`, prefix caching
off), taking turns on each workload, the order reversed every other round:

- `eager`: no compiled step (`compile_decode=False`), every step the eager forward;
- `compiled`: decode-only steps compiled, a step with a prompt chunk eager as a whole.

(Commit 73552d1 had a third mode, `split`: a step with prompt chunks ran its decode rows through the
compiled step and only the chunks eagerly; it measured 0.96-1.03x `compiled` and was removed.)

Workloads: `chat` is `gptoss-lite bench-serve`'s chat-like workload (64 requests at once, prompts 16-512
tokens, 32-256 new tokens, seed 0, step budget 512 and one decode token a round, as bench-serve runs
it); `batch16` is the peers harness's batch cell (16 prompts of 256 random tokens, 128 new each, the
engine's defaults: its offline step budget, decode bursts).
Greedy, EOS ignored; generated tokens over wall time; medians over rounds and the median of the per-round
ratios; every mode's tokens checked equal to the eager engine's (a count of equal requests: 16-bit
rounding may differ between batch shapes).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

MODES = ("eager", "compiled")


def _workload(name: str, llm):
    from gptoss_lite.engine import SamplingParams
    from gptoss_lite.engine.bench import WorkItem

    vocab = llm.config.vocab_size
    if name == "chat":  # bench-serve's own items for its chat-like command line
        from gptoss_lite.commands.bench_serve import _items

        chat = argparse.Namespace(
            requests=64, prompt_len=(16, 512), max_tokens=(32, 256), seed=0, shared_prefix=0, rate=float("inf")
        )
        return _items(llm, chat)
    import numpy as np

    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    return [WorkItem(rng.integers(0, vocab, 256).tolist(), params) for _ in range(16)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="model directory (HF gpt-oss or native layout) or a preset name")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=["chat", "batch16"], choices=["chat", "batch16"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--out", type=Path, default=None, help="write every sample as JSON")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from gptoss_lite.checkpoint import load_model
    from gptoss_lite.engine import LLM
    from gptoss_lite.engine.bench import run_workload

    model = load_model(args.model, dtype=getattr(torch, args.dtype))
    model.prepare_for_inference(compile_decode=True)
    base = args.modes[0]
    results: dict = {}
    for wl in args.workloads:
        # the chat workload as bench-serve runs it (its step budget and one decode token a round)
        budget = {"max_batch_tokens": 512, "decode_steps": 1} if wl == "chat" else {}
        engines = {}
        for mode in args.modes:
            engines[mode] = LLM(model, enable_prefix_caching=False, compile_decode=mode == "compiled", **budget)
        work = _workload(wl, next(iter(engines.values())))
        generated = sum(w.params.max_tokens for w in work)
        tokens, samples = {}, {m: [] for m in engines}
        for mode, llm in engines.items():  # warm-up, and the tokens each mode gives
            run_workload(llm, work[:4])
            tokens[mode] = _tokens(llm, work)
        same = {m: sum(a == b for a, b in zip(t, tokens[base])) for m, t in tokens.items()}
        for r in range(args.rounds):
            order = list(engines.items()) if r % 2 == 0 else list(reversed(engines.items()))
            for mode, llm in order:
                report = run_workload(llm, work)
                assert report.generated_tokens == generated
                samples[mode].append(report.generated_tps)
            print(f"{wl} round {r + 1}: " + ", ".join(f"{m} {samples[m][-1]:,.0f}" for m in engines), file=sys.stderr)
        results[wl] = {"samples": samples, "same_tokens": same, "requests": len(work)}
        _table(wl, args, samples, same, len(work))
    if args.out:
        cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        meta = {"dtype": args.dtype, "threads": args.threads, "rounds": args.rounds, "machine": platform.machine()}
        args.out.write_text(json.dumps({**meta, "results": results, "lscpu": cpu}, indent=1))
    return 0


def _tokens(llm, work) -> list[list[int]]:
    """Each request's generated tokens, in work order."""
    outs = llm.generate([w.prompt for w in work], [w.params for w in work])
    return [o.token_ids for o in outs]


def _table(wl: str, args, samples: dict, same: dict, n: int) -> None:
    modes = list(samples)
    print(f"\n# {wl}, {args.dtype}, {args.threads} threads, {args.rounds} rounds (generated tok/s)\n")
    heads = " | ".join(f"/ {m} (median of rounds)" for m in modes[:-1])
    print(f"| mode | tok/s (median) | {heads} | same tokens |")
    print("|---|---:|" + "---:|" * (len(modes) - 1) + "---:|")
    for m in modes:
        ratios = [statistics.median(a / b for a, b in zip(samples[m], samples[o])) for o in modes[:-1]]
        cells = " | ".join(f"{x:.2f}" for x in ratios)
        print(f"| {m} | {statistics.median(samples[m]):,.0f} | {cells} | {same[m]}/{n} |")


if __name__ == "__main__":
    sys.exit(main())
