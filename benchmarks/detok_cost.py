"""Detokenisation cost per token as the output grows: the engine's TextStream against re-decoding the
whole output at every token (what the engine did before), at output token 100 and at token 4,000.

    python benchmarks/detok_cost.py [--rounds 7]

Tokenizers: the byte tokenizer of the shipped model, and a byte-level BPE `tokenizer.json` trained
here on a few words (multi-byte tokens, characters split across tokens; built offline with the
tokenizers library, as tests/engine/test_detokenize.py does). Each stream has four 64-character stop
strings that never match. The output is a fixed random id stream (seed 0). A window is 100
consecutive pushes (each followed by `take()`, as the engine does); its time / 100 is the cost per
token there. Figure: the median over --rounds fresh streams of the window starting at token 100 and
of the window starting at token 4,000, and their ratio (the target: at most 1.2x).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from gptoss_lite.engine.detokenize import TextStream
from gptoss_lite.tokenizer import ByteTokenizer, HFTokenizer

WINDOW = 100
EARLY, LATE = 100, 4000
STOPS = tuple(f"never-{i}-" + "z" * 56 for i in range(4))


def bpe_tokenizer(directory: Path) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = "the pass key café naïve 😀 €uro über straße 日本語 テキスト 52718 , .".split(" ")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]
    )
    tok.train_from_iterator([" ".join(words)] * 100, trainer)
    tok.save(str(directory / "tokenizer.json"))
    return HFTokenizer(directory)


def stream_costs(tokenizer, ids: list[int]) -> tuple[float, float]:
    """Seconds per token of the windows at EARLY and LATE, TextStream."""
    ts = TextStream(tokenizer, STOPS)
    marks = {}
    t0 = 0.0
    for i, token in enumerate(ids):
        if i in (EARLY, LATE):
            t0 = time.perf_counter()
        ts.push(token)
        ts.take()
        if i in (EARLY + WINDOW - 1, LATE + WINDOW - 1):
            marks[i - WINDOW + 1] = (time.perf_counter() - t0) / WINDOW
    return marks[EARLY], marks[LATE]


def redecode_costs(tokenizer, ids: list[int]) -> tuple[float, float]:
    """The same windows when each token re-decodes the whole output and scans it for the stops."""
    marks = {}
    for start in (EARLY, LATE):
        t0 = time.perf_counter()
        for i in range(start, start + WINDOW):
            text = tokenizer.decode(ids[: i + 1])
            any(stop in text for stop in STOPS)
        marks[start] = (time.perf_counter() - t0) / WINDOW
    return marks[EARLY], marks[LATE]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = {"byte": ByteTokenizer(), "BPE tokenizer.json": bpe_tokenizer(Path(tmp))}
        print(f"# Detokenisation cost per token, median of {args.rounds} streams\n")
        print("| tokenizer | path | µs/token at 100 | µs/token at 4,000 | ratio |")
        print("|---|---|---:|---:|---:|")
        for name, tok in tokenizers.items():
            rng = random.Random(0)
            ids = [rng.randrange(3, tok.vocab_size) for _ in range(LATE + WINDOW)]
            for path, measure in (("TextStream", stream_costs), ("re-decode", redecode_costs)):
                runs = [measure(tok, ids) for _ in range(args.rounds)]
                early = statistics.median(r[0] for r in runs)
                late = statistics.median(r[1] for r in runs)
                print(f"| {name} | {path} | {early * 1e6:.1f} | {late * 1e6:.1f} | {late / early:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
