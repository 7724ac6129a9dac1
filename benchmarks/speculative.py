"""Decode tokens/s of plain greedy decoding vs prompt-lookup speculative decoding.

Model: the shipped demo model (`gptoss_lite.checkpoint.DEFAULT_MODEL`, trained at 256 tokens), fp32,
one thread (torch.set_num_threads(1)). Greedy; every speculative output is checked to equal the plain
one token for token. Prompts:

- passkey: the passkey evaluator's prompt (`PasskeyEvaluator.prompt_ids`) at 4,096 tokens, 16x the
  training context; one trial per key (depths cycle 0 / 0.5 / 1). The evaluator generates at most 16
  tokens and stops at end-of-text (the model answers " 70131." and stops: ~8 tokens, a few decode
  steps), far too few to time one by one. So two measurements: "answer", the evaluator's exact run,
  with decode tokens and seconds pooled over all trials and rounds; and a sustained one that decodes
  --new-tokens (default 64) tokens without stopping, reported over all 64 and over the first 16.
- copy: a copy-heavy prompt: a ~250-token passage of the passkey filler text four times, then its
  first 100 tokens again (~1,100 tokens).
- random: 1,024 uniformly random byte tokens (nothing to look up); speculation must cost <= 10%.

Decode time is from the first new token (the end of the prefill, identical in both modes) to the
last, so tokens/s = (n - 1) / that time. Each round runs plain then speculative on the same prompt
(interleaved, so both see the same machine load); figures are medians over all rounds x trials, the
speed-up is the median of the per-pair ratios. Acceptance rate = kept draft tokens / drafted tokens,
tokens/forward = new tokens / target forwards (the prefill counted as one; plain decoding has 1.0).

    python benchmarks/speculative.py                  # all three prompts, 3 rounds
    python benchmarks/speculative.py --prompts copy --rounds 5 --k 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gptoss_lite.checkpoint import DEFAULT_MODEL, load_model
from gptoss_lite.evals.passkey import PasskeyEvaluator, filler_sentences, passkey_keys
from gptoss_lite.generation import stream_generate
from gptoss_lite.speculative import PromptLookup, SpeculationStats
from gptoss_lite.tokenizer import ByteTokenizer

PASSKEY_LENGTH = 4096
ANSWER_TOKENS = 16


def run(
    model, ids: torch.Tensor, new_tokens: int, spec: PromptLookup | None, stop: list[int] | None = None
) -> tuple[list[float], torch.Tensor, SpeculationStats]:
    """Greedy decode; the timestamps of each new token, the tokens, the stats."""
    stats = SpeculationStats()
    stamps, tokens = [], []
    for token in stream_generate(model, ids, new_tokens, temperature=0, speculate=spec, stats=stats, stop_tokens=stop):
        stamps.append(time.perf_counter())
        tokens.append(token)
    return stamps, torch.stack(tokens, dim=1), stats


def tokens_per_s(stamps: list[float], n: int) -> float:
    return (n - 1) / (stamps[n - 1] - stamps[0])


def prompts(kind: str, trials: int, tok: ByteTokenizer, model) -> list[torch.Tensor]:
    if kind == "passkey":
        ev = PasskeyEvaluator(model, tok, lengths=[PASSKEY_LENGTH], n_trials=trials)
        keys = passkey_keys(PASSKEY_LENGTH, trials)
        return [
            torch.tensor([ev.prompt_ids(PASSKEY_LENGTH, key, (0.0, 0.5, 1.0)[i % 3])]) for i, key in enumerate(keys)
        ]
    if kind == "copy":
        out = []
        for t in range(trials):  # a ~250-token passage, four times, then its first ~100 tokens again
            text = "".join(filler_sentences(1000 + 97 * t, tok))[:250]
            out.append(torch.tensor([tok.encode_prompt(text * 4 + text[:100])]))
        return out
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (1, 1024), generator=g) for _ in range(trials)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--prompts", nargs="+", default=["passkey", "copy", "random"], choices=["passkey", "copy", "random"]
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=3, help="prompts per kind (passkey: keys)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=PromptLookup.k, help="draft tokens per step")
    ap.add_argument("--ngram", type=int, default=PromptLookup.ngram)
    ap.add_argument("--min-ngram", type=int, default=PromptLookup.min_ngram)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="a byte-tokenizer model (default: the shipped one)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model(args.model)
    tok = ByteTokenizer()
    spec = PromptLookup(k=args.k, ngram=args.ngram, min_ngram=args.min_ngram)
    name = "shipped model" if args.model == str(DEFAULT_MODEL) else args.model
    print(
        f"{name}, fp32, 1 thread, greedy; {spec}; {args.rounds} rounds x {args.trials} "
        f"prompts x {args.new_tokens} new tokens, plain and speculative interleaved"
    )
    print(
        f"{'prompt':>8} {'tokens':>6} | {'plain tok/s':>11} | {'spec tok/s':>10} | {'speed-up':>8} | "
        f"{'accept':>6} | {'tok/fwd':>7}"
    )
    for kind in args.prompts:
        batch = prompts(kind, args.trials, tok, model)
        n_list = [args.new_tokens] + ([ANSWER_TOKENS] if kind == "passkey" else [])
        rows = {n: {"plain": [], "spec": [], "ratio": []} for n in n_list}
        total = SpeculationStats()
        answer = {"plain": [0, 0.0], "spec": [0, 0.0], "ratio": []}  # pooled decode tokens, seconds
        answer_stats = SpeculationStats()
        for _ in range(args.rounds):
            for ids in batch:
                if kind == "passkey":  # the evaluator's own workload: <= 16 tokens, stop at end-of-text
                    got = {}
                    for mode, sp in (("plain", None), ("spec", spec)):
                        stamps, toks, st = run(model, ids, ANSWER_TOKENS, sp, [tok.eos_id])
                        got[mode] = toks
                        answer[mode][0] += len(stamps) - 1
                        answer[mode][1] += stamps[-1] - stamps[0]
                        if sp is not None:
                            for field in ("new_tokens", "target_forwards", "drafted", "accepted"):
                                setattr(answer_stats, field, getattr(answer_stats, field) + getattr(st, field))
                    assert torch.equal(got["plain"], got["spec"]), "speculative answer differs from plain"
                p_stamps, p_tokens, _ = run(model, ids, args.new_tokens, None)
                s_stamps, s_tokens, stats = run(model, ids, args.new_tokens, spec)
                assert torch.equal(p_tokens, s_tokens), "speculative output differs from plain greedy"
                for field in ("new_tokens", "target_forwards", "drafted", "accepted"):
                    setattr(total, field, getattr(total, field) + getattr(stats, field))
                for n in n_list:
                    p, s = tokens_per_s(p_stamps, n), tokens_per_s(s_stamps, n)
                    rows[n]["plain"].append(p)
                    rows[n]["spec"].append(s)
                    rows[n]["ratio"].append(s / p)
        if kind == "passkey":
            p_rate = answer["plain"][0] / answer["plain"][1]
            s_rate = answer["spec"][0] / answer["spec"][1]
            print(
                f"{'answer':>8} {'<=16':>6} | {p_rate:>11.1f} | {s_rate:>10.1f} | {s_rate / p_rate:>7.2f}x | "
                f"{answer_stats.acceptance_rate:>6.2f} | {answer_stats.tokens_per_forward:>7.2f}"
            )
        for n in n_list:
            r = rows[n]
            print(
                f"{kind:>8} {n:>6} | {statistics.median(r['plain']):>11.1f} | "
                f"{statistics.median(r['spec']):>10.1f} | {statistics.median(r['ratio']):>7.2f}x | "
                f"{total.acceptance_rate:>6.2f} | {total.tokens_per_forward:>7.2f}"
            )
    if "passkey" in args.prompts:
        ids = prompts("passkey", 1, tok, model)[0]
        stops = [tok.eos_id]
        answer = run(model, ids, ANSWER_TOKENS, spec, stops)[1][0].tolist()
        longer = run(model, ids, ANSWER_TOKENS, spec)[1][0].tolist()
        print(
            f"passkey trial 0: key {passkey_keys(PASSKEY_LENGTH, 1)[0]}; speculative answer "
            f"{tok.decode([t for t in answer if t not in stops])!r} (then end-of-text); without the stop "
            f"the first 16 tokens are {tok.decode(longer)!r}"
        )
    print(
        "(answer: the evaluator's run, stopping at end-of-text, tokens/s pooled over all trials; "
        "accept and tok/fwd of the other rows are over the whole --new-tokens runs of each prompt kind)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
