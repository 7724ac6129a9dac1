"""The documented OpenAI request surface: docs/server.md#request-fields and the code agree, and the
fields do what the table says.

The tables are read from the doc itself, so a row added there without the code (or a field added to a
request model without a row) fails here. Every route gets one request carrying every row (a second
one where fields exclude each other) on lite-tiny and on the harmony test model; each echoed row must
come back, and each 400 row is refused naming its field.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import typing
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer, create_app, tiny_llm
from pydantic import BaseModel

from gptoss_lite.server import protocol as P
from gptoss_lite.server import responses as R

ROOT = Path(__file__).resolve().parents[2]
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
ROUTES = [CHAT, COMPLETIONS, RESPONSES]
MODELS = {CHAT: P.ChatCompletionRequest, COMPLETIONS: P.CompletionRequest, RESPONSES: R.ResponsesRequest}
KINDS = ("acted on", "echoed", "no effect", "400")
# The official client's create parameters for each route (the fields a client can send by name).
CLIENT_PARAMS = {
    CHAT: ("openai.types.chat.completion_create_params", "CompletionCreateParamsStreaming"),
    COMPLETIONS: ("openai.types.completion_create_params", "CompletionCreateParamsStreaming"),
    RESPONSES: ("openai.types.responses.response_create_params", "ResponseCreateParamsStreaming"),
}
DROP = object()  # in a variant: leave the field out


def field_tables() -> dict[str, dict[str, str]]:
    """{route: {field: kind}} from docs/server.md#request-fields; a nested field is dotted."""
    text = (ROOT / "docs" / "server.md").read_text()
    section = text.split("\n## Request fields\n", 1)[1].split("\n## ", 1)[0]
    tables: dict[str, dict[str, str]] = {}
    route = None
    for line in section.splitlines():
        if line.startswith("### POST "):
            route = line.removeprefix("### POST ").strip()
            tables[route] = {}
        elif route is not None and line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            name = cells[0].strip("`")
            assert name not in tables[route], f"{route}: two rows for {name}"
            tables[route][name] = cells[1]
    return tables


TABLES = field_tables()

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
ALL_INCLUDES = list(typing.get_args(R.Includable))
SURFACE = {
    CHAT: {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 1,
        "stop": ["\n\n"],
        "n": 1,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "logit_bias": {"65": 1},
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {"type": "text"},
        "tools": [{"type": "function", "function": WEATHER}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning_effort": "minimal",
        "metadata": {"run": "surface"},
        "service_tier": "flex",
        "store": False,
        "prompt_cache_key": "session-1",
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
        "prompt_cache_retention": "24h",
        "safety_identifier": "hashed-user",
        "user": "user-1",
        "verbosity": "low",
        "prediction": {"type": "content", "content": "Hello"},
        "modalities": ["text"],
        "audio": None,
        "web_search_options": None,
        "moderation": None,
        "cache_salt": "salt-1",
        "ignore_eos": True,
        "priority": -1,
    },
    COMPLETIONS: {
        "prompt": "Hello",
        "max_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 1,
        "stop": ["\n\n"],
        "n": 1,
        "best_of": 1,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "logit_bias": {"65": 1},
        "logprobs": 2,
        "echo": False,
        "suffix": None,
        "user": "user-1",
        "cache_salt": "salt-1",
        "ignore_eos": True,
        "priority": -1,
    },
    RESPONSES: {
        "input": [{"role": "user", "content": "Hi"}],
        "instructions": "Be brief.",
        "max_output_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "stream": True,
        "stream_options": {"include_obfuscation": False},
        "previous_response_id": None,  # filled in with a stored response of the server
        "store": False,
        "tools": [{"type": "function", **WEATHER}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "reasoning": {
            "effort": "minimal",
            "summary": "auto",
            "generate_summary": "auto",
            "context": "auto",
            "mode": "standard",
        },
        "top_logprobs": 2,
        "include": ALL_INCLUDES,
        "truncation": "auto",
        "metadata": {"run": "surface"},
        "user": "user-1",
        "service_tier": "priority",
        "prompt_cache_key": "session-1",
        "prompt_cache_retention": "in_memory",
        "safety_identifier": "hashed-user",
        "max_tool_calls": 3,
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
        "access_programs": {"cyber": "standard"},
        "image": {"context_compression": "auto"},
        "background": False,
        "background_options": {"completion_window": "soonest"},
        "conversation": None,
        "prompt": None,
        "context_management": [],
        "moderation": None,
        "cache_salt": "salt-1",
        "priority": 3,
    },
}
# Further requests for fields that exclude one in SURFACE; the first of each route is not streamed,
# so its echoed fields can be read.
VARIANTS = {
    CHAT: [
        {"stream": False, "stream_options": DROP},
        {"max_tokens": DROP, "max_completion_tokens": 4, "tools": DROP, "tool_choice": DROP}
        | {"functions": [WEATHER], "function_call": "auto"},
    ],
    COMPLETIONS: [{"stream": False, "stream_options": DROP, "echo": True, "logprobs": DROP}],
    RESPONSES: [{"stream": False, "stream_options": DROP}],
}
# Fields only a harmony model serves (a 400 on lite-tiny, tested in test_errors and test_responses).
HARMONY_ONLY = {
    CHAT: {"tools", "tool_choice", "functions", "function_call", "reasoning_effort"},
    COMPLETIONS: set(),
    RESPONSES: {"tools", "tool_choice", "reasoning.effort"},
}
REFUSED = {
    CHAT: {
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
        "web_search_options": {},
        "moderation": {"model": "omni-moderation-latest"},
    },
    COMPLETIONS: {"suffix": " and the end."},
    RESPONSES: {
        "reasoning.context": "all_turns",
        "reasoning.mode": "pro",
        "background": True,
        "background_options": {"completion_window": "2h"},
        "conversation": "conv_123",
        "prompt": {"id": "pmpt_123", "version": "2"},
        "context_management": [{"type": "compaction", "compact_threshold": 1000}],
        "moderation": {"model": "omni-moderation-latest"},
    },
}


def _submodel(annotation) -> type[BaseModel] | None:
    """The pydantic model in an annotation such as `StreamOptions | None` (None when there is none)."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _wire_fields(model: type[BaseModel]) -> dict:
    return {(info.alias or name): info for name, info in model.model_fields.items()}


def _rows_of(body: dict, route: str) -> set[str]:
    """The table rows a body carries: its fields, dotted one level where the table splits a field."""
    rows = set()
    for key, value in body.items():
        split = any(r.startswith(key + ".") for r in TABLES[route])
        rows |= {f"{key}.{sub}" for sub in value} if split and isinstance(value, dict) else {key}
    return rows


def _apply(body: dict, changes: dict) -> dict:
    out = dict(body)
    for key, value in changes.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def _without(body: dict, rows: set[str]) -> dict:
    out = {k: v for k, v in body.items() if k not in rows}
    for row in rows:
        top, _, sub = row.partition(".")
        if sub and isinstance(out.get(top), dict):
            out[top] = {k: v for k, v in out[top].items() if k != sub}
    return out


def _at(body: dict, row: str):
    for part in row.split("."):
        body = body[part]
    return body


# ---- the tables against the code --------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_every_row_is_a_field_and_every_field_has_a_row(route):
    """Each row names a request-model field (dotted: a field of its sub-model) with a known kind, and each
    field of the model has a row, or rows for every field of its sub-model."""
    rows, fields = TABLES[route], _wire_fields(MODELS[route])
    for row, kind in rows.items():
        assert kind in KINDS, f"{route} {row}: kind {kind!r}"
        top, _, sub = row.partition(".")
        assert top in fields, f"{route}: the row {row} is no field of {MODELS[route].__name__}"
        if sub:
            inner = _submodel(fields[top].annotation)
            assert inner is not None and sub in _wire_fields(inner), f"{route}: {row} is no field"
    for name, info in fields.items():
        subs = {r.partition(".")[2] for r in rows if r.startswith(name + ".")}
        if name in rows:
            assert not subs, f"{route}: {name} has a row and rows for its parts"
        else:
            inner = _submodel(info.annotation)
            assert inner is not None and subs == set(_wire_fields(inner)), f"{route}: no row for {name}"


@pytest.mark.parametrize("route", ROUTES)
def test_every_field_the_openai_client_names_has_a_row(route):
    """Every parameter of the installed openai client's create call for the route has a row."""
    pytest.importorskip("openai")
    module, name = CLIENT_PARAMS[route]
    params = getattr(importlib.import_module(module), name)
    documented = set(params.__required_keys__ | params.__optional_keys__)
    tops = {row.partition(".")[0] for row in TABLES[route]}
    assert sorted(documented - tops) == []


@pytest.mark.parametrize("route", ROUTES)
def test_the_surface_bodies_carry_every_row(route):
    """The requests below carry every row of the table, and refuse exactly the 400 rows."""
    carried = _rows_of(SURFACE[route], route)
    for variant in VARIANTS[route]:
        carried |= _rows_of({k: v for k, v in variant.items() if v is not DROP}, route)
    assert carried == set(TABLES[route]) - {"model"}
    assert set(REFUSED[route]) == {row for row, kind in TABLES[route].items() if kind == "400"}


# ---- one request with everything ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain():
    llm = tiny_llm(max_model_len=256)
    with LiveServer(create_app(llm)) as live:
        yield live, llm


@pytest.fixture(scope="module")
def harmony():
    """The harmony test model's server (harmony_fixture lives beside the harmony tests)."""
    sys.path.insert(0, str(ROOT / "tests" / "harmony"))
    fixture = importlib.import_module("harmony_fixture")
    with fixture.harmony_server(max_running=4) as (llm, state, live):
        yield live, llm, state


def _send(live, route: str, body: dict) -> httpx.Response:
    return httpx.post(live.url + route, json=body, timeout=120)


def _serve_surface(live, model: str, route: str, leave_out: set[str]) -> None:
    base = {"model": model, **_without(SURFACE[route], leave_out)}
    if route == RESPONSES:
        first = _send(live, route, {"model": model, "input": "Hello", "max_output_tokens": 2})
        assert first.status_code == 200, first.text
        base["previous_response_id"] = first.json()["id"]
    r = _send(live, route, base)
    assert r.status_code == 200, r.text
    assert "event-stream" in r.headers["content-type"]
    if route == RESPONSES:
        assert re.findall(r"^event: (\S+)", r.text, re.M)[-1] in ("response.completed", "response.incomplete")
    else:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    if route == CHAT:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert {c["service_tier"] for c in chunks} == {"default"}
    for variant in VARIANTS[route]:
        body = _without(_apply(base, variant), leave_out)
        r = _send(live, route, body)
        assert r.status_code == 200, (variant, r.text)
        if body.get("stream"):
            continue
        answer = r.json()
        for row, kind in TABLES[route].items():
            if kind == "echoed" and row not in leave_out:
                sent = "default" if row == "service_tier" else _at(body, row)
                assert _at(answer, row) == sent, (row, answer)


@pytest.mark.parametrize("route", ROUTES)
def test_every_row_at_once_on_lite_tiny(plain, route):
    """lite-tiny answers one request carrying every row but the harmony-only ones with a 200 (streamed
    and not), and echoes each echoed row."""
    live, llm = plain
    _serve_surface(live, llm.model_name, route, HARMONY_ONLY[route])


@pytest.mark.parametrize("route", ROUTES)
def test_every_row_at_once_on_the_harmony_model(harmony, route):
    """The harmony test model answers one request carrying every row with a 200, and echoes each
    echoed row."""
    live, llm, _ = harmony
    _serve_surface(live, llm.model_name, route, set())


@pytest.mark.parametrize("route", ROUTES)
def test_each_400_row_is_refused_naming_its_field(plain, route):
    """Each 400 row's refused value is a 400 whose param is the field (the same body at its neutral
    value is the 200 above)."""
    live, llm = plain
    for row, value in REFUSED[route].items():
        body = {"model": llm.model_name, **_without(SURFACE[route], HARMONY_ONLY[route]), "stream": False}
        body.pop("stream_options")
        top, _, sub = row.partition(".")
        body[top] = {**body[top], sub: value} if sub else value
        r = _send(live, route, body)
        assert r.status_code == 400, (row, r.text)
        assert r.json()["error"]["param"] == row, r.text


def test_an_unknown_field_is_still_unrecognized(plain):
    """A field no endpoint documents stays a 400 'Unrecognized request argument supplied'."""
    live, llm = plain
    for route, base in ((CHAT, {"messages": [{"role": "user", "content": "x"}]}), (RESPONSES, {"input": "x"})):
        r = _send(live, route, {"model": llm.model_name, **base, "max_output_token": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_token", r.text
        assert "Unrecognized request argument supplied" in r.json()["error"]["message"]


# ---- what the acted-on fields do ----------------------------------------------------------------------------


def _count_fits(limit: int):
    """A `fits` for fit_conversation that counts characters of content."""
    return lambda shown: sum(len(m.get("content") or "") for m in shown) <= limit


def test_fit_conversation_drops_the_oldest_whole_items():
    """truncation 'auto' keeps the instructions, system messages and the newest user turn, drops the
    fewest oldest items, and drops a tool result with the call it answers."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}
    messages = [
        {"role": "user", "content": "a" * 10},
        {"role": "system", "content": "s"},
        call,
        {"role": "tool", "tool_call_id": "c1", "content": "r" * 10},
        {"role": "assistant", "content": "b" * 10},
        {"role": "user", "content": "n" * 10},
    ]
    head = [{"role": "system", "content": "i"}]
    assert R.fit_conversation(head, messages, _count_fits(100)) == messages  # fits: nothing dropped
    assert R.fit_conversation(head, messages, _count_fits(32)) == messages[1:]
    assert R.fit_conversation(head, messages, _count_fits(22)) == [messages[1], *messages[4:]]  # call and result
    assert R.fit_conversation(head, messages, _count_fits(12)) == [messages[1], messages[5]]
    assert R.fit_conversation(head, messages, _count_fits(5)) == [messages[1], messages[5]]  # the least there is
    assert R.fit_conversation(head, messages[-1:], _count_fits(5)) == messages[-1:]


def test_truncation_auto_fits_a_long_conversation(plain):
    """On lite-tiny (context 256): 'disabled' is the 400 context_length_exceeded; 'auto' drops the oldest
    user turn, of the input and of a stored conversation alike, and input_tokens is the kept prompt's."""
    live, llm = plain
    old, newer, newest = "x" * 150, "y" * 40, "z" * 30
    items = [{"role": "user", "content": old}, {"role": "assistant", "content": newer}]
    body = {"model": llm.model_name, "input": [*items, {"role": "user", "content": newest}], "max_output_tokens": 40}
    r = _send(live, RESPONSES, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = _send(live, RESPONSES, {**body, "truncation": "auto", "instructions": "Be brief."})
    assert r.status_code == 200 and r.json()["truncation"] == "auto", r.text
    kept = "System: Be brief.\nAssistant: " + newer + "\nUser: " + newest + "\nAssistant:"
    assert r.json()["usage"]["input_tokens"] == len(llm.encode(kept))

    first = _send(live, RESPONSES, {"model": llm.model_name, "input": old, "max_output_tokens": 4, "temperature": 0})
    answer = first.json()["output_text"]
    later = {"model": llm.model_name, "input": newest, "previous_response_id": first.json()["id"]}
    r = _send(live, RESPONSES, {**later, "max_output_tokens": 150, "truncation": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] == len(llm.encode(f"Assistant: {answer}\nUser: {newest}\nAssistant:"))


def _assert_same_logprobs(got: list[dict], expected: list[dict]) -> None:
    """The same tokens and alternatives, the values within 1e-4: a repeated prompt comes from the prefix
    cache, whose fp32 sums differ in the last bits from a fresh prefill's."""
    shape = [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]) for e in got]
    assert shape == [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]) for e in expected]
    values = [[e["logprob"], *(t["logprob"] for t in e["top_logprobs"])] for e in got]
    assert values == [
        pytest.approx([e["logprob"], *(t["logprob"] for t in e["top_logprobs"])], abs=1e-4) for e in expected
    ]


def test_responses_logprobs_are_chats(plain):
    """top_logprobs on /v1/responses gives the output_text part the entries chat's logprobs give for the
    same greedy prompt; streamed deltas join to them; include alone gives them without alternatives."""
    live, llm = plain
    chat = {"model": llm.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
    chat |= {"temperature": 0, "logprobs": True, "top_logprobs": 2}
    expected = _send(live, CHAT, chat).json()["choices"][0]
    resp = {"model": llm.model_name, "input": "Hi", "max_output_tokens": 6, "temperature": 0, "top_logprobs": 2}
    part = _send(live, RESPONSES, resp).json()["output"][0]["content"][0]
    assert part["text"] == expected["message"]["content"]
    assert len(part["logprobs"]) == 6
    _assert_same_logprobs(part["logprobs"], expected["logprobs"]["content"])
    events = _send(live, RESPONSES, {**resp, "stream": True}).text
    deltas = [json.loads(line[6:]) for line in events.splitlines() if '"response.output_text.delta"' in line]
    _assert_same_logprobs([e for d in deltas for e in d["logprobs"]], part["logprobs"])
    plain_lp = _send(live, RESPONSES, {**resp, "top_logprobs": None, "include": ["message.output_text.logprobs"]})
    entries = plain_lp.json()["output"][0]["content"][0]["logprobs"]
    assert [(e["token"], e["top_logprobs"]) for e in entries] == [(e["token"], []) for e in part["logprobs"]]
    assert _send(live, RESPONSES, {**resp, "top_logprobs": None}).json()["output"][0]["content"][0]["logprobs"] == []


def test_echo_begins_each_choice_with_the_prompt(plain):
    """echo: each choice is the prompt then the completion (token ids as their text), streamed or not."""
    live, llm = plain
    body = {"model": llm.model_name, "prompt": "The pass key is", "max_tokens": 5, "temperature": 0}
    alone = _send(live, COMPLETIONS, body).json()["choices"][0]["text"]
    assert _send(live, COMPLETIONS, {**body, "echo": True}).json()["choices"][0]["text"] == "The pass key is" + alone
    ids = llm.encode("The pass key is")
    by_ids = _send(live, COMPLETIONS, {**body, "prompt": ids, "echo": True, "n": 2}).json()["choices"]
    assert [c["text"] for c in by_ids] == [llm.tokenizer.decode(ids) + alone] * 2
    streamed = _send(live, COMPLETIONS, {**body, "echo": True, "stream": True}).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "The pass key is" + alone


def test_include_reasoning_encrypted_content_is_recorded():
    """include 'reasoning.encrypted_content' parses and sets wants_encrypted_reasoning; other values do not."""
    body = {"model": "m", "input": "x", "include": ["reasoning.encrypted_content"], "store": False}
    assert P.parse_request(R.ResponsesRequest, json.dumps(body).encode()).wants_encrypted_reasoning
    body["include"] = ["message.output_text.logprobs"]
    assert not P.parse_request(R.ResponsesRequest, json.dumps(body).encode()).wants_encrypted_reasoning
    with pytest.raises(P.APIError, match="include") as err:
        P.parse_request(R.ResponsesRequest, json.dumps({**body, "include": ["everything"]}).encode())
    assert err.value.param == "include.0"


# ---- on the harmony model -------------------------------------------------------------------------------------

ANSWER = (
    "<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>Sunny day.<|return|>"
)


def _prompts_of(llm, monkeypatch) -> list[list[int]]:
    """The prompt ids of every request the engine adds from now on (the server prepares them)."""
    seen: list[list[int]] = []
    add = llm.add_request

    def spy(prompt, sampling=None, **kwargs):
        seen.append(list(prompt.token_ids))
        return add(prompt, sampling, **kwargs)

    monkeypatch.setattr(llm, "add_request", spy)
    return seen


def test_minimal_effort_renders_low(harmony, monkeypatch):
    """reasoning_effort 'minimal' (chat) and reasoning.effort 'minimal' (responses) render the prompt of
    'low', the nearest gpt-oss effort, and the Response says 'low'."""
    from gptoss_lite.harmony.render import render

    live, llm, state = harmony
    seen = _prompts_of(llm, monkeypatch)
    messages = [{"role": "user", "content": "Hi"}]
    chat = {"model": llm.model_name, "messages": messages, "max_tokens": 2, "reasoning_effort": "minimal"}
    assert _send(live, CHAT, chat).status_code == 200
    r = _send(
        live,
        RESPONSES,
        {"model": llm.model_name, "input": "Hi", "max_output_tokens": 2, "reasoning": {"effort": "none"}},
    )
    assert r.json()["reasoning"]["effort"] == "low"
    low = render(state.harmony.encoding, messages, effort="low")
    assert seen == [low, low] and low != render(state.harmony.encoding, messages, effort="medium")


def test_legacy_functions_are_tools(harmony, monkeypatch):
    """functions / function_call render as tools / tool_choice, a legacy function_call and function
    message in the history as a tool call and its result, and {"name": X} forces a call to X."""
    live, llm, _ = harmony
    seen = _prompts_of(llm, monkeypatch)
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    legacy = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    modern = [
        legacy[0],
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": call}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    base = {"model": llm.model_name, "max_tokens": 2}
    tools = {"tools": [{"type": "function", "function": WEATHER}], "tool_choice": "auto"}
    assert (
        _send(live, CHAT, {**base, "messages": legacy, "functions": [WEATHER], "function_call": "auto"}).status_code
        == 200
    )
    assert _send(live, CHAT, {**base, "messages": modern, **tools}).status_code == 200
    assert seen[0] == seen[1]
    named = {
        **base,
        "max_tokens": 40,
        "messages": legacy[:1],
        "functions": [WEATHER],
        "function_call": {"name": "get_weather"},
    }
    message = _send(live, CHAT, named).json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    r = _send(live, CHAT, {**named, **tools})
    assert r.status_code == 400 and r.json()["error"]["param"] == "functions", r.text


def test_responses_logprobs_cover_the_message_text_only(harmony):
    """On a harmony answer, the output_text logprobs are those of the final message's tokens: their text
    joins to output_text, without the chain of thought or the control tokens."""
    from harmony_fixture import tokens_of

    live, llm, state = harmony
    llm.script(tokens_of(state.harmony.encoding, ANSWER))
    body = {"model": llm.model_name, "input": "Weather?", "top_logprobs": 1}
    out = _send(live, RESPONSES, body).json()
    assert [o["type"] for o in out["output"]] == ["reasoning", "message"]
    logprobs = out["output"][1]["content"][0]["logprobs"]
    assert "".join(e["token"] for e in logprobs) == out["output_text"] == "Sunny day."
    assert all(len(e["top_logprobs"]) == 1 for e in logprobs)
