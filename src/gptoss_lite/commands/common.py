"""Helpers shared by command handlers: model/tokenizer resolution and human-readable units."""

from __future__ import annotations

import argparse


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model directory (ours or a Hugging Face gpt-oss checkpoint) or a preset name "
                             "(seeded random weights); default: the shipped demo model")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weight/activation dtype (default: float32)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: cpu)")


def load_model_and_tokenizer(args: argparse.Namespace):
    """Resolve --model (default: the shipped demo model) and its tokenizer."""
    import torch

    from gptoss_lite.checkpoint import default_model_source, load_model
    from gptoss_lite.tokenizer import load_tokenizer

    source = args.model if args.model is not None else default_model_source()
    model = load_model(source, device=args.device, dtype=getattr(torch, args.dtype))
    model_dir = source if _is_dir(source) else None
    return model, load_tokenizer(model_dir), source


def _is_dir(source) -> bool:
    from pathlib import Path

    return Path(str(source)).is_dir()


def fmt_bytes(n: int) -> str:
    """Binary units (KiB/MiB/GiB), as SPEC §5.1 requires for memory sizes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
