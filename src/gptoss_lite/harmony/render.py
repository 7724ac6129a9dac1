"""OpenAI chat messages and tools -> a harmony conversation -> prompt token ids (openai-harmony renders).

The mapping, the same as the released gpt-oss chat template and vLLM's (docs/server.md#harmony-gpt-oss):

| OpenAI | harmony |
|---|---|
| (always) | a system message: identity, cutoff 2024-06, today (UTC), `Reasoning: …`, the channels |
| leading `system` / `developer` messages | the developer message's `# Instructions` (blank-line joined) |
| `tools` (function tools) | the developer message's `functions` namespace |
| a later `system` / `developer` message | a developer message in place |
| `user` | a user message |
| assistant `reasoning_content` (or `reasoning`) | an `analysis` message |
| assistant `content` | a `final` message (a `commentary` preamble when the message also has `tool_calls`) |
| assistant `tool_calls[i]` | `commentary` messages `to=functions.NAME <|constrain|>json`, one per call |
| `tool` (`tool_call_id`) | a message from `functions.NAME` to the assistant on `commentary` |
| `BuiltinTools` browser / python | the system message's `browser` and `python` tools (openai-harmony's own) |
| `BuiltinTools` namespaces (MCP servers) | one developer-message namespace each, named after the server's label |
| assistant `tool_calls[i]` of type `builtin` | a message to its `recipient` on its `channel` (with its content type) |
| `tool` answering a builtin call | a message from that recipient to the assistant on the call's channel |

Earlier chains of thought are dropped once a `final` answer follows them, and kept inside a tool-call
chain that has not reached one yet (openai-harmony's `auto_drop_analysis`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

EFFORTS = ("low", "medium", "high")
DEFAULT_EFFORT = "medium"
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class RenderError(ValueError):
    """A conversation harmony cannot express; `param` names the request field at fault."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class BuiltinTools:
    """The tools the server runs itself that a conversation declares: gpt-oss's `browser` and
    `python` (in the system message, exactly as openai-harmony's `with_browser_tool()` and
    `with_python_tool()` write them) and MCP servers' tools, each server a developer-message
    namespace: {"name": label, "description": text or None, "tools": [{"name", "description",
    "parameters"}]}."""

    browser: bool = False
    python: bool = False
    namespaces: tuple[dict, ...] = ()

    @property
    def recipients(self) -> frozenset[str]:
        """The namespaces whose calls the server runs (what the parser treats as builtin calls)."""
        names = {ns["name"] for ns in self.namespaces}
        names |= {"browser"} if self.browser else set()
        names |= {"python"} if self.python else set()
        return frozenset(names)

    def __bool__(self) -> bool:
        return self.browser or self.python or bool(self.namespaces)


def today() -> str:
    return datetime.now(timezone.utc).date().isoformat()


def message_text(content: Any, where: str) -> str:
    """The text of an OpenAI message `content`: a string, a list of text parts, or None ("")."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                raise RenderError(f"{where}.content[{i}]: only text parts are supported")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise RenderError(f"{where}.content[{i}].text: expected a string")
            parts.append(text)
        return "".join(parts)
    raise RenderError(f"{where}.content: expected a string or a list of text parts")


def function_tools(tools: Sequence[dict] | None) -> list[dict]:
    """Validated function tools: [{"name", "description", "parameters", "strict"}] (RenderError on a bad one)."""
    out, seen = [], set()
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RenderError(f"{where}: only tools of type 'function' are supported", "tools")
        fn = tool.get("function", tool)  # chat nests {"function": {...}}; responses puts the fields flat
        if not isinstance(fn, dict):
            raise RenderError(f"{where}.function: expected an object", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise RenderError(f"{where}: the function name must match [A-Za-z0-9_-]{{1,64}}", "tools")
        if name in seen:
            raise RenderError(f"{where}: two tools are named {name!r}", "tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RenderError(f"{where}: parameters must be a JSON schema object", "tools")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise RenderError(f"{where}: description must be a string", "tools")
        strict = fn.get("strict") is True
        out.append({"name": name, "description": description, "parameters": params, "strict": strict})
    return out


def conversation(
    messages: Sequence[dict],
    *,
    tools: Sequence[dict] | None = None,
    effort: str = DEFAULT_EFFORT,
    date: str | None = None,
    builtin: BuiltinTools | None = None,
):
    """The openai-harmony Conversation for OpenAI-shaped `messages` (dicts), function `tools` and the
    `builtin` tools the server runs."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
        ToolNamespaceConfig,
    )

    if effort not in EFFORTS:
        raise RenderError(f"reasoning_effort={effort!r}: expected one of {', '.join(EFFORTS)}", "reasoning_effort")
    system = (
        SystemContent.new()
        .with_reasoning_effort(ReasoningEffort(effort.capitalize()))
        .with_conversation_start_date(date or today())
    )
    builtin = builtin or BuiltinTools()
    if builtin.browser:
        system = system.with_browser_tool()
    if builtin.python:
        system = system.with_python_tool()
    described = function_tools(tools)
    head, rest = _leading_instructions(messages)
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    if head or described or builtin.namespaces:
        developer = DeveloperContent.new()
        if head:
            developer = developer.with_instructions("\n\n".join(head))
        if described:
            developer = developer.with_function_tools(
                [ToolDescription.new(t["name"], t["description"], parameters=t["parameters"]) for t in described]
            )
        for ns in builtin.namespaces:
            listed = [ToolDescription.new(t["name"], t["description"], parameters=t["parameters"]) for t in ns["tools"]]
            developer = developer.with_tools(
                ToolNamespaceConfig(name=ns["name"], description=ns["description"], tools=listed)
            )
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str, tuple[str, str]] = {}  # tool_call_id -> (author, channel) of the result that follows
    for index, message in rest:
        where = f"messages[{index}]"
        role = message.get("role")
        if role in ("system", "developer"):
            text = message_text(message.get("content"), where)
            out.append(Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(text)))
        elif role == "user":
            out.append(Message.from_role_and_content(Role.USER, message_text(message.get("content"), where)))
        elif role == "assistant":
            out.extend(_assistant(message, where, call_names))
        elif role == "tool":
            call_id = message.get("tool_call_id")
            author, channel = call_names.get(call_id, (None, "commentary")) if isinstance(call_id, str) else (None, "")
            name = message.get("name")
            if author is None and isinstance(name, str) and name:
                author, channel = f"functions.{name}", "commentary"
            if author is None:
                raise RenderError(f"{where}: a tool message needs the tool_call_id of an earlier assistant tool call")
            text = message_text(message.get("content"), where)
            result = Message.from_author_and_content(Author.new(Role.TOOL, author), text)
            out.append(result.with_channel(channel).with_recipient("assistant"))
        else:
            raise RenderError(f"{where}.role: {role!r} is not a chat role")
    return Conversation.from_messages(out)


def _leading_instructions(messages: Sequence[dict]) -> tuple[list[str], list[tuple[int, dict]]]:
    head: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RenderError(f"messages[{i}]: expected an object")
        if message.get("role") not in ("system", "developer"):
            return head, list(enumerate(messages))[i:]
        text = message_text(message.get("content"), f"messages[{i}]")
        if text:
            head.append(text)
    return head, []


def _assistant(message: dict, where: str, call_names: dict[str, tuple[str, str]]) -> list:
    from openai_harmony import Message, Role

    out = []
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if reasoning:
        if not isinstance(reasoning, str):
            raise RenderError(f"{where}.reasoning_content: expected a string")
        out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
    calls = message.get("tool_calls") or []
    text = message_text(message.get("content"), where)
    if text:
        channel = "commentary" if calls else "final"
        out.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel))
    for j, call in enumerate(calls):
        if isinstance(call, dict) and call.get("type") == "builtin":
            out.append(_builtin_call(call, f"{where}.tool_calls[{j}]", call_names))
            continue
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise RenderError(f"{where}.tool_calls[{j}].function.name: expected a function name")
        arguments = fn.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        if isinstance(call.get("id"), str):
            call_names[call["id"]] = (f"functions.{name}", "commentary")
        msg = Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel("commentary")
        out.append(msg.with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))
    return out


def _builtin_call(call: dict, where: str, call_names: dict[str, tuple[str, str]]):
    """A call the server ran (browser, python, an MCP tool), as the model wrote it: its recipient,
    channel and content type."""
    from openai_harmony import Message, Role

    recipient, channel = call.get("recipient"), call.get("channel") or "analysis"
    arguments, content_type = call.get("arguments", ""), call.get("content_type")
    if not isinstance(recipient, str) or not recipient or not isinstance(channel, str):
        raise RenderError(f"{where}: a builtin call needs its recipient and channel")
    if not isinstance(arguments, str) or not (content_type is None or isinstance(content_type, str)):
        raise RenderError(f"{where}: a builtin call's arguments and content type are strings")
    if isinstance(call.get("id"), str):
        call_names[call["id"]] = (recipient, channel)
    msg = Message.from_role_and_content(Role.ASSISTANT, arguments).with_channel(channel).with_recipient(recipient)
    return msg.with_content_type(content_type) if content_type else msg


def response_formats_section(name: str | None, schema: dict, description: str | None = None) -> str:
    """The developer message's `# Response Formats` section for a JSON schema, as harmony spells it."""
    lines = ["# Response Formats", "", f"## {name or 'response'}", ""]
    if description:
        lines.append(f"// {description}")
    lines.append(json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
    return "\n".join(lines)


def render(encoding, messages: Sequence[dict], *, response_format: dict | None = None, **kwargs) -> list[int]:
    """Prompt token ids for `messages`, ending with `<|start|>assistant` (kwargs: see `conversation`).

    A `json_schema` response_format adds a `# Response Formats` section at the end of the developer
    message (openai-harmony has no field for it, so its rendering is extended in place: the
    developer message's text is re-encoded with the section appended)."""
    from openai_harmony import Role

    convo = conversation(messages, **kwargs)
    ids = encoding.render_conversation_for_completion(convo, Role.ASSISTANT)
    spec = (response_format or {}).get("json_schema") if (response_format or {}).get("type") == "json_schema" else None
    if not isinstance(spec, dict):
        return ids
    section = response_formats_section(spec.get("name"), spec.get("schema") or {}, spec.get("description"))
    return _with_developer_text(encoding, ids, section)


def _with_developer_text(encoding, ids: list[int], section: str) -> list[int]:
    """`ids` with `section` appended to the developer message's text (one made after the system
    message if there is none)."""
    start, message, end = (
        encoding.encode(t, allowed_special="all")[0] for t in ("<|start|>", "<|message|>", "<|end|>")
    )
    developer = encoding.encode("developer", allowed_special="all")
    header = [start, *developer, message]
    at = next((i for i in range(len(ids)) if ids[i : i + len(header)] == header), None)
    if at is None:  # no developer message: one right after the system message
        after_system = ids.index(end) + 1
        body = encoding.encode(section, disallowed_special=())
        return ids[:after_system] + header + body + [end] + ids[after_system:]
    body_start = at + len(header)
    body_end = ids.index(end, body_start)
    text = encoding.decode_utf8(ids[body_start:body_end])
    body = encoding.encode(f"{text}\n\n{section}", disallowed_special=())
    return ids[:body_start] + body + ids[body_end:]
