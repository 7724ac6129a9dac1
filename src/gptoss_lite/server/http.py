"""The HTTP connection layer under the app: uvicorn's h11 protocol with three changes, and the one
place that builds a `uvicorn.Config` for `serve` and for `BackgroundServer`.

1. **A header deadline.** A connection must finish each request's headers within `header_timeout`
   seconds of opening (or of the previous response), else it gets a 408 and is closed. uvicorn only
   times out idle keep-alive connections, so a client that sends half a header line would hold its
   connection for as long as it likes.
2. **Protocol errors in the API's shape.** A request line, header or Content-Length that h11 cannot
   parse is answered with the same JSON error body as every other error (`{"error": {...}}`), not
   uvicorn's plain text.

3. **A way to drop a connection.** Each request's ASGI scope carries
   `scope["extensions"][ABORT_EXTENSION]`, a function that closes the connection at once with a
   reset, discarding what is still buffered (in the process and in the kernel). A stream whose
   client stopped reading uses it: a plain close would wait for the client to take megabytes it
   will never read, and hold the socket meanwhile.

The body has its own deadline (`body_timeout`), enforced by the app while it reads the body.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT = 10.0  # seconds to send a request's headers
DEFAULT_BODY_TIMEOUT = 30.0  # seconds to send a request's body, once the headers are in
ABORT_EXTENSION = "gptoss.abort_connection"


def error_response(status: int, reason: str, message: str, code: str | None) -> bytes:
    """A whole HTTP/1.1 response with the API's JSON error body, that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body.encode()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and JSON protocol errors (module docstring)."""

    header_timeout = DEFAULT_HEADER_TIMEOUT  # set per server by `protocol_class`

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._cycle_when_armed:  # a new request's headers are complete
            self._disarm_header_deadline()
            # The app's task has not run yet: the scope it will see still takes the extension.
            self.cycle.scope.setdefault("extensions", {})[ABORT_EXTENSION] = self._drop_connection

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_deadline()  # the next request on this connection has its own deadline

    def connection_lost(self, exc) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _drop_connection(self) -> None:
        """Close now, with a reset: what the kernel still buffers for this client is discarded too."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        self._disarm_header_deadline()
        if not self.transport.is_closing():
            self.transport.write(error_response(400, "Bad Request", f"invalid HTTP request: {msg}", "bad_http"))
            self.transport.close()

    # ---- the header deadline ------------------------------------------------------------------------

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._cycle_when_armed = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._header_timer: asyncio.TimerHandle | None = None

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.cycle is not self._cycle_when_armed:
            return
        if self.cycle is not None and self.conn.their_state is h11.IDLE and not self.conn.trailing_data[0]:
            return  # idle after a response, nothing of a next request yet: uvicorn's keep-alive timeout
        message = f"the request headers did not arrive within {self.header_timeout:g} s"
        self.transport.write(error_response(408, "Request Timeout", message, "request_timeout"))
        self.transport.close()


def protocol_class(header_timeout: float) -> type[GuardedH11Protocol]:
    """GuardedH11Protocol with this server's header deadline."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": float(header_timeout)})


def uvicorn_config(app, *, header_timeout: float = DEFAULT_HEADER_TIMEOUT, **kwargs) -> uvicorn.Config:
    """The uvicorn.Config every server of this package runs with (kwargs: host, port, log_level, ...).

    No WebSocket protocol (`ws="none"`): the API has no WebSocket route, and with the `websockets`
    package installed uvicorn would answer an `Upgrade: websocket` request itself, with a text/plain
    400, before the app's JSON errors could."""
    return uvicorn.Config(app, http=protocol_class(header_timeout), ws="none", **kwargs)
