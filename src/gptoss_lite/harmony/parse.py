"""Completion tokens of a harmony model -> reasoning, content and tool calls, one token at a time.

`HarmonyStream` feeds openai-harmony's StreamableParser and routes each message's text by its header:

- a recipient `functions.NAME` (on any channel) -> a tool call NAME whose arguments are the text;
- a recipient the server runs itself (`browser.search`, `python`, an MCP server's `LABEL.TOOL`: the
  `builtin` namespaces) -> a built-in call, kept with its channel and content type so the server can
  run it and render it back;
- the `analysis` channel -> reasoning;
- anything else (`final`, a `commentary` preamble, no channel) -> content.

The same object serves streaming and non-streaming answers, so streamed deltas always join to the
whole message. A stream the parser refuses (a header that never completes, a stray control token
where a header belongs, a cut-off header at the end) never raises: from the token that failed, the
text goes to content, the header tokens that were still pending included, and `malformed` holds
openai-harmony's reason (the server counts it). Text already handed out stays as it was.
"""

from __future__ import annotations

import codecs
import uuid
from dataclasses import dataclass, field

from gptoss_lite.harmony.vocabulary import HARMONY_SPECIALS

MESSAGE = HARMONY_SPECIALS["<|message|>"]
START = HARMONY_SPECIALS["<|start|>"]
ENDS = frozenset(HARMONY_SPECIALS[t] for t in ("<|end|>", "<|return|>", "<|call|>"))


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Part:
    """One message of the completion, in order: its kind (reasoning, content, call or builtin) and text
    so far. A builtin part's `call.name` is its whole recipient (`browser.search`, `python`), and
    `channel` and `content_type` are its header's (what rendering it back needs)."""

    kind: str
    text: str = ""
    call: ToolCall | None = None
    channel: str | None = None
    content_type: str | None = None


@dataclass
class CallDelta:
    """A piece of tool call `index`: `id` and `name` on its first piece, then argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class Delta:
    """What some tokens added."""

    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    parts: list[tuple[int, str]] = field(default_factory=list)  # (part index, text) in order; "" opens a part

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def extend(self, other: Delta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.parts += other.parts
        for piece in other.calls:
            last = self.calls[-1] if self.calls else None
            if last is not None and last.index == piece.index and piece.id is None:
                last.arguments += piece.arguments
            else:
                self.calls.append(CallDelta(piece.index, piece.arguments, piece.id, piece.name))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class HarmonyStream:
    """Parses one assistant completion (module docstring). `feed(tokens)` and `finish()` return the
    Delta they added; `reasoning`, `content` and `tool_calls` hold everything so far.

    tools: whether `functions.*` recipients become tool calls (False: their text is content, as for
    a request with `tool_choice: "none"`). builtin: the namespaces the server runs itself (`browser`,
    `python`, MCP server labels): a recipient NAME or NAME.FUNCTION of one is a builtin part."""

    def __init__(self, encoding, *, tools: bool = True, builtin: frozenset[str] = frozenset()):
        from openai_harmony import Role, StreamableParser

        self.encoding = encoding
        self.tools = tools
        self.builtin = frozenset(builtin)
        self._parser = StreamableParser(encoding, Role.ASSISTANT)
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []
        self.parts: list[Part] = []  # every message in order (what /v1/responses answers as items)
        self.reasoning_tokens = 0  # tokens of analysis text
        self.malformed: str | None = None  # openai-harmony's reason, once the stream fell back to content
        self.last_recipient: str | None = None  # of the last message that began: a call ends the turn
        self.channel: str | None = None  # of the last message that began
        self._in_text = False  # between a message's <|message|> and its end token
        self._kind = "content"  # where the current message's text goes: reasoning, content, or call
        self._pending: list[int] | None = []  # tokens of the header being read (None: in a message's text)
        self._bytes = codecs.getincrementaldecoder("utf-8")("replace")  # for the fallback text
        self._finished = False

    @property
    def in_text(self) -> bool:
        """The tokens fed so far end inside a message's text (after its <|message|>, before its end):
        where structured output constrains (see `channel` and `last_recipient` for which message)."""
        return self._in_text and self.malformed is None

    @property
    def ended_in_call(self) -> bool:
        """The last message was a tool call (the turn's finish reason is then "tool_calls")."""
        return self._kind == "call" and self.malformed is None

    @property
    def ended_in_builtin(self) -> bool:
        """The last message was a call to a built-in tool (the server runs it and goes on)."""
        return self._kind == "builtin" and self.malformed is None

    def feed(self, tokens) -> Delta:
        delta = Delta()
        for token in tokens:
            token = int(token)
            if self.malformed is not None:
                self._fallback(delta, [token])
                continue
            try:
                self._parser.process(token)
            except Exception as exc:  # noqa: BLE001 - HarmonyError; nothing of the stream may raise
                self._fail(delta, exc, [token])
                continue
            if token == START:
                self._pending = []
            elif token in ENDS:
                self._in_text = False
            elif token == MESSAGE:
                self._begin_message(delta)
            elif self._pending is not None:
                self._pending.append(token)
            if self._pending is None and self._kind == "reasoning" and not self.encoding.is_special_token(token):
                self.reasoning_tokens += 1
            text = self._parser.last_content_delta
            if text:
                self._route(delta, text)
        return delta

    def finish(self) -> Delta:
        """The end of the completion: a message still open is closed (its text was already handed
        out); a header still open falls back to content."""
        delta = Delta()
        if self._finished:
            return delta
        self._finished = True
        if self.malformed is None:
            try:
                self._parser.process_eos()
            except Exception as exc:  # noqa: BLE001
                self._fail(delta, exc, [])
        tail = self._bytes.decode(b"", final=True)
        if tail:
            self._add(delta, "content", tail)
        return delta

    # ---- internals --------------------------------------------------------------------------------

    def _begin_message(self, delta: Delta) -> None:
        self._pending = None
        recipient = self._parser.current_recipient
        self.last_recipient = recipient
        self.channel = self._parser.current_channel
        self._in_text = True
        call = None
        if recipient and recipient.startswith("functions.") and self.tools:
            call = ToolCall(new_call_id(), recipient.removeprefix("functions."))
            self.tool_calls.append(call)
            delta.calls.append(CallDelta(len(self.tool_calls) - 1, "", call.id, call.name))
            self._kind = "call"
        elif recipient and recipient.partition(".")[0] in self.builtin:
            call = ToolCall(new_call_id(), recipient)
            self._kind = "builtin"
        elif self._parser.current_channel == "analysis" and not recipient:
            self._kind = "reasoning"
        else:
            self._kind = "content"
        self._open(delta, self._kind, call)
        if call is not None and self._kind == "builtin":
            self.parts[-1].channel = self.channel
            self.parts[-1].content_type = self._parser.current_content_type or None

    def _open(self, delta: Delta, kind: str, call: ToolCall | None = None) -> None:
        self.parts.append(Part(kind, call=call))
        delta.parts.append((len(self.parts) - 1, ""))

    def _route(self, delta: Delta, text: str) -> None:
        self._add(delta, self._kind, text)

    def _add(self, delta: Delta, kind: str, text: str) -> None:
        if not self.parts or self.parts[-1].kind != kind:  # fallback text after a call or reasoning
            self._open(delta, kind)
        self.parts[-1].text += text
        delta.parts.append((len(self.parts) - 1, text))
        if kind == "reasoning":
            self.reasoning += text
            delta.reasoning += text
        elif kind == "builtin":
            self.parts[-1].call.arguments += text
        elif kind == "call":
            index = len(self.tool_calls) - 1
            self.tool_calls[index].arguments += text
            delta.calls.append(CallDelta(index, text))
        else:
            self.content += text
            delta.content += text

    def _fail(self, delta: Delta, exc: Exception, tokens: list[int]) -> None:
        self.malformed = str(exc) or type(exc).__name__
        self._kind = "content"
        pending = self._pending or []
        self._pending = []
        self._fallback(delta, [*pending, *tokens])

    def _fallback(self, delta: Delta, tokens: list[int]) -> None:
        plain = [t for t in tokens if not self.encoding.is_special_token(t)]
        if plain:
            text = self._bytes.decode(token_bytes(self.encoding, plain))
            if text:
                self._add(delta, "content", text)


def token_bytes(encoding, tokens: list[int]) -> bytes:
    """The bytes of ordinary tokens (a character may be cut at either end)."""
    inner = getattr(encoding, "_inner", None)
    if inner is not None and hasattr(inner, "decode_bytes"):
        return bytes(inner.decode_bytes(tokens))
    return encoding.decode(tokens).encode("utf-8")
