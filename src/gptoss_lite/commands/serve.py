"""`gptoss-lite serve`: the OpenAI-compatible HTTP server (docs/server.md).

The --tenant-* flags, --max-queue-time, --tenant-config and --admission set how tenants (API keys) share
the engine (docs/server.md#sharing-between-tenants); without them every tenant has an equal share and no
quota, and one tenant is plain first come, first served.

SIGTERM (or Ctrl-C) drains: the listening socket closes, new requests on open connections get 503,
running requests finish (up to --drain-timeout seconds; then each still running ends with an error
event and `[DONE]`), then the engine stops and the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import sys
import threading
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from gptoss_lite.commands.common import add_decode_steps_arg, add_engine_kv_args, add_model_arg

    p = sub.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve --model over HTTP: /v1/completions, /v1/chat/completions, /v1/responses (all "
        "streaming), /v1/models, /health, /metrics, and a playground page at /. A gpt-oss checkpoint (its "
        "tokenizer.json is the o200k_harmony vocabulary) chats in the harmony format: reasoning, tool calls; with "
        "--python-tool, --browser-corpus or --tool-server its /v1/responses also runs gpt-oss's built-in tools.",
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
    add_decode_steps_arg(p)
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    p.add_argument("--no-prefix-caching", action="store_true", help="never reuse cached prompt prefixes")
    p.add_argument(
        "--chat-format",
        choices=("auto", "harmony", "template"),
        default="auto",
        help="how chats are rendered and parsed: harmony (gpt-oss: reasoning, tool calls), the checkpoint's "
        "chat template, or auto: harmony when the tokenizer is the gpt-oss vocabulary (default: auto)",
    )
    add_engine_kv_args(p)
    add_tenant_args(p)
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds running requests may take to finish after SIGTERM (default: 60)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=None,
        metavar="NAME",
        help="a Host name requests may use (repeatable; '*' for any). Default: any when API keys are set, else "
        "--host and the localhost names, so a web page cannot reach the server by DNS rebinding",
    )
    p.add_argument(
        "--metrics-open",
        action="store_true",
        help="serve /metrics and /stats without a key on a server with API keys (they name tenants)",
    )
    p.add_argument(
        "--stalled-client-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="abort a stream whose client has not taken data for S seconds, freeing its KV blocks (default: 60)",
    )
    p.add_argument(
        "--header-timeout", type=float, default=10.0, metavar="S", help="seconds to send request headers (10)"
    )
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S", help="seconds to send a body (30)")
    p.add_argument(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="where /v1/responses keeps stored responses (responses.sqlite3) and the key that seals reasoning "
        "items (sealing.key); servers on one directory share both (default: $XDG_CACHE_HOME/gptoss-lite/server, "
        "else ~/.cache/gptoss-lite/server)",
    )
    p.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help="the key that seals reasoning items: 32 raw bytes or 64 hex digits (default: DIR/sealing.key, made on "
        "first start)",
    )
    p.add_argument(
        "--response-ttl",
        type=float,
        default=30 * 24 * 3600,
        metavar="S",
        help="seconds a stored response is kept for previous_response_id and GET (default: 2592000, 30 days)",
    )
    tools = p.add_argument_group(
        "built-in tools",
        "tools the server runs inside /v1/responses when a request enables them (gpt-oss harmony models only; "
        "docs/tools.md#serving-the-tools)",
    )
    tools.add_argument(
        "--python-tool",
        action="store_true",
        help="serve the python tool (`code_interpreter`): sandboxed interpreters, one per conversation; the server "
        "refuses to start where no sandbox (unshare or bubblewrap) works",
    )
    tools.add_argument(
        "--python-tool-unsandboxed",
        action="store_true",
        help="serve the python tool WITHOUT isolation (the code runs as this server's user, with its files and "
        "network): only where every client is trusted",
    )
    tools.add_argument(
        "--browser-corpus",
        default=None,
        metavar="DIR",
        help="serve the browser tool (`web_search`) over the documents in DIR (.txt, .md, .html; read only, its "
        "index kept in the data dir)",
    )
    tools.add_argument(
        "--tool-server",
        action="append",
        default=None,
        metavar="[LABEL=]URL",
        help="an MCP server whose tools requests may enable as {'type': 'mcp', 'server_label': LABEL} (repeatable; "
        "streamable HTTP, or SSE for a URL ending in /sse; without LABEL= the name the server gives itself)",
    )
    tools.add_argument(
        "--max-tool-calls",
        type=int,
        default=16,
        metavar="N",
        help="built-in calls one response may run when the request sends no max_tool_calls (default: 16)",
    )
    tools.add_argument(
        "--tool-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds one built-in call may take, python included (default: 120, what harmony tells the model)",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(handler=run)


def add_tenant_args(p: argparse.ArgumentParser) -> None:
    """How tenants share the engine (engine/fairness.py; docs/server.md#sharing-between-tenants)."""
    g = p.add_argument_group(
        "sharing between tenants",
        "each API key's tenant gets a share of the engine's slots and tokens; the limits below are each "
        "tenant's own (docs/server.md#sharing-between-tenants). Default: equal shares, no quotas",
    )
    g.add_argument(
        "--tenant-share",
        action="append",
        default=None,
        metavar="NAME=WEIGHT",
        help="tenant NAME's share of the engine relative to the others' (repeatable; a number > 0; default 1)",
    )
    g.add_argument(
        "--tenant-max-running",
        type=int,
        default=None,
        metavar="N",
        help="requests one tenant may have running at once (default: no limit but --max-running)",
    )
    g.add_argument(
        "--tenant-max-waiting",
        type=int,
        default=None,
        metavar="M",
        help="requests one tenant may have waiting beyond its running ones; one more is a 429 with Retry-After "
        "(default: no limit but --max-waiting)",
    )
    g.add_argument(
        "--tenant-tokens-per-minute",
        type=int,
        default=None,
        metavar="T",
        help="tokens (prompt + max_tokens per sample, the unused part given back) one tenant may queue per "
        "minute; beyond it a 429 with Retry-After (default: no limit)",
    )
    g.add_argument(
        "--max-queue-time",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a request that waited this long without being admitted is answered 429 queue_timeout "
        "(default: it waits as long as it takes)",
    )
    g.add_argument(
        "--tenant-config",
        default=None,
        metavar="FILE",
        help="the whole tenant policy from a YAML (.yaml, .yml) or JSON file: a 'default' section and "
        "per-tenant sections of share, max_running, max_waiting, tokens_per_minute, max_queue_time, and "
        "'fair'; not with the flags above, which set its 'default' section",
    )
    g.add_argument(
        "--admission",
        choices=("fair", "fcfs"),
        default=None,
        help="fair: tenants in turn by their shares; fcfs: arrival order across tenants, the rule before "
        "tenants shared (quotas still apply), for comparison (default: fair, or the config file's 'fair')",
    )


# The flags that set every tenant's limits, by TenantLimits field.
TENANT_LIMIT_FLAGS = {
    "max_running": "--tenant-max-running",
    "max_waiting": "--tenant-max-waiting",
    "tokens_per_minute": "--tenant-tokens-per-minute",
    "max_queue_time": "--max-queue-time",
}


def tenant_policy(args: argparse.Namespace, keys: dict[str, str] | None):
    """The TenantPolicy of the tenant flags (None when none is given: the engine's default, equal
    shares and no quotas), checked before the model loads. With API keys, every tenant the policy
    names must be one a key maps to (a misspelt name would silently get the default share); an open
    server has one tenant, "default"."""
    from gptoss_lite.engine import TenantLimits, TenantPolicy
    from gptoss_lite.engine.tenants import DEFAULT_TENANT
    from gptoss_lite.validation import check_int

    given = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in TENANT_LIMIT_FLAGS.items()}
    limits = {field: value for field, value in given.items() if value is not None}
    shares = parse_tenant_shares(args.tenant_share or [])
    if args.tenant_config is not None:
        clash = [TENANT_LIMIT_FLAGS[f] for f in limits] + (["--tenant-share"] if shares else [])
        if clash:
            raise ValueError(
                f"{', '.join(clash)} with --tenant-config: the file is the whole policy; put the limits in its "
                "'default' section and the shares under 'tenants'"
            )
        try:
            policy = TenantPolicy.load(args.tenant_config)
        except ValueError as exc:
            raise ValueError(f"--tenant-config: {exc}") from None
    elif limits or shares or args.admission is not None:
        for field, low in (("max_running", 1), ("max_waiting", 0), ("tokens_per_minute", 1)):
            if field in limits:
                check_int(TENANT_LIMIT_FLAGS[field], limits[field], low)
        seconds = limits.get("max_queue_time")
        if seconds is not None and not 0 < seconds < math.inf:
            raise ValueError(f"--max-queue-time {seconds}: must be a positive number of seconds")
        default = TenantLimits(**limits)
        named = {name: dataclasses.replace(default, share=share) for name, share in shares.items()}
        policy = TenantPolicy(default=default, tenants=named)
    else:
        return None
    if args.admission is not None:
        policy = dataclasses.replace(policy, fair=args.admission == "fair")
    for name, lim in [("every tenant", policy.default), *((f"tenant {n!r}", v) for n, v in policy.tenants.items())]:
        if lim.max_running is not None and lim.max_running > args.max_running:
            raise ValueError(
                f"max_running={lim.max_running} for {name} is more than --max-running {args.max_running}, "
                "which no tenant can pass; lower it or raise --max-running"
            )
    known = set(keys.values()) if keys is not None else {DEFAULT_TENANT}
    for name in policy.tenants:
        if name not in known:
            where = "--tenant-share" if args.tenant_config is None else f"--tenant-config {args.tenant_config}"
            served = (
                f"the --api-key tenants are {', '.join(sorted(known))}"
                if keys is not None
                else f"a server without --api-key has one tenant, {DEFAULT_TENANT!r}"
            )
            raise ValueError(f"{where}: no API key maps to tenant {name!r} ({served})")
    return policy


def describe_policy(policy) -> str:
    """A tenant policy in words, for the start-up lines."""
    from gptoss_lite.engine import TenantLimits

    def limits(lim: TenantLimits) -> str:
        parts = [f"{name} {getattr(lim, name):g}" for name in TENANT_LIMIT_FLAGS if getattr(lim, name) is not None]
        return ", ".join(parts) or "no quotas"

    rule = "fair shares" if policy.fair else "arrival order (fcfs)"
    named = "; ".join(f"{name}: share {lim.share:g}, {limits(lim)}" for name, lim in sorted(policy.tenants.items()))
    return f"{rule}; every tenant: {limits(policy.default)}" + (f"; {named}" if named else "")


def parse_tenant_shares(entries: list[str]) -> dict[str, float]:
    """['NAME=WEIGHT', ...] -> {name: weight}; each weight a finite number > 0, each name once."""
    shares: dict[str, float] = {}
    for entry in entries:
        name, sep, weight = entry.partition("=")
        name = name.strip()
        try:
            share = float(weight) if sep and name else math.nan
        except ValueError:
            share = math.nan
        if not 0 < share < math.inf:
            raise ValueError(f"--tenant-share {entry!r}: expected NAME=WEIGHT with a number WEIGHT > 0, e.g. alice=3")
        if name in shares:
            raise ValueError(f"--tenant-share: tenant {name!r} given twice")
        shares[name] = share
    return shares


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


def default_data_dir() -> Path:
    """$XDG_CACHE_HOME/gptoss-lite/server, or ~/.cache/gptoss-lite/server (XDG: a relative value is ignored)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "gptoss-lite" / "server"


def check_args(args: argparse.Namespace) -> dict[str, str] | None:
    """Everything checkable before the model loads; returns the {key: tenant} map (None: open server).
    The data directory is opened here too, so a store or key that cannot be used stops the start."""
    from gptoss_lite.commands.common import engine_kv_kwargs
    from gptoss_lite.server.state import open_data_dir
    from gptoss_lite.validation import check_int

    check_int("--port", args.port, 0, 65535)
    check_int("--max-running", args.max_running, 1)
    check_int("--max-waiting", args.max_waiting, 1)
    check_int("--max-batch-tokens", args.max_batch_tokens, 1)
    check_int("--decode-steps", args.decode_steps, 1)
    check_int("--block-size", args.block_size, 1)
    if args.kv_blocks is not None:
        check_int("--kv-blocks", args.kv_blocks, 1)
    if args.max_model_len is not None:
        check_int("--max-model-len", args.max_model_len, 1)
    engine_kv_kwargs(args)
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout {args.drain_timeout}: must be >= 0 seconds")
    for flag in ("stalled_client_timeout", "header_timeout", "body_timeout"):
        value = getattr(args, flag)
        if not 0 < value < float("inf"):
            raise ValueError(f"--{flag.replace('_', '-')} {value}: must be a positive number of seconds")
    for host in args.allowed_host or []:
        if not host.strip() or any(c.isspace() or c in "/@" for c in host.strip()):
            raise ValueError(f"--allowed-host {host!r}: expected a host name or address (no scheme, path or port)")
    entries = list(args.api_key or [])
    if args.api_key_file is not None:
        lines = Path(args.api_key_file).read_text().splitlines()
        entries += [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
    keys = parse_api_keys(entries) if entries else None
    if args.admin_key is not None and keys is None:
        raise ValueError("--admin-key needs --api-key: without keys the admin routes are open")
    if not 0 < args.response_ttl < math.inf:
        raise ValueError(f"--response-ttl {args.response_ttl}: must be a positive number of seconds")
    if args.data_dir is None:
        args.data_dir = str(default_data_dir())
    store, _ = open_data_dir(args.data_dir, args.secret_file, args.response_ttl)
    store.close()
    return keys


def tool_kwargs(args: argparse.Namespace) -> dict:
    """create_app's built-in tool arguments from the flags, checked before the model loads: the python
    pool is started (a ValueError of one line when no sandbox works and --python-tool-unsandboxed was
    not given), the corpus directory and the tool server URLs are checked."""
    from gptoss_lite.server.mcp_client import ToolServer
    from gptoss_lite.validation import check_int

    check_int("--max-tool-calls", args.max_tool_calls, 0)
    if not 0 < args.tool_timeout < math.inf:
        raise ValueError(f"--tool-timeout {args.tool_timeout}: must be a positive number of seconds")
    if args.browser_corpus is not None and not Path(args.browser_corpus).expanduser().is_dir():
        raise ValueError(f"--browser-corpus {args.browser_corpus!r}: not a directory")
    servers = [ToolServer.parse(entry) for entry in args.tool_server or ()]
    python = None
    if args.python_tool or args.python_tool_unsandboxed:
        from gptoss_lite.tools.python_tool import PythonToolPool, SandboxUnavailable

        try:
            python = PythonToolPool(sandbox="none" if args.python_tool_unsandboxed else "auto")
        except SandboxUnavailable as exc:
            why = " ".join(str(exc).split())
            raise ValueError(
                f"--python-tool: no sandbox works here ({why}); pass --python-tool-unsandboxed to run code "
                "without isolation"
            ) from None
    return {
        "python_tool": python,
        "browser_corpus": args.browser_corpus,
        "tool_servers": servers,
        "max_tool_calls": args.max_tool_calls,
        "tool_timeout": args.tool_timeout,
    }


def run(args: argparse.Namespace) -> int:

    from gptoss_lite.checkpoint import default_model_source
    from gptoss_lite.commands.common import (
        configure_threads,
        engine_kv_kwargs,
        resolve_device,
        speculation_label,
        torch_dtype,
    )
    from gptoss_lite.engine import LLM
    from gptoss_lite.server import create_app
    from gptoss_lite.server.http import uvicorn_config

    keys = check_args(args)
    tenants = tenant_policy(args, keys)
    tools = tool_kwargs(args)
    device = resolve_device(args.device)
    threads = configure_threads(args.threads)
    source = args.model if args.model is not None else default_model_source()
    llm = LLM(
        source,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running,
        decode_steps=args.decode_steps,
        dtype=torch_dtype(args.dtype),
        rope_factor=args.rope_factor,
        mxfp4_activations=args.mxfp4_activations,
        device=device,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        tenants=tenants,
        **engine_kv_kwargs(args, load_draft=True),
    )
    app = create_app(
        llm,
        api_keys=keys,
        admin_key=args.admin_key,
        max_waiting=args.max_waiting,
        served_model_name=args.served_model_name,
        allowed_hosts=args.allowed_host,
        bind_host=args.host,
        metrics_open=args.metrics_open,
        stall_timeout=args.stalled_client_timeout,
        body_timeout=args.body_timeout,
        harmony={"auto": None, "harmony": True, "template": False}[args.chat_format],
        data_dir=args.data_dir,
        secret_file=args.secret_file,
        response_ttl=args.response_ttl,
        **tools,
    )
    state = app.state.server
    print(
        f"gptoss-lite serve: {state.model_name} on http://{args.host}:{args.port} "
        f"(context {llm.max_model_len} tokens, {threads} thread(s), "
        f"{'open: no API key' if keys is None else f'{len(set(keys.values()))} tenant(s)'})",
        file=sys.stderr,
    )
    print(
        f"gptoss-lite serve: responses stored in {state.responses.path}, kept {args.response_ttl:,.0f} s "
        f"({args.response_ttl / 86400:.3g} days), the newest {state.responses.max_per_tenant:,} per tenant",
        file=sys.stderr,
    )
    if tenants is not None:
        print(f"gptoss-lite serve: tenants: {describe_policy(tenants)}", file=sys.stderr)
    if state.harmony is not None:
        print("gptoss-lite serve: chats in the harmony format (reasoning, tool calls)", file=sys.stderr)
    served = describe_tools(state.tools)
    if served:
        print(f"gptoss-lite serve: built-in tools in /v1/responses: {served}", file=sys.stderr)
    if llm.speculate is not None:
        print(f"gptoss-lite serve: speculative decoding, {speculation_label(args, llm)}", file=sys.stderr)
    if llm.compile_seconds is not None:
        print(f"gptoss-lite serve: compiled decode step ready in {llm.compile_seconds:.1f} s", file=sys.stderr)
    hosts = state.allowed_hosts
    if hosts is not None and args.host in ("0.0.0.0", "::"):
        print(
            f"gptoss-lite serve: answering Host {', '.join(sorted(hosts))} only; pass --allowed-host NAME for the "
            "names clients use to reach this machine",
            file=sys.stderr,
        )
    config = uvicorn_config(
        app,
        header_timeout=args.header_timeout,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,  # after the drain below: only closing what is left
    )
    draining_server(config, state, args.drain_timeout).run()
    print("gptoss-lite serve: stopped", file=sys.stderr)
    return 0


def describe_tools(tools) -> str:
    """The built-in tools a server runs, in words ("" for none)."""
    parts = []
    if tools.python is not None:
        parts.append(f"python (sandbox: {tools.python.sandbox})")
    if tools.corpus is not None:
        parts.append(f"browser over {tools.corpus.root} ({len(tools.corpus):,} documents)")
    parts += [f"mcp {s.label or '(label from the server)'} at {s.url}" for s in tools.servers]
    return ", ".join(parts)


def draining_server(config, state, drain_timeout: float):
    """A uvicorn.Server that drains on the first SIGTERM/SIGINT and then returns normally (uvicorn
    would raise the signal again once shut down: exit 143, not 0).

    The drain: the listening sockets close, the app is marked draining (a request that still arrives
    on an open connection gets 503, /health 503), running requests finish; after `drain_timeout`
    seconds the ones left are ended (each stream gets an error event and `[DONE]`). Only then does
    uvicorn's own shutdown close the connections. A second signal stops at once.
    """
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if state.draining:  # a second signal: stop now
                self.force_exit = True
                super().handle_exit(sig, frame)
            else:
                state.draining = True
                print("gptoss-lite serve: draining (running requests finish, new ones get 503)", file=sys.stderr)
                loop = getattr(self, "_loop", None)
                if loop is not None:
                    loop.call_soon_threadsafe(self._close_listeners)
                threading.Thread(target=self._drain, name="gptoss-drain", daemon=True).start()
            if hasattr(self, "_captured_signals"):
                self._captured_signals.clear()  # a drained shutdown is a success

        async def startup(self, sockets=None) -> None:
            import asyncio

            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def _close_listeners(self) -> None:
            for server in getattr(self, "servers", []):
                server.close()

        def _drain(self) -> None:
            deadline = time.monotonic() + drain_timeout
            while not state.engine.idle and time.monotonic() < deadline:
                time.sleep(0.05)
            if not state.engine.idle:
                print("gptoss-lite serve: drain timeout; ending the requests still running", file=sys.stderr)
                state.engine.fail_all("the server is shutting down: the drain timeout passed")
                until = time.monotonic() + 2.0  # let the streams write their last events
                while not state.engine.idle and time.monotonic() < until:
                    time.sleep(0.05)
                time.sleep(0.2)
            self.should_exit = True

    return DrainingServer(config)
