"""Draft-model speculation inside the batched engine: generated tokens/s with and without a draft model.

Two engines on the shipped model, run in alternating rounds (plain, draft, plain, draft, ...) on the
same 16 requests of the training filler (1,000-1,500 tokens each, --max-tokens new tokens, greedy):
one plain, one with `speculate=DraftModel(D, k)`. D is `models/lite-256` (a trained model of the same
vocabulary and size: it drafts, and the target rejects much of it) or `self` (a copy of the target:
every draft is kept, the upper bound). Reports the median tokens/s of each engine over --rounds, the
acceptance rate and the draft model's forwards; --json prints one JSON object.

It uses only the engine's public API, so the same script measures another checkout of the package in
the same sitting (PYTHONPATH=OTHER/src): that is how the batched drafter was compared with the one
request at a time drafting before it (docs/benchmarks.md#draft-model-speculation-in-the-engine).

    python benchmarks/engine_draft.py --rounds 3 --threads 2
    python benchmarks/engine_draft.py --rounds 3 --threads 2 --draft self
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import torch
from engine_speculation import alternate

from gptoss_lite.checkpoint import default_model_source, load_model
from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.filler import sentence_generator
from gptoss_lite.speculative import DraftModel

ROOT = Path(__file__).resolve().parents[1]


def prompts(n: int, seed: int) -> list[str]:
    gen, rng = sentence_generator("varied"), random.Random(seed)
    out = []
    for _ in range(n):
        text = ""
        while len(text) < rng.randint(1000, 1500):
            text += gen(rng) + " "
        out.append(text.strip())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--draft", default="models/lite-256", help="a draft model directory, or 'self'")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="the target decodes eagerly")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    source = str(default_model_source())
    compile_decode = not args.no_compile
    plain = LLM(source, compile_decode=compile_decode)
    draft_model = load_model(source if args.draft == "self" else ROOT / args.draft)
    engines = {
        "plain": plain,
        "draft": LLM(source, compile_decode=compile_decode, speculate=DraftModel(draft_model, k=args.k)),
    }
    batch = prompts(args.requests, 0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rates, spec = alternate(engines, batch, params, args.rounds)
    drafter = getattr(engines["draft"], "_drafter", None)
    result = {
        "draft": args.draft,
        "k": args.k,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "compiled": compile_decode,
        "plain_tok_s": round(statistics.median(rates["plain"]), 1),
        "draft_tok_s": round(statistics.median(rates["draft"]), 1),
        "acceptance_rate": round(statistics.median(s["acceptance_rate"] for s in spec), 3),
        "verifications": statistics.median(s["verifications"] for s in spec),
        "draft_forwards": getattr(drafter, "forwards", None),
        "samples": rates,
    }
    result["speedup"] = round(result["draft_tok_s"] / result["plain_tok_s"], 3)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"draft {args.draft}, k={args.k}, {args.requests} requests x {args.max_tokens} tokens, "
            f"{args.threads} threads, median of {args.rounds}: plain {result['plain_tok_s']} tok/s, "
            f"draft {result['draft_tok_s']} tok/s ({result['speedup']}x), acceptance {result['acceptance_rate']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
