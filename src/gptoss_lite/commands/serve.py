"""`gptoss-lite serve`: the OpenAI-compatible HTTP server (docs/server.md).

SIGTERM (or Ctrl-C) drains: the listening socket closes, new requests on open connections get 503,
running requests finish (up to --drain-timeout seconds), then the engine stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from gptoss_lite.commands.common import add_engine_kv_args, add_model_arg

    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve --model over HTTP: /v1/completions, /v1/chat/completions (streaming), /v1/models, "
        "/health, /metrics, and a playground page at /.",
    )
    add_model_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="[TENANT=]KEY",
        help="accept this API key (repeatable); the prefix cache is scoped per tenant, so keys of different "
        "tenants never share cached prefixes; without TENANT= each key is its own tenant; with no key the "
        "server is open to anyone who can reach it",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read [TENANT=]KEY lines from this file (keeps keys out of the process list)",
    )
    p.add_argument("--admin-key", default=None, help="key for /admin routes when API keys are set (default: none)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: the model's name)")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + max_tokens limit in tokens")
    p.add_argument("--max-running", type=int, default=64, help="requests generated together (default: 64)")
    p.add_argument(
        "--max-waiting", type=int, default=256, help="requests allowed to wait; beyond it a 429 (default: 256)"
    )
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per engine step (default: 512)")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks in the pool (default: sized by the engine)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--no-prefix-caching", action="store_true", help="never reuse cached prompt prefixes")
    add_engine_kv_args(p)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds running requests may take to finish after SIGTERM (default: 60)",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(handler=run)


def parse_api_keys(entries: list[str]) -> dict[str, str]:
    """['[TENANT=]KEY', ...] -> {key: tenant}; a bare key's tenant is 'key-' + 8 hex digits of its hash."""
    keys: dict[str, str] = {}
    for entry in entries:
        entry = entry.strip()
        tenant, sep, key = entry.partition("=")
        if not sep:
            tenant, key = "key-" + hashlib.sha256(entry.encode()).hexdigest()[:8], entry
        if not key or not tenant:
            raise ValueError(f"--api-key {entry!r}: expected KEY or TENANT=KEY, both non-empty")
        if any(c.isspace() for c in key):
            raise ValueError("--api-key: a key must not contain whitespace")
        if key in keys and keys[key] != tenant:
            raise ValueError(f"--api-key: one key given for two tenants ({keys[key]!r} and {tenant!r})")
        keys[key] = tenant
    return keys


def check_args(args: argparse.Namespace) -> dict[str, str] | None:
    """Everything checkable before the model loads; returns the {key: tenant} map (None: open server)."""
    from gptoss_lite.commands.common import engine_kv_kwargs
    from gptoss_lite.validation import check_int

    check_int("--port", args.port, 0, 65535)
    check_int("--max-running", args.max_running, 1)
    check_int("--max-waiting", args.max_waiting, 1)
    check_int("--max-batch-tokens", args.max_batch_tokens, 1)
    check_int("--block-size", args.block_size, 1)
    if args.kv_blocks is not None:
        check_int("--kv-blocks", args.kv_blocks, 1)
    if args.max_model_len is not None:
        check_int("--max-model-len", args.max_model_len, 1)
    engine_kv_kwargs(args)
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout {args.drain_timeout}: must be >= 0 seconds")
    entries = list(args.api_key or [])
    if args.api_key_file is not None:
        lines = Path(args.api_key_file).read_text().splitlines()
        entries += [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
    keys = parse_api_keys(entries) if entries else None
    if args.admin_key is not None and keys is None:
        raise ValueError("--admin-key needs --api-key: without keys the admin routes are open")
    return keys


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from gptoss_lite.checkpoint import default_model_source
    from gptoss_lite.commands.common import configure_threads, engine_kv_kwargs, resolve_device
    from gptoss_lite.engine import LLM
    from gptoss_lite.server import create_app

    keys = check_args(args)
    device = resolve_device(args.device)
    threads = configure_threads(args.threads)
    source = args.model if args.model is not None else default_model_source()
    llm = LLM(
        source,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
        dtype=getattr(torch, args.dtype),
        device=device,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        **engine_kv_kwargs(args),
    )
    app = create_app(
        llm,
        api_keys=keys,
        admin_key=args.admin_key,
        max_waiting=args.max_waiting,
        served_model_name=args.served_model_name,
    )
    state = app.state.server
    print(
        f"gptoss-lite serve: {state.model_name} on http://{args.host}:{args.port} "
        f"(context {llm.max_model_len} tokens, {threads} thread(s), "
        f"{'open: no API key' if keys is None else f'{len(set(keys.values()))} tenant(s)'})",
        file=sys.stderr,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.drain_timeout,
    )
    draining_server(config, state).run()
    print("gptoss-lite serve: stopped", file=sys.stderr)
    return 0


def draining_server(config, state):
    """A uvicorn.Server that marks the app as draining on the first SIGTERM/SIGINT, so requests that
    still arrive on open connections get 503 while the running ones finish, and that returns
    normally afterwards (uvicorn would raise the signal again once shut down: exit 143, not 0)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not state.draining:
                state.draining = True
                print("gptoss-lite serve: draining (running requests finish, new ones get 503)", file=sys.stderr)
            super().handle_exit(sig, frame)
            if hasattr(self, "_captured_signals"):
                self._captured_signals.clear()  # a drained shutdown is a success

    return DrainingServer(config)
