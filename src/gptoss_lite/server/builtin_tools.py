"""gpt-oss's built-in tools inside POST /v1/responses: the browser, python and MCP servers' tools run by
the server while it answers (docs/tools.md#serving-the-tools).

- `ServerTools` is what the app was started with (`create_app(python_tool=, browser_corpus=,
  tool_servers=)`): the interpreter pool, the corpus with its browser sessions, the MCP servers.
- `ServerTools.parse(tools)` splits a request's `tools` into its function tools (answered by the
  client, as before) and a `RequestTools`: `web_search` / `web_search_preview` -> the browser,
  `code_interpreter` -> python, `mcp` with a configured `server_label` -> that server. A tool the
  server was not started with, or a type it does not serve, is a 400 naming `tools`.
- `ToolLoop` is one response's use of them: it turns the call a round of generation ended in into
  its output item and events, runs it off the event loop, and gives the tokens of the tool's answer
  that the next round's prompt continues with.

Owners: a conversation's python interpreter belongs to its tenant and its container, which is the
request's `container` string when it names one, else `cntr_` + the id of the conversation's first
response (carried through previous_response_id). A browser session (its page stack) belongs to the
tenant and the conversation the same way. A stateless client (store false, no previous_response_id)
starts a new container each response unless it sends back the `container_id` of an earlier one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from gptoss_lite.harmony.render import BuiltinTools
from gptoss_lite.server import protocol as P
from gptoss_lite.server.mcp_client import ToolServer

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOOL_CALLS = 16  # built-in calls one response may run when the request sets no max_tool_calls
DEFAULT_TOOL_TIMEOUT = 120.0  # seconds one call may take (harmony tells the model python times out at 120 s)
MAX_BROWSER_SESSIONS = 256  # browser page stacks kept (least recently used dropped first)
WEB_SEARCH_TYPES = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11")
CONTAINER = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SERVED_TYPES = "function, web_search (web_search_preview), code_interpreter and mcp"


def _refuse(index: int, why: str) -> P.APIError:
    return P.APIError(400, f"tools[{index}]: {why}", param="tools")


@dataclass
class RequestTools:
    """The built-in tools one request enables (what `ServerTools.parse` read from its `tools`)."""

    browser: bool = False
    python: bool = False
    container: str | None = None  # the code_interpreter's named container (None: the conversation's)
    mcp: dict[str, tuple[ToolServer, frozenset[str] | None, str | None]] = field(default_factory=dict)
    # label -> (server, allowed tool names or None for all, the request's server_description)

    def __bool__(self) -> bool:
        return self.browser or self.python or bool(self.mcp)

    async def declarations(self) -> BuiltinTools:
        """What the prompt declares: the MCP servers' tools are listed (cached) here; a 503 naming
        `tools` when a server cannot be listed."""
        namespaces = []
        for label, (server, allowed, description) in self.mcp.items():
            try:
                listed = await server.tools()
            except RuntimeError as exc:
                why = f"tools: {exc}"
                raise P.APIError(503, why, type="server_error", param="tools", code="tool_server_error") from None
            shown = [t for t in listed if allowed is None or t["name"] in allowed]
            namespaces.append({"name": label, "description": description or server.description, "tools": shown})
        return BuiltinTools(browser=self.browser, python=self.python, namespaces=tuple(namespaces))


class ServerTools:
    """The built-in tools an app serves (module docstring). python: a PythonToolPool (the app closes
    it); corpus: a browser Corpus (the app closes it); tool_servers: MCP ToolServers."""

    def __init__(
        self,
        *,
        python=None,
        corpus=None,
        tool_servers=(),
        metrics=None,
        count_tokens=None,
        tool_timeout: float = DEFAULT_TOOL_TIMEOUT,
        max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS,
    ):
        if not tool_timeout > 0:
            raise ValueError(f"tool_timeout={tool_timeout}: must be > 0 seconds")
        if max_tool_calls < 0:
            raise ValueError(f"max_tool_calls={max_tool_calls}: must be >= 0")
        self.python, self.corpus, self.servers = python, corpus, list(tool_servers)
        self.metrics, self.count_tokens = metrics, count_tokens
        self.tool_timeout, self.max_tool_calls = tool_timeout, max_tool_calls
        self._sessions: OrderedDict[tuple[str, str], tuple[object, threading.Lock]] = OrderedDict()
        self._sessions_lock = threading.Lock()

    def __bool__(self) -> bool:
        return self.python is not None or self.corpus is not None or bool(self.servers)

    async def start(self) -> None:
        """List every MCP server (learning the labels not given); a ToolServerError for one that
        cannot be reached, or ValueError for two servers with one label."""
        for server in self.servers:
            if server.label is None:
                await server.start()
            else:
                try:
                    await server.start()
                except RuntimeError as exc:  # labelled: it may come up later; requests naming it get a 503
                    logger.warning("%s", exc)
        labels = [s.label for s in self.servers]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ValueError(f"--tool-server: two servers are labelled {twice[0]!r}; name them LABEL=URL")

    def close(self) -> None:
        if self.python is not None:
            self.python.close_all()
        if self.corpus is not None:
            self.corpus.close()

    def parse(self, tools: list[dict] | None) -> tuple[list[dict] | None, RequestTools]:
        """A request's `tools` -> (its function tools, the built-in tools it enables); APIError 400
        naming `tools` for a type not served, or a built-in tool this server was not started with."""
        functions, enabled = [], RequestTools()
        for i, tool in enumerate(tools or ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind == "function":
                functions.append(tool)
            elif kind in WEB_SEARCH_TYPES:
                if self.corpus is None:
                    raise _refuse(i, f"{kind} needs a server started with --browser-corpus DIR (it searches those)")
                enabled.browser = True
            elif kind == "code_interpreter":
                if self.python is None:
                    raise _refuse(i, "code_interpreter needs a server started with --python-tool")
                enabled.python, enabled.container = True, _container(i, tool.get("container"))
            elif kind == "mcp":
                label, entry = self._mcp(i, tool)
                if label in enabled.mcp:
                    raise _refuse(i, f"the tool server {label!r} is named twice")
                enabled.mcp[label] = entry
            else:
                raise _refuse(i, f"type {str(kind)[:40]!r} is not served here; this server runs {SERVED_TYPES} tools")
        return (functions if tools is not None else None), enabled

    def _mcp(self, i: int, tool: dict) -> tuple[str, tuple]:
        label = tool.get("server_label")
        server = next((s for s in self.servers if s.label == label), None)
        if server is None:
            known = ", ".join(repr(s.label) for s in self.servers) or "none (start it with --tool-server URL)"
            raise _refuse(i, f"no tool server is labelled {str(label)[:64]!r}; this server has {known}")
        if tool.get("server_url") not in (None, server.url):
            raise _refuse(
                i, "server_url: this server only uses the tool servers it was started with; send server_label"
            )
        for name in ("connector_id", "headers", "authorization"):
            if tool.get(name) is not None:
                raise _refuse(i, f"{name}: tool servers are reached with the server's own settings; leave it out")
        approval = tool.get("require_approval")
        if not (approval in (None, "never") or (isinstance(approval, dict) and set(approval) <= {"never"})):
            raise _refuse(i, "require_approval: approvals are not served; send 'never' (calls then run at once)")
        allowed = tool.get("allowed_tools")
        if isinstance(allowed, dict):
            allowed = allowed.get("tool_names")
        if allowed is not None and not (isinstance(allowed, list) and all(isinstance(n, str) for n in allowed)):
            raise _refuse(i, "allowed_tools: expected a list of tool names or {'tool_names': [...]}")
        description = tool.get("server_description")
        if description is not None and not isinstance(description, str):
            raise _refuse(i, "server_description: expected a string")
        return label, (server, None if allowed is None else frozenset(allowed), description)

    def browser_session(self, tenant: str, chain: str):
        """The browser session (and its lock) of a tenant's conversation, made on first use."""
        from gptoss_lite.tools.browser import BrowserSession

        key = (tenant, chain)
        with self._sessions_lock:
            found = self._sessions.get(key)
            if found is None:
                found = (BrowserSession(self.corpus, count_tokens=self.count_tokens), threading.Lock())
                self._sessions[key] = found
            self._sessions.move_to_end(key)
            while len(self._sessions) > MAX_BROWSER_SESSIONS:
                self._sessions.popitem(last=False)
        return found

    def record(self, tool: str, seconds: float, error: bool) -> None:
        if self.metrics is not None:
            self.metrics.record_tool(tool, seconds, error)


def _container(i: int, container) -> str | None:
    """The code_interpreter's `container`: a name (its interpreter), or {"type": "auto"} (None: the
    conversation's own)."""
    if container is None:
        return None
    if isinstance(container, str):
        if not CONTAINER.match(container):
            raise _refuse(i, "container: a container name must match [A-Za-z0-9_-]{1,64}")
        return container
    if not isinstance(container, dict) or container.get("type") != "auto":
        raise _refuse(i, "container: expected a container name or {'type': 'auto'}")
    if container.get("file_ids"):
        raise _refuse(i, "container.file_ids: this server has no files API; write files from the code itself")
    return None


def load_corpus(directory: str | Path, data_dir: str | Path):
    """The browser Corpus of `directory`, its index kept under the data directory (the corpus is read
    only)."""
    from gptoss_lite.tools.corpus import Corpus, default_index_path

    index = Path(data_dir) / "browser" / default_index_path(directory).name
    return Corpus(directory, index_path=index)


# ---- one response --------------------------------------------------------------------------------------


@dataclass
class Call:
    """A call the model addressed to a built-in tool: its recipient (`browser.search`, `python`,
    `LABEL.TOOL`), its text, and the channel and content type of its header."""

    recipient: str
    arguments: str
    channel: str | None
    content_type: str | None

    @property
    def namespace(self) -> str:
        return self.recipient.partition(".")[0]

    @property
    def function(self) -> str:
        return self.recipient.partition(".")[2]

    def as_message(self, item_id: str) -> dict:
        """The call as a chat-shaped assistant tool call (what the store keeps and render reads)."""
        return {
            "id": item_id,
            "type": "builtin",
            "recipient": self.recipient,
            "channel": self.channel or "analysis",
            "content_type": self.content_type,
            "arguments": self.arguments,
        }


class ToolLoop:
    """The built-in tools of one response (module docstring): the calls it has run, the bound on them,
    the token counts of all its rounds, and what the store keeps of each call."""

    def __init__(
        self,
        tools: ServerTools,
        enabled: RequestTools,
        declared: BuiltinTools,
        *,
        encoding,
        tenant: str,
        chain: str,
        max_calls: int | None,
        include: tuple[str, ...] = (),
    ):
        self.tools, self.enabled, self.declared, self.encoding = tools, enabled, declared, encoding
        self.tenant, self.chain = tenant, chain
        self.max_calls = tools.max_tool_calls if max_calls is None else max_calls
        self.include = include
        self.container = enabled.container or f"cntr_{chain.removeprefix('resp_')}"
        self.calls = 0  # built-in calls run so far
        self.ignored = 0  # calls past the bound, answered without running
        self.pending = None  # the builtin Part the last round ended in, until it is run
        self.stopped: str | None = None  # why the loop ended the response early (an incomplete reason)
        self.prompt_tokens = self.output_tokens = self.cached_tokens = self.reasoning_tokens = 0
        self.transcript: dict[str, dict] = {}  # item id -> {"call": call message, "output": text}
        self.answer = ""  # the text the model reads back from the last call run
        self.rounds = 0  # rounds of generation after the first
        self.round_extra = lambda: {}  # SamplingParams fields of a later round (the server sets them)

    @property
    def owner(self) -> str:
        """The python interpreter's owner: tenant and container, encoded so no pair spells another's."""
        return json.dumps([self.tenant, self.container])

    def add_round(self, final, parser) -> None:
        """Count one round's tokens (usage covers every round of the response)."""
        self.prompt_tokens += len(final.prompt_token_ids)
        self.output_tokens += len(final.token_ids)
        self.cached_tokens += final.num_cached_tokens
        self.reasoning_tokens += parser.reasoning_tokens

    def list_items(self, writer) -> list[dict]:
        """The `mcp_list_tools` items (one per MCP server the request enables) and their events, the
        first output of the response."""
        events = []
        for ns in self.declared.namespaces:
            tools = [
                {"name": t["name"], "description": t["description"], "input_schema": t["parameters"] or {}}
                for t in ns["tools"]
            ]
            item = {"type": "mcp_list_tools", "id": _id("mcpl"), "server_label": ns["name"], "tools": tools}
            events += writer.open(item)
            events += _status(writer, "response.mcp_list_tools.in_progress")
            events += _status(writer, "response.mcp_list_tools.completed")
            events += writer.close()
        return events

    def take(self) -> Call:
        part, self.pending = self.pending, None
        return Call(part.call.name, part.call.arguments, part.channel, part.content_type)

    async def run(self, call: Call, writer):
        """Run one call: yields the events of its item (opened, running, done) as they happen, and
        leaves the text the model reads in `self.answer`."""
        item = self._item(call)
        events = writer.open(item)
        kind = item["type"]
        if kind == "web_search_call":
            events += _status(writer, "response.web_search_call.in_progress")
            events += _status(writer, "response.web_search_call.searching")
        elif kind == "code_interpreter_call":
            events += _status(writer, "response.code_interpreter_call.in_progress")
            events += _status(writer, "response.code_interpreter_call_code.delta", delta=call.arguments)
            events += _status(writer, "response.code_interpreter_call_code.done", code=call.arguments)
            events += _status(writer, "response.code_interpreter_call.interpreting")
        else:
            events += _status(writer, "response.mcp_call.in_progress")
            events += _status(writer, "response.mcp_call_arguments.delta", delta=call.arguments)
            events += _status(writer, "response.mcp_call_arguments.done", arguments=call.arguments)
        yield events
        if self.calls >= self.max_calls:
            self.ignored += 1
            text, failed = f"Error: not run: this response may make at most {self.max_calls} tool calls.", True
            item["status"] = "incomplete"
        else:
            self.calls += 1
            started = time.monotonic()
            text, failed = await self._run(call, item)
            self.tools.record(_tool_label(call, item), time.monotonic() - started, failed)
        self.answer = text
        self.transcript[item["id"]] = {"call": call.as_message(item["id"]), "output": text}
        done = item["status"] == "completed"
        if kind == "web_search_call":
            events = _status(writer, "response.web_search_call.completed") if done else []
        elif kind == "code_interpreter_call":
            events = _status(writer, "response.code_interpreter_call.completed") if done else []
        else:
            events = _status(writer, "response.mcp_call.completed" if done else "response.mcp_call.failed")
        yield events + writer.close()

    def tool_message(self, call: Call, text: str) -> list[int]:
        """The tool's answer as harmony renders it (from the recipient, to the assistant, on the
        call's channel), then `<|start|>assistant`: what the next round's prompt appends."""
        from openai_harmony import Author, Message, Role

        message = Message.from_author_and_content(Author.new(Role.TOOL, call.recipient), text)
        if call.channel:
            message = message.with_channel(call.channel)
        ids = self.encoding.render(message.with_recipient("assistant"))
        return list(ids) + self.encoding.encode("<|start|>assistant", allowed_special="all")

    # ---- the three tools -------------------------------------------------------------------------

    def _item(self, call: Call) -> dict:
        if call.namespace == "browser":
            return {"type": "web_search_call", "id": _id("ws"), "status": "in_progress", "action": _action(call)}
        if call.namespace == "python":
            return {
                "type": "code_interpreter_call",
                "id": _id("ci"),
                "status": "in_progress",
                "code": call.arguments,
                "container_id": self.container,
                "outputs": None,
            }
        return {
            "type": "mcp_call",
            "id": _id("mcp"),
            "status": "in_progress",
            "server_label": call.namespace,
            "name": call.function,
            "arguments": call.arguments,
            "output": None,
            "error": None,
        }

    async def _run(self, call: Call, item: dict) -> tuple[str, bool]:
        """Run the call (blocking tools in a worker thread); (text for the model, failed). A tool that
        raises is a tool error the model reads, never a server error."""
        try:
            if item["type"] == "web_search_call":
                return await asyncio.to_thread(self._browse, call, item)
            if item["type"] == "code_interpreter_call":
                return await self._python(call, item)
            return await self._mcp(call, item)
        except Exception as exc:  # noqa: BLE001 - any failure of a tool is the model's to read
            logger.exception("built-in tool %s failed", call.recipient)
            item["status"] = "failed"
            return f"Error: the {call.namespace} tool failed: {type(exc).__name__}: {exc}", True

    def _browse(self, call: Call, item: dict) -> tuple[str, bool]:
        session, lock = self.tools.browser_session(self.tenant, self.chain)
        with lock:
            text = session.call(call.function, call.arguments)
            page = session.pages[-1] if session.pages else None
        action = item["action"]
        if page is not None and action["type"] in ("open_page", "find_in_page"):
            action["url"] = page.document_url or page.url or None
        if page is not None and action["type"] == "search" and "web_search_call.action.sources" in self.include:
            action["sources"] = [{"type": "url", "url": url} for url in page.links if url]
        item["status"] = "completed"
        return text, False

    async def _python(self, call: Call, item: dict) -> tuple[str, bool]:
        pool = self.tools.python
        timeout = min(self.tools.tool_timeout, pool.limits.wall_seconds)
        result = await asyncio.to_thread(pool.run, self.owner, call.arguments, timeout)
        item["outputs"] = [{"type": "logs", "logs": result.text}] if result.text else []
        item["status"] = "completed"
        return result.text, result.error

    async def _mcp(self, call: Call, item: dict) -> tuple[str, bool]:
        server, allowed, _ = self.enabled.mcp[call.namespace]
        if not call.function or (allowed is not None and call.function not in allowed):
            message = f"{call.recipient} is not one of the tools of {call.namespace}"
            item.update(status="failed", error={"type": "mcp_protocol_error", "code": -32602, "message": message})
            return f"Error: {message}", True
        outcome = await server.call(call.function, call.arguments, self.tools.tool_timeout)
        if outcome.error is None:
            item.update(status="completed", output=outcome.text)
        else:
            item.update(status="failed", error=outcome.error)
        return outcome.text, outcome.error is not None


def _action(call: Call) -> dict:
    """A browser call as a web_search_call's `action`: search (query), open_page, find_in_page (pattern)."""
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError:
        arguments = {}
    arguments = arguments if isinstance(arguments, dict) else {}
    if call.function == "open":
        link = arguments.get("id")
        return {"type": "open_page", "url": link if isinstance(link, str) else None}
    if call.function == "find":
        pattern = arguments.get("pattern")
        return {"type": "find_in_page", "pattern": pattern if isinstance(pattern, str) else "", "url": ""}
    query = arguments.get("query")
    return {"type": "search", "query": query if isinstance(query, str) else None}


def _tool_label(call: Call, item: dict) -> str:
    """The `tool` label of the metrics: browser, python, or mcp:LABEL."""
    kind = item["type"]
    return (
        "browser"
        if kind == "web_search_call"
        else "python"
        if kind == "code_interpreter_call"
        else f"mcp:{call.namespace}"
    )


def _status(writer, kind: str, **fields) -> list[dict]:
    """An event about the item being written (its id and index), e.g. `response.web_search_call.searching`."""
    index = len(writer.items) - 1
    return [writer.event(kind, item_id=writer.items[index]["id"], output_index=index, **fields)]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


__all__ = ["ServerTools", "RequestTools", "ToolLoop", "Call", "load_corpus", "DEFAULT_MAX_TOOL_CALLS"]
