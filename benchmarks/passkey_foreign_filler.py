"""Passkey retrieval in a haystack unlike anything the model was trained on.

The evaluator's filler and the training filler are both plain English sentences. This probe builds
the haystack from the Python reference documentation that ships with the interpreter
(`pydoc_data.topics`: prose mixed with code, brackets and symbols; digits removed so the passkey is
the only number), puts the needle at start, middle and end, and scores like docs/passkey.md (greedy 16
tokens through the cached path, first 5-digit number). Offline; the text depends on the Python
version (the figures in docs/passkey.md are from Python 3.11).

    python benchmarks/passkey_foreign_filler.py --lengths 1024 4096 --trials 10
"""

from __future__ import annotations

import argparse
import re

import torch

from gptoss_lite.checkpoint import DEFAULT_MODEL, load_model
from gptoss_lite.evals.passkey import PasskeyEvaluator, prompt_overhead


def python_docs_sentences() -> list[str]:
    """Sentences of the bundled Python reference docs, digit-free, each with a leading space."""
    from pydoc_data.topics import topics

    text = " ".join(topics[name] for name in sorted(topics))
    text = re.sub(r"\s+", " ", re.sub(r"[0-9]", "", text))
    return [" " + s.strip() for s in re.split(r"(?<=[.!?]) ", text) if 3 < len(s.strip()) < 300]


def haystack(sentences: list[str], budget: int, tokenizer) -> list[str]:
    """Leading sentences totalling at most `budget` tokens."""
    out, used = [], 0
    for s in sentences:
        n = len(tokenizer.encode(s))
        if used + n > budget:
            break
        out.append(s)
        used += n
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory (default: the shipped demo)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--trials", type=int, default=10, help="keys per length, each asked at 3 depths")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    evaluator = PasskeyEvaluator(model, lengths=args.lengths, n_trials=args.trials)
    sentences = python_docs_sentences()
    for length in args.lengths:
        filler = haystack(sentences, length - prompt_overhead(evaluator.tokenizer), evaluator.tokenizer)
        by_depth = {}
        for depth in evaluator.depths:
            hits = 0
            for key in evaluator.keys(length):
                ids = torch.tensor([evaluator.prompt_ids(length, key, depth, filler)])  # (1, T)
                hits += evaluator.answers(ids)[0][0] == key
            by_depth[depth] = hits
        total = sum(by_depth.values())
        cells = "  ".join(f"depth {d:g}: {h}/{args.trials}" for d, h in by_depth.items())
        print(
            f"{length:>6} tokens, Python-docs haystack: {total}/{args.trials * len(by_depth)} "
            f"({100 * total / (args.trials * len(by_depth)):.1f}%)  {cells}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
