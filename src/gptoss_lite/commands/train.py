"""`gptoss-lite train`: train a model on synthetic long-context data from a YAML/JSON config (docs/training.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model from a YAML/JSON config (runs under torchrun for DDP)",
        description="Train with AdamW + warmup/cosine on synthetic retrieval data. Under torchrun "
        "(WORLD_SIZE > 1) the same command runs DDP; only rank 0 writes.",
    )
    p.add_argument(
        "--config", required=True, metavar="PATH", help="train config, .yaml/.yml or .json (e.g. configs/demo_cpu.yaml)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the output directory")
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        metavar="N",
        help="stop after N optimiser steps in total (default: schedule.total_steps); the lr schedule is unchanged",
    )
    p.add_argument(
        "--out", default=None, metavar="DIR", help="output directory, overriding checkpoint.out_dir of the config"
    )
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    from gptoss_lite.commands.common import add_threads_arg

    add_threads_arg(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gptoss_lite.train.config import load_train_config

    config = load_train_config(args.config)
    if args.out is not None:
        config = config.replace(
            checkpoint=config.checkpoint.__class__(
                out_dir=args.out, every_n_steps=config.checkpoint.every_n_steps, keep=config.checkpoint.keep
            )
        )
    from gptoss_lite.commands.common import configure_threads
    from gptoss_lite.train.loop import check_out_dir, latest_checkpoint, train

    check_out_dir(Path(config.checkpoint.out_dir))
    configure_threads(args.threads, load_aware=False)  # same machine, same threads, same weights
    try:
        summary = train(config, resume=args.resume, max_steps=args.max_steps, progress=not args.no_progress)
    except KeyboardInterrupt:
        newest = latest_checkpoint(config.checkpoint.out_dir)
        where = (
            f"the newest checkpoint is {newest}; continue with --resume"
            if newest is not None
            else "no checkpoint was written yet"
        )
        print(f"gptoss-lite train: interrupted; {where}", file=sys.stderr)
        return 130
    if summary.final_dir is None:  # not rank 0
        return 0
    report = {
        "start_step": summary.start_step,
        "end_step": summary.end_step,
        "final_loss": summary.final_loss,
        "tokens_per_s": summary.tokens_per_s,
        "final_dir": summary.final_dir,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        first = summary.losses[0] if summary.losses else None
        print(f"steps {summary.start_step} -> {summary.end_step}   loss {first} -> {summary.final_loss}")
        print(f"model: {summary.final_dir}")
        print(f"throughput: {summary.tokens_per_s:,.0f} tokens/s")
    return 0
