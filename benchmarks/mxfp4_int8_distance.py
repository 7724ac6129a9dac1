"""How far the opt-in int8-activation MXFP4 experts move a model's output from the exact path.

    python benchmarks/mxfp4_int8_distance.py --model ~/.cache/gptoss-lite/gpt-oss-20b-random
    python benchmarks/mxfp4_int8_distance.py --prompts-kind passkey   # the shipped model, experts rounded to MXFP4

For each of `--prompts` prompts, the exact path (`set_mxfp4_activations("exact")`) decodes `--new-tokens`
greedy tokens through the cached path; the int8 path (`"int8"`) then reads the same prompt and is fed
the same tokens (teacher forcing), so the two are compared step by step on one sequence. Reported:

- max |Δlogit| over every step of every prompt, and that over the largest |logit| of the exact path;
- the mean |Δlogit| over the vocabulary and steps;
- greedy agreement: the steps whose argmax is the same, and the prompts whose whole greedy answer
  is the same (the int8 path's own greedy run equals the exact one exactly when every teacher-forced
  argmax agrees);
- the median gap between the exact path's two largest logits, which says how easily an argmax flips.

`--control` measures the same figures for a change that is not a rounding at all: the exact path with
its fp32 sums in another order (the MXFP4 kernel's fp32 FMA path instead of its bf16 dot products,
every product still exact). On a model whose outputs are chaotic in its inputs (random weights), that
floor is already far from zero, and the int8 figures only mean something beside it.

One model is loaded and switched between the two modes, so a 20b needs ~14 GB. A model without
packed MXFP4 experts (the shipped demo model) has its experts rounded to MXFP4 first
(`GPTOSS.use_mxfp4_experts`), and the comparison is between the two paths on those rounded weights.
Prompts are `--prompt-tokens` random ids (`random`, seeded) or passkey prompts of about that length
(`passkey`, keys and depths varied), which a trained model answers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def prompts(kind: str, n: int, length: int, vocab: int, tok) -> list[list[int]]:
    if kind == "random":
        g = torch.Generator().manual_seed(length)
        return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]
    from gptoss_lite.evals.passkey import build_passkey_prompt

    out = []
    for i in range(n):
        key = str(10000 + (7919 * (i + 1)) % 90000)
        out.append(tok.encode_prompt(build_passkey_prompt(length, key, (i % 5) / 4, tok)))
    return out


@torch.inference_mode()
def decode(model, prompt: list[int], new: int, forced: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """(logits (new, V) float32, tokens): greedy from `prompt`, or fed `forced` (teacher forcing)."""
    from gptoss_lite.kv.mixed import MixedKVCache

    cache = MixedKVCache(model.config, batch_size=1)
    logits = model(torch.tensor([prompt]), cache=cache, start_pos=0).logits[0, -1].float()
    rows, tokens, pos = [logits], [], len(prompt)
    for i in range(new - 1):
        nxt = forced[i] if forced is not None else int(logits.argmax())
        tokens.append(nxt)
        logits = model(torch.tensor([[nxt]]), cache=cache, start_pos=pos).logits[0, -1].float()
        rows.append(logits)
        pos += 1
    tokens.append(forced[new - 1] if forced is not None else int(logits.argmax()))
    return torch.stack(rows), tokens


class other_order:
    """The exact MXFP4 path with its sums in another order: the kernel's fp32 FMA path for bf16 inputs
    too (where the C kernels are built with bf16 dot products; else nothing changes, and `changed` is False)."""

    def __enter__(self):
        from gptoss_lite.kernels import mxfp4

        self.lib = mxfp4._library()
        self.changed = self.lib is not None and self.lib.bf16_dot
        if self.changed:
            self.lib.bf16_dot = False
        return self

    def __exit__(self, *exc):
        if self.changed:
            self.lib.bf16_dot = True


def measure(model, prompt_ids: list[list[int]], new: int, progress=None, control: bool = False) -> dict:
    """The figures of the module's docstring: exact against int8, or (`control`) against the exact
    path with its sums in another order."""
    max_abs = mean_abs = scale = 0.0
    agree = steps = same = 0
    gaps, firsts = [], []
    for i, ids in enumerate(prompt_ids):
        model.set_mxfp4_activations("exact")
        exact, tokens = decode(model, ids, new)
        if control:
            with other_order():
                int8, _ = decode(model, ids, new, forced=tokens)
        else:
            model.set_mxfp4_activations("int8")
            int8, _ = decode(model, ids, new, forced=tokens)
        diff = (int8 - exact).abs()
        max_abs, mean_abs = max(max_abs, diff.max().item()), mean_abs + diff.mean().item()
        scale = max(scale, exact.abs().max().item())
        hits = (int8.argmax(-1) == exact.argmax(-1)).tolist()
        agree, steps, same = agree + sum(hits), steps + len(hits), same + all(hits)
        firsts.append(hits.index(False) if not all(hits) else None)
        top2 = exact.topk(2, dim=-1).values
        gaps += (top2[:, 0] - top2[:, 1]).tolist()
        if progress:
            progress(i + 1, len(prompt_ids), max_abs, agree / steps)
    model.set_mxfp4_activations("exact")
    return {
        "prompts": len(prompt_ids),
        "new_tokens": new,
        "max_abs_dlogit": max_abs,
        "max_abs_logit": scale,
        "max_abs_dlogit_rel": max_abs / scale if scale else 0.0,
        "mean_abs_dlogit": mean_abs / len(prompt_ids),
        "argmax_agreement": agree / steps,
        "steps": steps,
        "same_greedy_answer": same,
        "first_divergence": [f for f in firsts if f is not None],
        "median_top2_gap": statistics.median(gaps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the shipped model, experts rounded)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    p.add_argument("--prompts", type=int, default=64, help="prompts (default: 64)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt (default: 32)")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per prompt (default: 16)")
    p.add_argument("--prompts-kind", choices=("random", "passkey"), default="random")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--control", action="store_true", help="the exact path in another summation order, not int8")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    for name in ("prompts", "prompt_tokens", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    sys.path.insert(0, str(REPO / "src"))
    from gptoss_lite.checkpoint import default_model_source, load_model
    from gptoss_lite.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    source = args.model or default_model_source()
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = load_model(source, dtype=dtype)
    rounded = not model.mxfp4_experts
    if rounded:
        model.use_mxfp4_experts().prepare_for_inference()
    tok = load_tokenizer(source) if args.prompts_kind == "passkey" else None
    ids = prompts(args.prompts_kind, args.prompts, args.prompt_tokens, model.config.vocab_size, tok)
    dt = next(model.parameters()).dtype
    print(
        f"{source}: {'experts rounded to MXFP4, ' if rounded else ''}{dt}, {torch.get_num_threads()} threads, "
        f"loaded in {time.perf_counter() - t0:.0f} s; {len(ids)} {args.prompts_kind} prompts of "
        f"{len(ids[0])} tokens, {args.new_tokens} greedy tokens each",
        flush=True,
    )

    def progress(i, n, max_abs, agreement):
        if i == n or i % max(1, n // 8) == 0:
            print(f"  {i}/{n} prompts: max |dlogit| {max_abs:.4g}, argmax agreement {agreement:.4f}", flush=True)

    if args.control:
        with other_order() as o:
            if not o.changed:
                p.error("--control needs the C kernels with AVX-512 BF16 and a bf16 model (no other order to take)")
        if dt != torch.bfloat16:
            p.error("--control needs a bf16 model (--dtype bfloat16): fp32 inputs have one exact path")
        print("control: the exact path against itself with its fp32 sums in another order", flush=True)
    result = measure(model, ids, args.new_tokens, progress, control=args.control)
    result.update(model=str(source), experts_rounded=rounded, dtype=str(dt), prompts_kind=args.prompts_kind)
    result["compared"] = "exact, other summation order" if args.control else "int8"
    result["prompt_tokens"] = len(ids[0])
    print(
        f"max |dlogit| {result['max_abs_dlogit']:.4g} ({result['max_abs_dlogit_rel']:.2%} of the largest |logit| "
        f"{result['max_abs_logit']:.4g}); mean |dlogit| {result['mean_abs_dlogit']:.3g}\n"
        f"greedy agreement: {result['argmax_agreement']:.4f} of {result['steps']} teacher-forced steps; "
        f"{result['same_greedy_answer']}/{result['prompts']} prompts decode the same {args.new_tokens} tokens; "
        f"median top-2 logit gap {result['median_top2_gap']:.3g}"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
