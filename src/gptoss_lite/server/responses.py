"""POST /v1/responses: the Responses API, minimal but real (docs/server.md#v1responses).

- `input` is a string or a list of items: messages (`{"role", "content"}`, with or without
  `"type": "message"`), `function_call` and `function_call_output` items, and `reasoning` items sent
  back; `instructions` becomes the developer message's instructions;
- `reasoning.effort`, function `tools` (the flat Responses shape) and `tool_choice`;
- `truncation: "auto"` drops the oldest conversation items until the prompt fits (`fit_conversation`);
- `top_logprobs` (or `include: ["message.output_text.logprobs"]`) puts the tokens' logprobs on the
  `output_text` parts and their deltas;
- `previous_response_id` continues a stored conversation: every response with `store` (the default)
  keeps its input and output in the response store (server/response_store.py), per tenant, so one
  tenant can never continue another's;
- `include: ["reasoning.encrypted_content"]` seals each reasoning item's text into its
  `encrypted_content` (server/sealing.py), and a reasoning item sent back with one is read from it,
  so a client that stores nothing here still continues its chain of thought;
- every other documented field is echoed, accepted with no effect, or refused with a 400 naming it
  (docs/server.md#request-fields);
- the built-in tools (`web_search`, `code_interpreter`, `mcp`) run inside the response on a server
  started with them (server/builtin_tools.py); their items (`web_search_call`,
  `code_interpreter_call`, `mcp_call`) are answered, and accepted back as input;
- the answer's `output` is items in the order the model wrote them: `reasoning`, `message`
  (`output_text`) and `function_call`, and the built-in tools' items; streamed, the events the official client parses
  (`response.created`, `response.output_item.added`, `response.reasoning_text.delta`,
  `response.output_text.delta`, `response.function_call_arguments.delta`, ..., `response.completed`);
  the items, the body and the events are built in server/response_events.py.

A harmony model answers with reasoning and calls; any other model through its chat template, with
one message item (tools and reasoning effort are then a 400, as for chat).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field

from gptoss_lite.harmony.render import RenderError, message_text
from gptoss_lite.server import fields as F
from gptoss_lite.server import protocol as P

ENCRYPTED_REASONING = "reasoning.encrypted_content"  # the `include` value that asks for sealed reasoning


class ReasoningParam(P._Strict):
    effort: F.Effort | None = None  # the nearest gpt-oss effort is used
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; no summaries are written
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the deprecated name of summary
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: Annotated[str, Field(max_length=64)] | None = None


class TextFormat(P._Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextParam(P._Strict):
    format: TextFormat | None = None
    verbosity: F.Verbosity | None = None  # accepted; gpt-oss has no such control


class BackgroundOptions(P._Strict):
    completion_window: Literal["soonest", "2h", "8h"] | None = None
    continuation_id: Annotated[str, Field(max_length=256)] | None = None


class ContextManagement(P._Strict):
    type: Annotated[str, Field(max_length=64)]
    compact_threshold: Annotated[int, Field(ge=0, le=P.MAX_TOKENS_LIMIT)] | None = None


class AccessPrograms(P._Strict):
    cyber: Literal["standard", "daybreak_blue", "daybreak_red"] | None = None


class ImageOptions(P._Strict):
    context_compression: Literal["auto", "enabled", "disabled"] | None = None


class ResponsesStreamOptions(P._Strict):
    include_obfuscation: bool | None = None  # accepted; no `obfuscation` padding is sent


Includable = Literal[
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]


class ResponsesRequest(P._Strict):
    """POST /v1/responses (module docstring; docs/server.md#request-fields says what each field does).
    The sampling fields the chat endpoint shares are exposed under its names, so the same checks and
    SamplingParams apply."""

    model: str
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    reasoning: ReasoningParam | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=P.MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: P.MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    include: Annotated[list[Includable], Field(max_length=16)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    store: bool = True
    text: TextParam | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    priority: F.Priority = 0  # an extension: lower runs first within the tenant's share
    # Echoed in the answer.
    metadata: F.Metadata | None = None
    user: F.Identifier | None = None
    service_tier: F.ServiceTier | None = None
    prompt_cache_key: F.Identifier | None = None
    prompt_cache_retention: F.CacheRetention | None = None
    safety_identifier: F.SafetyIdentifier | None = None
    max_tool_calls: Annotated[int, Field(ge=0, le=P.MAX_TOKENS_LIMIT)] | None = None
    # Hints with no effect here (docs/server.md#request-fields says why).
    prompt_cache_options: F.PromptCacheOptions | None = None
    access_programs: AccessPrograms | None = None
    image: ImageOptions | None = None
    # What this server cannot do: accepted at their neutral value, a 400 otherwise.
    background: bool | None = None
    background_options: BackgroundOptions | None = None
    conversation: Annotated[str, Field(max_length=256)] | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: Annotated[list[ContextManagement], Field(max_length=16)] | None = None
    moderation: dict[str, Any] | None = None

    @property
    def n(self) -> int:
        return 1  # no n in the Responses API: one answer

    def check(self) -> None:
        """Refuse what parses but this server cannot do (raises APIError 400 naming the field)."""
        if self.stream_options is not None and not self.stream:
            P.refuse("stream_options", "only allowed with stream=true")
        if self.background:
            P.refuse("background", "responses are not run in the background here; leave it out or send false")
        opts = self.background_options
        if opts is not None and (opts.completion_window not in (None, "soonest") or opts.continuation_id):
            P.refuse("background_options", "completion windows and continuations need background runs")
        if self.conversation is not None:
            P.refuse("conversation", "this server has no Conversations API; use previous_response_id")
        if self.prompt is not None:
            P.refuse("prompt", "this server keeps no prompt templates; send the instructions and input")
        if self.context_management:
            P.refuse("context_management", "this server does not compact context; use truncation: 'auto'")
        if self.moderation is not None:
            P.refuse("moderation", "this server runs no moderation model")
        reasoning = self.reasoning
        if reasoning is not None and reasoning.context == "all_turns":
            P.refuse("reasoning.context", "gpt-oss drops a chain of thought once a final answer follows it")
        if reasoning is not None and reasoning.mode not in (None, "standard"):
            P.refuse("reasoning.mode", "only the 'standard' reasoning mode is served")

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets (max_tokens aside)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "logprobs": self.logprobs_k}

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token to report (None: no logprobs). `top_logprobs` or the include value
        `message.output_text.logprobs` turns them on."""
        if self.top_logprobs is None and "message.output_text.logprobs" not in (self.include or ()):
            return None
        return self.top_logprobs or 0

    @property
    def wants_encrypted_reasoning(self) -> bool:
        """Whether the client asked for `reasoning.encrypted_content` on reasoning items (stateless
        clients, `store: false`, send them back in the next request's input)."""
        return ENCRYPTED_REASONING in (self.include or ())

    @property
    def token_limit(self) -> int | None:
        return self.max_output_tokens

    @property
    def structured(self) -> dict | None:
        """The text format as a chat `response_format` when it asks for JSON (None for text)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_ or {}}}

    @property
    def effort(self) -> str | None:
        """The gpt-oss reasoning effort asked for (the nearest of low, medium, high)."""
        return F.nearest_effort(self.reasoning.effort if self.reasoning is not None else None)

    def uses_tools(self, messages: list[dict]) -> bool:
        return bool(self.tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _text_of(content: Any, where: str) -> str:
    """The text of an item's content (a string or text parts); a 400 naming `input` otherwise."""
    try:
        return message_text(content, where)
    except RenderError as exc:
        raise P.APIError(400, str(exc), param="input") from None


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise P.APIError(400, f"{where}.{key}: expected a string", param="input")
    return value


def input_messages(req: ResponsesRequest, unseal: Callable[[str], str] | None = None) -> list[dict]:
    """The request's input as chat-shaped messages (reasoning and calls joined to assistant turns).

    unseal(encrypted_content) -> the reasoning text a reasoning item sealed (a ValueError when it does
    not open); a sealed item's text replaces any plain text the item also carries."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict] = []
    assistant: dict | None = None  # the assistant turn being gathered from reasoning / call / message items

    def flush() -> None:
        nonlocal assistant
        if assistant is not None:
            messages.append(assistant)
            assistant = None

    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise P.APIError(400, f"{where}.role: expected user, system, developer or assistant", param="input")
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                assistant = assistant or {"role": "assistant"}
                assistant["content"] = assistant.get("content", "") + text
                continue
            flush()
            messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            if assistant is not None and (assistant.get("content") or assistant.get("tool_calls")):
                flush()
            assistant = assistant or {"role": "assistant"}
            if item.get("encrypted_content") is not None:
                text = _unsealed(item["encrypted_content"], unseal, where)
            else:
                parts = item.get("content") or item.get("summary") or []
                text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
            assistant["reasoning_content"] = assistant.get("reasoning_content", "") + text
        elif kind == "function_call":
            assistant = assistant or {"role": "assistant"}
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            assistant.setdefault("tool_calls", []).append(call)
        elif kind in ("code_interpreter_call", "mcp_call"):
            assistant = assistant or {"role": "assistant"}
            call, output = _builtin_input(item, where)
            assistant.setdefault("tool_calls", []).append(call)
            flush()
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
        elif kind in ("web_search_call", "mcp_list_tools"):
            continue  # see _builtin_input: nothing of them is rendered
        elif kind == "function_call_output":
            flush()
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        else:
            raise P.APIError(400, f"{where}.type: {str(kind)[:40]!r} items are not supported", param="input")
    flush()
    return messages


def _builtin_input(item: dict, where: str) -> tuple[dict, str]:
    """A built-in call item sent back as input -> (the assistant's builtin call, the tool's answer).

    A code_interpreter_call is a call to `python` on the analysis channel, answered by its logs; an
    mcp_call a call to LABEL.NAME on commentary, answered by its output or error. A web_search_call
    carries no page text, so it is not rendered (nor is an mcp_list_tools item: the request's tools
    declare the servers): harmony drops the analysis channel, where gpt-oss browses, once a final
    answer follows anyway."""
    item_id = _string(item, "id", where)
    if item["type"] == "code_interpreter_call":
        outputs = item.get("outputs") or []
        logs = "".join(o.get("logs", "") for o in outputs if isinstance(o, dict) and o.get("type") == "logs")
        code = item.get("code") or ""
        if not isinstance(code, str) or not isinstance(logs, str):
            raise P.APIError(400, f"{where}: code and outputs[].logs must be strings", param="input")
        call = {"recipient": "python", "channel": "analysis", "content_type": "code", "arguments": code}
        return {"id": item_id, "type": "builtin", **call}, logs
    label, name = _string(item, "server_label", where), _string(item, "name", where)
    output = item.get("output")
    if output is None:
        error = item.get("error")
        output = f"Error: {json.dumps(error) if not isinstance(error, str) else error}" if error else ""
    if not isinstance(output, str):
        raise P.APIError(400, f"{where}.output: expected a string", param="input")
    call = {
        "recipient": f"{label}.{name}",
        "channel": "commentary",
        "content_type": "<|constrain|>json",
        "arguments": _string(item, "arguments", where),
    }
    return {"id": item_id, "type": "builtin", **call}, output


def _unsealed(sealed: Any, unseal: Callable[[str], str] | None, where: str) -> str:
    """The reasoning text of a reasoning item's `encrypted_content`; a 400 naming `input` otherwise."""
    if not isinstance(sealed, str):
        raise P.APIError(400, f"{where}.encrypted_content: expected a string", param="input")
    assert unseal is not None, "input_messages needs unseal to read encrypted_content"
    try:
        return unseal(sealed)
    except ValueError as exc:
        raise P.APIError(
            400,
            f"{where}.encrypted_content: this server cannot read it: {exc}",
            param="input",
            code="invalid_encrypted_content",
        ) from None


def output_messages(items: list[dict], transcript: dict[str, dict] | None = None) -> list[dict]:
    """A response's output items as the chat-shaped turns they continue a conversation with: one
    assistant turn, split after each built-in call by the tool's answer. transcript: item id ->
    {"call": the builtin call as the model wrote it, "output": the text it read back}."""
    messages: list[dict] = []
    turn: dict = {"role": "assistant"}
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            if turn.get("content") or turn.get("tool_calls"):
                messages.append(turn)
                turn = {"role": "assistant"}
            turn["reasoning_content"] = turn.get("reasoning_content", "") + item["content"][0]["text"]
        elif kind == "message":
            turn["content"] = turn.get("content", "") + item["content"][0]["text"]
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            turn.setdefault("tool_calls", []).append(call)
        elif item["id"] in (transcript or {}):  # a built-in call and the answer the model read
            ran = transcript[item["id"]]
            turn.setdefault("tool_calls", []).append(ran["call"])
            messages += [turn, {"role": "tool", "tool_call_id": item["id"], "content": ran["output"]}]
            turn = {"role": "assistant"}
    if len(turn) > 1 or not messages:
        messages.append(turn)
    return messages


def fit_conversation(head: list[dict], messages: list[dict], fits) -> list[dict]:
    """`truncation: "auto"`: the messages left once the oldest whole items are dropped so that
    `fits(head + kept)` holds, as the API defines it. `head` (the instructions) is never dropped, nor
    a system or developer message, nor the newest user turn and what follows it; a tool result goes
    with the call it answers. When nothing more may go and it still does not fit, the shortest
    conversation is answered (and the context check refuses it)."""
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    newest = users[-1] if users else max(len(messages) - 1, 0)
    droppable = [i for i in range(newest) if messages[i].get("role") not in ("system", "developer")]

    def kept(k: int) -> list[dict]:
        gone = set(droppable[:k])
        out, calls = [], set()
        for i, m in enumerate(messages):
            if i in gone or (m.get("role") == "tool" and m.get("tool_call_id") not in calls and i < newest):
                continue
            calls.update(c.get("id") for c in m.get("tool_calls") or ())
            out.append(m)
        return out

    if not droppable or fits(head + messages):
        return messages
    lo, hi = 1, len(droppable)  # fewest items to drop: dropping more never lengthens the prompt
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(head + kept(mid)):
            hi = mid
        else:
            lo = mid + 1
    return kept(hi)


__all__ = [
    "ResponsesRequest",
    "input_messages",
    "output_messages",
    "fit_conversation",
]
