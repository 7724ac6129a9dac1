"""Server-sent events: the JSON framing and a streaming response that notices a client that left or
stopped reading (docs/server.md#robustness)."""

from __future__ import annotations

import json

import anyio
from fastapi.responses import StreamingResponse

from gptoss_lite.server.http import ABORT_EXTENSION

_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS_JSON_KEEPS)


def sse_event(obj: dict) -> str:
    return f"event: {obj['type']}\ndata: {sse_json(obj)}\n\n"


def sse(obj: dict) -> str:
    return f"data: {sse_json(obj)}\n\n"


class SSEResponse(StreamingResponse):
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
