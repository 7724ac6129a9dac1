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


def add_speculate_args(parser: argparse.ArgumentParser) -> None:
    """--speculate {none,lookup,draft:PATH} and --draft-tokens K (issue 14)."""
    parser.add_argument("--speculate", default="none", metavar="{none,lookup,draft:PATH}",
                        help="speculative decoding: 'lookup' drafts by n-gram lookup in the prompt and the "
                             "generated text, 'draft:PATH' with a smaller model of the same vocabulary "
                             "(checkpoint directory or preset name); greedy output is unchanged "
                             "(default: none)")
    parser.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                        help="tokens drafted per step, verified in one forward (default: 8 for lookup, "
                             "4 for a draft model)")


def build_speculation(args: argparse.Namespace, model):
    """The `speculate=` argument for generate() from --speculate / --draft-tokens (None for 'none');
    a draft model is loaded like --model, on the same device and dtype."""
    import torch

    from gptoss_lite.speculative import DraftModel, PromptLookup

    mode, k = args.speculate, args.draft_tokens
    if k is not None and (isinstance(k, bool) or k < 1):
        raise ValueError(f"--draft-tokens {k}: must be >= 1")
    if mode == "none":
        if k is not None:
            raise ValueError("--draft-tokens needs --speculate lookup or --speculate draft:PATH")
        return None
    if mode == "lookup":
        return PromptLookup() if k is None else PromptLookup(k=k)
    if mode.startswith("draft:") and mode[len("draft:"):]:
        from gptoss_lite.checkpoint import load_model

        draft = load_model(mode[len("draft:"):], device=args.device, dtype=getattr(torch, args.dtype))
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"--speculate {mode}: the draft's vocab_size {draft.config.vocab_size} differs "
                             f"from the model's {model.config.vocab_size}; use a draft with the same tokenizer")
        return DraftModel(draft) if k is None else DraftModel(draft, k=k)
    raise ValueError(f"--speculate {mode!r}: use none, lookup or draft:PATH (a checkpoint directory or "
                     "preset name)")


def speculation_line(stats) -> str:
    """One line for --stats: acceptance rate and tokens per target forward."""
    return (f"speculation: {stats.accepted}/{stats.drafted} drafted tokens accepted "
            f"({100 * stats.acceptance_rate:.1f}%), {stats.tokens_per_forward:.2f} tokens per target forward "
            f"({stats.new_tokens} tokens, {stats.target_forwards} target forwards)")
