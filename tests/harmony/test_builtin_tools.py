"""gpt-oss's built-in tools inside /v1/responses: the browser and python run by the server while the
scripted model answers, read back through the official client (docs/tools.md#serving-the-tools)."""

from __future__ import annotations

import json
import queue
import threading

import httpx
import pytest
from harmony_fixture import harmony_server, tokens_of

from gptoss_lite.harmony.render import BuiltinTools, render
from gptoss_lite.tools.python_tool import Limits, PythonToolPool, SandboxUnavailable

openai = pytest.importorskip("openai")
harmony = pytest.importorskip("openai_harmony")

BIG = "1267650600228229401496703205376"  # 2**100
PYTHON = [{"type": "code_interpreter", "container": {"type": "auto"}}]
BROWSER = [{"type": "web_search_preview"}]
DOCS = {
    "guide/install.md": "# Installing the server\n\nRun `pip install gptoss-lite`, then start it.\n",
    "guide/serve.txt": "Start the server with gptoss-lite serve. Stop it with Ctrl-C.\n",
    "notes.html": "<html><head><title>Release notes</title></head><body><h1>Release 0.1</h1></body></html>",
}
TOOL_TIMEOUT = 5.0  # seconds a call may take here: `while True: pass` ends within it


def python_call(code: str, thought: str = "Let me run it.") -> str:
    return (
        f"<|channel|>analysis<|message|>{thought}<|end|>"
        f"<|start|>assistant<|channel|>analysis to=python code<|message|>{code}<|call|>"
    )


def browser_call(function: str, arguments: dict) -> str:
    return f"<|channel|>analysis to=browser.{function} code<|message|>{json.dumps(arguments)}<|call|>"


def answer(text: str) -> str:
    return f"<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>{text}<|return|>"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    try:
        pool = PythonToolPool(max_interpreters=4, idle_seconds=600, limits=Limits(memory_bytes=1 << 30))
    except SandboxUnavailable as err:
        pytest.skip(f"no sandbox on this machine: {err}")
    corpus = tmp_path_factory.mktemp("corpus")
    for name, text in DOCS.items():
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_text(text)
    with harmony_server(
        max_running=4,
        api_keys={"ka": "alice", "kb": "bob"},
        python_tool=pool,
        browser_corpus=corpus,
        tool_timeout=TOOL_TIMEOUT,
        data_dir=tmp_path_factory.mktemp("data"),
    ) as server:
        yield server


def client(live, key="ka"):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0)


def script(served, *texts):
    llm, state, _ = served
    llm.script(*(tokens_of(state.harmony.encoding, t) for t in texts))


def decoded(state, ids) -> str:
    return state.harmony.encoding.decode_utf8(ids)


def test_the_declarations_are_openai_harmonys_own(served):
    """A request with web_search and code_interpreter renders the system message exactly as
    openai-harmony's with_browser_tool().with_python_tool() do: the same token ids."""
    llm, state, live = served
    script(served, answer("Hi."))
    client(live).responses.create(
        model=llm.model_name, input="Hello", tools=BROWSER + PYTHON, reasoning={"effort": "low"}
    )
    H = harmony
    system = (
        H.SystemContent.new()
        .with_reasoning_effort(H.ReasoningEffort.LOW)
        .with_conversation_start_date(_date_of(state, llm.prompts[-1]))
        .with_browser_tool()
        .with_python_tool()
    )
    convo = H.Conversation.from_messages(
        [H.Message.from_role_and_content(H.Role.SYSTEM, system), H.Message.from_role_and_content(H.Role.USER, "Hello")]
    )
    theirs = state.harmony.encoding.render_conversation_for_completion(convo, H.Role.ASSISTANT)
    assert llm.prompts[-1] == theirs
    ours = render(
        state.harmony.encoding,
        [{"role": "user", "content": "Hello"}],
        effort="low",
        date=_date_of(state, theirs),
        builtin=BuiltinTools(browser=True, python=True),
    )
    assert ours == theirs


def _date_of(state, ids) -> str:
    return decoded(state, ids).split("Current date: ")[1][:10]


def test_python_runs_inside_the_response(served):
    """print(2**100): the code_interpreter_call item holds the code and the number, the next round's
    prompt is the first's extended by the call and harmony's tool message, and usage counts both rounds."""
    llm, state, live = served
    call, final = python_call("print(2**100)"), answer(f"It is {BIG}.")
    script(served, call, final)
    before = len(llm.prompts)
    r = client(live).responses.create(model=llm.model_name, input="What is 2**100?", tools=PYTHON)
    assert r.status == "completed" and r.output_text == f"It is {BIG}."
    assert [o.type for o in r.output] == ["reasoning", "code_interpreter_call", "reasoning", "message"]
    ci = r.output[1]
    assert (ci.code, ci.status, ci.container_id) == ("print(2**100)", "completed", f"cntr_{r.id.removeprefix('resp_')}")
    assert [(o.type, o.logs) for o in ci.outputs] == [("logs", BIG + "\n")]
    first, second = llm.prompts[before:]
    enc = state.harmony.encoding
    message = f"<|start|>python to=assistant<|channel|>analysis<|message|>{BIG}\n<|end|><|start|>assistant"
    assert second == first + tokens_of(enc, call) + tokens_of(enc, message)
    generated = len(tokens_of(enc, call)) + len(tokens_of(enc, final))
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(first) + len(second), generated)
    assert r.usage.input_tokens_details.cached_tokens >= len(first)  # the second round reads the first from cache


def test_python_state_follows_the_conversation(served):
    """A variable set in one response is read by the next response of its chain (previous_response_id),
    not by another conversation, nor by another tenant naming the same container."""
    llm, _, live = served
    c = client(live)
    script(served, python_call("x = 41"), answer("Set."))
    first = c.responses.create(model=llm.model_name, input="Set x.", tools=PYTHON)
    script(served, python_call("print(x + 1)"), answer("42."))
    second = c.responses.create(model=llm.model_name, input="x+1?", tools=PYTHON, previous_response_id=first.id)
    assert second.output[1].container_id == first.output[1].container_id
    assert second.output[1].outputs[0].logs == "42\n"
    script(served, python_call("print(x)"), answer("None."))
    other = c.responses.create(model=llm.model_name, input="x?", tools=PYTHON)
    assert "NameError" in other.output[1].outputs[0].logs
    # A stateless client names the container it was given; another tenant naming it gets its own.
    named = [{"type": "code_interpreter", "container": first.output[1].container_id}]
    script(served, python_call("print(x)"), answer("41."))
    again = c.responses.create(model=llm.model_name, input="x?", tools=named, store=False)
    assert again.output[1].outputs[0].logs == "41\n"
    script(served, python_call("print(x)"), answer("None."))
    bob = client(live, "kb").responses.create(model=llm.model_name, input="x?", tools=named)
    assert "NameError" in bob.output[1].outputs[0].logs


def test_an_endless_loop_is_a_tool_error_and_other_tenants_stream_on(served):
    """`while True: pass` ends in the tool's time-limit error inside a completed response; meanwhile
    bob's stream gets exactly its scripted tokens, without waiting for the tool."""
    llm, state, live = served
    script(served, python_call("while True: pass"))
    events: queue.Queue = queue.Queue()

    def abuse():
        with client(live).responses.stream(model=llm.model_name, input="Spin.", tools=PYTHON) as stream:
            for event in stream:
                events.put(event)
            events.put(stream.get_final_response())

    thread = threading.Thread(target=abuse)
    thread.start()
    while (event := events.get(timeout=60)).type != "response.code_interpreter_call.interpreting":
        pass
    victim = "<|channel|>final<|message|>" + " ".join(f"word{i}" for i in range(30)) + "<|return|>"
    script(served, victim, answer("It timed out."))
    text = client(live, "kb").responses.create(model=llm.model_name, input="Talk.").output_text
    assert text == " ".join(f"word{i}" for i in range(30))
    assert events.empty(), "the tool finished before the victim had its answer"
    thread.join(60)
    kinds, final = [], None
    while not events.empty():
        event = events.get()
        if hasattr(event, "type") and event.type.startswith("response."):
            kinds.append(event.type)
        else:
            final = event
    assert "response.code_interpreter_call.completed" in kinds and kinds[-1] == "response.completed"
    assert final.status == "completed" and final.output_text == "It timed out."
    logs = final.output[1].outputs[0].logs
    assert f"timed out after {TOOL_TIMEOUT:g} s" in logs


def test_browser_search_then_open(served):
    """A search and then opening its first result: two web_search_call items (search with its query,
    open_page with the document's URL), and each page is the tool message the next round reads."""
    llm, state, live = served
    search, opened = browser_call("search", {"query": "install server"}), browser_call("open", {"id": 0})
    script(served, search, opened, answer("Run pip install."))
    before = len(llm.prompts)
    r = client(live).responses.create(model=llm.model_name, input="How do I install it?", tools=BROWSER)
    assert [o.type for o in r.output] == ["web_search_call", "web_search_call", "reasoning", "message"]
    assert r.output[0].action.type == "search" and r.output[0].action.query == "install server"
    assert r.output[1].action.type == "open_page" and r.output[1].action.url == "file:///guide/install.md"
    assert all(o.status == "completed" for o in r.output[:2])
    prompts = [decoded(state, p) for p in llm.prompts[before:]]
    assert len(prompts) == 3
    head = "<|start|>browser.search to=assistant<|channel|>analysis<|message|>[0] install server\n"
    assert head in prompts[1] and "【0†Installing the server†guide/install.md】" in prompts[1]
    page = "<|start|>browser.open to=assistant<|channel|>analysis<|message|>[1] Installing the server"
    assert page in prompts[2] and "L4: Run `pip install gptoss-lite`, then start it." in prompts[2]


def test_streamed_events_build_the_same_items(served):
    """Streamed, a python response sends the code_interpreter_call events in order, and the final
    response has the items a non-streamed one has."""
    llm, _, live = served
    c = client(live)
    script(served, python_call("print(2**100)"), answer("Big."))
    kinds = []
    with c.responses.stream(model=llm.model_name, input="2**100?", tools=PYTHON) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_response()
    ci = [k for k in kinds if "code_interpreter" in k]
    assert ci == [
        "response.code_interpreter_call.in_progress",
        "response.code_interpreter_call_code.delta",
        "response.code_interpreter_call_code.done",
        "response.code_interpreter_call.interpreting",
        "response.code_interpreter_call.completed",
    ]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    assert [o.type for o in final.output] == ["reasoning", "code_interpreter_call", "reasoning", "message"]
    assert final.output[1].outputs[0].logs == BIG + "\n" and final.output_text == "Big."
    stored = c.responses.retrieve(final.id)
    assert [o.type for o in stored.output] == [o.type for o in final.output]


def test_calls_past_max_tool_calls_are_not_run(served):
    """max_tool_calls=1: the second call is answered "not run" (its item incomplete) and the model
    goes on; a third ends the response as incomplete (max_tool_calls)."""
    llm, state, live = served
    c = client(live)
    script(served, python_call("print(1)"), python_call("print(2)"), answer("One."))
    r = c.responses.create(model=llm.model_name, input="Count.", tools=PYTHON, max_tool_calls=1)
    assert r.status == "completed" and r.output_text == "One."
    calls = [o for o in r.output if o.type == "code_interpreter_call"]
    assert [(o.status, bool(o.outputs)) for o in calls] == [("completed", True), ("incomplete", False)]
    assert "may make at most 1 tool calls" in decoded(state, llm.prompts[-1])
    script(served, python_call("print(1)"), python_call("print(2)"), python_call("print(3)"))
    r = c.responses.create(model=llm.model_name, input="Count.", tools=PYTHON, max_tool_calls=1)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_tool_calls"


def test_a_tool_that_raises_is_a_tool_error_not_a_500(served, monkeypatch):
    """A python pool that raises: the item is failed, the model reads the error, the response completes."""
    llm, state, live = served

    def broken(owner, code, timeout=None):
        raise RuntimeError("the sandbox broke")

    monkeypatch.setattr(state.tools.python, "run", broken)
    script(served, python_call("print(1)"), answer("Sorry."))
    r = client(live).responses.create(model=llm.model_name, input="Run.", tools=PYTHON)
    assert r.status == "completed" and r.output_text == "Sorry."
    assert r.output[1].status == "failed"
    assert "Error: the python tool failed: RuntimeError: the sandbox broke" in decoded(state, llm.prompts[-1])


def test_metrics_count_tool_calls_and_time(served):
    """/metrics has the calls, errors and seconds of each tool."""
    _, _, live = served
    text = httpx.get(f"{live.url}/metrics", headers={"Authorization": "Bearer ka"}).text
    assert 'gptoss_tool_calls_total{tool="python"}' in text
    assert 'gptoss_tool_call_seconds_count{tool="browser"}' in text


@pytest.mark.parametrize(
    "tools, match",
    [
        ([{"type": "file_search", "vector_store_ids": ["v"]}], "type 'file_search' is not served here"),
        ([{"type": "code_interpreter", "container": {"type": "auto", "file_ids": ["f"]}}], "no files API"),
        ([{"type": "mcp", "server_label": "weather"}], "no tool server is labelled 'weather'"),
        ([{"type": "code_interpreter", "container": "../x"}], "container name must match"),
    ],
)
def test_bad_tools_are_a_400_naming_tools(served, tools, match):
    """A tool type not served, or a built-in tool asked for in a way not served, is a 400 naming `tools`."""
    llm, _, live = served
    with pytest.raises(openai.BadRequestError, match=match) as err:
        client(live).responses.create(model=llm.model_name, input="Hi", tools=tools)
    assert err.value.body["param"] == "tools"


def test_a_server_without_the_tools_refuses_them():
    """web_search without --browser-corpus and code_interpreter without --python-tool are 400s naming
    `tools` and the flag to start the server with."""
    with harmony_server(max_running=1) as (llm, _, live):
        c = client(live)
        with pytest.raises(openai.BadRequestError, match="--browser-corpus") as err:
            c.responses.create(model=llm.model_name, input="Hi", tools=[{"type": "web_search"}])
        assert err.value.body["param"] == "tools"
        with pytest.raises(openai.BadRequestError, match="--python-tool"):
            c.responses.create(model=llm.model_name, input="Hi", tools=PYTHON)


ABUSE = {  # code the model might write -> what the tool's answer must say (each within TOOL_TIMEOUT)
    "socket to 127.0.0.1": (
        "import socket\nsocket.create_connection(('127.0.0.1', 8000), timeout=2)",
        ("unreachable", "timed out"),
    ),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", ("Resource temporarily unavailable",)),
    "10 GB allocation": ("b = bytearray(10 * 10**9)", ("MemoryError",)),
    "100 MB of output": (
        "import sys\nfor _ in range(100): sys.stdout.write('x' * 10**6)",
        ("output cut: 100,000,000 bytes written",),
    ),
    "write outside /mnt/data": ("open('/etc/gptoss-x', 'w').write('x')", ("Read-only file system", "No such file")),
}


@pytest.mark.parametrize("case", list(ABUSE))
def test_abuse_is_a_tool_error_while_another_tenant_streams(served, case):
    """Each hostile cell ends, inside a completed response, in a tool answer that says what stopped it,
    within the tool's time limit; bob's stream, running all the while, gets exactly its tokens."""
    llm, state, live = served
    code, expected = ABUSE[case]
    words = " ".join(f"word{i}" for i in range(200))
    script(served, "<|channel|>final<|message|>" + words + "<|return|>")
    streamed: list[str] = []
    started = threading.Event()

    def victim():
        with client(live, "kb").responses.stream(model=llm.model_name, input="Talk.") as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    streamed.append(event.delta)
                    started.set()
            streamed.append(stream.get_final_response().status)

    thread = threading.Thread(target=victim)
    thread.start()
    assert started.wait(60), "the victim never started"
    script(served, python_call(code), answer("Stopped."))
    out = client(live).responses.create(model=llm.model_name, input="Run it.", tools=PYTHON)
    thread.join(120)
    assert out.status == "completed" and out.output_text == "Stopped."
    logs = out.output[1].outputs[0].logs
    assert any(text in logs for text in expected), (case, logs[:300])
    assert "".join(streamed[:-1]) == words and streamed[-1] == "completed"
