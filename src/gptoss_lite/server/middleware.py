"""The app's error handlers (every error is an OpenAI-style body, never a 5xx for what a client sent)
and its ASGI middleware: the request guard (host, origin, content type) and the request counter."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gptoss_lite.server import headers as H
from gptoss_lite.server import protocol as P
from gptoss_lite.server.metrics import ServerMetrics
from gptoss_lite.server.state import ServerState


def add_error_handlers(app: FastAPI) -> None:
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


class Guard:
    """ASGI middleware in front of every route: the Host and Origin checks, and for a POST the
    Content-Type and Content-Encoding checks (headers.check_headers). A refused request gets its
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
            H.check_headers(scope["method"], headers, self.state.allowed_hosts)
        except P.APIError as exc:
            return await JSONResponse(exc.body(), status_code=exc.status)(scope, receive, send)
        return await self.app(scope, receive, send)


class CountRequests:
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
