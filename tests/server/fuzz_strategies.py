"""Hypothesis strategies for fuzzing the HTTP server: JSON request bodies and raw HTTP/1.1 requests.

`request_bodies(model)` draws (path, body bytes) for POST /v1/completions, /v1/chat/completions and
/v1/responses. A body starts as a valid request, with each documented field at a value the server
accepts one time in four (docs/server.md#request-fields), and then may get hostile values for any
field of the schemas in `gptoss_lite.server.protocol` and `.responses` (the values a field refuses
among them), unknown fields, fields of another endpoint, a missing required field, and damage to the
whole body. Bodies are serialised by hand (`to_json`) so a case can hold what
`json.dumps` would never write: NaN and Infinity, integers of thousands of digits, duplicate keys,
lone surrogates (escaped, or as raw bytes that are not UTF-8), nesting 10,000 deep, trailing garbage.

`raw_http_requests(host, model)` draws `RawRequest`s: bytes for a plain socket, with bad request lines,
odd methods and targets, broken framing (Content-Length wrong, duplicated, negative or not a number;
chunked bodies with bad or missing chunks), missing or odd Host, malformed and huge header lines,
two Authorization headers, unexpected Content-Type / Content-Encoding, foreign Origin headers, and
bodies cut short. Each says whether an answer is due (`complete`) and whether it is a valid HTTP
message that reaches the app (`wellformed`), so the harness knows what to require of the answer.

Requests that do generate stay cheap, so the default run is fast: valid `max_tokens` is mostly 1..4
and prompts are a few tokens (the tiny model's context is 256 tokens).
"""

from __future__ import annotations

import gzip
import json
import math
import typing
from dataclasses import dataclass

from hypothesis import strategies as st

from gptoss_lite.server import protocol
from gptoss_lite.server import responses as R

MAX_STOP_CHARS = getattr(protocol, "MAX_STOP_CHARS", 4096)
MAX_STOP_STRINGS = getattr(protocol, "MAX_STOP_STRINGS", 4)
COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
VOCAB = 264  # the byte tokenizer of lite-tiny
CONTEXT = 256  # the max_model_len the harness serves with


# ---- hand-made JSON --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """JSON text spliced into a body as is (it need not be valid JSON)."""

    text: bytes

    def __repr__(self) -> str:
        t = self.text
        return f"Raw({t[:40]!r}{f'...<{len(t)} bytes>' if len(t) > 40 else ''})"


@dataclass(frozen=True)
class Obj:
    """A JSON object as (key, value) pairs in order; a key may repeat."""

    pairs: tuple


def to_json(value, ascii: bool = True) -> bytes:
    """`value` as JSON text. Unlike json.dumps: floats NaN/Infinity are written as such, `Raw` is
    spliced verbatim, `Obj` may repeat keys, and with ascii=False a lone surrogate becomes the raw
    (invalid UTF-8) bytes of its code point instead of an error."""
    out: list[bytes] = []
    _emit(value, ascii, out)
    return b"".join(out)


def _emit(value, ascii: bool, out: list[bytes]) -> None:
    if isinstance(value, Raw):
        out.append(value.text)
    elif value is None:
        out.append(b"null")
    elif value is True:
        out.append(b"true")
    elif value is False:
        out.append(b"false")
    elif isinstance(value, int):
        out.append(str(value).encode())  # callers use Raw beyond 4,300 digits
    elif isinstance(value, float):
        if math.isnan(value):
            out.append(b"NaN")
        elif math.isinf(value):
            out.append(b"Infinity" if value > 0 else b"-Infinity")
        else:
            out.append(repr(value).encode())
    elif isinstance(value, str):
        out.append(json.dumps(value, ensure_ascii=ascii).encode("utf-8", "surrogatepass"))
    elif isinstance(value, (dict, Obj)):
        pairs = value.items() if isinstance(value, dict) else value.pairs
        out.append(b"{")
        for i, (k, v) in enumerate(pairs):
            if i:
                out.append(b",")
            _emit(k, ascii, out)
            out.append(b":")
            _emit(v, ascii, out)
        out.append(b"}")
    elif isinstance(value, (list, tuple)):
        out.append(b"[")
        for i, v in enumerate(value):
            if i:
                out.append(b",")
            _emit(v, ascii, out)
        out.append(b"]")
    else:
        raise TypeError(f"cannot write {type(value).__name__} as JSON")


# ---- value pools -----------------------------------------------------------------------------------------

ODD_TEXT = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\u200f\u202eevil\u202c",  # RTL mark, RTL override
    "\ufeff",
    "😀",
    "👩‍👩‍👧‍👦",
    "\U0010ffff",
    "\ud800",  # lone high surrogate
    "\udfff",  # lone low surrogate
    "a\ud83db",
    "e\u0301",
    "\u0085\u2028\u2029",
    "\r\n\r\nX-Injected: 1",
    '"\\',
    "</script><script>alert(1)</script>",
    "{{ 7*7 }}{% for x in range(10**9) %}",  # data, never a template
    "%s%n%x",
    "\x7f\x1b[2J",
    "日本語",
]

RAW_STRINGS = [
    b'"\\u0000"',
    b'"\\ud800"',
    b'"\\udfff\\ud800"',
    b'"\\ud83d\\ude00"',  # a valid pair
    b'"\\ud800\\u0041"',
    b'"\xff\xfe"',  # not UTF-8
    b'"\xc0\xaf"',  # overlong UTF-8
    b'"\xed\xa0\x80"',  # a surrogate encoded in UTF-8
    b'"\\x41"',  # not a JSON escape
    b'"\\u12"',
    b'"tab\there"',  # raw control character
    b'"unterminated',
    b"'single quoted'",
]

EDGE_INTS = [0, 1, -1, 2, 4, 16, 256, 257, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**100]
EDGE_FLOATS = [
    0.0,
    -0.0,
    5e-324,
    1e-46,
    1e-8,
    0.5,
    1.0,
    0.9999999999999999,
    1.0000000000000002,
    2.0,
    2.0000000000000004,
    -1.0,
    1e308,
    -1e308,
    1.7976931348623157e308,
    math.nan,
    math.inf,
    -math.inf,
]
RAW_NUMBERS = [
    b"1e400",
    b"-1e400",
    b"1e-400",
    b"1.0e0",
    b"01",
    b"-0",
    b"+1",
    b".5",
    b"1.",
    b"0x10",
    b"1_000",
    b"NaN",
    b"-NaN",
    b"nan",
    b"Infinity",
    b"-Infinity",
    b"1e99999999999",
]
JUNK = [None, True, False, 0, -1, 1.5, "", "x", "1", "true", "null", [], [1], [None], {}, {"a": 1}, [[]], [{}]]
UNKNOWN_KEYS = [
    "max_token",
    "prompts",
    "foo",
    "",
    "__proto__",
    "constructor",
    "model\x00",
    "MODEL",
    "Model",
    "temperature ",
    "\uff4dodel",  # fullwidth m
    "functions",
    "stream_options.include_usage",
    "k" * 1000,
    "\ud800",
]


def huge_ints() -> st.SearchStrategy[Raw]:
    """Integer literals of 4,299 to 20,000 digits, 100..0 or 99..9 (Python refuses to print over 4,300,
    and 99..9 plus a prompt length gains a digit)."""
    return st.builds(
        lambda digits, sign, nines: Raw(sign + (b"9" * digits if nines else b"1" + b"0" * (digits - 1))),
        st.sampled_from([4299, 4300, 4300, 4300, 4301, 5000, 20000]),
        st.sampled_from([b"", b"", b"-"]),
        st.booleans(),
    )


def deep() -> st.SearchStrategy[Raw]:
    """Nesting 1,000 or 10,000 deep (lists or objects), balanced or not."""
    return st.builds(
        lambda n, kind, balanced: Raw(
            (b"[" * n + (b"]" * n if balanced else b""))
            if kind == "list"
            else (b'{"a":' * n + b"1" + (b"}" * n if balanced else b""))
        ),
        st.sampled_from([1000, 10000]),
        st.sampled_from(["list", "object"]),
        st.booleans(),
    )


def odd_strings() -> st.SearchStrategy:
    """Strings meant to trip a parser or a template: NUL, RTL marks, emoji, lone surrogates, bad escapes."""
    return st.one_of(
        st.sampled_from(ODD_TEXT),
        st.text(max_size=10),
        st.characters(categories=["Cs"]),
        st.sampled_from(RAW_STRINGS).map(Raw),
    )


def numbers() -> st.SearchStrategy:
    """Numbers at and past every edge: 0, -0.0, 5e-324, 1e308, NaN, 2**64, 5,000 digits, '0x10'."""
    return st.one_of(
        st.sampled_from(EDGE_INTS),
        st.sampled_from(EDGE_FLOATS),
        st.sampled_from(RAW_NUMBERS).map(Raw),
        huge_ints(),
        huge_ints(),
        st.integers(),
        st.floats(),
    )


def junk() -> st.SearchStrategy:
    """A value of a wrong or hostile type for any field."""
    return st.one_of(st.sampled_from(JUNK), odd_strings(), numbers(), deep())


def hostile(*specific) -> st.SearchStrategy:
    """Hostile values for one field: the `specific` ones (lists of values or strategies) and junk."""
    parts = [s if isinstance(s, st.SearchStrategy) else st.sampled_from(s) for s in specific]
    return st.one_of(*parts, junk())


# ---- fields ----------------------------------------------------------------------------------------------

_short_text = st.text(min_size=1, max_size=8)


def cheap_max_tokens() -> st.SearchStrategy[int]:
    """Valid token limits, nearly all 1..4 so that requests which generate stay fast."""
    return st.one_of(st.integers(1, 4), st.integers(1, 4), st.sampled_from([1, 2, 3, 4, 16]))


def valid_prompts() -> st.SearchStrategy:
    return st.one_of(
        st.text(min_size=1, max_size=12),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
        st.text(min_size=1, max_size=12).map(lambda s: [s]),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12).map(lambda ids: [ids]),
        st.sampled_from(["😀 naïve", "\u202eRTL\u200f", "a\x00b", "\ufeffBOM", "{{ 7*7 }}", "x" * (CONTEXT - 4)]),
        st.sampled_from(["\ud800", "a\udfffb", "\ud83d"]),  # lone surrogates: escapes that are valid JSON
    )


def hostile_prompts() -> st.SearchStrategy:
    return hostile(
        ["", [], [[]], [""], ["a", "b"], [[1], [2]], [VOCAB], [-1], [2**63], [2**64], [1.0], [True], [None]],
        [[[[1]]], [["a"]], [1, "a"], {"text": "x"}, "x" * (CONTEXT - 3), "x" * 300, [0] * 300, "x" * 70000],
        st.lists(st.integers(), min_size=1, max_size=8),
        odd_strings(),
        huge_ints().map(lambda r: Raw(b"[" + r.text + b"]")),
    )


def _message(content: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": content},
        optional={"name": _short_text},
    )


_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), min_size=1, max_size=2)


def valid_messages() -> st.SearchStrategy:
    lone = st.sampled_from(["\ud800", "a\udfffb"])  # valid JSON as escapes (ascii=True)
    return st.lists(_message(st.one_of(st.text(max_size=12), _parts, lone)), min_size=1, max_size=3)


def hostile_messages() -> st.SearchStrategy:
    user = {"role": "user", "content": "x"}
    return hostile(
        [[], [{}], [{"role": "user"}], [{"content": "x"}], [{"role": "tool", "content": "x"}]],
        [[{"role": "robot", "content": "x"}], [{"role": "USER", "content": "x"}], [{"role": None, "content": "x"}]],
        [[{"role": "user", "content": None}], [{"role": "user", "content": 5}], [{"role": "user", "content": {}}]],
        [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://evil.example/x.png"}}]}]],
        [[{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"text": "x"}]}]],
        [[{"role": "user", "content": [{"type": "text", "text": "x", "extra": 1}]}], [{**user, "extra": 1}]],
        [[{**user, "name": 5}], user, "hi", [user] * 200, [{"role": "user", "content": "x" * 300}], [[user]]],
        st.lists(_message(hostile()), min_size=1, max_size=2),
        st.lists(_message(odd_strings()), min_size=1, max_size=2),
    )


def valid_stops() -> st.SearchStrategy:
    return st.one_of(
        st.none(),
        st.text(min_size=1, max_size=4),
        st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=MAX_STOP_STRINGS),
        st.sampled_from(["\n", "User:", "K", "\ufffd", "\ud800", "x" * MAX_STOP_CHARS]),
    )


def hostile_stops() -> st.SearchStrategy:
    too_long = "x" * (MAX_STOP_CHARS + 1)
    return hostile(
        ["", [""], [None], [1], [["a"]], {"a": 1}, 5, too_long, "x" * 60000, [too_long], [too_long] * 4],
        [["a"] * (MAX_STOP_STRINGS + 1), [f"s{i}" for i in range(1000)], ["\ud800"], ["\x00"]],
        st.lists(st.text(min_size=1, max_size=3), min_size=MAX_STOP_STRINGS + 1, max_size=20),
        st.lists(odd_strings(), min_size=1, max_size=4),
    )


_nullish = st.sampled_from([None, 0, 0.0, -0.0])

COMMON_FIELDS = {
    # name: (valid values, hostile values)
    "temperature": (
        st.one_of(
            st.sampled_from([5e-324, 1e-46, 1e-300, 2.0, 1.9999999999999998]),
            st.sampled_from([0, 0.0, -0.0, 0.7, 1, 1.0, 2]),
            st.floats(0, 2),
        ),
        hostile(numbers()),
    ),
    "top_p": (
        st.one_of(
            st.sampled_from([1e-46, 5e-324, 1e-300, 1e-8]),
            st.sampled_from([1, 1.0, 0.5, 0.9999999999999999]),
            st.floats(0, 1, exclude_min=True),
        ),
        hostile(numbers()),
    ),
    "seed": (st.one_of(st.sampled_from([None, 0, 1, 42, 2**63 - 1]), st.integers(0, 2**63 - 1)), hostile(numbers())),
    "stop": (valid_stops(), hostile_stops()),
    "n": (st.just(1), hostile(numbers())),
    "stream": (st.booleans(), hostile([0, 1, "yes"])),
    "stream_options": (
        st.sampled_from(
            [None, {"include_usage": True}, {"include_usage": False}, {}, {"include_obfuscation": False}]
            + [{"include_usage": True, "include_obfuscation": True}]
        ),
        hostile(
            [{"include_usage": "yes"}, {"include_usage": None}, {"x": 1}, {"include_usage": True, "x": 1}],
            [{"include_obfuscation": "no"}, {"include_obfuscation": 0}],
        ),
    ),
    "user": (st.one_of(st.none(), _short_text, odd_strings()), hostile(["u" * 100000])),
    "frequency_penalty": (_nullish, hostile(numbers())),
    "presence_penalty": (_nullish, hostile(numbers())),
    "logit_bias": (
        st.sampled_from([None, {}]),
        hostile(
            [{"1": 5}, {"1": -100}, {"1": "x"}, {"": 1}, {"99999": math.nan}],
            st.dictionaries(st.one_of(st.text(max_size=4), st.sampled_from(ODD_TEXT)), numbers(), max_size=3),
        ),
    ),
    "cache_salt": (
        st.one_of(st.none(), _short_text, st.just("s" * 256)),
        hostile(["", "s" * 257, "s" * 100000]),
    ),
    "ignore_eos": (st.booleans(), hostile([0, 1, "true"])),
}


def _identifier(limit: int) -> tuple:
    """(valid, hostile) for an opaque client string of at most `limit` characters."""
    return (st.one_of(st.none(), _short_text, st.just("k" * limit)), hostile(["k" * (limit + 1), "k" * 100000]))


_METADATA = (
    st.one_of(
        st.sampled_from([None, {}, {"k": "v"}, {"k" * 64: "v" * 512}]),
        st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=16),
    ),
    hostile(
        [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, {"k": None}, ["k", "v"]],
        st.dictionaries(st.text(max_size=4), junk(), min_size=1, max_size=3),
    ),
)
_SERVICE_TIER = (
    st.sampled_from([None, "auto", "default", "flex", "scale", "priority", "fast", "ultrafast"]),
    hostile(["turbo", "Default", ""]),
)
_CACHE_OPTIONS = (
    st.sampled_from([None, {}, {"mode": "implicit"}, {"mode": "explicit", "ttl": "30m"}, {"ttl": "12h"}]),
    hostile([{"mode": "x"}, {"ttl": "1h"}, {"mode": "implicit", "x": 1}]),
)
_RETENTION = (st.sampled_from([None, "in_memory", "24h"]), hostile(["1h", "forever"]))
_VERBOSITY = (st.sampled_from([None, "low", "medium", "high"]), hostile(["loud", "LOW"]))
_NEUTRAL_ONLY = (st.none(), hostile([{}, {"model": "omni-moderation-latest"}, "x", [1]]))  # a 400 unless null

COMPLETION_FIELDS = {
    "prompt": (valid_prompts(), hostile_prompts()),
    "max_tokens": (cheap_max_tokens(), hostile(numbers())),
    "echo": (st.booleans(), hostile(["true", 1])),
    "logprobs": (st.none(), hostile(numbers())),
    "best_of": (st.sampled_from([None, 1]), hostile(numbers())),
    "suffix": (st.sampled_from([None, ""]), hostile(odd_strings())),
}

CHAT_FIELDS = {
    "messages": (valid_messages(), hostile_messages()),
    "max_tokens": (cheap_max_tokens(), hostile(numbers())),
    "max_completion_tokens": (cheap_max_tokens(), hostile(numbers())),
    "logprobs": (st.just(False), hostile([True])),
    "top_logprobs": (st.none(), hostile(numbers())),
    "tools": (
        st.sampled_from([None, []]),
        hostile([[{"type": "function", "function": {"name": "f", "parameters": {}}}], [{}], {"type": "function"}]),
    ),
    "tool_choice": (st.sampled_from([None, "none"]), hostile(["auto", "required", {"type": "function"}])),
    "response_format": (
        st.sampled_from([None, {"type": "text"}]),
        hostile([{"type": "json_object"}, {"type": "json_schema", "json_schema": {}}, {}, {"type": "text", "x": 1}]),
    ),
    "parallel_tool_calls": (st.sampled_from([None, True, False]), hostile()),
    # Legacy tools and reasoning: lite-tiny is no harmony model, so only their neutral values are 200s.
    "functions": (st.none(), hostile([[{"name": "f"}], [{"name": "f", "parameters": {}}], [{}], [{"name": 5}]])),
    "function_call": (st.sampled_from([None, "none", "auto"]), hostile(["required", {"name": "f"}, {"name": 1}])),
    "reasoning_effort": (
        st.none(),
        hostile(["none", "minimal", "low", "medium", "high", "xhigh", "max", "extreme", "LOW"]),
    ),
    "metadata": _METADATA,
    "service_tier": _SERVICE_TIER,
    "store": (st.sampled_from([None, True, False]), hostile(["false", 0])),
    "prompt_cache_key": _identifier(256),
    "prompt_cache_options": _CACHE_OPTIONS,
    "prompt_cache_retention": _RETENTION,
    "safety_identifier": _identifier(128),
    "verbosity": _VERBOSITY,
    "prediction": (
        st.sampled_from([None, {"type": "content", "content": "x"}, {"type": "content", "content": []}]),
        hostile([{"type": "content"}, {"type": "text", "content": "x"}, {"content": [{"type": "image"}]}]),
    ),
    "modalities": (st.sampled_from([None, [], ["text"]]), hostile([["audio"], ["text", "audio"], ["video"], "text"])),
    "audio": _NEUTRAL_ONLY,
    "web_search_options": _NEUTRAL_ONLY,
    "moderation": _NEUTRAL_ONLY,
}

_INCLUDES = list(typing.get_args(R.Includable))  # every documented `include` value
_ITEMS = [
    [{"role": "user", "content": "hi"}],
    [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    [
        {"role": "user", "content": "x" * 150},
        {"role": "assistant", "content": "y" * 60},
        {"role": "user", "content": "z"},
    ],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}],
]

RESPONSE_FIELDS = {
    "input": (
        st.one_of(st.text(min_size=1, max_size=12), st.sampled_from(_ITEMS)),
        hostile(
            ["", [], [{}], [{"role": "robot", "content": "x"}], [{"type": "image", "url": "x"}], "x" * 300],
            [[{"type": "function_call_output", "call_id": "c", "output": "o"}], [{"type": "reasoning"}]],
        ),
    ),
    "instructions": (st.one_of(st.none(), _short_text), hostile(odd_strings())),
    "max_output_tokens": (cheap_max_tokens(), hostile(numbers())),
    "temperature": COMMON_FIELDS["temperature"],
    "top_p": COMMON_FIELDS["top_p"],
    "top_logprobs": (st.one_of(st.none(), st.integers(0, 20)), hostile(numbers())),
    "include": (
        st.one_of(st.none(), st.lists(st.sampled_from(_INCLUDES), max_size=4)),
        hostile([["everything"], "reasoning.encrypted_content", [None], _INCLUDES * 3]),
    ),
    "truncation": (st.sampled_from([None, "auto", "disabled"]), hostile(["Auto", "none"])),
    "stream": (st.booleans(), hostile([0, 1, "yes"])),
    "stream_options": (st.none(), hostile([{"include_obfuscation": True}, {"include_usage": True}, {"x": 1}])),
    "previous_response_id": (st.none(), hostile(["resp_nope", "", "r" * 300])),
    "store": (st.sampled_from([True, False]), hostile(["false", None])),
    "text": (
        st.sampled_from([None, {}, {"format": {"type": "text"}}, {"verbosity": "low"}]),
        hostile([{"format": {"type": "yaml"}}, {"verbosity": "loud"}, {"format": {"type": "json_schema"}}]),
    ),
    "reasoning": (
        st.sampled_from([None, {}, {"summary": "auto"}, {"generate_summary": "concise"}, {"context": "current_turn"}])
        | st.sampled_from([{"mode": "standard"}, {"effort": None}]),
        hostile(
            [{"effort": "low"}, {"effort": "minimal"}, {"effort": "max2"}, {"context": "all_turns"}, {"mode": "pro"}],
            [{"summary": "long"}, {"mode": "m" * 65}],
        ),
    ),
    "tools": (st.sampled_from([None, []]), hostile([[{"type": "function", "name": "f"}], [{"type": "web_search"}]])),
    "tool_choice": (st.sampled_from([None, "none", "auto"]), hostile(["required", {"type": "function", "name": "f"}])),
    "parallel_tool_calls": (st.sampled_from([None, True, False]), hostile()),
    "metadata": _METADATA,
    "user": _identifier(256),
    "service_tier": _SERVICE_TIER,
    "prompt_cache_key": _identifier(256),
    "prompt_cache_retention": _RETENTION,
    "prompt_cache_options": _CACHE_OPTIONS,
    "safety_identifier": _identifier(128),
    "max_tool_calls": (st.sampled_from([None, 0, 5]), hostile(numbers())),
    "access_programs": (st.sampled_from([None, {}, {"cyber": "standard"}]), hostile([{"cyber": "x"}])),
    "image": (st.sampled_from([None, {"context_compression": "auto"}]), hostile([{"context_compression": 1}])),
    "background": (st.sampled_from([None, False]), hostile([True, "true"])),
    "background_options": (
        st.sampled_from([None, {}, {"completion_window": "soonest"}]),
        hostile([{"completion_window": "2h"}, {"continuation_id": "c"}, {"completion_window": "1d"}]),
    ),
    "conversation": (st.none(), hostile(["conv_1", {"id": "conv_1"}])),
    "prompt": (st.none(), hostile([{"id": "pmpt_1"}, "p"])),
    "context_management": (
        st.sampled_from([None, []]),
        hostile([[{"type": "compaction"}], [{"type": "compaction", "compact_threshold": -1}], [{}]]),
    ),
    "moderation": _NEUTRAL_ONLY,
    "cache_salt": COMMON_FIELDS["cache_salt"],
}
FIELDS = {
    COMPLETIONS: {**COMMON_FIELDS, **COMPLETION_FIELDS},
    CHAT: {**COMMON_FIELDS, **CHAT_FIELDS},
    RESPONSES: RESPONSE_FIELDS,
}

# Fields whose values reach the engine's arithmetic: mutated three times as often as the others.
FOCUS = ["max_tokens", "max_completion_tokens", "max_output_tokens", "temperature", "top_p", "seed", "stop"]
FOCUS += ["prompt", "messages", "input"]

BODY_DAMAGE = ["none"] * 60 + [
    "duplicate_key",
    "trailing_garbage",
    "truncated",
    "deep_body",
    "deep_field",
    "not_an_object",
    "bom",
    "invalid_utf8",
    "empty",
    "whitespace",
    "over_8_mib",
    "nul_byte",
]


@st.composite
def request_bodies(draw, model: str = "lite-tiny"):
    """(path, body bytes) for the three generating endpoints: a valid request, then up to three hostile
    changes (a bad value for a schema field, a removed required field, an unknown field, a field of
    another endpoint) and possibly damage to the whole body (see BODY_DAMAGE)."""
    path = draw(st.sampled_from([COMPLETIONS, COMPLETIONS, CHAT, CHAT, RESPONSES]))
    own = FIELDS[path]
    other = {k: v for p, fields in FIELDS.items() if p != path for k, v in fields.items() if k not in own}
    required = {COMPLETIONS: "prompt", CHAT: "messages", RESPONSES: "input"}[path]
    body: dict = {"model": model, required: draw(own[required][0])}
    if path == CHAT:
        # Without a limit a chat request generates up to the context (slow), so "neither" is rare.
        limit = draw(st.sampled_from(["max_tokens"] * 12 + ["max_completion_tokens"] * 6 + ["both", "neither"]))
    elif path == RESPONSES:
        limit = draw(st.sampled_from(["max_output_tokens"] * 19 + ["neither"]))
    else:
        limit = draw(st.sampled_from(["max_tokens"] * 8 + ["neither"]))  # a completion defaults to 16
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if limit in (name, "both") and name in own:
            body[name] = draw(cheap_max_tokens())
    limits = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    optional = sorted(k for k in own if k not in (required, *limits))
    for name in optional:  # each optional field with a valid value, one time in four
        if draw(st.integers(0, 3)) == 0:
            body[name] = draw(own[name][0])
    if draw(st.integers(0, 2)) == 0:
        body["stream"] = True
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["hostile"] * 6 + ["model", "delete", "unknown", "foreign"]))
        if kind == "hostile":
            name = draw(st.sampled_from(sorted(own) + [k for k in FOCUS if k in own] * 2))
            body[name] = draw(own[name][1])
        elif kind == "model":
            body["model"] = draw(
                hostile(["", "gpt-4", model.upper(), model + " ", model + "\x00", "../" + model, "\ud800"])
            )
        elif kind == "delete":
            body.pop(draw(st.sampled_from(["model", required])), None)
        elif kind == "unknown":
            body[draw(st.one_of(st.sampled_from(UNKNOWN_KEYS), st.text(max_size=8)))] = draw(junk())
        else:
            name = draw(st.sampled_from(sorted(other)))
            body[name] = draw(other[name][0])
    return path, _damage(draw, body, draw(st.sampled_from(BODY_DAMAGE)), draw(st.booleans()))


def _damage(draw, body: dict, damage: str, ascii: bool) -> bytes:
    pairs = list(body.items())
    if damage == "duplicate_key":
        key = draw(st.sampled_from([k for k, _ in pairs] or ["model"]))
        pairs.insert(draw(st.integers(0, len(pairs))), (key, draw(junk())))
    elif damage == "deep_field":
        pairs.append((draw(st.sampled_from([k for k, _ in pairs] + ["extra"])), draw(deep())))
    elif damage == "over_8_mib":
        field = next((k for k in ("prompt", "messages", "input") if k in body), "prompt")
        pairs.append((field, Raw(b'"' + b"x" * ((8 << 20) + 1) + b'"')))
    text = to_json(Obj(tuple(pairs)), ascii=ascii)
    if damage == "trailing_garbage":
        return text + draw(st.sampled_from([b" x", b"}", b"{}", b"\x00", b",", b'\n\n{"a":1}', b"]"]))
    if damage == "truncated":
        return text[: draw(st.integers(0, max(0, len(text) - 1)))]
    if damage == "deep_body":
        return draw(deep()).text
    if damage == "not_an_object":
        return draw(st.sampled_from([b"[]", b"null", b"1", b'"str"', b"true", b"[{}]", b"NaN", b"[" + text + b"]"]))
    if damage == "bom":
        return b"\xef\xbb\xbf" + text
    if damage == "invalid_utf8":
        at = draw(st.integers(0, len(text)))
        return text[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80"])) + text[at:]
    if damage == "empty":
        return b""
    if damage == "whitespace":
        return b" \t\r\n" + text + b"\n\x0c"
    if damage == "nul_byte":
        at = draw(st.integers(0, len(text)))
        return text[:at] + b"\x00" + text[at:]
    return text


# ---- raw HTTP --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RawRequest:
    """Bytes to send on a fresh socket, and what may be required of the answer."""

    data: bytes
    method: str  # as sent (latin-1), to know whether the answer has a body (HEAD)
    target: str  # as sent (latin-1)
    complete: bool  # the message is whole: an answer is due within the client's timeout
    wellformed: bool  # valid HTTP/1.1 that reaches the app, whose errors are JSON
    hang_up: bool  # close the socket right after sending, without reading
    label: str  # the choices that made it, for the counts and failure reports

    def __repr__(self) -> str:
        d = self.data
        shown = d if len(d) <= 400 else d[:400] + b"...<%d bytes>" % len(d)
        return f"RawRequest({self.label}, complete={self.complete}, wellformed={self.wellformed}, {shown!r})"


GOOD_TARGETS = [
    COMPLETIONS,
    CHAT,
    "/v1/models",
    "/v1/models/lite-tiny",
    "/health",
    "/stats",
    "/metrics",
    "/admin/reset_prefix_cache",
    "/",
    "/v1/nothing",
    "/v1/completions?stream=true",
    "/v1/completions/",
    "//v1/completions",
    "/v1/models/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "/v1/models/%ED%A0%80",  # a surrogate, percent-encoded
    "/v1/models/%FF%00",
    "/V1/COMPLETIONS",
    "/v1/models/" + "a" * 8000,
]
ODD_TARGETS = ["*", "http://evil.example/v1/completions", "/v1/models/\x7f", "/v1/completions\t", "v1/completions"]
BAD_REQUEST_LINES = [
    b"",
    b"GARBAGE",
    b"GET",
    b"GET /",
    b"GET  / HTTP/1.1",
    b"GET / HTTP/1.1 extra",
    b"GET / HTTP/9.9",
    b"GET / HTTP/2.0",
    b"GET / http/1.1",
    b"GET /\x00 HTTP/1.1",
    b"GET /\xff HTTP/1.1",
    b"G\x00T / HTTP/1.1",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
    b"PRI * HTTP/2.0",
    b"POST /v1/completions HTTP/1.1 POST /v1/completions HTTP/1.1",
]
METHODS = ["POST"] * 8 + ["GET", "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "BREW", "post"]
AUTH = {
    "alice": [b"Authorization: Bearer key-alice"],
    "bob": [b"Authorization: Bearer key-bob"],
    "alice_then_bob": [b"Authorization: Bearer key-alice", b"Authorization: Bearer key-bob"],
    "bob_then_bad": [b"Authorization: Bearer key-bob", b"Authorization: Bearer nope"],
    "none": [],
    "empty": [b"Authorization:"],
    "bearer_only": [b"Authorization: Bearer "],
    "basic": [b"Authorization: Basic a2V5LWFsaWNlOg=="],
    "lowercase": [b"authorization: bearer key-alice"],
    "comma": [b"Authorization: Bearer key-alice, Bearer key-bob"],
    "huge": [b"Authorization: Bearer " + b"k" * 20000],
    "admin": [b"Authorization: Bearer root"],
}
CONTENT_TYPES = {
    "json": [b"Content-Type: application/json"],
    "text_plain": [b"Content-Type: text/plain"],
    "form": [b"Content-Type: application/x-www-form-urlencoded"],
    "multipart": [b"Content-Type: multipart/form-data; boundary=x"],
    "missing": [],
    "json_charset": [b"Content-Type: application/json; charset=utf-8"],
    "json_latin1": [b"Content-Type: application/json; charset=latin-1"],
    "json_upper": [b"Content-Type: APPLICATION/JSON"],
    "garbage": [b"Content-Type: \xff\xfe;;;="],
    "two": [b"Content-Type: application/json", b"Content-Type: text/plain"],
}
ENCODINGS = ["none"] * 6 + ["gzip", "gzip_not_gzipped", "br", "identity", "deflate", "gzip_gzip"]
ORIGINS = [None] * 5 + [
    "http://evil.example",
    "null",
    "HOST",
    "https://evil.example:443",
    "http://127.0.0.1.evil.example",
]
# (header lines, still valid HTTP): junk that a request may carry besides its own headers
EXTRA_HEADERS = [
    ([b"X-No-Colon"], False),
    ([b"X-Space : v"], False),
    ([b"X-Folded: a", b" continued"], False),
    ([b"X-Nul: a\x00b"], False),
    ([b": no-name"], False),
    ([b"X-Big: " + b"a" * 8000], True),
    ([b"X-Huge: " + b"a" * 60000], False),  # one line under 64 KB, over h11's 16 KB header block
    ([b"X-Latin: \xe9t\xe9"], True),
    ([b"Expect: 100-continue"], True),
    ([b"Connection: close"], True),
    ([b"Connection: keep-alive"], True),
    ([b"Connection: Upgrade", b"Upgrade: websocket"], True),
    ([b"Connection: Upgrade, HTTP2-Settings", b"Upgrade: h2c", b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA"], True),
    ([b"X-Forwarded-For: 1.2.3.4", b"X-Forwarded-Host: evil.example", b"Forwarded: host=evil.example"], True),
    ([b"X-Many-%d: v" % i for i in range(100)], True),
    ([b"Cookie: " + b"a=b; " * 1000], True),
    ([b"Accept-Encoding: gzip, br, *;q=0"], True),
    ([b"Range: bytes=0-1"], True),
]
FRAMINGS = ["content_length"] * 10 + [
    "none",
    "cl_duplicate_same",
    "cl_duplicate_differ",
    "cl_negative",
    "cl_not_a_number",
    "cl_larger",
    "cl_smaller",
    "cl_huge",
    "cl_zero_with_body",
    "chunked",
    "chunked_extension",
    "chunked_bad_size",
    "chunked_short",
    "chunked_no_end",
    "chunked_and_cl",
    "te_gzip_chunked",
    "te_identity",
    "te_twice",
    "head_cut",
    "bare_lf",
]
VALID_FRAMINGS = {"content_length", "none", "cl_smaller", "cl_zero_with_body", "chunked", "chunked_extension"}
INCOMPLETE = {"cl_larger", "cl_huge", "chunked_short", "chunked_no_end", "head_cut", "bare_lf"}


def _cheap_body(path: str, model: str, max_tokens: int, stream: bool) -> bytes:
    if path.startswith(CHAT):
        msgs = [{"role": "user", "content": "hi"}]
        return to_json({"model": model, "messages": msgs, "max_tokens": max_tokens, "stream": stream})
    return to_json({"model": model, "prompt": "hi", "max_tokens": max_tokens, "stream": stream})


def _chunks(body: bytes, cuts: list[int], ext: bytes = b"") -> bytes:
    points = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
    out = b""
    for a, b in zip(points, points[1:]):
        if b > a:
            out += b"%x%s\r\n%s\r\n" % (b - a, ext, body[a:b])
    return out


@st.composite
def raw_http_requests(draw, host: str, model: str = "lite-tiny"):
    """Raw HTTP/1.1 requests (see the module docstring) to the server at `host` ("127.0.0.1:PORT")."""
    label: list[str] = []
    wellformed = True

    def pick(name, options):
        choice = draw(st.sampled_from(options))
        label.append(f"{name}={choice}")
        return choice

    # Request line.
    if draw(st.integers(0, 19)) == 0:
        line = draw(st.sampled_from(BAD_REQUEST_LINES))
        label.append(f"line={line[:24]!r}")
        method, target, wellformed = "?", "?", False
    else:
        method = pick("method", METHODS)
        target = pick("target", GOOD_TARGETS * 3 + ODD_TARGETS) if draw(st.booleans()) else COMPLETIONS
        if target in ODD_TARGETS:
            wellformed = False
        if target in (COMPLETIONS, CHAT) and method == "POST" and draw(st.integers(0, 3)) == 0:
            target = draw(st.sampled_from([COMPLETIONS, CHAT]))
        version = pick("version", ["HTTP/1.1"] * 9 + ["HTTP/1.0"])
        line = f"{method} {target} {version}".encode("latin-1")

    # Headers.
    headers: list[bytes] = []
    host_kind = pick("host", ["good"] * 8 + ["evil", "missing", "empty", "twice", "odd"])
    if host_kind == "good":
        headers.append(b"Host: " + host.encode())
    elif host_kind == "evil":
        headers.append(b"Host: evil.example")
    elif host_kind == "empty":
        headers.append(b"Host:")
    elif host_kind == "twice":
        headers += [b"Host: " + host.encode(), b"Host: evil.example"]
        wellformed = False
    elif host_kind == "odd":
        odd = ["127.0.0.1:1", "[::1]:80", "localhost", "a b", "\xe9vil.example", f"{host}@evil.example", "h" * 300]
        headers.append(b"Host: " + draw(st.sampled_from(odd)).encode("latin-1"))
    elif not line.endswith(b"HTTP/1.0"):
        wellformed = False  # HTTP/1.1 requires Host
    headers += AUTH[pick("auth", ["alice"] * 8 + sorted(AUTH))]
    ctype = pick("ctype", ["json"] * 8 + sorted(CONTENT_TYPES))
    headers += CONTENT_TYPES[ctype]
    origin = pick("origin", ORIGINS)
    if origin is not None:
        headers.append(b"Origin: " + (f"http://{host}" if origin == "HOST" else origin).encode())
    for lines, valid in draw(st.lists(st.sampled_from(EXTRA_HEADERS), max_size=2, unique_by=lambda e: e[0][0])):
        label.append(f"extra={lines[0][:16]!r}")
        headers += lines
        wellformed = wellformed and valid
    if sum(map(len, headers)) > 16000:
        wellformed = False  # over h11's limit for a header block: refused before the app

    # Body.
    body_kind = pick("body", ["cheap"] * 4 + ["fuzzed", "empty"])
    if body_kind == "cheap":
        body = _cheap_body(target, model, draw(st.integers(1, 3)), draw(st.booleans()))
    elif body_kind == "fuzzed":
        body = draw(request_bodies(model))[1]
        if len(body) > 1 << 20:
            body = body[: 1 << 20]  # keep sends short; such a body is refused anyway
    else:
        body = b""
    encoding = pick("encoding", ENCODINGS)
    if encoding == "gzip":
        body = gzip.compress(body)
        headers.append(b"Content-Encoding: gzip")
    elif encoding == "gzip_not_gzipped":
        headers.append(b"Content-Encoding: gzip")
    elif encoding == "gzip_gzip":
        body = gzip.compress(gzip.compress(body))
        headers.append(b"Content-Encoding: gzip, gzip")
    elif encoding != "none":
        headers.append(b"Content-Encoding: " + encoding.encode())

    # Framing.
    framing = pick("framing", FRAMINGS)
    cuts = draw(st.lists(st.integers(0, 1 << 16), max_size=3))
    n = len(body)
    payload = body
    if framing == "content_length":
        headers.append(b"Content-Length: %d" % n)
    elif framing == "cl_duplicate_same":
        headers += [b"Content-Length: %d" % n] * 2
    elif framing == "cl_duplicate_differ":
        headers += [b"Content-Length: %d" % n, b"Content-Length: %d" % (n + 1)]
    elif framing == "cl_negative":
        headers.append(b"Content-Length: -%d" % max(n, 1))
    elif framing == "cl_not_a_number":
        bad = [b"abc", b"1e3", b"0x10", b"12abc", b"", b"1 2", b"+%d" % n, b"%d.0" % n, b"\xd9\xa1"]
        headers.append(b"Content-Length: " + draw(st.sampled_from(bad)))
    elif framing == "cl_larger":
        headers.append(b"Content-Length: %d" % (n + draw(st.integers(1, 1000))))
    elif framing == "cl_smaller":
        headers.append(b"Content-Length: %d" % max(0, n - draw(st.integers(1, max(1, n)))))
    elif framing == "cl_huge":
        headers.append(b"Content-Length: " + draw(st.sampled_from([b"99999999999999999999", b"%d" % 2**64])))
    elif framing == "cl_zero_with_body":
        headers.append(b"Content-Length: 0")
    elif framing in ("chunked", "chunked_extension", "chunked_no_end"):
        headers.append(b"Transfer-Encoding: chunked")
        ext = b";name=value" if framing == "chunked_extension" else b""
        payload = _chunks(body, cuts, ext) + (b"" if framing == "chunked_no_end" else b"0\r\n\r\n")
    elif framing == "chunked_bad_size":
        headers.append(b"Transfer-Encoding: chunked")
        payload = draw(st.sampled_from([b"zz\r\n", b"-1\r\n", b" \r\n", b"5\r\nabcdefgh\r\n"])) + body
    elif framing == "chunked_short":
        headers.append(b"Transfer-Encoding: chunked")
        payload = b"%x\r\n" % (n + 100) + body
    elif framing == "chunked_and_cl":
        headers += [b"Transfer-Encoding: chunked", b"Content-Length: %d" % n]
        payload = _chunks(body, cuts) + b"0\r\n\r\n"
    elif framing in ("te_gzip_chunked", "te_identity", "te_twice"):
        te = {"te_gzip_chunked": [b"gzip, chunked"], "te_identity": [b"identity"], "te_twice": [b"chunked"] * 2}
        headers += [b"Transfer-Encoding: " + v for v in te[framing]]
        payload = _chunks(body, cuts) + b"0\r\n\r\n"
    if framing not in VALID_FRAMINGS:
        wellformed = False

    sep = b"\n" if framing == "bare_lf" else b"\r\n"
    head = sep.join([line, *headers]) + sep
    if framing == "head_cut":
        data = head[: draw(st.integers(0, len(head)))]
    else:
        data = head + sep + payload
    complete = framing not in INCOMPLETE
    hang_up = not complete and draw(st.booleans())
    return RawRequest(
        data=data,
        method=method,
        target=target,
        complete=complete,
        wellformed=wellformed and complete,
        hang_up=hang_up,
        label=" ".join(label),
    )
