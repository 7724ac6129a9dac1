"""The OpenAI-compatible HTTP API: `create_app(llm, ...)` returns a FastAPI app.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE with `stream: true`),
POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/models, GET /health, GET /metrics
(Prometheus), GET /stats (engine figures as JSON), POST /admin/reset_prefix_cache and GET / (the
playground page). The LLM runs on one EngineLoop thread; handlers only queue commands.

Built-in tools (`python_tool`, `browser_corpus`, `tool_servers`): a /v1/responses request that enables
them gets its browser, python and MCP calls run by the server inside the same response
(server/builtin_tools.py, docs/tools.md#serving-the-tools).

Tenancy: with `api_keys` ({key: tenant}) every /v1 request needs `Authorization: Bearer KEY`, and
the prefix-cache scope of its request is its tenant plus any `cache_salt` it sent, so a prefix that
one key cached is never a hit for another (docs/server.md#tenancy). Without keys everyone is the
tenant "default".

Sharing: every request runs on its tenant's share of the engine, ordered within it by its `priority`
(engine/fairness.py). A request a tenant's quota refuses, or that finds the queue full, is a 429 with
Retry-After; one that waits longer than its tenant's max_queue_time is a 429 `queue_timeout`
(docs/server.md#sharing-between-tenants).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import sqlite3
import tempfile
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gptoss_lite.engine import PreparedRequest, QuotaExceeded, SamplingParams
from gptoss_lite.engine.fairness import DEFAULT_TENANT
from gptoss_lite.grammar import GrammarError, HarmonyConstraint, JsonConstraint, compile_schema, lltokenizer, schema_of
from gptoss_lite.harmony.render import function_tools
from gptoss_lite.server import protocol as P
from gptoss_lite.server import responses as R
from gptoss_lite.server.builtin_tools import (
    DEFAULT_MAX_TOOL_CALLS,
    DEFAULT_TOOL_TIMEOUT,
    ServerTools,
    ToolLoop,
    load_corpus,
)
from gptoss_lite.server.chat import ChatTemplate, ChatTemplateError
from gptoss_lite.server.engine_loop import Channel, EngineLoop, QueueFull, ShuttingDown
from gptoss_lite.server.harmony import RenderError, chained, chat_delta, chat_message, finish_reason, harmony_for
from gptoss_lite.server.http import ABORT_EXTENSION, DEFAULT_BODY_TIMEOUT
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


def create_app(
    llm,
    *,
    api_keys: dict[str, str] | None = None,
    admin_key: str | None = None,
    max_waiting: int = 256,
    served_model_name: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    allowed_hosts: list[str] | None = None,
    bind_host: str = "127.0.0.1",
    metrics_open: bool = False,
    stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    harmony: bool | None = None,
    data_dir: str | Path | None = None,
    secret_file: str | Path | None = None,
    response_ttl: float = TTL_SECONDS,
    python_tool=None,
    browser_corpus=None,
    tool_servers: list | None = None,
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS,
    tool_timeout: float = DEFAULT_TOOL_TIMEOUT,
) -> FastAPI:
    """A FastAPI app serving `llm`; the engine thread starts and stops with the app's lifespan.

    api_keys: {API key: tenant name}, or None for an open server (one tenant, "default").
    admin_key: the key for /admin routes when api_keys is set (without api_keys they are open).
    max_waiting: requests allowed to wait for a slot; beyond it a request gets 429.
    allowed_hosts: the names a request's Host header may give ("*": any). Default: any host when
        api_keys is set, else `bind_host` and the localhost names (what DNS rebinding cannot spell).
    metrics_open: /metrics and /stats without a key on a keyed server.
    stall_timeout: seconds a stream may wait for its client to read before the request is aborted.
    body_timeout: seconds a client has to send a request body.
    harmony: render and parse chats in the harmony format (None: when the model's tokenizer is the
        gpt-oss vocabulary; True: always, a HarmonyUnavailable ValueError if it is not; False: never,
        the chat template instead).
    data_dir: where stored responses (`responses.sqlite3`) and the sealing key (`sealing.key`) live,
        shared by every server on it (made if absent); None: a private temporary directory, gone with
        the app. A file there that is not a response store is a StoreError (a ValueError) here.
    secret_file: the key that seals reasoning items (32 raw bytes or 64 hex digits) instead of the
        data directory's.
    response_ttl: seconds a stored response is kept.
    python_tool: a PythonToolPool that runs the python tool (`code_interpreter`); the app closes it.
    browser_corpus: a directory of documents (or a browser Corpus) the browser tool (`web_search`)
        searches; a directory's index is kept under data_dir.
    tool_servers: MCP servers (`mcp` tools): ToolServers or "[LABEL=]URL" strings, listed when the app
        starts (an unlabelled one that cannot be reached stops the start).
    max_tool_calls: built-in calls one response may run when the request sets no max_tool_calls.
    tool_timeout: seconds one built-in call may take.
    """
    state = ServerState(
        llm,
        api_keys=api_keys,
        admin_key=admin_key,
        max_waiting=max_waiting,
        served_model_name=served_model_name,
        max_body_bytes=max_body_bytes,
        allowed_hosts=P.allowed_host_set(allowed_hosts, bind_host, keyed=bool(api_keys)),
        metrics_open=metrics_open,
        stall_timeout=stall_timeout,
        body_timeout=body_timeout,
        harmony=harmony,
        data_dir=data_dir,
        secret_file=secret_file,
        response_ttl=response_ttl,
        tools={
            "python_tool": python_tool,
            "browser_corpus": browser_corpus,
            "tool_servers": tool_servers,
            "max_tool_calls": max_tool_calls,
            "tool_timeout": tool_timeout,
        },
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.tools.start()
        state.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.engine.stop)
            await asyncio.to_thread(state.tools.close)

    app = FastAPI(title="gptoss-lite", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(_CountRequests, metrics=state.metrics)
    app.add_middleware(_Guard, state=state)  # outermost: refused requests reach nothing else
    _add_error_handlers(app)

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    @app.get("/health")
    async def health(request: Request):
        engine = state.engine
        faults = {"failed_requests": engine.failed_requests, "step_failures": engine.step_failures}
        if engine.error is not None:
            faults["last_failure"] = engine.error
        faults["queue"] = _queue(engine.snapshot.stats, tenants=state.may_observe(request))
        if state.draining or not engine.alive:
            why = "draining" if state.draining else "engine stopped"
            return JSONResponse({"status": why, **faults}, status_code=503)
        return {"status": "ok", **faults}

    @app.get("/metrics")
    async def metrics(request: Request):
        state.observer(request)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats(request: Request):
        state.observer(request)
        s = state.engine.snapshot.stats
        return {"model": state.model_name, **(dataclasses.asdict(s) if s is not None else {})}

    @app.post("/admin/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        """Drop every cached prefix (all tenants); answers the KV figures afterwards, so an idle server
        must then report every block free (the leak check of the load and disconnect tests)."""
        state.admin(request)

        def reset(llm):
            llm.clear_prefix_cache()
            return llm.stats()

        s = await state.engine.call(reset)
        return {"cleared": True, **dataclasses.asdict(s)}

    @app.get("/v1/models")
    async def list_models(request: Request):
        state.tenant(request)
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        state.tenant(request)
        _check_model(state, model_id)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = state.tenant(request)
        req = P.parse_request(P.CompletionRequest, await _read_body(request, state))
        _check_model(state, req.model)
        prompt = req.single_prompt()
        echo = _prompt_text(state, prompt) if req.echo else ""
        return await _serve(state, request, tenant, req, prompt, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = state.tenant(request)
        req = P.parse_request(P.ChatCompletionRequest, await _read_body(request, state))
        _check_model(state, req.model)
        if state.harmony is not None:
            return await _serve_harmony(state, request, tenant, req)
        choice_param = "function_call" if req.function_call is not None else "tool_choice"
        _refuse_harmony_fields(
            req.uses_tools,
            req.requested_tool_choice,
            req.reasoning_effort,
            params=(req.tools_param, choice_param, "reasoning_effort"),
        )
        try:
            prompt = state.template.render([{"role": m.role, "content": m.text()} for m in req.messages])
        except ChatTemplateError as exc:
            raise P.APIError(400, str(exc), param="messages") from None
        extra = _structured(state, req.structured, "response_format")
        return await _serve(state, request, tenant, req, prompt, chat=True, extra=extra)

    @app.post("/v1/responses")
    async def responses(request: Request):
        tenant = state.tenant(request)
        req = P.parse_request(R.ResponsesRequest, await _read_body(request, state))
        _check_model(state, req.model)
        return await _serve_response(state, request, tenant, req)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        tenant = state.tenant(request)
        _refuse_query(request)
        body = await asyncio.to_thread(state.responses.body, tenant, response_id)
        if body is None:
            raise _response_not_found(response_id)
        return JSONResponse(body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        tenant = state.tenant(request)
        _refuse_query(request)
        if not await asyncio.to_thread(state.responses.delete, tenant, response_id):
            raise _response_not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return app


# ---- request handling ------------------------------------------------------------------------------------


def _queue(stats, *, tenants: bool) -> dict:
    """/health's view of the queue: running and waiting requests, and with `tenants` each tenant's."""
    if stats is None:
        return {"running": 0, "waiting": 0}
    queue = {"running": stats.num_running, "waiting": stats.num_waiting}
    if tenants:
        queue["tenants"] = {
            name: {"running": c.running, "waiting": c.waiting} for name, c in sorted(stats.tenants.items())
        }
    return queue


def _busy(state: ServerState, tenant: str, exc: Exception) -> P.APIError:
    """The 429 for a request refused before it was queued: the tenant's quota, or a full queue."""
    if isinstance(exc, QuotaExceeded):
        state.metrics.record_rejected(tenant, "rate_limit_exceeded")
        return P.APIError(
            429, str(exc), type="rate_limit_error", code="rate_limit_exceeded", headers=P.retry_after(exc.retry_after)
        )
    state.metrics.record_rejected(tenant, "queue_full")
    busy = f"the server is busy: {exc}; retry later"
    return P.APIError(429, busy, type="server_error", code="queue_full", headers=P.retry_after(BUSY_RETRY_AFTER))


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "gptoss-lite",
        "max_model_len": state.llm.max_model_len,
    }


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise P.APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{state.model_name}'",
            param="model",
            code="model_not_found",
        )


async def _read_body(request: Request, state: ServerState) -> bytes:
    """The request body: a 413 as soon as it is known to exceed the limit, a 408 if it has not all
    arrived within the body timeout. Both close the connection (the rest of the body is never read)."""
    limit = state.max_body_bytes
    too_big = P.APIError(413, f"request body is larger than {limit:,} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        with anyio.fail_after(state.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
    except TimeoutError:
        raise P.APIError(
            408, f"the request body did not arrive within {state.body_timeout:g} s", code="request_timeout"
        ) from None
    return b"".join(chunks)


def _response_not_found(response_id: str) -> P.APIError:
    return P.APIError(404, f"Response with id {response_id[:80]!r} not found", code="response_not_found")


def _refuse_query(request: Request) -> None:
    """GET / DELETE /v1/responses/{id} take no options (a stored response is replayed as answered,
    never streamed again): a query parameter is a 400 naming it rather than ignored."""
    for name in request.query_params:
        raise P.APIError(400, f"{name[:40]}: not supported on this route", param=name[:40])


def _refuse_harmony_fields(
    uses_tools: bool, tool_choice, effort: str | None, params=("tools", "tool_choice", "reasoning_effort")
) -> None:
    """What only a harmony model does: tools and reasoning effort are a 400 on any other model, naming
    the field the request used (`params`: its tools, tool choice and effort fields)."""
    tools_param, choice_param, effort_param = params
    if uses_tools:
        why = f"{tools_param}: this model does not call tools (it is not a harmony model)"
        raise P.APIError(400, why, param=tools_param)
    if tool_choice not in (None, "none", "auto"):
        raise P.APIError(400, f"{choice_param}: this model does not call tools", param=choice_param)
    if effort is not None:
        why = f"{effort_param}: this model does not reason (it is not a harmony model)"
        raise P.APIError(400, why, param=effort_param)


async def _serve_harmony(state: ServerState, request: Request, tenant: str, req: P.ChatCompletionRequest):
    harmony = state.harmony
    tools, choice = req.requested_tools, req.requested_tool_choice
    legacy = {"tools": req.tools_param, "tool_choice": "function_call" if req.function_call is not None else None}
    try:
        prompt = harmony.prompt(
            [m.as_dict() for m in req.messages],
            tools=tools,
            tool_choice=choice,
            effort=req.effort,
            response_format=req.structured,
        )
    except RenderError as exc:
        raise P.APIError(400, str(exc), param=legacy.get(exc.param) or exc.param) from None
    constraint = _structured(state, req.structured, "response_format", tools, req.tools_param).get("logits_processor")
    extra = {
        "stop_token_ids": harmony.stop_token_ids,
        "logits_processor": chained(harmony.tool_choice_processor(tools, choice), constraint),
    }
    return await _serve(state, request, tenant, req, prompt, chat=True, extra=extra, harmony_choice=choice)


async def _serve_response(state: ServerState, request: Request, tenant: str, req: R.ResponsesRequest):
    """POST /v1/responses: the stored conversation (previous_response_id), then this input; with
    `truncation: "auto"` its oldest items are dropped until it fits the context. Built-in tools the
    request enables run inside the response (a ToolLoop)."""
    functions, enabled = state.tools.parse(req.tools)
    rid = R.response_id()
    history, chain = [], rid
    if req.previous_response_id:
        history = await asyncio.to_thread(state.responses.conversation, tenant, req.previous_response_id)
        if history is None:
            raise P.APIError(
                404,
                f"Previous response with id {req.previous_response_id[:80]!r} not found",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        chain = await asyncio.to_thread(state.responses.chain, tenant, req.previous_response_id) or chain
    messages = history + R.input_messages(req, unseal=lambda sealed: state.sealer.open(tenant, sealed))
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    builtin = await enabled.declarations() if enabled and state.harmony is not None else None
    render = _response_renderer(state, req, messages, functions, builtin)
    kept = messages
    if req.truncation == "auto":
        kept = R.fit_conversation(head, messages, lambda shown: _fits(state, render(shown), req.token_limit))
    prompt = render(head + kept)
    loop = None
    if state.harmony is not None:
        constraint = _structured(state, req.structured, "text.format", functions).get("logits_processor")
        extra = {
            "stop_token_ids": state.harmony.stop_token_ids,
            "logits_processor": chained(state.harmony.tool_choice_processor(functions, req.tool_choice), constraint),
        }
        if builtin and req.tool_choice != "none":
            loop = ToolLoop(
                state.tools,
                enabled,
                builtin,
                encoding=state.harmony.encoding,
                tenant=tenant,
                chain=chain,
                max_calls=req.max_tool_calls,
                include=tuple(req.include or ()),
            )
            loop.round_extra = lambda: {  # later rounds: a fresh constraint, no tool_choice prefix
                "stop_token_ids": state.harmony.stop_token_ids,
                "logits_processor": constraint.fork() if constraint is not None else None,
            }
    else:
        extra = _structured(state, req.structured, "text.format")

    def store(body: dict, items: list[dict], transcript: dict) -> None:
        if req.store:
            state.responses.put(tenant, body["id"], messages + R.output_messages(items, transcript), body, chain)

    seal = (lambda text: state.sealer.seal(tenant, text)) if req.wants_encrypted_reasoning else None
    return await _serve(
        state,
        request,
        tenant,
        req,
        prompt,
        chat=True,
        extra=extra,
        harmony_choice=req.tool_choice,
        on_response=store,
        seal=seal,
        rid=rid,
        loop=loop,
    )


def _response_renderer(state: ServerState, req: R.ResponsesRequest, messages: list[dict], functions, builtin):
    """render(chat-shaped messages) -> the prompt of a /v1/responses request: harmony ids (declaring
    the function tools and the built-in ones), or the chat template's text (tools and effort being a
    400 on a model without harmony)."""
    if state.harmony is not None:

        def render(shown: list[dict]):
            try:
                return state.harmony.prompt(
                    shown,
                    tools=functions,
                    tool_choice=req.tool_choice,
                    effort=req.effort,
                    response_format=req.structured,
                    builtin=builtin,
                )
            except RenderError as exc:
                raise P.APIError(400, str(exc), param="input" if exc.param == "messages" else exc.param) from None

        return render
    params = ("tools", "tool_choice", "reasoning")
    _refuse_harmony_fields(req.uses_tools(messages), req.tool_choice, req.effort, params=params)

    def render(shown: list[dict]):
        try:
            return state.template.render([{"role": m["role"], "content": m.get("content", "")} for m in shown])
        except ChatTemplateError as exc:
            raise P.APIError(400, str(exc), param="input") from None

    return render


def _prompt_text(state: ServerState, prompt: str | list[int]) -> str:
    """A completions prompt as `echo: true` shows it: the text sent, or the text of the ids sent."""
    if isinstance(prompt, str):
        return prompt
    if state.llm.tokenizer is None:
        P.refuse("echo", "this model has no tokenizer to show the prompt's ids as text")
    try:
        return state.llm.tokenizer.decode(prompt)
    except (ValueError, TypeError, IndexError) as exc:
        raise P.APIError(400, f"prompt: {exc}", param="prompt") from None


def _fits(state: ServerState, prompt, max_tokens: int | None) -> bool:
    """Whether a prompt leaves room in the context for max_tokens (None: for at least one token)."""
    try:
        n_prompt = len(state.llm.encode(prompt))
    except (ValueError, TypeError):
        return True  # not a prompt at all: _prepare says why
    return n_prompt + (max_tokens or 1) <= state.llm.max_model_len


def _structured(
    state: ServerState, response_format: dict | None, param: str, tools=None, tools_param: str = "tools"
) -> dict:
    """{"logits_processor": ...} that keeps JSON where JSON belongs ({} when nothing does; a 400 for a
    schema that does not compile). A plain model: the whole completion follows `response_format`. A
    harmony model: a final message's text follows it, and a call's arguments follow its tool's
    `parameters` (a strict tool's schema must compile; another's is constrained where it does)."""
    harmony = state.harmony
    if response_format is None and (harmony is None or not tools):
        return {}
    tokenizer = state.llm.tokenizer
    if tokenizer is None:
        raise P.APIError(400, f"{param}: structured output needs a model with a tokenizer", param=param)
    end = harmony.return_token if harmony is not None else tokenizer.eos_id
    try:
        lltok = lltokenizer(tokenizer, state.llm.config.vocab_size, end)
        final = None if response_format is None else compile_schema(schema_of(response_format), lltok)
    except GrammarError as exc:
        raise P.APIError(400, f"{param}: {exc}", param=param) from None
    if harmony is None:
        return {"logits_processor": JsonConstraint(lltok, final, end_token=end)}
    calls = {}
    for tool in function_tools(tools):
        if tool["parameters"] is None:
            continue
        try:
            calls[tool["name"]] = compile_schema(tool["parameters"], lltok)
        except GrammarError as exc:
            if tool["strict"]:
                raise P.APIError(400, f"{tools_param}: {tool['name']}: {exc}", param=tools_param) from None
    if final is None and not calls:
        return {}
    ends = (harmony.return_token, harmony.call_token)
    return {"logits_processor": HarmonyConstraint(lltok, harmony.encoding, final=final, calls=calls, ends=ends)}


def _prepare(state: ServerState, req, prompt, extra: dict | None = None) -> PreparedRequest:
    """The request tokenised and checked once (`LLM.prepare`), after checking that prompt +
    max_tokens fits the context (400 if not, or for anything the engine would refuse)."""
    limit = state.llm.max_model_len
    if isinstance(prompt, str) and state.llm.tokenizer is None:
        raise P.APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
    try:
        ids = state.llm.encode(prompt)
    except (ValueError, TypeError) as exc:
        raise P.APIError(400, str(exc), param=getattr(req, "prompt_param", "prompt")) from None
    n_prompt = len(ids)
    max_tokens = req.token_limit
    if max_tokens is None:  # chat without a limit: the rest of the context
        max_tokens = limit - n_prompt
    if n_prompt + max_tokens > limit or max_tokens < 1:
        if req.token_limit is None:  # no limit asked: the prompt alone leaves no room to answer
            asked = f"the prompt has {n_prompt} tokens, which leaves no room for an answer; shorten the prompt"
        else:
            asked = (
                f"the prompt has {n_prompt} tokens and {max_tokens} more were requested ({n_prompt + max_tokens} "
                "in all); shorten the prompt or lower max_tokens"
            )
        raise P.APIError(
            400,
            f"This model's maximum context length is {limit} tokens; {asked}",
            param="messages" if isinstance(req, P.ChatCompletionRequest) else getattr(req, "prompt_param", "prompt"),
            code="context_length_exceeded",
        )
    try:
        sampling = SamplingParams(max_tokens=max_tokens, **req.sampling_kwargs(), **(extra or {}))
        return state.llm.prepare(ids, sampling)
    except (ValueError, TypeError) as exc:
        raise P.APIError(400, str(exc)) from None


async def _serve(
    state: ServerState,
    request: Request,
    tenant: str,
    req,
    prompt,
    *,
    chat: bool,
    extra=None,
    harmony_choice=None,
    on_response=None,
    seal=None,
    echo: str = "",
    rid: str | None = None,
    loop: ToolLoop | None = None,
):
    """Queue the request and answer it. extra: more SamplingParams fields (a harmony chat's: its
    answer is then parsed); harmony_choice: its tool_choice; on_response(body, output items): the
    request is a /v1/responses one, answered as a Response, and this runs (in a worker thread) once
    it is complete, before the client sees the end; seal: reasoning text -> encrypted_content; echo:
    text every completion choice begins with (the prompt, for `echo: true`); rid: the response's id
    (made here if None); loop: a response's built-in tools, run between rounds of generation."""
    if state.draining:
        raise P.APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
    prepared = _prepare(state, req, prompt, extra)
    sampling = prepared.sampling
    if rid is None:
        rid = R.response_id() if on_response is not None else f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        channel = await state.engine.add(
            rid, prepared, cache_scope(tenant, req.cache_salt), tenant=tenant, priority=req.priority
        )
    except (QuotaExceeded, QueueFull) as exc:
        raise _busy(state, tenant, exc) from None
    except ShuttingDown as exc:
        raise P.APIError(503, str(exc), type="server_error", code="shutting_down") from None
    except (ValueError, TypeError) as exc:  # the engine refused the request (nothing was queued)
        raise P.APIError(400, str(exc)) from None
    run = _Run(state, tenant, rid, channel, sampling.n)
    run.priority = req.priority
    if sampling.n > req.n:  # completions' best_of
        run.answer_n, run.show_logprobs = req.n, req.logprobs is not None
    if extra and state.harmony is not None:  # a harmony chat: parse each sample's tokens
        builtin = loop.declared if loop is not None else None
        run.parsers = {i: state.harmony.stream(harmony_choice, builtin) for i in range(sampling.n)}
    if loop is not None:
        run.loop, run.req, run.prompt_ids = loop, req, list(prepared.token_ids)
        run.scope, run.harmony_choice = cache_scope(tenant, req.cache_salt), harmony_choice
    if on_response is not None:
        run.writer, run.on_response = R.EventWriter(rid, state.model_name, req, seal=seal), on_response
    run.echo, run.metadata = echo, getattr(req, "metadata", None)
    if req.stream and state.max_queue_time(tenant) is not None:
        # Until the request is admitted it may still time out in the queue: a 429 then, not a stream
        # that began with 200 and ends in an error event, so its first tokens are awaited first.
        if not await run.started(request):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    if req.stream:
        return _SSEResponse(
            run.response_events() if run.writer is not None else run.events(chat, req.include_usage),
            on_close=run.abort,
            on_stall=run.stalled,
            stall_timeout=state.stall_timeout,
            media_type="text/event-stream",
        )
    return JSONResponse(await run.collect(request, chat))


class _Run:
    """One accepted request (its n samples): reads its channel, aborts it if its client goes away or
    stops reading."""

    def __init__(self, state: ServerState, tenant: str, rid: str, channel: Channel, n: int = 1):
        self.state, self.tenant, self.rid, self.channel, self.n = state, tenant, rid, channel, n
        self.done = False  # the engine finished it (or failed it): nothing to abort
        self.finals: dict[int, object] = {}  # sample index -> final output
        self.logprob_offset: dict[int, int] = {}  # per sample: characters of token text before the next entry
        self.parsers: dict[int, object] | None = None  # per sample, a HarmonyStream (a harmony chat)
        self.writer: R.EventWriter | None = None  # a /v1/responses request: its items and events
        self.answer_n = n  # samples the answer shows (best_of generates more; the best n are shown)
        self.show_logprobs = True  # False: logprobs were computed only to rank best_of samples
        self.on_response = None  # /v1/responses: on_response(final body, output items) keeps it
        self.response: dict | None = None  # /v1/responses: the final Response body, once complete
        self.echo = ""  # what each completion choice begins with (`echo: true`: the prompt)
        self.metadata: dict | None = None  # a chat request's, echoed in its answer
        # A response with built-in tools: several rounds of generation, one engine request each.
        self.loop: ToolLoop | None = None
        self.engine_rid = rid  # the engine request of the round being generated
        self.req = None  # the request (its sampling fields and token limit, for later rounds)
        self.prompt_ids: list[int] = []  # the prompt of the round being generated
        self.scope, self.harmony_choice = "", None
        self.priority = 0  # the request's, for later rounds of a response with built-in tools
        self.client_gone = False
        self._held = None  # an update `started` took from the channel, for the stream to begin with

    async def _watch(self, request: Request) -> None:
        """Wake the reader when the server reports that the client disconnected (the body is already
        read, so the next ASGI message is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        self.channel.leave()

    async def started(self, request: Request) -> bool:
        """Wait for the request's first update (its first tokens, or its end), watching for the client
        leaving meanwhile; False if it left (the request is aborted). A request that timed out in the
        queue raises its 429 here; any other update is kept for the stream to begin with."""
        watcher = asyncio.ensure_future(self._watch(request))
        try:
            update = await self.channel.get()
        except BaseException:  # the handler was cancelled (the server stops): free the request
            self.abort()
            raise
        finally:
            watcher.cancel()
        if update.client_gone:
            self.abort()
            return False
        for final in update.finals.values():
            if final.error_code == "queue_timeout":
                self.done = True  # the engine loop has aborted the other samples
                raise _queue_timeout(final)
        self._held = update
        return True

    async def _next(self):
        """The next update; an APIError 500 if the server ended the request or the engine failed it,
        429 if it timed out in its tenant's queue."""
        update, self._held = self._held or await self.channel.get(), None
        if update.failure is not None:
            self.done = True
            code = "shutting_down" if self.state.draining else None
            raise P.APIError(503 if code else 500, update.failure, type="server_error", code=code)
        for index, final in update.finals.items():
            if final.finish_reason == "error":
                self.done = True  # the engine loop has aborted the other samples
                if final.error_code == "queue_timeout":
                    raise _queue_timeout(final)
                raise P.APIError(500, f"the engine failed on this request: {final.error}", type="server_error")
            self.finals[index] = final
        if len(self.finals) == self.n and not self.done:
            self.done = True
            first = self.finals[0]
            self.state.metrics.record_usage(self.tenant, len(first.prompt_token_ids), first.num_cached_tokens)
        return update

    @property
    def complete(self) -> bool:
        return len(self.finals) == self.n

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self.state.engine.abort(self.engine_rid)
            self.state.metrics.aborted.inc()

    def stalled(self) -> None:
        """The client stopped reading the stream for the stall timeout: abort, and count it."""
        if not self.done:
            self.state.metrics.stalled.inc()
        self.abort()

    def _usage(self) -> dict:
        first = self.finals[0]
        generated = sum(len(out.token_ids) for out in self.finals.values())
        return P.usage(len(first.prompt_token_ids), generated, first.num_cached_tokens)

    def _answered(self, entries: dict[int, list]) -> list[tuple[int, object]]:
        """(choice index, final output) of the samples the answer shows: all n, or with best_of the n
        whose tokens have the highest total logprob (ties: the earlier sample), numbered 0..n-1 in
        that order. `entries` (logprobs by sample) is renumbered to match, emptied where logprobs were
        computed only to rank."""
        finals = sorted(self.finals.items())
        if self.answer_n >= len(finals):
            return finals
        total = {i: sum(e.logprob for e in entries.get(i, [])) for i, _ in finals}
        chosen = sorted(finals, key=lambda item: (-total[item[0]], item[0]))[: self.answer_n]
        shown = {new: entries.get(i, []) if self.show_logprobs else [] for new, (i, _) in enumerate(chosen)}
        entries.clear()
        entries.update(shown)
        return [(new, out) for new, (_, out) in enumerate(chosen)]

    # ---- /v1/responses ----------------------------------------------------------------------------

    def _response_status(self) -> str:
        if self.loop is not None and self.loop.stopped is not None:
            return "incomplete"
        return "incomplete" if self.finals[0].finish_reason == "length" else "completed"

    def _response_usage(self) -> dict:
        """Tokens of the response: with built-in tools, every round's prompt and output summed (each
        round reads its whole prompt, mostly from the prefix cache: cached_tokens says how much)."""
        loop = self.loop
        if loop is not None:
            return R.usage(loop.prompt_tokens, loop.output_tokens, loop.cached_tokens, loop.reasoning_tokens)
        first = self.finals[0]
        reasoning = self.parsers[0].reasoning_tokens if self.parsers is not None else 0
        return R.usage(len(first.prompt_token_ids), len(first.token_ids), first.num_cached_tokens, reasoning)

    def _finish_response(self) -> list[dict]:
        """The last events of a Response (an empty message if it wrote nothing); `response` is its body."""
        writer = self.writer
        events = [] if writer.items else writer.open(R.new_message_item())
        reason = self.loop.stopped if self.loop is not None else None
        events += writer.finish(self._response_status(), self._response_usage(), reason)
        self.response = events[-1]["response"]
        return events

    def _ends_in_builtin_call(self, final) -> bool:
        """The round ended in a call to a built-in tool (its <|call|>): the server runs it and goes on."""
        parser, harmony = self.parsers[0], self.state.harmony
        ids = final.token_ids
        return parser.ended_in_builtin and final.finish_reason == "stop" and bool(ids) and ids[-1] == harmony.call_token

    async def _tool_round(self):
        """Run the built-in call the last round ended in (yielding its item's events), then begin the
        next round on the prompt extended by the call and the tool's answer. When no round may follow
        (the bound on calls, the output budget or the context is spent), `loop.stopped` says why and
        the response is left to be finished; when the client has gone, nothing more is started."""
        loop = self.loop
        call = loop.take()
        async for events in loop.run(call, self.writer):
            yield events
        if self.client_gone:
            return
        if loop.ignored > 1:  # a second call past the bound: the model will not stop calling
            loop.stopped = "max_tool_calls"
            return
        ids = self.prompt_ids + list(self.finals[0].token_ids) + loop.tool_message(call, loop.answer)
        await self._start_round(ids)

    async def _start_round(self, ids: list[int]) -> None:
        """Queue the next round of a response with built-in tools (or set `loop.stopped`)."""
        state, loop, req = self.state, self.loop, self.req
        budget = state.llm.max_model_len - len(ids)
        if req.token_limit is not None:
            budget = min(budget, req.token_limit - loop.output_tokens)
        if budget < 1:
            loop.stopped = "max_output_tokens"
            return
        try:
            sampling = SamplingParams(max_tokens=budget, **req.sampling_kwargs(), **loop.round_extra())
            prepared = state.llm.prepare(ids, sampling)
            loop.rounds += 1
            engine_rid = f"{self.rid}-{loop.rounds}"
            channel = await state.engine.add(
                engine_rid, prepared, self.scope, tenant=self.tenant, priority=self.priority
            )
        except (QuotaExceeded, QueueFull) as exc:  # busy, not broken: the client may retry the response
            raise _busy(state, self.tenant, exc) from None
        except (ShuttingDown, ValueError, TypeError) as exc:
            why = f"the next round of the response could not start: {exc}"
            raise P.APIError(503, why, type="server_error") from None
        self.engine_rid, self.channel, self.prompt_ids = engine_rid, channel, list(prepared.token_ids)
        self.finals, self.done = {}, False
        self.parsers = {0: state.harmony.stream(self.harmony_choice, loop.declared)}

    def _response_events(self, update) -> list[dict]:
        """The Response events of one update (output items open, grow and close as the text comes).
        With logprobs asked for, those of the tokens that wrote a message's text go with that text."""
        writer, events = self.writer, []
        final = update.finals.get(0)
        logprobs = update.logprobs.get(0, [])
        if self.parsers is not None:
            parser = self.parsers[0]
            tokens = update.tokens.get(0, [])
            # With logprobs, one token at a time: which of them are message text is the parser's to say.
            steps = list(zip(([t] for t in tokens), logprobs)) if len(logprobs) == len(tokens) else [(tokens, None)]
            for chunk, entry in steps:
                delta = parser.feed(chunk)
                if entry is not None and _writes_message_text(parser, chunk[0]):
                    writer.note_logprobs(self._logprob_entries([entry]))
                events += self._items_of(parser, delta)
            if final is not None:
                events += self._items_of(parser, self._finish_parse(parser))
                if self.loop is not None:
                    self.loop.add_round(final, parser)
                    if self._ends_in_builtin_call(final):
                        self.loop.pending = parser.parts[-1]
                        return events
        else:
            if logprobs:
                writer.note_logprobs(self._logprob_entries(logprobs))
            if update.text.get(0):
                if not writer.items:
                    events += writer.open(R.new_message_item())
                events += writer.add(update.text[0])
        if final is not None:
            events += self._finish_response()
        return events

    async def _keep_response(self) -> None:
        """Store the complete response (off the event loop) before its client sees the end, so a
        `previous_response_id` sent right after finds it; an APIError 500 if the store fails."""
        transcript = self.loop.transcript if self.loop is not None else {}
        try:
            await asyncio.to_thread(self.on_response, self.response, self.writer.items, transcript)
        except sqlite3.Error as exc:
            why = f"the response could not be stored: {exc}"
            raise P.APIError(500, why, type="server_error", code="store_failed") from None

    def _items_of(self, parser, delta) -> list[dict]:
        """The events of what a harmony parse added: items opened ("" text) and text added. A call to a
        built-in tool gets its item when the call is complete (ToolLoop.run)."""
        events = []
        for index, text in delta.parts:
            if parser.parts[index].kind == "builtin":
                events += self.writer.close()  # what came before the call is done
            elif text == "":
                events += self.writer.open(R.new_item(parser.parts[index]))
            else:
                events += self.writer.add(text)
        return events

    def _logprob_entries(self, entries: list) -> list[dict]:
        """TokenLogprobs as an output_text part lists them: token, logprob, bytes, top_logprobs."""
        return (self._logprobs(entries, True, 0) or {"content": []})["content"]

    async def _response_batches(self):
        """The events of a /v1/responses answer in the batches they become known: each engine update's,
        then, when a round ends in a built-in call, the call's and those of the end of the response."""
        while not self.complete:
            yield self._response_events(await self._next())
            if self.complete and self.loop is not None and self.loop.pending is not None:
                async for events in self._tool_round():
                    yield events
                if self.complete:  # no round may follow: the response ends here
                    yield self._finish_response()

    async def response_events(self):
        """The SSE stream of a /v1/responses request (named events, no [DONE], as the API sends). The
        response is stored before the client sees its last event."""
        try:
            for event in self.writer.start():  # sent before anything is added: its snapshot lists no output
                yield _sse_event(event)
            for event in self.loop.list_items(self.writer) if self.loop is not None else []:
                yield _sse_event(event)
            try:
                async for events in self._response_batches():
                    if self.response is not None:
                        await self._keep_response()
                    for event in events:
                        yield _sse_event(event)
            except P.APIError as exc:
                yield _sse_event(self.writer.event("error", message=exc.message, code=exc.code, param=None))
        finally:
            self.abort()

    def _finish_parse(self, parser):
        """End a sample's harmony parse; a stream the parser refused is counted (its text is content)."""
        delta = parser.finish()
        if parser.malformed is not None:
            self.state.metrics.harmony_malformed.inc()
        return delta

    def _logprobs(self, entries: list, chat: bool, index: int) -> dict | None:
        """The API's logprobs object for these TokenLogprobs of one sample (None when none were asked for)."""
        if not entries:
            return None
        tokenizer = self.state.llm.tokenizer
        rows = [
            (*_piece(tokenizer, e.token_id), e.logprob, [(*_piece(tokenizer, t), v) for t, v in e.top]) for e in entries
        ]
        if chat:
            return P.chat_logprobs(rows)
        offset = self.logprob_offset.get(index, 0)
        self.logprob_offset[index] = offset + sum(len(r[0]) for r in rows)
        return P.completion_logprobs(rows, offset)

    async def collect(self, request: Request, chat: bool) -> dict:
        """Wait for the whole answer (non-streaming); abort if the client disconnects meanwhile."""
        watcher = asyncio.ensure_future(self._watch(request))
        entries: dict[int, list] = {}
        if self.loop is not None:
            self.loop.list_items(self.writer)
        try:
            while True:
                update = await self._next()
                for index, lps in update.logprobs.items():
                    entries.setdefault(index, []).extend(lps)
                if self.writer is not None:
                    self._response_events(update)
                elif self.parsers is not None:
                    for index, tokens in update.tokens.items():
                        self.parsers[index].feed(tokens)
                if self.complete and self.loop is not None and self.loop.pending is not None:
                    async for _ in self._tool_round():
                        pass
                    if self.client_gone:
                        return {}
                    if not self.complete:
                        continue  # the next round
                    self._finish_response()  # no round may follow: the response ends here
                    break
                if self.complete:
                    break
                if update.client_gone:
                    return {}  # nobody to answer; the finally aborts the request
        finally:
            watcher.cancel()
            self.abort()
        if self.writer is not None:
            await self._keep_response()
            return self.response
        choice = P.chat_choice if chat else P.completion_choice
        choices = []
        for i, out in self._answered(entries):
            answer, reason = self.echo + out.text, out.finish_reason
            if self.parsers is not None:
                parser = self.parsers[i]
                self._finish_parse(parser)
                answer, reason = chat_message(parser), finish_reason(parser, reason)
            choices.append(choice(i, answer, reason, self._logprobs(entries.get(i, []), chat, i)))
        if chat:
            return P.chat_body(self.rid, self.state.model_name, choices, self._usage(), self.metadata)
        return P.completion_body(self.rid, self.state.model_name, choices, self._usage())

    async def events(self, chat: bool, include_usage: bool):
        """SSE events: deltas as tokens arrive (each chunk names its sample's `index`), the finish
        reasons, usage if asked, then [DONE]. Text the engine hands out is final (it holds back a
        possible stop string or a cut character), so the deltas join to the non-streamed text."""
        name = self.state.model_name
        pending: dict[int, list] = {}  # per sample: logprobs of tokens whose text has not been sent yet
        try:
            if chat:
                for i in range(self.n):
                    yield _sse(P.chat_chunk(self.rid, name, {"role": "assistant", "content": ""}, None, index=i))
            elif self.echo:
                for i in range(self.n):
                    yield _sse(P.completion_chunk(self.rid, name, self.echo, None, index=i))
            while not self.complete:
                try:
                    update = await self._next()
                except P.APIError as exc:
                    yield _sse(exc.body())
                    break
                for index, lps in update.logprobs.items():
                    pending.setdefault(index, []).extend(lps)
                for index in sorted(set(update.text) | set(update.finals) | set(update.tokens)):
                    text = update.text.get(index, "")
                    final = update.finals.get(index)
                    reason = final.finish_reason if final is not None else None
                    delta = {"content": text} if text else {}
                    if self.parsers is not None:  # a harmony chat: the parsed pieces, not the raw text
                        parser = self.parsers[index]
                        parsed = parser.feed(update.tokens.get(index, ()))
                        if final is not None:
                            parsed.extend(self._finish_parse(parser))
                            reason = finish_reason(parser, reason)
                        delta = chat_delta(parsed)
                    elif not (text or reason):
                        continue
                    if not (delta or reason):
                        continue
                    logprobs = self._logprobs(pending.pop(index, []), chat, index)
                    if chat:
                        yield _sse(P.chat_chunk(self.rid, name, delta, reason, logprobs=logprobs, index=index))
                    else:
                        yield _sse(P.completion_chunk(self.rid, name, text, reason, logprobs=logprobs, index=index))
            if self.complete and include_usage:
                chunk = P.chat_chunk if chat else P.completion_chunk
                yield _sse(chunk(self.rid, name, None, None, self._usage()))
            yield "data: [DONE]\n\n"
        finally:
            self.abort()  # a no-op unless the client left before the end


def _queue_timeout(final) -> P.APIError:
    """The 429 for a request that waited longer than its tenant's max_queue_time without a slot."""
    return P.APIError(
        429, final.error, type="server_error", code="queue_timeout", headers=P.retry_after(BUSY_RETRY_AFTER)
    )


def _writes_message_text(parser, token: int) -> bool:
    """Whether a token just fed to a harmony parse is text of a message (not reasoning, a call, a
    header or a control token): the tokens whose logprobs a Response's output_text reports."""
    if parser.malformed is not None:
        return True  # everything from the refused token on is answered as message text
    part = parser.parts[-1] if parser.parts else None
    return (
        parser.in_text and part is not None and part.kind == "content" and not parser.encoding.is_special_token(token)
    )


def _piece(tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token's text and bytes, as logprobs show them (a byte that is part of a character shows as
    U+FFFD; its bytes say which)."""
    raw_of = getattr(tokenizer, "token_bytes", None)
    raw = raw_of(token_id) if raw_of is not None else tokenizer.decode([token_id]).encode("utf-8")
    return raw.decode("utf-8", errors="replace"), raw


# Characters JSON may leave raw that some line splitters (Python's str.splitlines, JavaScript before
# ES2019) take for line ends; escaped, an SSE `data:` line stays one line for every client.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse_json(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS_JSON_KEEPS)


def _sse_event(obj: dict) -> str:
    return f"event: {obj['type']}\ndata: {_sse_json(obj)}\n\n"


def _sse(obj: dict) -> str:
    return f"data: {_sse_json(obj)}\n\n"


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that also watches for the client going away while no token is due, and
    for a client that stops reading.

    Starlette's own, under an ASGI 2.4 server, notices a disconnect only when a send fails, so a
    request still queued behind others would keep its slot until its first token; here the stream is
    cancelled as soon as the server reports the disconnect, and the generator's `finally` aborts it.
    A send that waits longer than `stall_timeout` (the client's receive window and the server's
    write buffer are full) ends the stream too: `on_stall` aborts the request and frees its blocks,
    and the connection is dropped with what it still buffers (server/http.py's abort extension).
    """

    def __init__(self, content, *, on_close, on_stall, stall_timeout: float, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close  # runs even if the stream never started (client gone before the first send)
        self.on_stall = on_stall
        self.stall_timeout = stall_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def send_or_stall(message) -> None:
            try:
                with anyio.fail_after(self.stall_timeout):
                    await send(message)
            except TimeoutError:
                self.on_stall()
                drop = (scope.get("extensions") or {}).get(ABORT_EXTENSION)
                if drop is not None:
                    drop()  # a close would wait for the client to take what is buffered
                raise _Stalled from None

        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send_or_stall)
                    except (OSError, _Stalled):  # the client went away, or stopped reading
                        pass
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


class _Stalled(Exception):
    """A send waited past the stall timeout."""


# ---- errors and request counting -----------------------------------------------------------------------


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(P.APIError)
    async def api_error(request: Request, exc: P.APIError):
        # A body refused before it was all read leaves the connection unusable: close it.
        headers = {"Connection": "close"} if exc.status in (408, 413) else {}
        return JSONResponse(exc.body(), status_code=exc.status, headers={**headers, **(exc.headers or {})})

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect):
        return Response(status_code=400)  # nobody reads it; no traceback in the log for a client that left

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else None
        return JSONResponse(P.error_body(str(exc.detail), code=kind), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(P.error_body(str(exc.errors()[0].get("msg"))), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        # The log has the traceback (the server re-raises to it); the client gets no internals.
        return JSONResponse(
            P.error_body(f"internal error ({type(exc).__name__}); see the server log", type="server_error"),
            status_code=500,
        )


class _Guard:
    """ASGI middleware in front of every route: the Host and Origin checks, and for a POST the
    Content-Type and Content-Encoding checks (protocol.check_headers). A refused request gets its
    JSON error and reaches nothing else."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[str, list[str]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))
        try:
            P.check_headers(scope["method"], headers, self.state.allowed_hosts)
        except P.APIError as exc:
            return await JSONResponse(exc.body(), status_code=exc.status)(scope, receive, send)
        return await self.app(scope, receive, send)


class _CountRequests:
    """ASGI middleware: counts /v1 requests by endpoint and response status (streams count at start)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_counting(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
            self.metrics.requests.labels(path, str(status["code"])).inc()


KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models")
