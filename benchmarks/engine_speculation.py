"""Speculative decoding inside the batched engine: tokens/s with and without prompt lookup, same sitting.

Two workloads, each run by two engines in alternating rounds (plain, lookup, plain, lookup, ...):

- `repeat`: the shipped demo model on 16 prompts of its training filler (a paragraph written twice);
  its greedy answers are long runs of repeated text, what prompt lookup drafts well (the model was
  trained to copy passkeys, not to edit code: this is the copy-heavy case it can show);
- `random`: the random gpt-oss-bench-20m model on random prompts, where drafts rarely match: the
  cost of speculating for nothing.

Each engine is warmed up on two requests first. Reports per workload the median generated tokens/s of
each engine over --rounds rounds, their ratio, the acceptance rate (draft tokens kept / drafted) and
the tokens per verification; --json prints one JSON object.

The prompts are 800-1,500 tokens. With the default 128 new tokens their prefill is most of the
time; --max-tokens 1024 is the editing case, where the output is about as long as the prompt it
repeats.

    python benchmarks/engine_speculation.py --rounds 3 --threads 2
    python benchmarks/engine_speculation.py --rounds 3 --threads 2 --max-tokens 1024
    python benchmarks/engine_speculation.py --rounds 3 --threads 2 --no-compile
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import warnings

import torch

from gptoss_lite.checkpoint import default_model_source
from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.filler import sentence_generator
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.speculative import PromptLookup


def repeat_prompts(n: int, seed: int) -> list[str]:
    gen, rng = sentence_generator("varied"), random.Random(seed)
    out = []
    for _ in range(n):
        sentences = [gen(rng) for _ in range(12)]
        text = " ".join(sentences)
        out.append(f"{text} {text} {' '.join(sentences[:2])}")
    return out


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(64, 512))] for _ in range(n)]


def one_round(llm: LLM, prompts, params: SamplingParams) -> tuple[float, dict]:
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    after = llm.stats()
    drafted = after.spec_drafted - before.spec_drafted
    accepted = after.spec_accepted - before.spec_accepted
    verifications = after.spec_verifications - before.spec_verifications
    emitted = after.spec_tokens - before.spec_tokens
    spec = {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_verification": emitted / verifications if verifications else 0.0,
        "verifications": verifications,
    }
    return sum(len(o.token_ids) for o in outs) / seconds, spec


def alternate(engines: dict[str, LLM], prompts, params: SamplingParams, rounds: int, label: str = ""):
    """Warm each engine up on two requests, then run `rounds` rounds of every engine in turn (prefix
    cache cleared first): (tokens/s per engine, the speculation figures of the last engine's rounds)."""
    for llm in engines.values():
        llm.generate(prompts[:2], params)  # warm-up
    rates: dict[str, list[float]] = {k: [] for k in engines}
    spec: list[dict] = []
    last = list(engines)[-1]
    for r in range(rounds):
        for key, llm in engines.items():
            llm.clear_prefix_cache()
            tps, s = one_round(llm, prompts, params)
            rates[key].append(tps)
            if key == last:
                spec.append(s)
            print(f"  {label}round {r + 1} {key:6s} {tps:8.1f} tok/s", file=sys.stderr)
    return rates, spec


def workload(name: str, source: str, prompts, args) -> dict:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    engines = {
        "plain": LLM(source, compile_decode=not args.no_compile),
        "lookup": LLM(source, compile_decode=not args.no_compile, speculate=PromptLookup(k=args.draft_tokens)),
    }
    rates, spec = alternate(engines, prompts, params, args.rounds, f"{name} ")
    plain, lookup = statistics.median(rates["plain"]), statistics.median(rates["lookup"])
    return {
        "workload": name,
        "model": source,
        "requests": len(prompts),
        "max_tokens": args.max_tokens,
        "plain_tok_s": round(plain, 1),
        "lookup_tok_s": round(lookup, 1),
        "speedup": round(lookup / plain, 3),
        "acceptance_rate": round(statistics.median(s["acceptance_rate"] for s in spec), 3),
        "tokens_per_verification": round(statistics.median(s["tokens_per_verification"] for s in spec), 2),
        "samples": rates,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true", help="both engines decode eagerly")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="the repeat workload's model (default: the shipped one)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*RANDOM weights.*")
    shipped = args.model or str(default_model_source())
    vocab = resolve_config("gpt-oss-bench-20m").vocab_size
    results = [
        workload("repeat", shipped, repeat_prompts(args.requests, 0), args),
        workload("random", "gpt-oss-bench-20m", random_prompts(args.requests, vocab, 0), args),
    ]
    if args.json:
        print(json.dumps({"threads": args.threads, "compiled": not args.no_compile, "results": results}, indent=2))
        return 0
    print(f"engine speculation (prompt lookup, k={args.draft_tokens}), {args.threads} threads, median of {args.rounds}")
    print(
        f"{'workload':10s} {'plain tok/s':>12s} {'lookup tok/s':>13s} {'ratio':>7s} "
        f"{'accepted':>9s} {'tok/verify':>11s}"
    )
    for r in results:
        print(
            f"{r['workload']:10s} {r['plain_tok_s']:12.1f} {r['lookup_tok_s']:13.1f} {r['speedup']:6.2f}x "
            f"{r['acceptance_rate']:8.1%} {r['tokens_per_verification']:11.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
