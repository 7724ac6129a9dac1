"""The answer of /v1/responses: its output items (reasoning, message, function call), the response
body, usage, and `EventWriter`, which turns parsed harmony into the stream of response events."""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable

from gptoss_lite.server import fields as F
from gptoss_lite.server.responses import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [output_text(text)],
    }


def output_text(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_body(
    rid: str,
    model: str,
    req: ResponsesRequest,
    output: list[dict],
    *,
    status: str,
    usage: dict | None,
    created: int,
    reason: str | None = None,
) -> dict:
    """The Response object (what the official client's `Response` model parses). reason: why an
    incomplete one stopped (default max_output_tokens)."""
    incomplete = {"reason": reason or "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "output_text": "".join(i["content"][0]["text"] for i in output if i["type"] == "message"),
        "error": None,
        "incomplete_details": incomplete,
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.effort, "summary": None},  # no summaries are written
        "store": req.store,
        "background": False,
        "service_tier": F.SERVED_TIER,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_logprobs": req.top_logprobs,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "text": {"format": _format_shape(req), "verbosity": (req.text and req.text.verbosity) or "medium"},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": [_tool_shape(t) for t in req.tools or []],
        "truncation": req.truncation or "disabled",
        "prompt_cache_key": req.prompt_cache_key,
        "prompt_cache_retention": req.prompt_cache_retention,
        "safety_identifier": req.safety_identifier,
        "usage": usage,
        "user": req.user,
    }


def _format_shape(req: ResponsesRequest) -> dict:
    fmt = req.text.format if req.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)


def _tool_shape(tool: dict) -> dict:
    if tool.get("type") != "function":  # a built-in tool, echoed as sent (credentials were refused)
        return dict(tool)
    fn = tool.get("function", tool)
    return {
        "type": "function",
        "name": fn.get("name"),
        "description": fn.get("description"),
        "parameters": fn.get("parameters"),
        "strict": fn.get("strict"),
    }


def usage(prompt_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


class EventWriter:
    """The streamed events of one response, from what the parser (or the plain text) adds.

    Items open as their first piece arrives and close (`.done` events) when the next one opens or the
    response ends; every event carries a `sequence_number`. With `seal` (text -> encrypted_content), a
    reasoning item gets its `encrypted_content` as it closes, so `response.output_item.done` and the
    final body carry it."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest, seal: Callable[[str], str] | None = None):
        self.rid, self.model, self.req, self.seal = rid, model, req, seal
        self.created = int(time.time())
        self.sequence = 0
        self.items: list[dict] = []  # output items so far (the open one last)
        self._open: int | None = None  # index of the item being written
        self._logprobs: list[dict] = []  # logprobs of message tokens whose text has not been added yet

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def body(self, status: str, use: dict | None = None, reason: str | None = None) -> dict:
        return response_body(
            self.rid, self.model, self.req, self.items, status=status, usage=use, created=self.created, reason=reason
        )

    def start(self) -> list[dict]:
        snapshot = self.body("in_progress")
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def open(self, item: dict) -> list[dict]:
        events = self.close()
        self.items.append(item)
        self._open = len(self.items) - 1
        # A copy: the item grows with the text added next, and the event shows it as it began.
        added = {**copy.deepcopy(item), "status": "in_progress"}
        events.append(self.event("response.output_item.added", output_index=self._open, item=added))
        if item["type"] == "message":
            events.append(self._part_event("response.content_part.added", output_text("")))
        return events

    def note_logprobs(self, entries: list[dict]) -> None:
        """Logprobs of message tokens (`top_logprobs`): they go out with the next text added to a
        message, or with the message when it closes."""
        self._logprobs.extend(entries)

    def add(self, text: str) -> list[dict]:
        if not text or self._open is None:
            return []
        item = self.items[self._open]
        where = {"item_id": item["id"], "output_index": self._open}
        if item["type"] == "reasoning":
            item["content"][0]["text"] += text
            return [self.event("response.reasoning_text.delta", content_index=0, delta=text, **where)]
        if item["type"] == "message":
            part, logprobs = item["content"][0], self._take_logprobs()
            part["text"] += text
            part["logprobs"] += logprobs
            return [self.event("response.output_text.delta", content_index=0, delta=text, logprobs=logprobs, **where)]
        item["arguments"] += text
        return [self.event("response.function_call_arguments.delta", delta=text, **where)]

    def _take_logprobs(self) -> list[dict]:
        taken, self._logprobs = self._logprobs, []
        return taken

    def close(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.items[index]
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            if self.seal is not None:
                item["encrypted_content"] = self.seal(text)
            events.append(self.event("response.reasoning_text.done", content_index=0, text=text, **where))
        elif item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += self._take_logprobs()
            text, logprobs = part["text"], part["logprobs"]
            events.append(
                self.event("response.output_text.done", content_index=0, text=text, logprobs=logprobs, **where)
            )
            events.append(self._part_event("response.content_part.done", output_text(text, logprobs), index))
        elif item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", arguments=item["arguments"], **where))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _part_event(self, kind: str, part: dict, index: int | None = None) -> dict:
        index = self._open if index is None else index
        return self.event(kind, item_id=self.items[index]["id"], output_index=index, content_index=0, part=part)

    def finish(self, status: str, use: dict, reason: str | None = None) -> list[dict]:
        if status == "incomplete" and self._open is not None:
            self.items[self._open]["status"] = "incomplete"  # the item max_output_tokens cut off
        events = self.close()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self.event(kind, response=self.body(status, use, reason)))
        return events


def new_item(part) -> dict:
    """A fresh output item (empty text) for a parsed harmony message that just began."""
    if part.kind == "reasoning":
        return reasoning_item(_id("rs"), "")
    if part.kind == "call":
        return call_item(_id("fc"), part.call.id, part.call.name, "")
    return message_item(_id("msg"), "")


def new_message_item() -> dict:
    return message_item(_id("msg"), "")


def response_id() -> str:
    return _id("resp")


__all__ = ["EventWriter", "new_item", "new_message_item", "response_id", "usage", "response_body"]
