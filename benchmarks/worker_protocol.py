"""The line protocol between `serve_vs_vllm.py` and its engine workers (stdlib only: the vLLM worker runs in
vLLM's own virtual environment, where this package is not installed).

A worker loads its engine, prints `READY {json}` (what it runs: versions, threads, settings), then answers
each request line on stdin with one `RESULT {json}` line:

    {"op": "run", "prompts": [[id, ...], ...], "max_tokens": N}
        -> {"wall_s": seconds for the whole batch, "tokens": [[id, ...] per prompt, in prompt order], ...}
    {"op": "quit"}  (or end of input) -> the worker exits

Engines print logs (vLLM prints to stdout, also from its child processes), so `protocol_stream()` moves the
process's file descriptor 1 onto stderr before any engine is imported and keeps a private copy of the real
stdout for the protocol lines alone.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import TextIO

READY = "READY"
RESULT = "RESULT"

# run(prompts, max_tokens) -> (wall seconds, generated ids per prompt, extra fields for the result)
RunBatch = Callable[[list[list[int]], int], tuple[float, list[list[int]], dict]]


def protocol_stream() -> TextIO:
    """A private handle on the original stdout; fd 1 (and sys.stdout) now write to stderr, so nothing an
    engine or a child process it starts prints can be mistaken for a protocol line."""
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def serve(channel: TextIO, info: dict, run: RunBatch) -> None:
    """Announce `info`, then answer requests from stdin until `quit` or end of input."""
    channel.write(f"{READY} {json.dumps(info)}\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        if msg["op"] == "quit":
            break
        if msg["op"] != "run":
            raise ValueError(f"unknown op {msg['op']!r}: expected 'run' or 'quit'")
        wall, tokens, extra = run(msg["prompts"], msg["max_tokens"])
        short = [i for i, t in enumerate(tokens) if len(t) != msg["max_tokens"]]
        if short:  # EOS is ignored, so every request must run to max_tokens; a short one means a broken run
            raise RuntimeError(f"requests {short[:5]} returned fewer than max_tokens={msg['max_tokens']} tokens")
        channel.write(f"{RESULT} {json.dumps({'wall_s': wall, 'tokens': tokens, **extra})}\n")
