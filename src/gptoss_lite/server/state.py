"""The server's state: the engine loop, tenancy (API keys, admins, observers), the stores and
built-in tools a `create_app` call gathers (server/openai_api.py), and the prefix-cache scope rule."""

from __future__ import annotations

import hmac
import json
import tempfile
import time
from pathlib import Path

from fastapi import Request

from gptoss_lite.engine import QuotaExceeded
from gptoss_lite.engine.tenants import DEFAULT_TENANT
from gptoss_lite.server import protocol as P
from gptoss_lite.server.builtin_tools import (
    DEFAULT_MAX_TOOL_CALLS,
    DEFAULT_TOOL_TIMEOUT,
    ServerTools,
    load_corpus,
)
from gptoss_lite.server.chat import ChatTemplate
from gptoss_lite.server.engine_loop import EngineLoop
from gptoss_lite.server.harmony import harmony_for
from gptoss_lite.server.mcp_client import ToolServer
from gptoss_lite.server.metrics import ServerMetrics
from gptoss_lite.server.response_store import FILE_NAME, TTL_SECONDS, ResponseStore
from gptoss_lite.server.sealing import Sealer, data_dir_key, read_key_file

STATIC = Path(__file__).resolve().parent / "static"
# Seconds a 429 for a full queue or a queue timeout tells the client to wait: the engine's own figure for
# a full per-tenant queue (fairness.py: a slot frees when any running request finishes).
BUSY_RETRY_AFTER = 1.0
MAX_BODY_BYTES = 8 << 20  # a request body over this is a 413 (a prompt this long is over any context anyway)
DEFAULT_STALL_TIMEOUT = 60.0  # seconds a stream may wait for its client to take data before it is aborted


class ServerState:
    """Everything one app holds: the engine loop, metrics, the served name, the chat template, keys."""

    def __init__(
        self,
        llm,
        *,
        api_keys,
        admin_key,
        max_waiting,
        served_model_name,
        max_body_bytes,
        allowed_hosts,
        metrics_open,
        stall_timeout,
        body_timeout,
        harmony,
        data_dir,
        secret_file,
        response_ttl,
        tools=None,
    ):
        self.scratch = None  # without a data directory: the private temporary one used instead
        if data_dir is None:
            self.scratch = tempfile.TemporaryDirectory(prefix="gptoss-lite-server-")  # removed on collection or exit
            data_dir = self.scratch.name
        self.responses, self.sealer = open_data_dir(data_dir, secret_file, response_ttl)
        self.llm = llm
        self.admin_key = admin_key
        self.model_name = served_model_name or llm.model_name
        self.api_keys = dict(api_keys) if api_keys else None
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = allowed_hosts  # lower-case names, or None: any host
        self.metrics_open = metrics_open or self.api_keys is None
        self.stall_timeout, self.body_timeout = stall_timeout, body_timeout
        # A template that writes bos_token gets no second BOS from encode_prompt (docs/checkpoints.md#the-bos-rule).
        bos_token = llm.tokenizer.bos_token if llm.tokenizer is not None else None
        self.template = ChatTemplate(llm.chat_template, bos_token=bos_token or "")
        self.harmony = None if harmony is False else harmony_for(llm.tokenizer, required=harmony is True)
        self.engine = EngineLoop(llm, max_waiting=max_waiting, on_finished=self._finished)
        self.metrics = ServerMetrics(lambda: self.engine.snapshot.stats)
        self.tools = _server_tools(self, data_dir, **(tools or {}))
        self.draining = False
        self.created = int(time.time())

    def _finished(self, output, tenant: str) -> None:
        self.metrics.record_finished(output, tenant)

    def max_queue_time(self, tenant: str) -> float | None:
        """The tenant's max_queue_time (None: its requests wait as long as it takes)."""
        policy = self.llm.engine_config.tenants
        return None if policy is None else policy.limits(tenant).max_queue_time

    def admin(self, request: Request) -> None:
        """Admin routes: open on a server without API keys, else only for `admin_key` (401 otherwise;
        404 when keys are set and no admin key is)."""
        if self.api_keys is None:
            return
        key = _bearer(request)
        if self.admin_key is None:
            raise P.APIError(404, "Not Found", code="not_found")
        if not self._is_admin(key):
            raise P.APIError(
                401, "admin routes need the admin key", type="authentication_error", code="invalid_api_key"
            )

    def tenant(self, request: Request) -> str:
        """The tenant of the request's API key (APIError 401 for a missing or unknown key, 400 for
        several Authorization headers)."""
        if self.api_keys is None:
            _bearer(request)  # still one Authorization header at most
            return DEFAULT_TENANT
        key = _bearer(request)
        if key is None:
            raise P.APIError(
                401,
                "Missing API key: send 'Authorization: Bearer KEY'",
                type="authentication_error",
                code="invalid_api_key",
            )
        found = None
        for known, tenant in self.api_keys.items():  # compare with every key, in constant time each
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        if found is None:
            raise P.APIError(401, "Incorrect API key provided", type="authentication_error", code="invalid_api_key")
        return found

    def observer(self, request: Request) -> None:
        """/metrics and /stats: open without API keys or with --metrics-open; otherwise any API key or
        the admin key (they show tenant names and per-tenant counters)."""
        if self.metrics_open or self._is_admin(_bearer(request)):
            return
        self.tenant(request)

    def may_observe(self, request: Request) -> bool:
        """Whether `observer` would let this request see tenant names (for /health, which is open to
        all and shows them only then)."""
        try:
            self.observer(request)
        except P.APIError:
            return False
        return True

    def _is_admin(self, key: str | None) -> bool:
        admin = self.admin_key
        return key is not None and admin is not None and hmac.compare_digest(key.encode(), admin.encode())


def _server_tools(
    state: ServerState,
    data_dir,
    *,
    python_tool=None,
    browser_corpus=None,
    tool_servers=None,
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS,
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT,
) -> ServerTools:
    """The app's built-in tools (create_app's arguments); a ValueError when some are given to a model
    that does not speak harmony (only gpt-oss was trained to call them)."""
    servers = [s if isinstance(s, ToolServer) else ToolServer.parse(s) for s in tool_servers or ()]
    corpus = browser_corpus
    if corpus is not None and isinstance(corpus, (str, Path)):
        corpus = load_corpus(corpus, data_dir)
    count_tokens = None
    if state.harmony is not None:
        encoding = state.harmony.encoding
        count_tokens = lambda text: len(encoding.encode(text, disallowed_special=()))  # noqa: E731
    tools = ServerTools(
        python=python_tool,
        corpus=corpus,
        tool_servers=servers,
        metrics=state.metrics,
        count_tokens=count_tokens,
        tool_timeout=tool_timeout,
        max_tool_calls=max_tool_calls,
    )
    if tools and state.harmony is None:
        tools.close()
        raise ValueError("python_tool, browser_corpus and tool_servers need a harmony (gpt-oss) model")
    return tools


def open_data_dir(
    data_dir: str | Path, secret_file: str | Path | None = None, response_ttl: float = TTL_SECONDS
) -> tuple[ResponseStore, Sealer]:
    """The response store and the reasoning sealer of a data directory (made, mode 0700, if absent);
    a StoreError or ValueError naming the file that cannot be used."""
    folder = Path(data_dir)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = read_key_file(secret_file) if secret_file is not None else data_dir_key(folder)
    return ResponseStore(folder / FILE_NAME, ttl=response_ttl), Sealer(key)


def _bearer(request: Request) -> str | None:
    """The key of the request's one `Authorization: Bearer KEY` header (None without one). Two
    Authorization headers are a 400: which one counts would be a guess."""
    values = request.headers.getlist("authorization")
    if len(values) > 1:
        raise P.APIError(
            400, f"{len(values)} Authorization headers: send exactly one", param="authorization", code="bad_auth"
        )
    scheme, _, key = (values[0] if values else "").partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def cache_scope(tenant: str, cache_salt: str | None) -> str:
    """The prefix-cache scope: tenant and salt, encoded so no (tenant, salt) pair can spell another's."""
    return json.dumps([tenant, cache_salt])


def busy_error(state: ServerState, tenant: str, exc: Exception) -> P.APIError:
    """The 429 for a request refused before it was queued: the tenant's quota, or a full queue."""
    if isinstance(exc, QuotaExceeded):
        state.metrics.record_rejected(tenant, "rate_limit_exceeded")
        return P.APIError(
            429, str(exc), type="rate_limit_error", code="rate_limit_exceeded", headers=P.retry_after(exc.retry_after)
        )
    state.metrics.record_rejected(tenant, "queue_full")
    busy = f"the server is busy: {exc}; retry later"
    return P.APIError(429, busy, type="server_error", code="queue_full", headers=P.retry_after(BUSY_RETRY_AFTER))
