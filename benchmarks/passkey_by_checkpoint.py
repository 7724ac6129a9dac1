"""Passkey accuracy of every checkpoint of a training run: when does retrieval appear, and at which lengths?

Runs the docs/passkey.md evaluation (few trials, every depth) on each `checkpoints/step_*` of a run
directory plus its `final`, prints a step x length table and optionally plots it.

    python benchmarks/passkey_by_checkpoint.py runs/demo_cpu_stage2 --lengths 256 1024 4096 --trials 10 \
        --plot docs/passkey_by_step.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gptoss_lite.checkpoint import load_model
from gptoss_lite.evals.passkey import PasskeyEvaluator


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every saved checkpoint, in step order; `final` last at its recorded step."""
    found = sorted(
        (int(d.name.removeprefix("step_")), d) for d in (run_dir / "checkpoints").glob("step_*") if d.is_dir()
    )
    final = run_dir / "final"
    if (final / "config.json").is_file():
        step = json.loads((final / "config.json").read_text()).get("training", {}).get("step")
        if step is None or step not in {s for s, _ in found}:
            found.append((step if step is not None else (found[-1][0] + 1 if found else 0), final))
    if not found:
        raise SystemExit(f"{run_dir}: no checkpoints/step_* or final/ directories with a model")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a training output directory (checkpoint.out_dir)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--trials", type=int, default=10, help="keys per length, each asked at 3 depths")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plot", default=None, metavar="PNG", help="accuracy-vs-step line plot")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print(f"passkey accuracy (%) by checkpoint, {args.trials} keys x 3 depths per length")
    print(f"{'step':>6} " + " ".join(f"{n:>7}" for n in args.lengths))
    for step, directory in checkpoints(args.run_dir):
        result = PasskeyEvaluator(load_model(directory), lengths=args.lengths, n_trials=args.trials).run()
        rows.append((step, [100 * result.accuracy[n] for n in args.lengths]))
        print(f"{step:>6} " + " ".join(f"{a:>7.1f}" for a in rows[-1][1]), flush=True)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4))
        for j, n in enumerate(args.lengths):
            ax.plot([s for s, _ in rows], [acc[j] for _, acc in rows], marker="o", label=f"{n} tokens")
        ax.set_xlabel("training step")
        ax.set_ylabel("passkey accuracy (%)")
        ax.set_ylim(-3, 103)
        ax.set_title(f"{args.run_dir}: {args.trials} keys x 3 depths per point")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
