"""`gptoss-lite <command>`: one entry point, one module per subcommand in `gptoss_lite.commands`.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`handler=<function(args) -> int>`. Command modules import heavy libraries (torch) inside their
handlers so that `gptoss-lite plan` stays pure Python and `--help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order shown in `gptoss-lite --help`.
COMMANDS: tuple[str, ...] = (
    "generate",
    "plan",
    "kv_bench",
    "train",
    "passkey",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gptoss-lite",
        description="Small, honest, fast inference for gpt-oss-style long-context models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for name in COMMANDS:
        importlib.import_module(f"gptoss_lite.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, MemoryError) as exc:
        # Caller mistakes get one clear line, not a traceback.
        print(f"gptoss-lite {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
