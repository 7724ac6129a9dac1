"""The OpenAI wire format: request bodies (pydantic, strict), response bodies, and error bodies.

Requests are parsed in strict mode with unknown fields forbidden, as the OpenAI API does: a string
where a number belongs (`"max_tokens": "8"`) or a misspelt field (`"max_token": 8`) is a 400 naming
the field, never silently coerced or ignored. Every field the API documents parses, and is then acted
on, echoed, accepted as a hint with no effect here, or refused with a 400 naming it when it asks for
something this server cannot do (`modalities: ["audio"]`, `web_search_options`, a `suffix`), so a
client never gets an answer computed without an option it needs. docs/server.md#request-fields has
the table, field by field.

Three extensions beyond the OpenAI fields: `cache_salt` (a client-chosen string that further splits the
prefix-cache scope of its tenant), `ignore_eos` (generate exactly `max_tokens`, for benchmarks) and
`priority` (an integer, lower first, that orders the request within its tenant's share of the engine).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from gptoss_lite.server import fields as F
from gptoss_lite.server.fields import StreamOptions

MAX_STOP_STRINGS = 4  # the OpenAI API's limit on `stop`
MAX_STOP_CHARS = 4096  # characters in one stop string
MAX_SEED = 2**63 - 1  # a JSON integer every client library can send
MAX_TOKENS_LIMIT = 2**31 - 1  # above any context; the context check gives the real bound
MAX_INT_DIGITS = 20  # a JSON integer with more digits is refused before it is converted
MAX_NUMBER_CHARS = 64  # the same for a JSON number with a fraction or an exponent
MAX_N = 128  # choices per request the API accepts
MAX_TOOLS = 128  # function tools in one request (the OpenAI limit)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions, also for an explicit null


class APIError(Exception):
    """An error the HTTP layer turns into an OpenAI-shaped body with this status (and these headers:
    a 429's Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code=None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    """{"error": {"message", "type", "param", "code"}}: the shape every OpenAI client library parses."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def retry_after(seconds: float) -> dict[str, str]:
    """The Retry-After header for a wait of `seconds`: whole seconds (RFC 9110 allows no fraction),
    rounded up so a client that waits as told is not refused again for a fraction, and at least 1."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def refuse(param: str, why: str) -> None:
    """The 400 for a documented field that asks for something this server cannot do."""
    raise APIError(400, f"{param}: {why}", param=param)


_Strict = F.Strict
Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]


class _SamplingFields(_Strict):
    """Fields both endpoints share."""

    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: F.Identifier | None = None  # accepted; nothing here tells end users apart
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=1024)] | None = None
    # Extensions.
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    ignore_eos: bool = False
    priority: F.Priority = 0

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def check(self) -> None:
        """Refuse what parses but this server cannot do (raises APIError 400)."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        for key in self.logit_bias or {}:
            if not key.isdigit() or len(key) > MAX_INT_DIGITS:
                raise APIError(400, f"logit_bias: keys are token ids, got {key[:40]!r}", param="logit_bias")

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets (max_tokens aside: it needs the prompt's length)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop_strings(),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs_k,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "logit_bias": self.logit_bias_ids(),
            "n": self.samples,
        }

    @property
    def samples(self) -> int:
        """Samples to generate (n; completions' best_of may ask for more)."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. One prompt: a string, a list of token ids, or a one-element list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: MaxTokens | None = COMPLETIONS_DEFAULT_MAX_TOKENS  # null means this default too
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    @property
    def token_limit(self) -> int:
        return self.max_tokens if self.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token to compute (None: none). With best_of > n every token's own
        logprob is needed to rank the samples, so at least 0."""
        if self.logprobs is None and self.samples > self.n:
            return 0
        return self.logprobs

    @property
    def samples(self) -> int:
        """Samples to generate: best_of (the n best by total logprob are answered), else n."""
        return self.best_of if self.best_of is not None else self.n

    def check(self) -> None:
        super().check()
        if self.echo and self.logprobs is not None:
            refuse("echo", "echo with logprobs needs the prompt's logprobs, which this server does not compute")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of={self.best_of} must be at least n={self.n}", param="best_of")
        if self.stream and self.samples > self.n:
            raise APIError(
                400, "best_of > n cannot be streamed (the best samples are known at the end)", param="best_of"
            )
        if self.suffix:
            refuse("suffix", "text after the insertion point needs a fill-in-the-middle model; this one only continues")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (APIError 400 for a batch or an empty prompt)."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise APIError(400, f"prompt: {len(p)} prompts in one request; send one per request", param="prompt")
            p = p[0]
        if len(p) == 0:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    """An assistant message's tool call, as a client sends the previous turn back."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant turn sent back: its chain of thought (either name) and its tool calls.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None  # a tool result: the call it answers
    function_call: ToolCallFunction | None = None  # the legacy shape of one tool call
    # What the official client includes when it sends back a message it received; nothing to render.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_dict(self) -> dict[str, Any]:
        """The message as the harmony renderer reads it (OpenAI field names, None fields left out). The
        legacy shapes become today's: a `function` result is a `tool` result named by `name`, and an
        assistant's `function_call` is its one tool call."""
        out: dict[str, Any] = {"role": "tool" if self.role == "function" else self.role, "content": self.text()}
        for key in ("name", "reasoning_content", "reasoning", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        calls = [c.model_dump() for c in self.tool_calls or ()]
        if self.function_call is not None:
            calls.append({"type": "function", "function": self.function_call.model_dump()})
        if calls:
            out["tool_calls"] = calls
        return out

    @property
    def calls_tools(self) -> bool:
        """A tool call or a tool result, in either shape."""
        return self.role in ("tool", "function") or bool(self.tool_calls) or self.function_call is not None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions (docs/server.md#request-fields says what each field does)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None  # None: up to the context limit
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    functions: Annotated[list[F.FunctionDef], Field(max_length=MAX_TOOLS)] | None = None  # legacy tools
    function_call: Literal["none", "auto"] | F.FunctionName | None = None  # legacy tool_choice
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted; a harmony turn makes at most one call
    reasoning_effort: F.Effort | None = None
    # Echoed in the answer.
    metadata: F.Metadata | None = None
    service_tier: F.ServiceTier | None = None
    # Hints with no effect here (docs/server.md#request-fields says why).
    store: bool | None = None
    prompt_cache_key: F.Identifier | None = None
    prompt_cache_options: F.PromptCacheOptions | None = None
    prompt_cache_retention: F.CacheRetention | None = None
    safety_identifier: F.SafetyIdentifier | None = None
    verbosity: F.Verbosity | None = None
    prediction: F.Prediction | None = None
    # What this server cannot do: accepted at their neutral value, a 400 otherwise.
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        kind = (self.response_format or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            why = "response_format: type must be 'text', 'json_object' or 'json_schema'"
            raise APIError(400, why, param="response_format")
        if self.functions is not None and self.tools is not None:
            refuse("functions", "give tools or the legacy functions, not both")
        if self.function_call is not None and self.tool_choice is not None:
            refuse("function_call", "give tool_choice or the legacy function_call, not both")
        if "audio" in (self.modalities or ()):
            refuse("modalities", "this server answers text only; send ['text'] or leave it out")
        if self.audio is not None:
            refuse("audio", "this server has no audio output")
        if self.web_search_options is not None:
            refuse("web_search_options", "this server has no web search")
        if self.moderation is not None:
            refuse("moderation", "this server runs no moderation model")

    @property
    def requested_tools(self) -> list[dict] | None:
        """`tools`, or the legacy `functions` as tools."""
        return self.tools if self.functions is None else F.legacy_tools(self.functions)

    @property
    def requested_tool_choice(self):
        """`tool_choice`, or the legacy `function_call` as a tool_choice."""
        return self.tool_choice if self.function_call is None else F.legacy_tool_choice(self.function_call)

    @property
    def tools_param(self) -> str:
        """The field a problem with the tools is reported under (what the client sent)."""
        return "functions" if self.functions is not None else "tools"

    @property
    def effort(self) -> str | None:
        """The gpt-oss reasoning effort asked for (the nearest of low, medium, high)."""
        return F.nearest_effort(self.reasoning_effort)

    @property
    def structured(self) -> dict | None:
        """The response_format when it asks for JSON (None for text)."""
        rf = self.response_format
        return rf if rf is not None and rf.get("type", "text") != "text" else None

    @property
    def uses_tools(self) -> bool:
        """Whether the request needs a model that can call tools (tools, or tool turns in its history)."""
        return bool(self.requested_tools) or any(m.calls_tools for m in self.messages)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        """Alternatives per token to report (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_request(cls: type[_Strict], body: bytes) -> Any:
    """Validate a JSON body into `cls`; any problem is an APIError 400 naming the first bad field.

    The body is read by `parse_json` first, so a number too long to convert, NaN, or nesting too
    deep for the parser is refused before anything looks at its value."""
    obj = parse_json(body)
    if not isinstance(obj, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        req = cls.model_validate(obj, strict=True)
    except ValidationError as exc:
        err = _most_telling(exc.errors(include_url=False))
        loc = ".".join(str(p) for p in err["loc"] if _is_field(p))
        if err["type"] == "model_type" or not loc:
            raise APIError(400, "request body must be a JSON object") from None
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {loc}", param=loc) from None
        if err["type"] == "missing":
            raise APIError(400, f"{loc}: required field is missing", param=loc) from None
        if isinstance(err.get("input"), _LongNumber):
            raise APIError(400, f"{loc}: {err['input'].why}", param=loc) from None
        raise APIError(400, f"{loc}: {err['msg']} (got {_shown(err.get('input'))})", param=loc) from None
    req.check()
    return req


def parse_json(body: bytes) -> Any:
    """The JSON value of a request body (APIError 400 for anything that is not plain JSON of sane size).

    Refused: invalid UTF-8 or JSON, NaN and Infinity (not JSON), an integer of more than
    MAX_INT_DIGITS digits or a number of more than MAX_NUMBER_CHARS characters (converting a
    4,300-digit integer is what Python refuses to do), and nesting too deep for the parser.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: not UTF-8 at byte {exc.start}") from None
    try:
        obj = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_no_constant)
    except _BadNumber as exc:
        raise APIError(400, f"request body: {exc}") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if "\\u" in text:  # an escape could spell half a surrogate pair, which is no character: refuse it
        where = _surrogate_path(obj)
        if where is not None:
            raise APIError(400, f"{where}: a string holds an unpaired surrogate escape", param=where)
    return obj


def _surrogate_path(obj, path: str = "") -> str | None:
    """The dotted path of the first string (or key) with an unpaired surrogate ('' for the top)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")  # shown escaped: no surrogate in it
        here = f"{path}.{name}" if path else name
        if isinstance(key, str) and not _encodes(key):
            return here
        if isinstance(value, str):
            if not _encodes(value):
                return here
        elif isinstance(value, (dict, list)):
            found = _surrogate_path(value, here)
            if found is not None:
                return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _BadNumber(ValueError):
    pass


class _LongNumber:
    """Stands in for a JSON number too long to convert; validation then names the field it is in."""

    def __init__(self, text: str, what: str) -> None:
        self.why = f"{what} of {len(text):,} characters, too long to be a value here"


def _parse_int(digits: str) -> int | _LongNumber:
    if len(digits) > MAX_INT_DIGITS:
        return _LongNumber(digits, "an integer")
    return int(digits)


def _parse_float(text: str) -> float | _LongNumber:
    if len(text) > MAX_NUMBER_CHARS:
        return _LongNumber(text, "a number")
    value = float(text)
    if not math.isfinite(value):
        raise _BadNumber(f"{text[:20]} is out of range for a number")
    return value


def _no_constant(name: str):
    raise _BadNumber(f"{name} is not a JSON value")


def _shown(value) -> str:
    """A bad value as an error message shows it: scalars by repr, cut to 80 characters; containers by type."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return f"{value!r:.80}"
    return type(value).__name__


def _most_telling(errors: list[dict]) -> dict:
    """Of the errors for the first bad field, one that says more than "wrong type": a value of the
    union member whose type matched (a list that is too long) beats "not a string"."""
    first = errors[0]
    same_field = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    return next((e for e in same_field if not e["type"].endswith("_type")), first)


def _is_field(part) -> bool:
    """Location parts that name a field or an index, not a union member ('list[int]', 'constrained-str')."""
    return isinstance(part, int) or (part.isidentifier() and part not in ("str", "int", "float", "bool", "list"))
