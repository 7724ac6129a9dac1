"""RULER score of every checkpoint of a training run, beside its training loss: the training curve.

Runs a small `gptoss-lite ruler` suite (eval split, held-out phrasings, words and haystacks) on each
`checkpoints/step_*` of a run directory plus its `final` (and optionally the model it started from,
as step 0), prints a step x task table (mean over haystacks) and plots it under the run's loss curve
(`metrics.jsonl`, answer tokens only when the run scores answers only).

    python benchmarks/ruler_by_checkpoint.py runs/demo_cpu_stage3 --start runs/demo_cpu_stage2/final \\
        --length 4096 --trials 6 --json benchmarks/results/ruler_by_step.json --plot docs/img/ruler_by_step.png
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from passkey_by_checkpoint import checkpoints as run_checkpoints

from gptoss_lite.checkpoint import load_model
from gptoss_lite.evals.ruler import RulerEvaluator, RulerSuite

DEFAULT_TASKS = ("single-number", "single-word", "single-uuid", "multi-key", "none")


def checkpoints(run_dir: Path, start: Path | None) -> list[tuple[int, Path]]:
    """(step, directory) of the start model (step 0), every saved checkpoint and `final`, in step order."""
    found = run_checkpoints(run_dir)
    return [(0, start), *found] if start is not None else found


def loss_curve(run_dir: Path) -> list[tuple[int, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a training output directory (checkpoint.out_dir)")
    ap.add_argument("--start", type=Path, default=None, help="the model the run started from, shown as step 0")
    ap.add_argument("--length", type=int, default=4096, help="prompt tokens (default: 4096)")
    ap.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS))
    ap.add_argument("--trials", type=int, default=6, help="trials per task x haystack cell (default: 6)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, metavar="FILE", help="write the table and loss curve as JSON")
    ap.add_argument("--plot", default=None, metavar="PNG", help="loss and RULER score against the step")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    suite = RulerSuite(lengths=(args.length,), tasks=tuple(args.tasks), n_trials=args.trials)
    print(
        f"RULER eval split at {args.length} tokens by checkpoint: {args.trials} trials x "
        f"{len(suite.haystack_kinds)} haystacks per task (%, mean over haystacks)"
    )
    print(f"{'step':>6} " + " ".join(f"{t:>13}" for t in args.tasks) + f" {'mean':>6} {'s':>5}")
    rows = []
    for step, directory in checkpoints(args.run_dir, args.start):
        t0 = time.perf_counter()
        result = RulerEvaluator(load_model(directory), suite).run()
        scores = [100 * result.mean(t, args.length) for t in args.tasks]
        rows.append({"step": step, "model": str(directory), "scores": dict(zip(args.tasks, scores))})
        mean = sum(scores) / len(scores)
        print(
            f"{step:>6} " + " ".join(f"{s:>13.1f}" for s in scores) + f" {mean:>6.1f} {time.perf_counter() - t0:>5.0f}",
            flush=True,
        )
    curve = loss_curve(args.run_dir)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"length": args.length, "trials": args.trials, "rows": rows, "loss": curve}, indent=1) + "\n"
        )
        print(f"json: {args.json}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6), sharex=True)
        if curve:
            steps, losses = zip(*curve)
            k = 10  # moving average over k logged points
            windows = [losses[max(0, i - k + 1) : i + 1] for i in range(len(losses))]
            smooth = [sum(w) / len(w) for w in windows]
            top.plot(steps, losses, color="0.75", lw=0.8, label="logged")
            top.plot(steps, smooth, color="C0", lw=1.5, label=f"mean of {k}")
            top.set_yscale("log")
            top.set_ylabel("training loss (nats/token)")
            top.legend()
        top.grid(alpha=0.3)
        top.set_title(f"{args.run_dir}")
        for task in args.tasks:
            bottom.plot([r["step"] for r in rows], [r["scores"][task] for r in rows], marker="o", label=task)
        bottom.set_xlabel("training step")
        bottom.set_ylabel(f"RULER score at {args.length} tokens (%)")
        bottom.set_ylim(-3, 103)
        bottom.grid(alpha=0.3)
        bottom.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
