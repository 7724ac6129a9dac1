"""MCP servers' tools inside /v1/responses: an MCP server started here (the `mcp` SDK's MCPServer, the
FastMCP of mcp 1.x, over streamable HTTP on 127.0.0.1) is listed, declared, and called end to end."""

from __future__ import annotations

import asyncio

import pytest
from harmony_fixture import harmony_server, tokens_of

from gptoss_lite.server.background import BackgroundServer

openai = pytest.importorskip("openai")
harmony = pytest.importorskip("openai_harmony")
mcp_server = pytest.importorskip("mcp.server.mcpserver")

WEATHER = [{"type": "mcp", "server_label": "weather", "require_approval": "never"}]
CALL = (
    "<|channel|>analysis<|message|>Ask the weather server.<|end|>"
    '<|start|>assistant<|channel|>commentary to=weather.forecast <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
ANSWER = "<|channel|>final<|message|>Sunny in Paris.<|return|>"


def weather_server():
    server = mcp_server.MCPServer("weather")

    @server.tool()
    def forecast(city: str) -> str:
        """Tomorrow's forecast for a city."""
        return f"sunny in {city}"

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def boom() -> str:
        """Always fails."""
        raise RuntimeError("kaput")

    return server


@pytest.fixture(scope="module")
def mcp_url():
    with BackgroundServer(weather_server().streamable_http_app()) as live:
        yield f"{live.url}/mcp"


@pytest.fixture(scope="module")
def served(mcp_url, tmp_path_factory):
    # No label: the server's own name ("weather") is read when the app starts.
    with harmony_server(max_running=2, tool_servers=[mcp_url], data_dir=tmp_path_factory.mktemp("data")) as server:
        yield server


def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def script(served, *texts):
    llm, state, _ = served
    llm.script(*(tokens_of(state.harmony.encoding, t) for t in texts))


def decoded(state, ids) -> str:
    return state.harmony.encoding.decode_utf8(ids)


def listed_tools(url: str) -> list:
    """The server's tools as the SDK's own client lists them (not through the server under test)."""
    from mcp import Client

    async def run():
        async with Client(url) as c:
            return (await c.list_tools()).tools

    return asyncio.run(run())


def test_the_servers_tools_render_as_a_namespace_named_after_its_label(served, mcp_url):
    """The prompt's developer message holds the server's tools as a harmony namespace `weather` (what
    DeveloperContent.with_tools(ToolNamespaceConfig) renders), and the output lists them first."""
    llm, state, live = served
    script(served, ANSWER)
    r = client(live).responses.create(model=llm.model_name, input="Weather?", tools=WEATHER)
    H = harmony
    tools = [H.ToolDescription.new(t.name, t.description, parameters=t.input_schema) for t in listed_tools(mcp_url)]
    namespace = H.ToolNamespaceConfig(name="weather", description=None, tools=tools)
    developer = H.DeveloperContent.new().with_tools(namespace)
    prompt = decoded(state, llm.prompts[-1])
    date = prompt.split("Current date: ")[1][:10]
    system = H.SystemContent.new().with_reasoning_effort(H.ReasoningEffort.MEDIUM).with_conversation_start_date(date)
    convo = H.Conversation.from_messages(
        [
            H.Message.from_role_and_content(H.Role.SYSTEM, system),
            H.Message.from_role_and_content(H.Role.DEVELOPER, developer),
            H.Message.from_role_and_content(H.Role.USER, "Weather?"),
        ]
    )
    assert llm.prompts[-1] == state.harmony.encoding.render_conversation_for_completion(convo, H.Role.ASSISTANT)
    assert "namespace weather {" in prompt and "type forecast = (_: {" in prompt
    assert [o.type for o in r.output] == ["mcp_list_tools", "message"]
    assert r.output[0].server_label == "weather"
    assert [t.name for t in r.output[0].tools] == ["forecast", "add", "boom"]


def test_a_call_runs_on_the_server_and_the_next_turn_renders_it(served):
    """The model's call to weather.forecast runs on the MCP server: an mcp_call item with its output,
    the tool message in the next round's prompt, and, continued by previous_response_id, the call and
    its answer rendered again (they are on commentary, which harmony keeps)."""
    llm, state, live = served
    c = client(live)
    script(served, CALL, ANSWER)
    before = len(llm.prompts)
    r = c.responses.create(model=llm.model_name, input="Weather in Paris?", tools=WEATHER)
    assert [o.type for o in r.output] == ["mcp_list_tools", "reasoning", "mcp_call", "message"]
    call = r.output[2]
    assert (call.server_label, call.name, call.arguments) == ("weather", "forecast", '{"city": "Paris"}')
    assert (call.status, call.output, call.error) == ("completed", "sunny in Paris", None)
    result = "<|start|>weather.forecast to=assistant<|channel|>commentary<|message|>sunny in Paris<|end|>"
    assert len(llm.prompts) == before + 2 and result in decoded(state, llm.prompts[-1])
    script(served, ANSWER)
    c.responses.create(model=llm.model_name, input="And tomorrow?", tools=WEATHER, previous_response_id=r.id)
    again = decoded(state, llm.prompts[-1])
    header = "<|start|>assistant to=weather.forecast<|channel|>commentary <|constrain|>json<|message|>"
    assert header + '{"city": "Paris"}<|call|>' + result in again
    # The same conversation sent back as items (a stateless client) renders the same prompt.
    script(served, ANSWER)
    items = [{"role": "user", "content": "Weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in r.output]]
    items.append({"role": "user", "content": "And tomorrow?"})
    c.responses.create(model=llm.model_name, input=items, tools=WEATHER, store=False)
    assert llm.prompts[-1] == llm.prompts[-2]


def test_streamed_mcp_events(served):
    """Streamed: the list's and the call's events, in order, and the same items as a whole response."""
    llm, _, live = served
    script(served, CALL, ANSWER)
    with client(live).responses.stream(model=llm.model_name, input="Weather?", tools=WEATHER) as stream:
        kinds = [event.type for event in stream if "mcp" in event.type]
        final = stream.get_final_response()
    assert kinds == [
        "response.mcp_list_tools.in_progress",
        "response.mcp_list_tools.completed",
        "response.mcp_call.in_progress",
        "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done",
        "response.mcp_call.completed",
    ]
    assert [o.type for o in final.output] == ["mcp_list_tools", "reasoning", "mcp_call", "message"]
    assert final.output[2].output == "sunny in Paris"


def test_a_tool_that_raises_is_a_failed_call_the_model_reads(served):
    """A tool that raises on the MCP server: the mcp_call is failed with the server's error, the model
    reads it, and the response completes (no 5xx)."""
    llm, state, live = served
    boom = "<|channel|>commentary to=weather.boom <|constrain|>json<|message|>{}<|call|>"
    script(served, boom, ANSWER)
    r = client(live).responses.create(model=llm.model_name, input="Boom?", tools=WEATHER)
    assert r.status == "completed"
    call = r.output[1]
    assert (call.type, call.status, call.error.type) == ("mcp_call", "failed", "mcp_tool_execution_error")
    assert "<|start|>weather.boom to=assistant<|channel|>commentary<|message|>Error executing tool boom" in decoded(
        state, llm.prompts[-1]
    )


def test_allowed_tools_limit_what_is_declared_and_run(served):
    """allowed_tools: only those are declared and listed; a call to another is a failed call, not run."""
    llm, state, live = served
    tools = [{**WEATHER[0], "allowed_tools": ["add"]}]
    script(served, CALL, ANSWER)
    r = client(live).responses.create(model=llm.model_name, input="Weather?", tools=tools)
    assert [t.name for t in r.output[0].tools] == ["add"]
    assert "type forecast" not in decoded(state, llm.prompts[-2])
    assert r.output[2].status == "failed" and "not one of the tools" in r.output[2].error.message


@pytest.mark.parametrize(
    "tool, match",
    [
        ({"server_url": "http://127.0.0.1:1/mcp"}, "server_url: this server only uses the tool servers"),
        ({"require_approval": "always"}, "require_approval: approvals are not served"),
        ({"headers": {"Authorization": "Bearer x"}}, "headers: tool servers are reached with the server's own"),
        ({"server_label": "nope"}, "no tool server is labelled 'nope'; this server has 'weather'"),
    ],
)
def test_mcp_requests_the_server_does_not_serve_are_a_400(served, tool, match):
    """A URL the client names is never connected to; approvals and client headers are refused by name."""
    llm, _, live = served
    with pytest.raises(openai.BadRequestError, match=match) as err:
        client(live).responses.create(model=llm.model_name, input="Hi", tools=[{**WEATHER[0], **tool}])
    assert err.value.body["param"] == "tools"


def test_a_labelled_server_that_is_down_is_a_503_naming_tools(tmp_path):
    """A labelled tool server that cannot be reached does not stop the start; a request that enables
    it is a 503 naming `tools` (and one that does not is answered)."""
    down = "down=http://127.0.0.1:9/mcp"  # the discard port: nothing listens there
    with harmony_server(max_running=1, tool_servers=[down], data_dir=tmp_path) as (llm, state, live):
        tools = [{"type": "mcp", "server_label": "down", "require_approval": "never"}]
        with pytest.raises(openai.APIStatusError, match="the tool server http://127.0.0.1:9/mcp") as err:
            client(live).responses.create(model=llm.model_name, input="Hi", tools=tools)
        assert err.value.status_code == 503 and err.value.body["param"] == "tools"
        llm.script(tokens_of(state.harmony.encoding, ANSWER))
        assert client(live).responses.create(model=llm.model_name, input="Hi").output_text == "Sunny in Paris."
