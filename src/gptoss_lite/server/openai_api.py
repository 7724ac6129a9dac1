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
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gptoss_lite.server import headers as H
from gptoss_lite.server import protocol as P
from gptoss_lite.server import responses as R
from gptoss_lite.server.builtin_tools import (
    DEFAULT_MAX_TOOL_CALLS,
    DEFAULT_TOOL_TIMEOUT,
)
from gptoss_lite.server.chat import ChatTemplateError
from gptoss_lite.server.http import DEFAULT_BODY_TIMEOUT
from gptoss_lite.server.middleware import CountRequests, Guard, add_error_handlers
from gptoss_lite.server.response_store import TTL_SECONDS
from gptoss_lite.server.serving import (
    prompt_text,
    refuse_harmony_fields,
    serve,
    serve_harmony,
    serve_response,
    structured,
)
from gptoss_lite.server.state import DEFAULT_STALL_TIMEOUT, MAX_BODY_BYTES, STATIC, ServerState


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
        allowed_hosts=H.allowed_host_set(allowed_hosts, bind_host, keyed=bool(api_keys)),
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
    app.add_middleware(CountRequests, metrics=state.metrics)
    app.add_middleware(Guard, state=state)  # outermost: refused requests reach nothing else
    add_error_handlers(app)

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
        echo = prompt_text(state, prompt) if req.echo else ""
        return await serve(state, request, tenant, req, prompt, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        tenant = state.tenant(request)
        req = P.parse_request(P.ChatCompletionRequest, await _read_body(request, state))
        _check_model(state, req.model)
        if state.harmony is not None:
            return await serve_harmony(state, request, tenant, req)
        choice_param = "function_call" if req.function_call is not None else "tool_choice"
        refuse_harmony_fields(
            req.uses_tools,
            req.requested_tool_choice,
            req.reasoning_effort,
            params=(req.tools_param, choice_param, "reasoning_effort"),
        )
        try:
            prompt = state.template.render([{"role": m.role, "content": m.text()} for m in req.messages])
        except ChatTemplateError as exc:
            raise P.APIError(400, str(exc), param="messages") from None
        extra = structured(state, req.structured, "response_format")
        return await serve(state, request, tenant, req, prompt, chat=True, extra=extra)

    @app.post("/v1/responses")
    async def responses(request: Request):
        tenant = state.tenant(request)
        req = P.parse_request(R.ResponsesRequest, await _read_body(request, state))
        _check_model(state, req.model)
        return await serve_response(state, request, tenant, req)

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
