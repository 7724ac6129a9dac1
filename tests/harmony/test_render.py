"""OpenAI chat messages render exactly as the same conversation written directly in openai-harmony.

Each case is a pair: the chat the server receives, and the harmony messages it stands for, written
out by hand with openai-harmony's own types (the reference). The prompt ids must be identical."""

from __future__ import annotations

import itertools
import json

import pytest
from harmony_fixture import tokenizer_json

oh = pytest.importorskip("openai_harmony")
from openai_harmony import (  # noqa: E402
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from gptoss_lite.harmony.render import RenderError, conversation, render  # noqa: E402
from gptoss_lite.harmony.vocabulary import load_encoding  # noqa: E402

DATE = "2026-12-01"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {  # nested objects, arrays and defaults: the namespace renderer's harder cases
    "type": "function",
    "function": {
        "name": "search_flights",
        "description": "Find flights",
        "parameters": {
            "type": "object",
            "properties": {
                "route": {
                    "type": "object",
                    "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
                    "required": ["from", "to"],
                },
                "passengers": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"age": {"type": "integer"}}},
                },
                "max_stops": {"type": "integer", "default": 1},
            },
            "required": ["route"],
        },
    },
}
NO_PARAMS = {"type": "function", "function": {"name": "now", "description": "The time"}}


def _tool_descs(tools):
    return [
        ToolDescription.new(
            t["function"]["name"], t["function"].get("description", ""), parameters=t["function"].get("parameters")
        )
        for t in tools
    ]


def _system(effort: str):
    content = (
        SystemContent.new()
        .with_reasoning_effort(ReasoningEffort(effort.capitalize()))
        .with_conversation_start_date(DATE)
    )
    return Message.from_role_and_content(Role.SYSTEM, content)


def _developer(instructions: str | None, tools):
    dev = DeveloperContent.new()
    if instructions:
        dev = dev.with_instructions(instructions)
    if tools:
        dev = dev.with_function_tools(_tool_descs(tools))
    return Message.from_role_and_content(Role.DEVELOPER, dev)


def A(text, channel):  # noqa: N802 - reads as the message kind
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def CALL(name, args):  # noqa: N802
    msg = Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
    return msg.with_recipient(f"functions.{name}").with_content_type("<|constrain|>json")


def RESULT(name, text):  # noqa: N802
    author = Author.new(Role.TOOL, f"functions.{name}")
    return Message.from_author_and_content(author, text).with_channel("commentary").with_recipient("assistant")


def U(text):  # noqa: N802
    return Message.from_role_and_content(Role.USER, text)


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# (name, chat messages, harmony messages after system/developer, instructions, tools)
SCENARIOS = [
    ("plain", [{"role": "user", "content": "Hi"}], [U("Hi")], None, []),
    (
        "system prompt",
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
        [U("Hi")],
        "You are terse.",
        [],
    ),
    (
        "system and developer",
        [
            {"role": "system", "content": "Be kind."},
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        ],
        [U("Hello there")],
        "Be kind.\n\nAnswer in French.",
        [],
    ),
    (
        "multi-turn with earlier reasoning (dropped after its final)",
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
            {"role": "user", "content": "And 3+3?"},
        ],
        [U("2+2?"), A("Add them.", "analysis"), A("4", "final"), U("And 3+3?")],
        None,
        [],
    ),
    (
        "reasoning under vLLM's field name",
        [
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "Because.", "reasoning": "Think."},
            {"role": "user", "content": "Sure?"},
        ],
        [U("Why?"), A("Think.", "analysis"), A("Because.", "final"), U("Sure?")],
        None,
        [],
    ),
    (
        "tool chain in progress (its chain of thought kept)",
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Need the weather tool.",
                "tool_calls": [call("c1", "get_weather", {"city": "Paris"})],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
        ],
        [
            U("Weather in Paris?"),
            A("Need the weather tool.", "analysis"),
            CALL("get_weather", json.dumps({"city": "Paris"})),
            RESULT("get_weather", '{"temp": 21}'),
        ],
        None,
        [WEATHER],
    ),
    (
        "two tool turns, then a final answer, then a new question",
        [
            {"role": "user", "content": "Weather in Paris and a flight there?"},
            {
                "role": "assistant",
                "reasoning_content": "Weather first.",
                "tool_calls": [call("a", "get_weather", {"city": "Paris"})],
            },
            {"role": "tool", "tool_call_id": "a", "content": "sunny"},
            {
                "role": "assistant",
                "reasoning_content": "Now flights.",
                "tool_calls": [call("b", "search_flights", {"route": {"from": "NYC", "to": "PAR"}})],
            },
            {"role": "tool", "tool_call_id": "b", "content": "AF7"},
            {"role": "assistant", "content": "Sunny; take AF7.", "reasoning_content": "Summarise."},
            {"role": "user", "content": "Thanks. Tomorrow?"},
        ],
        [
            U("Weather in Paris and a flight there?"),
            A("Weather first.", "analysis"),
            CALL("get_weather", json.dumps({"city": "Paris"})),
            RESULT("get_weather", "sunny"),
            A("Now flights.", "analysis"),
            CALL("search_flights", json.dumps({"route": {"from": "NYC", "to": "PAR"}})),
            RESULT("search_flights", "AF7"),
            A("Summarise.", "analysis"),
            A("Sunny; take AF7.", "final"),
            U("Thanks. Tomorrow?"),
        ],
        None,
        [WEATHER, SEARCH],
    ),
    (
        "parallel calls with a preamble, results by id",
        [
            {"role": "user", "content": "Paris and Rome?"},
            {
                "role": "assistant",
                "content": "Checking both.",
                "tool_calls": [call("p", "get_weather", {"city": "Paris"}), call("r", "get_weather", {"city": "Rome"})],
            },
            {"role": "tool", "tool_call_id": "p", "content": "rain"},
            {"role": "tool", "tool_call_id": "r", "content": "sun"},
        ],
        [
            U("Paris and Rome?"),
            A("Checking both.", "commentary"),
            CALL("get_weather", json.dumps({"city": "Paris"})),
            CALL("get_weather", json.dumps({"city": "Rome"})),
            RESULT("get_weather", "rain"),
            RESULT("get_weather", "sun"),
        ],
        None,
        [WEATHER],
    ),
    (
        "a tool without parameters, a result named by `name`",
        [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "tool_calls": [call("t", "now", {})]},
            {"role": "tool", "name": "now", "content": "12:00"},
        ],
        [U("Time?"), CALL("now", "{}"), RESULT("now", "12:00")],
        "Use tools.",
        [NO_PARAMS, WEATHER],
    ),
    (
        "a later system message stays in place",
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "system", "content": "Now be brief."},
            {"role": "user", "content": "Bye"},
        ],
        [
            U("Hi"),
            A("Hello", "final"),
            Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Now be brief.")),
            U("Bye"),
        ],
        None,
        [],
    ),
]
EFFORTS = ("low", "medium", "high")
CASES = list(itertools.product(SCENARIOS, EFFORTS))


@pytest.fixture(scope="module")
def encoding():
    return load_encoding(tokenizer_json())


def test_cases_cover_the_acceptance_list():
    assert len(CASES) >= 30


@pytest.mark.parametrize(("scenario", "effort"), CASES, ids=[f"{s[0]}-{e}" for s, e in CASES])
def test_render_matches_openai_harmony(encoding, scenario, effort):
    _, chat, body, instructions, tools = scenario
    reference = [_system(effort)]
    if instructions or tools:
        reference.append(_developer(instructions, tools))
    expected = encoding.render_conversation_for_completion(Conversation.from_messages(reference + body), Role.ASSISTANT)
    got = render(encoding, chat, tools=tools or None, effort=effort, date=DATE)
    assert encoding.decode(got) == encoding.decode(expected)
    assert got == expected


def test_the_released_system_message(encoding):
    """The text gpt-oss was trained on, spelt out once."""
    text = encoding.decode(render(encoding, [{"role": "user", "content": "Hi"}], effort="high", date=DATE))
    assert text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2026-12-01\n\nReasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message."
        "<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant"
    )


def test_earlier_chain_of_thought_is_dropped_after_a_final(encoding):
    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "SECRET-THOUGHT"},
        {"role": "user", "content": "c"},
    ]
    assert "SECRET-THOUGHT" not in encoding.decode(render(encoding, chat, date=DATE))
    in_chain = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "reasoning_content": "KEEP-THOUGHT", "tool_calls": [call("x", "now", {})]},
        {"role": "tool", "tool_call_id": "x", "content": "1"},
    ]
    assert "KEEP-THOUGHT" in encoding.decode(render(encoding, in_chain, tools=[NO_PARAMS], date=DATE))


@pytest.mark.parametrize(
    ("chat", "tools", "effort", "param", "words"),
    [
        ([{"role": "tool", "tool_call_id": "nope", "content": "1"}], None, "medium", "messages", "tool_call_id"),
        ([{"role": "user", "content": "x"}], [{"type": "code_interpreter"}], "medium", "tools", "function"),
        (
            [{"role": "user", "content": "x"}],
            [{"type": "function", "function": {"name": "bad name"}}],
            "medium",
            "tools",
            "name",
        ),
        ([{"role": "user", "content": "x"}], [NO_PARAMS, NO_PARAMS], "medium", "tools", "two tools"),
        ([{"role": "user", "content": "x"}], None, "extreme", "reasoning_effort", "low, medium, high"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], None, "medium", "messages", "text parts"),
    ],
)
def test_what_harmony_cannot_express_is_a_named_error(chat, tools, effort, param, words):
    with pytest.raises(RenderError, match=words) as caught:
        conversation(chat, tools=tools, effort=effort, date=DATE)
    assert caught.value.param == param


def test_a_json_schema_adds_a_response_formats_section(encoding):
    """openai-harmony has no field for it: the expected prompt is the developer message as plain text."""
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}}
    rf = {"type": "json_schema", "json_schema": {"name": "shopping_list", "description": "entries", "schema": schema}}
    section = (
        "# Response Formats\n\n## shopping_list\n\n// entries\n"
        '{"type":"object","properties":{"items":{"type":"array","items":{"type":"string"}}}}'
    )
    for instructions in ("You shop.", None):
        chat = [{"role": "system", "content": instructions}] if instructions else []
        chat.append({"role": "user", "content": "eggs"})
        text = f"# Instructions\n\n{instructions}\n\n{section}" if instructions else section
        developer = Message.from_role_and_content(Role.DEVELOPER, text)
        expected = encoding.render_conversation_for_completion(
            Conversation.from_messages([_system("medium"), developer, U("eggs")]), Role.ASSISTANT
        )
        assert render(encoding, chat, date=DATE, response_format=rf) == expected
    plain = [{"role": "user", "content": "x"}]
    assert render(encoding, plain, date=DATE, response_format={"type": "json_object"}) == render(
        encoding, plain, date=DATE
    )
