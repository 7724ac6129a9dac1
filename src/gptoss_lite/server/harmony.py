"""Serving a harmony (gpt-oss) model: the prompt, the stop tokens, `tool_choice`, and the OpenAI shapes
of what `gptoss_lite.harmony.parse.HarmonyStream` reads out of a completion (docs/server.md#harmony-gpt-oss).

A server is a harmony server when its model's `tokenizer.json` is the gpt-oss vocabulary (with the
harmony control tokens at their released ids): chat requests are then rendered by openai-harmony,
not by a Jinja template, and answers are parsed into `reasoning_content`, `content` and `tool_calls`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from gptoss_lite.harmony.parse import Delta, HarmonyStream
from gptoss_lite.harmony.render import DEFAULT_EFFORT, BuiltinTools, RenderError, function_tools, render
from gptoss_lite.harmony.vocabulary import HARMONY_SPECIALS, HarmonyUnavailable, load_encoding

logger = logging.getLogger(__name__)


def harmony_for(tokenizer, *, required: bool = False):
    """The HarmonyServing of a tokenizer, or None for a model that does not speak harmony. A
    tokenizer with the harmony control tokens whose vocabulary is not gpt-oss's is served with its
    template instead, and the reason is logged. required: raise HarmonyUnavailable (with the reason)
    instead of answering None."""
    path = getattr(tokenizer, "path", None)
    token_to_id = getattr(tokenizer, "token_to_id", None)
    if path is None or token_to_id is None:
        if required:
            raise HarmonyUnavailable("the model has no tokenizer.json, so it cannot be the gpt-oss vocabulary")
        return None
    if any(token_to_id(name) != tid for name, tid in HARMONY_SPECIALS.items()) and not required:
        return None
    try:
        return HarmonyServing(load_encoding(path))
    except HarmonyUnavailable as exc:
        if required:
            raise
        logger.warning("harmony control tokens, but not served as harmony: %s", exc)
        return None


class ToolChoicePrefix:
    """A logits processor that makes a completion begin with one of some token sequences (a tool
    call's header), then leaves it free: how `tool_choice` "required" and a named function are
    enforced rather than hoped for."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        self.sequences = [list(s) for s in sequences]
        self.longest = max(len(s) for s in self.sequences)

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        k = len(token_ids)
        if k >= self.longest:
            return logits
        allowed = {s[k] for s in self.sequences if len(s) > k and s[:k] == token_ids[:k]}
        if not allowed:
            return logits
        masked = torch.full_like(logits, float("-inf"))
        index = torch.tensor(sorted(allowed), device=logits.device)
        masked[index] = logits[index]
        return masked


class Chained:
    """Logits processors applied in turn (a tool_choice prefix, then a JSON constraint)."""

    def __init__(self, *processors):
        self.processors = [p for p in processors if p is not None]

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for processor in self.processors:
            logits = processor(token_ids, logits)
        return logits

    def fork(self) -> Chained:
        return Chained(*(p.fork() if hasattr(p, "fork") else p for p in self.processors))


def chained(*processors):
    """One processor for these (None for none, the one itself for one)."""
    present = [p for p in processors if p is not None]
    return None if not present else present[0] if len(present) == 1 else Chained(*present)


class HarmonyServing:
    """One harmony model's rendering and parsing, as the chat and responses endpoints use them."""

    def __init__(self, encoding):
        self.encoding = encoding
        self.stop_token_ids = tuple(encoding.stop_tokens_for_assistant_actions())  # <|return|>, <|call|>
        self.return_token = HARMONY_SPECIALS["<|return|>"]  # how a final answer ends
        self.call_token = HARMONY_SPECIALS["<|call|>"]  # how a tool call ends

    def prompt(
        self,
        messages: Sequence[dict],
        *,
        tools,
        tool_choice,
        effort: str | None,
        response_format: dict | None = None,
        date: str | None = None,
        builtin: BuiltinTools | None = None,
    ) -> list[int]:
        """Prompt ids (RenderError for a conversation harmony cannot express). `builtin`: the tools the
        server runs that this conversation declares (none with tool_choice "none")."""
        described = function_tools(tools)
        names = {t["name"] for t in described}
        self.check_tool_choice(tool_choice, names)
        shown = None if tool_choice == "none" else tools
        builtin = None if tool_choice == "none" else builtin
        effort = effort or DEFAULT_EFFORT
        return render(
            self.encoding,
            messages,
            tools=shown,
            effort=effort,
            date=date,
            response_format=response_format,
            builtin=builtin,
        )

    @staticmethod
    def check_tool_choice(tool_choice, names: set[str]) -> None:
        if tool_choice in (None, "auto", "none"):
            return
        if tool_choice == "required":
            if not names:
                raise RenderError("tool_choice 'required' needs tools", "tool_choice")
            return
        name = _named_choice(tool_choice)
        if name is None:
            raise RenderError(
                "tool_choice: expected 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': …}}",
                "tool_choice",
            )
        if name not in names:
            raise RenderError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")

    def tool_choice_processor(self, tools, tool_choice) -> ToolChoicePrefix | None:
        """The processor that enforces a "required" or named tool_choice (None for auto / none)."""
        if tool_choice in (None, "auto", "none"):
            return None
        names = [t["name"] for t in function_tools(tools)]
        named = _named_choice(tool_choice)
        chosen = [named] if named is not None else names
        headers = [f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>" for n in chosen]
        return ToolChoicePrefix([self.encoding.encode(h, allowed_special="all") for h in headers])

    def stream(self, tool_choice=None, builtin: BuiltinTools | None = None) -> HarmonyStream:
        """A parse of one completion; calls to `builtin`'s namespaces are builtin parts."""
        runs = builtin.recipients if builtin is not None and tool_choice != "none" else frozenset()
        return HarmonyStream(self.encoding, tools=tool_choice != "none", builtin=runs)


def _named_choice(tool_choice) -> str | None:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function", tool_choice)  # chat nests it; responses puts the name flat
        name = fn.get("name") if isinstance(fn, dict) else None
        return name if isinstance(name, str) else None
    return None


def chat_delta(delta: Delta) -> dict:
    """A streamed chat chunk's `delta` for what some tokens added."""
    out: dict = {}
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.calls:
        calls = []
        for piece in delta.calls:
            entry: dict = {"index": piece.index, "function": {"arguments": piece.arguments}}
            if piece.id is not None:
                entry.update(id=piece.id, type="function")
                entry["function"]["name"] = piece.name
            calls.append(entry)
        out["tool_calls"] = calls
    return out


def chat_message(stream: HarmonyStream) -> dict:
    """The non-streamed chat `message` of a parsed completion."""
    message: dict = {"role": "assistant", "content": stream.content or (None if stream.tool_calls else "")}
    if stream.reasoning:
        message["reasoning_content"] = stream.reasoning
    if stream.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in stream.tool_calls
        ]
    return message


def finish_reason(stream: HarmonyStream, engine_reason: str | None) -> str | None:
    """ "tool_calls" when the turn ended in a call, else the engine's reason."""
    if engine_reason == "stop" and stream.ended_in_call:
        return "tool_calls"
    return engine_reason


__all__ = ["HarmonyServing", "harmony_for", "chat_delta", "chat_message", "finish_reason", "RenderError"]
