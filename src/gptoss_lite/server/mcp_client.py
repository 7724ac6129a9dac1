"""MCP tool servers the app was started with (`serve --tool-server [LABEL=]URL`), through the `mcp` SDK.

A `ToolServer` is one server: its label (the harmony namespace its tools render under, and the
`server_label` a request names it by), its URL, and its tools, listed when the app starts and again
once `list_ttl` seconds have passed. A URL whose path ends in `/sse` is spoken to over the SSE
transport, any other over streamable HTTP. Each listing and each call opens its own connection:
nothing is held between requests, so a server that restarts is simply reached again, and no task of
the SDK outlives the request that used it.

Only URLs given at start are ever connected to; a request names a server by label
(docs/tools.md#serving-the-tools).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import anyio

from gptoss_lite.harmony.render import TOOL_NAME

logger = logging.getLogger(__name__)

LABEL = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
RESERVED_LABELS = ("functions", "browser", "python", "assistant", "user", "system", "developer")
LIST_TTL = 60.0  # seconds a tool listing is used before the server is asked again
CONNECT_TIMEOUT = 10.0  # seconds to connect and list


class ToolServerError(RuntimeError):
    """A tool server could not be reached or listed (the message names it and says why)."""


@dataclass
class CallOutcome:
    """What one MCP tool call gave: the text the model reads, and the error (None on success) in the
    shape an `mcp_call` item's `error` takes."""

    text: str
    error: dict | None = None


def check_label(label: str, where: str) -> str:
    if not LABEL.match(label) or label in RESERVED_LABELS:
        raise ValueError(
            f"{where}: label {label!r} must match [A-Za-z][A-Za-z0-9_-]{{0,63}} and not be one of "
            f"{', '.join(RESERVED_LABELS)}"
        )
    return label


class ToolServer:
    """One MCP server (module docstring). `label` None: the name the server gives itself, read by
    `start()`."""

    def __init__(self, url: str, label: str | None = None, *, list_ttl: float = LIST_TTL):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"--tool-server {url!r}: expected an http:// or https:// URL")
        self.url = url
        self.label = None if label is None else check_label(label, f"--tool-server {url!r}")
        self.transport = "sse" if parts.path.rstrip("/").endswith("/sse") else "streamable-http"
        self.list_ttl = list_ttl
        self.description: str | None = None  # the server's own instructions, if it gives any
        self._tools: list[dict] | None = None
        self._listed_at = float("-inf")

    @classmethod
    def parse(cls, entry: str) -> ToolServer:
        """`[LABEL=]URL` (the CLI's form) -> a ToolServer."""
        entry = entry.strip()
        head, sep, rest = entry.partition("=")
        if sep and "://" not in head:
            return cls(rest, head)
        return cls(entry)

    def _client(self):
        from mcp import Client
        from mcp.client.sse import sse_client

        target = sse_client(self.url) if self.transport == "sse" else self.url
        return Client(target, cache=None)

    async def start(self) -> None:
        """List the tools now (and learn the label from the server when none was given); a
        ToolServerError when the server cannot be reached."""
        await self.tools(refresh=True)

    async def tools(self, refresh: bool = False) -> list[dict]:
        """The server's tools as harmony declares them: [{"name", "description", "parameters"}]
        (listed again when older than list_ttl); a ToolServerError when it cannot be listed."""
        if not refresh and self._tools is not None and time.monotonic() - self._listed_at < self.list_ttl:
            return self._tools
        try:
            with anyio.fail_after(CONNECT_TIMEOUT):
                async with self._client() as client:
                    listed = await client.list_tools()
                    info, instructions = client.server_info, client.instructions
        except Exception as exc:  # noqa: BLE001 - any failure of the SDK or the network is "unreachable"
            raise ToolServerError(f"the tool server {self.url} could not be listed: {_reason(exc)}") from None
        if self.label is None:
            name = re.sub(r"[^A-Za-z0-9_-]", "_", getattr(info, "name", "") or "")
            self.label = check_label(name, f"--tool-server {self.url} (the name the server gives itself)")
        tools = []
        for tool in listed.tools:
            if not TOOL_NAME.match(tool.name):
                logger.warning("tool server %s: tool %r skipped (not a harmony tool name)", self.label, tool.name)
                continue
            schema = tool.input_schema if isinstance(tool.input_schema, dict) else None
            tools.append({"name": tool.name, "description": tool.description or "", "parameters": schema})
        self._tools, self._listed_at, self.description = tools, time.monotonic(), instructions
        return tools

    async def call(self, name: str, arguments: str, timeout: float) -> CallOutcome:
        """Call tool `name` with the model's argument text (a JSON object); never raises: a failure is
        a CallOutcome with its error."""
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return _failure(f"the arguments are not JSON: {exc}", -32602)
        if not isinstance(parsed, dict):
            return _failure("the arguments must be a JSON object", -32602)
        try:
            with anyio.fail_after(timeout):
                async with self._client() as client:
                    result = await client.call_tool(name, parsed)
        except TimeoutError:
            return _failure(f"{self.label}.{name} did not answer within {timeout:g} s", -32001)
        except Exception as exc:  # noqa: BLE001 - the server, the network or the SDK failed: tool output
            return _failure(f"{self.label}.{name} failed: {_reason(exc)}", getattr(exc, "code", -32603))
        text = _text_of(result)
        if result.is_error:
            content = [{"type": "text", "text": text}]
            return CallOutcome(text, {"type": "mcp_tool_execution_error", "content": content})
        return CallOutcome(text)


def _text_of(result) -> str:
    """An MCP CallToolResult as the text the model reads: its text parts joined, other parts named, and
    the structured content as JSON when there is no text."""
    pieces = []
    for part in result.content or []:
        kind = getattr(part, "type", "")
        pieces.append(part.text if kind == "text" else f"[{kind} content not shown]")
    if not pieces and result.structured_content is not None:
        pieces.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(pieces)


def _failure(message: str, code) -> CallOutcome:
    code = code if isinstance(code, int) else -32603
    return CallOutcome(f"Error: {message}", {"type": "mcp_protocol_error", "code": code, "message": message})


def _reason(exc: BaseException) -> str:
    """The innermost reason of an exception (the SDK wraps failures in exception groups)."""
    while getattr(exc, "exceptions", None):  # an ExceptionGroup (a builtin from Python 3.11)
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


__all__ = ["ToolServer", "ToolServerError", "CallOutcome", "check_label"]
