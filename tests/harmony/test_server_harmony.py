"""A harmony model served end to end: the real engine on a random-weight gpt-oss-tiny with the real
gpt-oss vocabulary, driven by scripted token streams (its own outputs are random), and the official
`openai` client."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import httpx
import pytest
from harmony_fixture import harmony_server, tokens_of
from test_parse import fuzzed_stream

from gptoss_lite.harmony.render import render

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
FLIGHTS = {
    "type": "function",
    "function": {
        "name": "find_flight",
        "description": "A flight",
        "parameters": {"type": "object", "properties": {"to": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def served():
    with harmony_server() as server:
        yield server


@pytest.fixture
def client(served):
    _, _, live = served
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def script(served, text: str) -> None:
    llm, state, _ = served
    llm.script(tokens_of(state.harmony.encoding, text))


def call_turn(reasoning: str, name: str, args: dict) -> str:
    return (
        f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>commentary "
        f"to=functions.{name} <|constrain|>json<|message|>{json.dumps(args)}<|call|>"
    )


def test_a_gpt_oss_tokenizer_makes_a_harmony_server(served):
    _, state, _ = served
    assert state.harmony is not None


def test_two_tool_turns_then_an_answer_through_the_openai_client(served, client):
    llm, state, _ = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris? Then fly."}]
    tools = [WEATHER, FLIGHTS]

    script(served, call_turn("Need weather.", "get_weather", {"city": "Paris"}))
    first = client.chat.completions.create(model=llm.model_name, messages=messages, tools=tools, max_tokens=100)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "Need weather."
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert not choice.message.content
    expected_prompt = render(state.harmony.encoding, messages, tools=tools)
    assert first.usage.prompt_tokens == len(expected_prompt)  # the date is today's on both sides

    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    script(served, call_turn("Now a flight.", "find_flight", {"to": "CDG"}))
    second = client.chat.completions.create(model=llm.model_name, messages=messages, tools=tools, max_tokens=100)
    call2 = second.choices[0].message.tool_calls[0]
    assert call2.function.name == "find_flight"

    messages += [second.choices[0].message, {"role": "tool", "tool_call_id": call2.id, "content": "AF1"}]
    script(
        served,
        "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>Clear; AF1.<|return|>",
    )
    third = client.chat.completions.create(model=llm.model_name, messages=messages, tools=tools, max_tokens=100)
    answer = third.choices[0]
    assert (answer.message.content, answer.finish_reason) == ("Clear; AF1.", "stop")
    assert answer.message.model_extra["reasoning_content"] == "Done."
    assert not answer.message.tool_calls

    # The whole history, answers included, goes back once more without a template error.
    messages += [answer.message, {"role": "user", "content": "Thanks"}]
    script(served, "<|channel|>final<|message|>Bye.<|return|>")
    fourth = client.chat.completions.create(model=llm.model_name, messages=messages, tools=tools, max_tokens=100)
    assert fourth.choices[0].message.content == "Bye."


def test_streamed_deltas_join_to_the_whole_message(served, client):
    llm, _, _ = served
    text = call_turn("Thinking about Zürich…", "get_weather", {"city": "Zürich"})
    messages = [{"role": "user", "content": "Weather?"}]
    script(served, text)
    whole = client.chat.completions.create(model=llm.model_name, messages=messages, tools=[WEATHER], max_tokens=100)
    script(served, text)
    reasoning, content, calls, reasons = "", "", {}, []
    stream = client.chat.completions.create(
        model=llm.model_name, messages=messages, tools=[WEATHER], max_tokens=100, stream=True
    )
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                entry = calls.setdefault(piece.index, {"name": None, "arguments": ""})
                if piece.function.name:
                    entry["name"] = piece.function.name
                entry["arguments"] += piece.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    message = whole.choices[0].message
    assert reasoning == message.model_extra["reasoning_content"] == "Thinking about Zürich…"
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    assert reasons == ["tool_calls"] == [whole.choices[0].finish_reason]


def test_tool_choice_required_and_named_are_enforced(served, client):
    """No script: the random model would never call a tool by itself; the server makes it."""
    llm, _, _ = served
    messages = [{"role": "user", "content": "Anything."}]
    for choice, names in (
        ("required", {"get_weather", "find_flight"}),
        ({"type": "function", "function": {"name": "find_flight"}}, {"find_flight"}),
    ):
        out = client.chat.completions.create(
            model=llm.model_name, messages=messages, tools=[WEATHER, FLIGHTS], tool_choice=choice, max_tokens=30
        )
        calls = out.choices[0].message.tool_calls
        assert calls, out.choices[0]
        assert calls and calls[0].function.name in names


def test_tool_choice_none_hides_the_tools(served, client):
    llm, state, _ = served
    messages = [{"role": "user", "content": "Hi"}]
    script(served, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{}<|call|>")
    out = client.chat.completions.create(
        model=llm.model_name, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=40
    )
    assert out.usage.prompt_tokens == len(render(state.harmony.encoding, messages))  # no tools rendered
    assert not out.choices[0].message.tool_calls and out.choices[0].message.content == "{}"


def test_reasoning_effort_reaches_the_system_message(served, client):
    llm, state, _ = served
    messages = [{"role": "user", "content": "Hi"}]
    for effort in ("low", "high"):
        script(served, "<|channel|>final<|message|>ok<|return|>")
        out = client.chat.completions.create(
            model=llm.model_name, messages=messages, reasoning_effort=effort, max_tokens=10
        )
        assert out.usage.prompt_tokens == len(render(state.harmony.encoding, messages, effort=effort))
    enc = state.harmony.encoding
    assert "Reasoning: low" in enc.decode(render(enc, messages, effort="low"))


def test_bad_tool_requests_are_400_naming_the_field(served):
    llm, _, live = served
    base = {"model": llm.model_name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "tool_call_id": "missing", "content": "1"}]}, "messages"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ]
    for extra, param in cases:
        r = httpx.post(f"{live.url}/v1/chat/completions", json={**base, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param


def fuzz_server(served, count: int) -> int:
    """Send `count` chats, one at a time, whose completions are fuzzed token streams (half of them
    streamed); every answer must be a 200 that ends properly. Returns how many fell back to content."""
    llm, state, live = served
    rng = random.Random(count)
    before = state.metrics.harmony_malformed._value.get()
    base = {"model": llm.model_name, "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    with httpx.Client(base_url=live.url, timeout=120) as http:
        for i in range(count):
            tokens = fuzzed_stream(rng)
            llm.script(tokens)  # taken by the next request the engine adds: this one
            body = {**base, "max_tokens": len(tokens), "stream": i % 2 == 1}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            if body["stream"]:
                assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
        assert http.get("/health").json()["status"] == "ok"
        assert "gptoss_harmony_malformed_total" in http.get("/metrics").text
    return int(state.metrics.harmony_malformed._value.get() - before)


def test_fuzzed_token_streams_never_500_and_the_server_stays_healthy(served):
    assert fuzz_server(served, 60) > 0


@pytest.mark.slow
def test_ten_thousand_fuzzed_streams_through_the_server(served):
    """`pytest -s -m slow tests/harmony/test_server_harmony.py`: 10,000 fuzzed completions, one by one."""
    malformed = fuzz_server(served, 10_000)
    print(f"10,000 fuzzed streams: 0 non-200 answers, {malformed:,} fell back to content")
    assert malformed > 0


def test_the_playground_shows_reasoning_and_tool_calls(served):
    """The playground on a harmony model: the chain of thought streams into its own collapsible part,
    the answer into the message, and a tool call is shown as one."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from test_playground import playground

    _, _, live = served
    script(
        served,
        "<|channel|>analysis<|message|>Thinking it over.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Paris.<|return|>",
    )
    with playground(live.url, "gpt-oss-tiny", "chat", 60) as page:
        page.fill("#prompt", "Capital of France?")
        page.click("#send")
        page.wait_for_selector(".msg.assistant[data-done='true']", timeout=60_000)
        assert page.inner_text(".msg.assistant .body") == "Paris."
        assert page.text_content(".msg.assistant .reasoning") == "Thinking it over."
        assert page.get_attribute(".msg.assistant .thinking", "hidden") is None
        assert page.inner_text("#finish") == "stop"
        script(served, call_turn("Look it up.", "get_weather", {"city": "Paris"}))  # the history goes back too
        page.fill("#prompt", "Weather there?")
        page.click("#send")
        page.wait_for_function("document.querySelectorAll(\".msg.assistant[data-done='true']\").length == 2")
        assert page.inner_text(".msg.assistant:last-child .calls") == '→ get_weather({"city": "Paris"})'
        assert page.inner_text("#finish") == "tool_calls"
