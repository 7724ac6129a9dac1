"""`gptoss-lite <command>`: one entry point, one module per subcommand in `gptoss_lite.commands`.

Each command module exposes `register(subparsers)`, which adds its parser and sets
`handler=<function(args) -> int>`. Command modules import heavy libraries (torch) inside their
handlers so that `gptoss-lite plan` stays pure Python and `--help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Order is the order shown in `gptoss-lite --help`.
COMMANDS: tuple[str, ...] = (
    "generate",
    "plan",
    "kv_bench",
    "train",
    "passkey",
    "ruler",
    "bench_serve",
    "serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gptoss-lite", description="Small, honest, fast inference for gpt-oss-style long-context models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for name in COMMANDS:
        importlib.import_module(f"gptoss_lite.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except BrokenPipeError:
        # The reader went away (`gptoss-lite generate --json | head`): stop quietly, as `cat` does,
        # and keep the interpreter's final flush from raising again into a closed pipe.
        _discard_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe
    except KeyboardInterrupt:
        print(f"gptoss-lite {args.command}: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT
    except (ValueError, TypeError, OSError, MemoryError, FloatingPointError) as exc:
        # Caller mistakes and unusable files get one clear line, not a traceback.
        print(f"gptoss-lite {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _discard_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. captured by a test)
        pass


if __name__ == "__main__":
    raise SystemExit(main())
