"""What do int8/int4 KV and a token budget on the full layers cost? Measured on the shipped model.

Three parts, each writing into one JSON file (`--out`), which `--plot` turns into a quality-vs-bytes
figure (docs/kv-cache.md#measured-quality):

- `passkey`: passkey accuracy by length x depth (docs/passkey.md protocol, `PasskeyEvaluator`) under
  each setting, with the KV bytes per sequence. A StreamingLLM budget below the needle's distance is
  the negative control: it must fail at the depths whose needle lies outside the budget.
- `fidelity`: held-out text (the evaluator's haystack, never in the training data, with a needle)
  is prefilled up to its last `--scored` tokens, which are then fed one at a time (teacher forcing)
  through each setting's cache. Against the 16-bit cache: the relative error of every layer's
  attention output (||y - y16|| / ||y16|| over the scored steps), next-token agreement (argmax equal)
  and perplexity of the text's own next tokens.
- `needle`: after the whole prompt is prefilled under a budget, the fraction of the needle's key digits
  each full layer still holds (per KV head, averaged): why StreamingLLM fails and what H2O keeps.
- `engine`: the passkey grid through the batched engine (`gptoss_lite.engine.LLM`) on its paged blocks:
  settings 16 / 8 / 4 (int8 / int4 blocks) and window@N (the engine's full-layer window: full layers
  attend to their last N keys), with the full-layer block bytes per request and the wall time.
- `plot`: passkey accuracy and next-token agreement against full-layer KV bytes per sequence.

    python benchmarks/kv_quality.py passkey --trials 30 --out benchmarks/results/kv_quality_passkey.json
    python benchmarks/kv_quality.py fidelity --out benchmarks/results/kv_quality_fidelity.json
    python benchmarks/kv_quality.py needle --depths 0 0.5 1 --out benchmarks/results/kv_quality_needle.json
    python benchmarks/kv_quality.py engine --settings 16 8 4 window@1024 --out benchmarks/results/kv_quality_engine.json
    python benchmarks/kv_quality.py plot --inputs benchmarks/results/kv_quality_*.json --plot docs/img/kv_quality.png

Settings (`--settings`): 16, 8, 4 (bits) or a `--kv-format` name, streaming@N and h2o@N (a budget of N
tokens per full layer).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from gptoss_lite.checkpoint import default_model_source, load_model
from gptoss_lite.evals.passkey import PasskeyEvaluator, build_passkey_prompt, filler_sentences
from gptoss_lite.kv.settings import KVSettings
from gptoss_lite.kvspec import kv_format
from gptoss_lite.prompts import NEEDLE_TEMPLATE
from gptoss_lite.tokenizer import load_tokenizer

DEFAULT_SETTINGS = ("16", "8", "4", "streaming@1024", "h2o@1024")


def parse_setting(text: str) -> KVSettings:
    """'16' / '8' / '4' (bits) or a format name ('int8', ...) -> a format; 'streaming@N' / 'h2o@N' -> a
    budget of N tokens."""
    if "@" in text:
        policy, budget = text.split("@", 1)
        return KVSettings(budget=int(budget), policy=policy)
    return KVSettings(format=kv_format(int(text) if text.isdigit() else text))


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _save(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def run_passkey(args, model, tok) -> None:
    data = _load(args.out)
    section = data.setdefault("passkey", {})
    section["meta"] = {"lengths": args.lengths, "trials": args.trials, "depths": [0.0, 0.5, 1.0]}
    print(f"passkey: {args.trials} keys x 3 depths per length, lengths {args.lengths}", flush=True)
    for text in args.settings:
        kv = parse_setting(text)
        t0 = time.perf_counter()
        result = PasskeyEvaluator(
            model, tok, lengths=args.lengths, n_trials=args.trials, batch_size=args.batch_size, kv=kv
        ).run()
        section[kv.label] = {
            "accuracy": {str(n): result.accuracy[n] for n in result.lengths},
            "accuracy_by_depth": {
                str(n): {str(d): a for d, a in result.accuracy_by_depth[n].items()} for n in result.lengths
            },
            "kv_allocated_bytes": {str(n): result.kv_allocated_bytes[n] for n in result.lengths},
            "kv_payload_bytes": {str(n): result.kv_payload_bytes[n] for n in result.lengths},
            "seconds": time.perf_counter() - t0,
        }
        _save(args.out, data)
        cells = "  ".join(
            f"{n}: {100 * result.accuracy[n]:5.1f}% ("
            + "/".join(f"{100 * a:.0f}" for a in result.accuracy_by_depth[n].values())
            + f") {result.kv_allocated_bytes[n] / 2**20:.2f} MiB"
            for n in result.lengths
        )
        print(f"{kv.label:>16}  {cells}  [{time.perf_counter() - t0:.0f} s]", flush=True)


def engine_setting(text: str) -> tuple[str, int | None, str]:
    """'16' / '8' / '4' (or a format name) -> the KV format; 'window@N' -> the engine's full-layer window
    of N tokens. Returns (format name, full_window, label)."""
    if text.startswith("window@"):
        window = int(text.split("@", 1)[1])
        if window < 1:
            raise ValueError(f"{text}: the full-layer window must be >= 1 token")
        return "dense", window, text
    fmt = kv_format(int(text) if text.isdigit() else text)
    return fmt.name, None, fmt.label


def run_engine(args, model, tok) -> None:
    """The passkey grid through the engine, every trial of a length submitted at once."""
    from gptoss_lite.config import FULL
    from gptoss_lite.engine import LLM, SamplingParams
    from gptoss_lite.evals.passkey import NEW_TOKENS, extract_passkey

    data = _load(args.out)
    section = data.setdefault("engine", {})
    depths = [0.0, 0.5, 1.0]
    section["meta"] = {"lengths": args.lengths, "trials": args.trials, "depths": depths, "threads": args.threads}
    evaluator = PasskeyEvaluator(model, tok, lengths=args.lengths, n_trials=args.trials)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    print(f"engine passkey: {args.trials} keys x 3 depths per length, lengths {args.lengths}", flush=True)
    for text in args.settings:
        fmt, window, label = engine_setting(text)
        entry = {"accuracy": {}, "accuracy_by_depth": {}, "full_layer_bytes": {}, "seconds": {}}
        for n in args.lengths:
            llm = LLM(model, kv_format=fmt, full_window=window, enable_prefix_caching=window is None)
            cases = [(key, d) for key in evaluator.keys(n) for d in depths]
            t0 = time.perf_counter()
            outs = llm.generate([evaluator.prompt_ids(n, key, d) for key, d in cases], params)
            seconds = time.perf_counter() - t0
            hits = [extract_passkey(tok.decode(o.token_ids)) == key for o, (key, _) in zip(outs, cases)]
            by_depth = {str(d): sum(h for h, (_, dd) in zip(hits, cases) if dd == d) / args.trials for d in depths}
            held = n if window is None else min(n, window)  # tokens a request's full layers hold (+ < 1 block)
            blocks = math.ceil(held / llm.kv.block_size)
            entry["accuracy"][str(n)] = sum(hits) / len(hits)
            entry["accuracy_by_depth"][str(n)] = by_depth
            entry["full_layer_bytes"][str(n)] = blocks * llm.runner.store.block_bytes(FULL)
            entry["seconds"][str(n)] = seconds
            print(
                f"{label:>14}  {n}: {100 * sum(hits) / len(hits):5.1f}% ("
                + "/".join(f"{100 * a:.0f}" for a in by_depth.values())
                + f")  full-layer blocks {entry['full_layer_bytes'][str(n)] / 2**20:.2f} MiB  [{seconds:.0f} s]",
                flush=True,
            )
        section[label] = entry
        _save(args.out, data)


class _AttentionTap:
    """Forward hooks that keep every layer's attention output of the current forward pass."""

    def __init__(self, model):
        self.outputs: list[torch.Tensor | None] = [None] * len(model.blocks)
        self.handles = [block.attn.register_forward_hook(self._hook(i)) for i, block in enumerate(model.blocks)]

    def _hook(self, i):
        def hook(module, inputs, output):
            self.outputs[i] = output.detach().float().clone()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _teacher_forced(model, ids: torch.Tensor, scored: int, kv: KVSettings, chunk: int):
    """Prefill ids[:, :-scored], then feed the last `scored` tokens one at a time through a cache of
    `kv`: (logits (scored, V) predicting ids[-scored + 1:] and one more, per-layer attention outputs
    [(scored, C)] of those steps, full-layer KV bytes allocated at the end)."""
    cache = kv.build(model.config, batch_size=1)
    T = ids.shape[1]
    tap = _AttentionTap(model)
    logits, attn = [], [[] for _ in model.blocks]
    try:
        with torch.inference_mode():
            model.prefill(ids[:, : T - scored], cache, kv.prefill_chunk(chunk))
            for pos in range(T - scored, T):
                out = model(ids[:, pos : pos + 1], cache=cache, start_pos=pos, last_only=True).logits
                logits.append(out[0, -1].float())
                for i, y in enumerate(tap.outputs):
                    attn[i].append(y[0, -1])
    finally:
        tap.remove()
    full_bytes = sum(store.nbytes for i, store in enumerate(cache.layers) if not model.config.is_sliding(i))
    return torch.stack(logits), [torch.stack(a) for a in attn], full_bytes


def run_fidelity(args, model, tok) -> None:
    data = _load(args.out)
    section = data.setdefault("fidelity", {})
    settings = [parse_setting(s) for s in args.settings]
    assert settings[0].label == "16-bit", "the first setting must be 16 (the reference)"
    section["meta"] = {"lengths": args.lengths, "scored": args.scored, "texts_per_length": len(args.depths)}
    print(f"fidelity: last {args.scored} tokens teacher-forced, {len(args.depths)} texts per length", flush=True)
    for n in args.lengths:
        filler = filler_sentences(n, tok)
        # Each text ends with its passkey answer, so the scored tokens include the retrieval itself.
        keys = ["31415", "27182", "16180", "14142"]
        texts = [
            build_passkey_prompt(n, keys[i % 4], d, tok, filler=filler) + f" {keys[i % 4]}."
            for i, d in enumerate(args.depths)
        ]
        answer_tokens = len(tok.encode(" 31415."))
        runs = {}
        for kv in settings:
            t0 = time.perf_counter()
            per_text = []
            for text in texts:
                ids = torch.tensor([tok.encode_prompt(text)], dtype=torch.long)
                per_text.append((ids, *_teacher_forced(model, ids, args.scored, kv, args.prefill_chunk)))
            runs[kv.label] = per_text
            print(f"  {n} {kv.label}: {time.perf_counter() - t0:.0f} s", flush=True)
        ref = runs["16-bit"]
        out = {}
        for label, per_text in runs.items():
            agree, nll, count, answer_nll, answer_count = 0, 0.0, 0, 0.0, 0
            err_num = [0.0] * len(model.blocks)
            err_den = [0.0] * len(model.blocks)
            for (ids, logits, attn, _bytes), (_, ref_logits, ref_attn, _) in zip(per_text, ref):
                targets = ids[0, -args.scored + 1 :]  # the text's own next tokens
                lp = torch.log_softmax(logits[:-1], dim=-1)
                token_nll = -lp.gather(1, targets[:, None])[:, 0]  # (scored - 1,)
                nll += token_nll.sum().item()
                count += targets.numel()
                answer_nll += token_nll[-answer_tokens:].sum().item()  # ' NNNNN.' given the haystack
                answer_count += answer_tokens
                agree += (logits.argmax(-1) == ref_logits.argmax(-1)).sum().item()
                for i, (y, yr) in enumerate(zip(attn, ref_attn)):
                    err_num[i] += (y - yr).pow(2).sum().item()
                    err_den[i] += yr.pow(2).sum().item()
            out[label] = {
                "next_token_agreement": agree / (args.scored * len(per_text)),
                "perplexity": math.exp(nll / count),
                "answer_perplexity": math.exp(answer_nll / answer_count),
                "attention_rel_error_by_layer": [math.sqrt(a / b) for a, b in zip(err_num, err_den)],
                "full_layer_kv_bytes": per_text[0][3],
            }
        section[str(n)] = out
        _save(args.out, data)
        print(
            f"length {n}: setting, next-token agreement, perplexity (delta vs 16-bit), answer perplexity "
            "(delta), attention rel. error by layer, full-layer KV bytes"
        )
        base, base_answer = out["16-bit"]["perplexity"], out["16-bit"]["answer_perplexity"]
        for label, r in out.items():
            errs = " ".join(f"{e:.2e}" for e in r["attention_rel_error_by_layer"])
            print(
                f"  {label:>16}  {100 * r['next_token_agreement']:6.2f}%  {r['perplexity']:.2f} "
                f"({r['perplexity'] - base:+.2f})  {r['answer_perplexity']:.4f} "
                f"({r['answer_perplexity'] - base_answer:+.4f})  [{errs}]  {r['full_layer_kv_bytes']:,} B"
            )


def run_needle(args, model, tok) -> None:
    """Which of the needle's key digits does each budget policy still hold after the whole prompt
    (question included) is prefilled? Fraction of the 5 digit tokens kept, per full layer, averaged over
    KV heads, per (length, depth): the mechanism behind the passkey results."""
    data = _load(args.out)
    section = data.setdefault("needle_kept", {})
    settings = [parse_setting(s) for s in args.settings if "@" in s]
    print("needle digits still held after prefill (fraction, per full layer, mean over KV heads)", flush=True)
    for n in args.lengths:
        filler = filler_sentences(n, tok)
        for depth in args.depths:
            key = "27182"
            text = build_passkey_prompt(n, key, depth, tok, filler=filler)
            needle = NEEDLE_TEMPLATE.format(key=key)
            before = text.index(needle) + needle.index(key)
            first = len(tok.encode_prompt(text[:before]))  # token position of the first key digit
            last = len(tok.encode_prompt(text[: before + len(key)]))  # one past the last digit
            ids = torch.tensor([tok.encode_prompt(text)], dtype=torch.long)
            for kv in settings:
                cache = kv.build(model.config)
                with torch.inference_mode():
                    model.prefill(ids, cache, kv.prefill_chunk(args.prefill_chunk))
                kept = {}
                for layer in range(model.config.n_layers):
                    if model.config.is_sliding(layer):
                        continue
                    pos = cache.positions(layer)[0]  # (K, held)
                    digits = ((pos >= first) & (pos < last)).sum(dim=1).float() / (last - first)  # (K,)
                    kept[str(layer)] = digits.mean().item()
                section.setdefault(kv.label, {}).setdefault(str(n), {})[str(depth)] = kept
                cells = " ".join(f"layer {k}: {v:.2f}" for k, v in kept.items())
                print(f"  {n:>6} depth {depth:<4} {kv.label:>16}  digits at {first}..{last - 1}: {cells}", flush=True)
    _save(args.out, data)


def _shown(label: str) -> str:
    """Plot label: '16-bit' is the unquantised cache in the model's own dtype (fp32 for the shipped model)."""
    return "unquantised" if label == "16-bit" else label


def run_plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data: dict = {}
    for path in args.inputs or [args.out]:
        for part, section in _load(path).items():  # several files may hold parts of one section
            data.setdefault(part, {}).update(section)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    passkey = {k: v for k, v in data.get("passkey", {}).items() if k != "meta"}
    ax = axes[0]
    for n in data.get("passkey", {}).get("meta", {}).get("lengths", []):
        pts = sorted(
            (v["kv_allocated_bytes"][str(n)] / 2**20, 100 * v["accuracy"][str(n)], k) for k, v in passkey.items()
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=f"{n} tokens")
        for x, y, label in pts:
            ax.annotate(_shown(label), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("KV bytes per sequence, all layers (MiB)")
    ax.set_ylabel("passkey accuracy (%)")
    ax.set_title("passkey (3 depths) vs KV bytes")
    ax.legend()
    ax = axes[1]
    fid = data.get("fidelity", {})
    for n in fid.get("meta", {}).get("lengths", []):
        rows = fid.get(str(n), {})
        pts = sorted((r["full_layer_kv_bytes"] / 2**20, 100 * r["next_token_agreement"], k) for k, r in rows.items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s", label=f"{n} tokens")
        for x, y, label in pts:
            ax.annotate(_shown(label), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("full-layer KV bytes per sequence (MiB)")
    ax.set_ylabel("next-token agreement with unquantised (%)")
    ax.set_title("teacher-forced decode vs the unquantised cache")
    ax.legend()
    fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("passkey", "fidelity", "needle", "engine", "plot"))
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the shipped demo model)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--trials", type=int, default=30, help="passkey keys per length, each at 3 depths")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS))
    ap.add_argument("--scored", type=int, default=256, help="fidelity: teacher-forced tokens at the end of each text")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.5], help="fidelity: needle depth per text")
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_quality.json"))
    ap.add_argument("--plot", default="docs/img/kv_quality.png")
    ap.add_argument("--inputs", type=Path, nargs="+", default=None, help="plot: JSON files to merge (default: --out)")
    args = ap.parse_args(argv)
    for s in args.settings:
        (engine_setting if args.part == "engine" else parse_setting)(s)  # fail before any work
    if args.part == "plot":
        run_plot(args)
        return 0
    torch.set_num_threads(args.threads)
    source = args.model or default_model_source()
    model, tok = load_model(source), load_tokenizer(source)
    print(f"model {source}, {args.threads} thread(s)", flush=True)
    if args.part == "passkey":
        run_passkey(args, model, tok)
    elif args.part == "needle":
        run_needle(args, model, tok)
    elif args.part == "engine":
        run_engine(args, model, tok)
    else:
        run_fidelity(args, model, tok)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
