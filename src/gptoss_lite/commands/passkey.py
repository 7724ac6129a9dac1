"""`gptoss-lite passkey`: passkey retrieval accuracy by context length and depth (docs/passkey.md)."""

from __future__ import annotations

import argparse
import json
import sys

from gptoss_lite.evals.passkey import DEFAULT_LENGTHS  # pure Python: no torch at import


def _depth(text: str) -> float:
    aliases = {"start": 0.0, "middle": 0.5, "end": 1.0}
    if text in aliases:
        return aliases[text]
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"depth {text!r}: use a fraction in [0, 1] or start/middle/end") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    from gptoss_lite.commands.common import (
        add_compile_arg,
        add_eval_batch_args,
        add_kv_args,
        add_model_arg,
        add_speculate_args,
    )
    from gptoss_lite.evals.passkey import BASE_SEED, DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_TRIALS, TEMPLATES

    p = subparsers.add_parser(
        "passkey",
        help="passkey retrieval accuracy by context length and depth",
        description="Needle-in-a-haystack passkey retrieval: greedy, cached generation of 16 tokens "
        "per trial; prints accuracy per length and a length x depth grid, then PASS/FAIL at the "
        "longest length (target >= 85%). Exits 0 either way.",
    )
    add_model_arg(p)
    add_compile_arg(p)
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        metavar="TOKENS",
        help=f"context lengths in tokens (default: those of {' '.join(map(str, DEFAULT_LENGTHS))} "
        "that fit the model's max_position_embeddings)",
    )
    p.add_argument(
        "--depths",
        type=_depth,
        nargs="+",
        default=list(DEFAULT_DEPTHS),
        metavar="FRAC",
        help="needle depths, fractions in [0, 1] or start/middle/end (default: 0 0.5 1)",
    )
    p.add_argument(
        "--trials",
        type=int,
        default=DEFAULT_TRIALS,
        metavar="N",
        help=f"distinct passkeys per length, each asked at every depth (default: {DEFAULT_TRIALS})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=BASE_SEED,
        help=f"base seed: keys of length L come from random.Random(seed + L) (default: {BASE_SEED})",
    )
    p.add_argument(
        "--template",
        choices=TEMPLATES,
        default="default",
        help="prompt template; 'classic' is the grass/sky/sun template (default: default)",
    )
    add_eval_batch_args(p, "prompts of one length and depth")
    p.add_argument(
        "--no-shared-prefix",
        action="store_true",
        help="prefill every trial's whole prompt; by default the haystack the trials of one length and "
        "depth share (up to the needle) is prefilled once and copied (same answers, less time)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a length x depth accuracy heatmap")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    add_speculate_args(p)
    add_kv_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gptoss_lite.commands.common import (
        build_speculation,
        check_plot_file,
        check_speculate_args,
        kv_settings,
        load_model_and_tokenizer,
        speculation_line,
        warn,
    )
    from gptoss_lite.evals.passkey import PasskeyEvaluator

    if args.plot:
        check_plot_file("--plot", args.plot)
    check_speculate_args(args)
    kv = kv_settings(args)
    model, tokenizer, source = load_model_and_tokenizer(args)
    if args.lengths is None:
        args.lengths = default_lengths(model.config.max_position_embeddings)
        if len(args.lengths) < len(DEFAULT_LENGTHS):
            warn(
                "passkey",
                f"default lengths capped at the model's {model.config.max_position_embeddings:,} "
                f"positions: {' '.join(map(str, args.lengths))}",
            )
    speculate = build_speculation(args, model)
    evaluator = PasskeyEvaluator(
        model,
        tokenizer=tokenizer,
        lengths=args.lengths,
        depths=args.depths,
        n_trials=args.trials,
        base_seed=args.seed,
        template=args.template,
        prefill_chunk=args.prefill_chunk,
        batch_size=args.batch_size,
        speculate=speculate,
        kv=kv,
        share_prefix=not args.no_shared_prefix,
    )
    result = evaluator.run(progress=not args.no_progress)
    if args.plot:
        plot_heatmap(result, args.plot)
    if args.json:
        out = result.to_dict()
        out["model"] = str(source)
        out["rope_factor"] = model.config.rope_factor
        out["shared_prefix_tokens"] = evaluator.shared_tokens
        print(json.dumps(out, indent=2))
    else:
        print(format_table(result, str(source), model.config.rope_factor))
        if args.plot:
            print(f"heatmap: {args.plot}")
        if speculate is not None:
            print(
                f"{speculation_line(evaluator.speculation_stats)}; --speculate {args.speculate}, "
                f"--draft-tokens {speculate.k}"
            )
        print(result.verdict())
    return 0


def default_lengths(max_positions: int) -> list[int]:
    """The default lengths that fit a model of `max_positions` (the largest power of two that fits if none do)."""
    from gptoss_lite.evals.passkey import DEFAULT_LENGTHS, NEW_TOKENS

    limit = max_positions - NEW_TOKENS
    fitting = [n for n in DEFAULT_LENGTHS if n <= limit]
    if fitting:
        return fitting
    n = 1
    while 2 * n <= limit:
        n *= 2
    return [n]


def format_table(result, source: str, rope_factor: float | None = None) -> str:
    """Accuracy per length (with extrapolation ratio and KV bytes), then the length x depth grid."""
    from gptoss_lite.commands.common import fmt_bytes

    ratio = result.extrapolation
    lines = [
        f"passkey retrieval: model {source}, template {result.template}, {result.n_trials} trials x "
        f"{len(result.depths)} depths per length, train context "
        f"{result.train_context_length if result.train_context_length else 'unknown'}"
        + (f", YaRN factor {rope_factor:g}" if rope_factor is not None else ""),
        "",
    ]
    header = (
        f"{'length':>8} {'tokens':>8} {'x train':>8} {'accuracy':>9} {'KV payload':>12} {'KV alloc':>12} "
        f"{'time':>8} {'peak RSS':>10}"
    )
    lines += [header, "-" * len(header)]
    for n in result.lengths:
        x = f"{ratio[n]:.1f}x" if ratio else "-"
        lines.append(
            f"{n:>8} {result.prompt_tokens[n]:>8} {x:>8} {100 * result.accuracy[n]:>8.1f}% "
            f"{fmt_bytes(result.kv_payload_bytes[n]):>12} {fmt_bytes(result.kv_allocated_bytes[n]):>12} "
            f"{result.seconds.get(n, 0.0):>7.1f}s {fmt_bytes(result.peak_rss_bytes.get(n, 0)):>10}"
        )
    lines += ["", "accuracy by depth (%)"]
    head = f"{'length':>8} {'x train':>8} " + " ".join(f"{d:>6g}" for d in result.depths)
    lines += [head, "-" * len(head)]
    for n in result.lengths:
        x = f"{ratio[n]:.1f}x" if ratio else "-"
        lines.append(
            f"{n:>8} {x:>8} " + " ".join(f"{100 * result.accuracy_by_depth[n][d]:>6.1f}" for d in result.depths)
        )
    return "\n".join(lines)


def plot_heatmap(result, path: str, title: str | None = None) -> None:
    """Length x depth accuracy heatmap as PNG (matplotlib, imported only here); `result` needs
    `lengths`, `depths`, `accuracy_by_depth`, `extrapolation` and `n_trials` (or a `title`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [[100 * result.accuracy_by_depth[n][d] for d in result.depths] for n in result.lengths]
    fig, ax = plt.subplots(figsize=(1.2 * len(result.depths) + 3, 0.5 * len(result.lengths) + 2))
    im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(result.depths)), [f"{d:g}" for d in result.depths])
    ratio = result.extrapolation
    ax.set_yticks(range(len(result.lengths)), [f"{n} ({ratio[n]:.0f}x)" if ratio else str(n) for n in result.lengths])
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context length (tokens)")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=9)
    fig.colorbar(im, ax=ax, label="accuracy (%)")
    ax.set_title(title or f"passkey retrieval, {result.n_trials} trials per cell")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"passkey: wrote {path}", file=sys.stderr)
