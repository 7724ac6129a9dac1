"""Clients this project did not write, driving the server as their users do (test extras, offline).

- the OpenAI Agents SDK: an agent with one function tool, through both of its model classes
  (`OpenAIResponsesModel`, `OpenAIChatCompletionsModel`), streamed and not. The first turn is forced
  with `tool_choice="required"`; the SDK runs the tool and sends its output back, and the server
  answers that turn. The model is the random harmony test model: its forced call is whole (the
  tool's schema is an enum, which the grammar closes), and the answer turn is scripted (a chain of
  thought, then a final message). Left free, the random model writes to `max_tokens`: the server
  answers an honest `incomplete`, which the SDK's Responses model reports as such;
- LangChain's `ChatOpenAI` with the same tool, bound strict (a schema without
  `additionalProperties: false` lets a random model add keys until `max_tokens`) and forced, then the
  tool's answer sent back.

Each request the engine gets is recorded, so a test checks what the server *rendered* from what the
client sent: the tool's output is in the second prompt, as openai-harmony renders it. Where a client
sends a field this server refuses, the client raises and the test fails naming it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from harmony_fixture import WEATHER_ANSWER, harmony_server, tokens_of

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")
harmony = pytest.importorskip("openai_harmony")

CITIES = ("Paris", "Tokyo")
MAX_TOKENS = 24  # the free answer of a random model stops here: `incomplete`, not an error
ANSWER = WEATHER_ANSWER  # the answer turn: a chain of thought, then "Sunny."


@pytest.fixture(scope="module")
def served():
    with harmony_server(max_running=4) as server:
        yield server


def _decoded(state, ids: list[int]) -> str:
    return state.harmony.encoding.decode(ids)


def _tool_output_rendered(state, prompt_ids: list[int], output: str) -> bool:
    """Whether the prompt holds the tool's output as openai-harmony renders a tool's message (from
    `functions.get_weather` to the assistant, on `commentary`)."""
    author = harmony.Author.new(harmony.Role.TOOL, "functions.get_weather")
    message = harmony.Message.from_author_and_content(author, output).with_channel("commentary")
    rendered = state.harmony.encoding.render(message.with_recipient("assistant"))
    n = len(rendered)
    return any(prompt_ids[i : i + n] == rendered for i in range(len(prompt_ids) - n + 1))


def _weather_agent(model, ran: list[str]):
    @agents.function_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """Current weather in a city."""
        ran.append(city)
        return f"sunny in {city}"

    return agents.Agent(
        name="weather",
        instructions="Answer briefly.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS),
    )


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("model_class", ["OpenAIResponsesModel", "OpenAIChatCompletionsModel"])
def test_agents_sdk_runs_a_function_tool_and_gets_an_answer(served, model_class, stream):
    llm, state, live = served
    agents.set_tracing_disabled(True)  # tracing would post to OpenAI: offline, and not ours to test
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    model = getattr(agents, model_class)(model=llm.model_name, openai_client=client)
    ran: list[str] = []
    agent = _weather_agent(model, ran)
    first_request = len(llm.prompts)
    llm.script([], tokens_of(state.harmony.encoding, ANSWER))  # the first turn free (forced by tool_choice)

    async def run():
        if not stream:
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
        result = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        async for _ in result.stream_events():
            pass
        return result

    try:
        result = asyncio.run(run())
    except openai.BadRequestError as exc:  # a field the server refuses: name it
        pytest.fail(f"{model_class} (stream={stream}): the server refused the SDK's request: {exc.message}")
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds
    assert len(ran) == 1 and ran[0] in CITIES  # the SDK parsed the forced call and ran the tool
    assert kinds[-1] == "MessageOutputItem" and result.final_output == "Sunny."
    prompts = llm.prompts[first_request:]
    assert len(prompts) == 2, "one request for the call, one for the answer"
    assert _tool_output_rendered(state, prompts[1], f"sunny in {ran[0]}")
    assert "Weather in Paris?" in _decoded(state, prompts[1])


def test_agents_sdk_hears_an_honest_incomplete_from_a_length_cut_turn(served):
    """Unscripted, the answer turn runs to max_tokens. The server answers `status: incomplete`,
    `incomplete_details.reason: max_output_tokens` (a 200, not an error status); the SDK's Responses
    model stops the run with its own ModelBehaviorError that says so."""
    llm, state, live = served
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    ran: list[str] = []
    agent = _weather_agent(agents.OpenAIResponsesModel(model=llm.model_name, openai_client=client), ran)
    with pytest.raises(agents.exceptions.ModelBehaviorError, match="max_output_tokens"):
        asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=3))
    assert len(ran) == 1  # the tool ran; the cut came in the answer turn


def test_langchain_chat_openai_calls_the_tool_and_reads_its_answer(served):
    lc_openai = pytest.importorskip("langchain_openai")
    messages_mod = pytest.importorskip("langchain_core.messages")
    tools_mod = pytest.importorskip("langchain_core.tools")
    llm, state, live = served

    @tools_mod.tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    chat = lc_openai.ChatOpenAI(
        model=llm.model_name, base_url=f"{live.url}/v1", api_key="unused", max_tokens=MAX_TOKENS, max_retries=0
    )
    first_request = len(llm.prompts)
    history = [messages_mod.HumanMessage("Weather in Paris?")]
    try:
        called = chat.bind_tools([get_weather], tool_choice="required", strict=True).invoke(history)
        assert len(called.tool_calls) == 1, called
        call = called.tool_calls[0]
        assert call["name"] == "get_weather" and call["args"]["city"] in CITIES
        history += [called, messages_mod.ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
        answer = chat.bind_tools([get_weather], strict=True).invoke(history)
    except openai.BadRequestError as exc:
        pytest.fail(f"ChatOpenAI: the server refused LangChain's request: {exc.message}")
    assert isinstance(answer.content, str)
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    prompts = llm.prompts[first_request:]
    assert len(prompts) == 2
    assert _tool_output_rendered(state, prompts[1], f"sunny in {call['args']['city']}")


# ---- a Codex-style stateless exchange ------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Run a command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    }
]


def _call(thought: str, cmd: str) -> str:
    return (
        f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant<|channel|>commentary "
        f'to=functions.shell <|constrain|>json<|message|>{{"cmd": "{cmd}"}}<|call|>'
    )


def _contains(prompt_ids: list[int], part: list[int]) -> bool:
    n = len(part)
    return any(prompt_ids[i : i + n] == part for i in range(len(prompt_ids) - n + 1))


def test_codex_style_stateless_exchange_carries_the_chain_of_thought(served):
    """store: false and include: ["reasoning.encrypted_content"], three tool turns. The client sends
    back each reasoning item with its sealed content only (no readable text, as Codex does), and every
    next prompt holds the earlier thoughts as openai-harmony renders an analysis message."""
    from harmony_fixture import tokens_of

    llm, state, live = served
    c = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    encoding = state.harmony.encoding
    thoughts = ["First list the files.", "Now read the README.", "Then count its lines."]
    commands = ["ls", "cat README.md", "wc -l README.md"]
    items: list[dict] = [{"type": "message", "role": "user", "content": "How long is the README?"}]
    for turn, (thought, cmd) in enumerate(zip(thoughts, commands)):
        llm.script(tokens_of(encoding, _call(thought, cmd)))
        out = c.responses.create(
            model=llm.model_name,
            input=items,
            tools=TOOLS,
            store=False,
            include=["reasoning.encrypted_content"],
            instructions="You are a coding agent.",
        )
        prompt = llm.prompts[-1]
        for earlier in thoughts[:turn]:
            analysis = harmony.Message.from_role_and_content(harmony.Role.ASSISTANT, earlier).with_channel("analysis")
            assert _contains(prompt, encoding.render(analysis)), (turn, earlier)
        reasoning, call = out.output
        assert reasoning.type == "reasoning" and reasoning.encrypted_content
        assert call.type == "function_call" and json.loads(call.arguments) == {"cmd": cmd}
        sent_back = reasoning.model_dump(exclude_none=True)
        sent_back.pop("content", None)  # only the sealed copy goes back
        items += [
            sent_back,
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": f"output of {cmd}"},
        ]
    # One byte changed in a sealed item is a 400 naming the input.
    sealed = items[1]["encrypted_content"]
    flipped = sealed[:10] + ("A" if sealed[10] != "A" else "B") + sealed[11:]
    with pytest.raises(openai.BadRequestError) as refused:
        c.responses.create(model=llm.model_name, input=[items[0], {**items[1], "encrypted_content": flipped}])
    assert refused.value.body["param"] == "input"
