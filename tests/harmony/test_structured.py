"""Structured output: the grammar, not the model, makes the JSON (random-weight models throughout)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from harmony_fixture import harmony_server, tokens_of

from gptoss_lite.engine import LLM
from gptoss_lite.server import create_app
from gptoss_lite.server.background import BackgroundServer

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def plain():
    llm = LLM("lite-tiny", max_model_len=4096, max_running=16)
    with BackgroundServer(create_app(llm)) as live:
        yield llm, live


@pytest.fixture(scope="module")
def harmony():
    with harmony_server() as server:
        yield server


def concurrently(live, bodies: list[dict], path: str = "/v1/chat/completions") -> list[dict]:
    """POST every body, 16 at a time (so the engine batches them); the JSON answers in order."""
    with httpx.Client(base_url=live.url, timeout=300) as http, ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda body: http.post(path, json=body).json(), bodies))


def test_every_schema_answer_is_valid_on_a_model_without_harmony(plain):
    llm, live = plain
    bodies = [
        {
            "model": llm.model_name,
            "messages": [{"role": "user", "content": "A person, please."}],
            "max_tokens": 200,
            "seed": seed,
            "temperature": 1.0,
            "response_format": SCHEMA_FORMAT,
        }
        for seed in range(50)
    ]
    for answer in concurrently(live, bodies):
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_every_json_object_answer_is_an_object_on_a_model_without_harmony(plain):
    """json_object bounds nothing, so the random model's objects run long (up to about 1,400 tokens
    on these seeds); with room for them, 50 of 50 end, and each is a JSON object. (A completion cut
    by max_tokens would be a prefix of one: docs/server.md#structured-output.)"""
    llm, live = plain
    bodies = [
        {
            "model": llm.model_name,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4000,
            "seed": seed,
            "response_format": {"type": "json_object"},
        }
        for seed in range(50)
    ]
    for answer in concurrently(live, bodies):
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop", answer["usage"]
        assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_on_a_harmony_model_only_the_final_channel_is_constrained(harmony):
    llm, state, live = harmony
    enc = state.harmony.encoding
    before = state.metrics.harmony_malformed._value.get()
    prefix = "<|channel|>analysis<|message|>Free thought: {not json<|end|><|start|>assistant<|channel|>final<|message|>"
    llm.script(*[tokens_of(enc, prefix)] * 20)  # the same prefix for each: the order they are taken in is moot
    bodies = [
        {
            "model": llm.model_name,
            "messages": [{"role": "user", "content": "A person."}],
            "max_tokens": 200,
            "seed": seed,
            "response_format": SCHEMA_FORMAT,
        }
        for seed in range(20)
    ]
    for answer in concurrently(live, bodies):
        choice = answer["choices"][0]
        message = choice["message"]
        assert message["reasoning_content"] == "Free thought: {not json"
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(message["content"]), PERSON)
    assert state.metrics.harmony_malformed._value.get() == before  # 0 harmony parse errors


def test_responses_text_format_json_schema(harmony):
    llm, state, live = harmony
    llm.script(tokens_of(state.harmony.encoding, "<|channel|>final<|message|>"))
    body = {
        "model": llm.model_name,
        "input": "A person.",
        "max_output_tokens": 200,
        "text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    }
    out = httpx.post(f"{live.url}/v1/responses", json=body, timeout=120).json()
    jsonschema.validate(json.loads(out["output_text"]), PERSON)
    assert out["text"]["format"]["name"] == "person"


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema", "json_schema": "not an object"},
        {"type": "yaml"},
    ],
)
def test_a_schema_that_does_not_compile_is_a_400(plain, response_format):
    llm, live = plain
    body = {"model": llm.model_name, "messages": [{"role": "user", "content": "x"}], "response_format": response_format}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"


CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "forecast", "description": "Forecast", "parameters": CITY}}


def test_tool_arguments_follow_the_tool_schema(harmony):
    """tool_choice "required" forces the call's header; the grammar then makes its arguments valid
    JSON for the tool's schema, ending with <|call|> (a random model, no script)."""
    llm, state, live = harmony
    bodies = [
        {
            "model": llm.model_name,
            "messages": [{"role": "user", "content": "Forecast?"}],
            "tools": [TOOL],
            "tool_choice": "required",
            "max_tokens": 200,
            "seed": seed,
        }
        for seed in range(10)
    ]
    for answer in concurrently(live, bodies):
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)


def test_a_strict_tool_whose_schema_does_not_compile_is_a_400(harmony):
    llm, _, live = harmony
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}, "strict": True}}
    body = {"model": llm.model_name, "messages": [{"role": "user", "content": "x"}], "tools": [bad], "max_tokens": 4}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    bad["function"]["strict"] = False  # not strict: served, its arguments unconstrained
    assert httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
