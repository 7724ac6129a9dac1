"""`gptoss-lite ruler`: a RULER-style suite, score by task x length x haystack (docs/ruler.md)."""

from __future__ import annotations

import argparse
import json
import sys

# Pure Python at import (no torch), so `--help` stays instant.
from gptoss_lite.evals.ruler import BASE_SEED, DEFAULT_LENGTHS, DEFAULT_TRIALS, TASKS
from gptoss_lite.evals.ruler_splits import SPLIT_NAMES, SPLITS


def register(subparsers: argparse._SubParsersAction) -> None:
    from gptoss_lite.commands.common import add_compile_arg, add_eval_batch_args, add_kv_args, add_model_arg

    families = "; ".join(f"{s.name}: {', '.join(f.name for f in s.families)}" for s in SPLITS.values())
    kinds = "; ".join(f"{s.name}: {', '.join(s.haystacks)}" for s in SPLITS.values())
    p = subparsers.add_parser(
        "ruler",
        help="RULER-style long-context suite: score by task x length x haystack",
        description="Needles of several kinds (numbers, words, UUID-like codes, several keys, values, "
        "queries, variable chains, and no needle at all) hidden in several haystacks, answered greedily "
        "through the cached path. Prints a task x length table per haystack and their mean. The eval "
        "split's phrasings, words and haystacks are never used in training.",
    )
    add_model_arg(p)
    add_compile_arg(p)
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=list(DEFAULT_LENGTHS),
        metavar="TOKENS",
        help=f"prompt lengths in tokens, BOS included (default: {' '.join(map(str, DEFAULT_LENGTHS))})",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        choices=TASKS,
        default=list(TASKS),
        metavar="TASK",
        help=f"tasks (default: all: {', '.join(TASKS)})",
    )
    p.add_argument(
        "--split",
        choices=SPLIT_NAMES,
        default="eval",
        help="template families, words and haystacks to use; train is the material training may see (default: eval)",
    )
    p.add_argument(
        "--haystacks",
        nargs="+",
        default=None,
        metavar="KIND",
        help=f"haystack kinds of the split (default: all of the split's; {kinds})",
    )
    p.add_argument(
        "--templates",
        nargs="+",
        default=None,
        metavar="FAMILY",
        help=f"template families of the split, used round robin (default: all of the split's; {families})",
    )
    p.add_argument(
        "--trials", type=int, default=DEFAULT_TRIALS, metavar="N", help=f"trials per cell (default: {DEFAULT_TRIALS})"
    )
    p.add_argument("--seed", type=int, default=BASE_SEED, help=f"base seed of every trial (default: {BASE_SEED})")
    add_eval_batch_args(p, "one cell's")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="processes evaluating (haystack, length) cells in parallel, each loading the model and "
        "using --threads threads (default: 1; on a small model N one-thread workers beat one N-thread "
        "process); the result is the same trial for trial",
    )
    p.add_argument("--json", action="store_true", help="print the result (every cell and trial) as JSON")
    p.add_argument(
        "--out", default=None, metavar="FILE", help="also write that JSON to FILE (the table is still printed)"
    )
    p.add_argument("--plot", default=None, metavar="PNG", help="write a task x length heatmap per haystack")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    add_kv_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gptoss_lite.commands import common
    from gptoss_lite.evals.ruler import RulerEvaluator, RulerSuite

    # Everything checkable is checked before the model loads: a run can take hours.
    suite = RulerSuite(
        lengths=tuple(args.lengths),
        tasks=tuple(args.tasks),
        haystacks=None if args.haystacks is None else tuple(args.haystacks),
        families=None if args.templates is None else tuple(args.templates),
        split=args.split,
        n_trials=args.trials,
        seed=args.seed,
    )
    if args.workers < 1:
        raise ValueError(f"--workers {args.workers}: must be >= 1")
    if args.plot:
        common.check_plot_file("--plot", args.plot)
    if args.out:
        common.check_output_file("--out", args.out)
    kv = common.kv_settings(args)
    if args.workers == 1:
        model, tokenizer, source = common.load_model_and_tokenizer(args)
        evaluator = RulerEvaluator(
            model, suite, tokenizer=tokenizer, prefill_chunk=args.prefill_chunk, batch_size=args.batch_size, kv=kv
        )
        result = evaluator.run(progress=not args.no_progress)
    else:
        result, source = _run_parallel(args, suite)
    if args.plot:
        plot_heatmap(result, args.plot)
    out = result.to_dict()
    out["model"] = str(source)
    if args.out:
        common.write_text_atomic(args.out, json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(format_table(result, str(source)))
        if args.plot:
            print(f"heatmap: {args.plot}")
        cells = ", ".join(f"{n}: {100 * result.overall(n):.1f}%" for n in suite.lengths)
        print(f"mean score over all cells: {cells}")
    return 0


def _run_cells(args: argparse.Namespace, suite, haystack: str, n_tokens: int):
    """One worker's share: every task of one (haystack, length), as a RulerResult and the model source."""
    import dataclasses

    from gptoss_lite.commands import common
    from gptoss_lite.evals.ruler import RulerEvaluator

    cell = dataclasses.replace(suite, lengths=(n_tokens,), haystacks=(haystack,))
    model, tokenizer, source = common.load_model_and_tokenizer(args)
    evaluator = RulerEvaluator(
        model,
        cell,
        tokenizer=tokenizer,
        prefill_chunk=args.prefill_chunk,
        batch_size=args.batch_size,
        kv=common.kv_settings(args),
    )
    return evaluator.run(), str(source)


def _run_parallel(args: argparse.Namespace, suite):
    """The suite split into (haystack, length) jobs over `args.workers` processes, merged into one
    RulerResult: the same trials and scores as one process (each trial depends on its cell only)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from gptoss_lite.evals.harness import progress_bar
    from gptoss_lite.evals.ruler import RulerResult

    jobs = [(h, n) for n in sorted(suite.lengths, reverse=True) for h in suite.haystack_kinds]  # longest first
    args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "handler"})
    parts = {}
    bar = progress_bar(len(jobs), "ruler cells", not args.no_progress)
    with ProcessPoolExecutor(min(args.workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_run_cells, args, suite, h, n): (h, n) for h, n in jobs}
        for future in as_completed(futures):
            parts[futures[future]] = future.result()
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    first, source = next(iter(parts.values()))  # every worker loaded the same model
    score = {
        h: {t: {n: parts[h, n][0].score[h][t][n] for n in suite.lengths} for t in suite.tasks}
        for h in suite.haystack_kinds
    }
    tokens = {n: max(parts[h, n][0].prompt_tokens[n] for h in suite.haystack_kinds) for n in suite.lengths}
    # Trials in the order one process records them: haystack, task, length, index.
    trials = [
        r
        for h in suite.haystack_kinds
        for t in suite.tasks
        for n in suite.lengths
        for r in parts[h, n][0].trials
        if r["task"] == t
    ]
    result = RulerResult(
        suite=suite,
        score=score,
        prompt_tokens=tokens,
        train_context_length=first.train_context_length,
        trials=trials,
    )
    return result, source


def _column(result, n: int) -> str:
    ratio = f" ({n / result.train_context_length:g}x)" if result.train_context_length else ""
    return f"{n}{ratio}"


def format_table(result, source: str) -> str:
    """A task x length table (scores in %) per haystack, then the mean over haystacks."""
    s = result.suite
    lines = [
        f"RULER suite: model {source}, split {s.split} (template families {', '.join(s.family_names)}), "
        f"{s.n_trials} trials per cell, seed {s.seed}, train context "
        f"{result.train_context_length if result.train_context_length else 'unknown'}, "
        f"Python {result.python_version}",
        "score: share of the expected values found first in the answer (%)",
    ]
    heads = [_column(result, n) for n in s.lengths]
    width = max(12, *map(len, heads))

    def block(title: str, value) -> None:
        head = f"{'task':<14}" + "".join(f"{h:>{width}}" for h in heads)
        lines.extend(["", title, head, "-" * len(head)])
        for task in s.tasks:
            lines.append(f"{task:<14}" + "".join(f"{100 * value(task, n):>{width}.1f}" for n in s.lengths))

    for h in s.haystack_kinds:
        block(f"haystack {h}", lambda task, n, h=h: result.score[h][task][n])
    if len(s.haystack_kinds) > 1:
        block(f"mean over {len(s.haystack_kinds)} haystacks", result.mean)
    return "\n".join(lines)


def plot_heatmap(result, path: str) -> None:
    """Task x length heatmaps, one panel per haystack (and the mean), as PNG (matplotlib, imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.suite
    panels = [(f"haystack {h}", lambda t, n, h=h: result.score[h][t][n]) for h in s.haystack_kinds]
    if len(panels) > 1:
        panels.append(("mean", result.mean))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(1.1 * len(s.lengths) * len(panels) + 2.5, 0.45 * len(s.tasks) + 1.8), squeeze=False
    )
    for ax, (title, value) in zip(axes[0], panels):
        grid = [[100 * value(t, n) for n in s.lengths] for t in s.tasks]
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(s.lengths)), [_column(result, n) for n in s.lengths], fontsize=8)
        ax.set_yticks(range(len(s.tasks)), s.tasks if ax is axes[0][0] else [""] * len(s.tasks))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("prompt tokens", fontsize=8)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), label="score (%)")
    fig.suptitle(f"RULER suite, split {s.split}, {s.n_trials} trials per cell", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"ruler: wrote {path}", file=sys.stderr)
