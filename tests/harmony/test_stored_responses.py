"""/v1/responses through the official client, on the harmony test model: stored responses read back
and deleted (GET / DELETE), and the stateless round trip of sealed reasoning items
(`include: ["reasoning.encrypted_content"]`, `store: false`)."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from harmony_fixture import WEATHER_ANSWER, WEATHER_CALL, WEATHER_TOOLS, harmony_server, tokens_of

from gptoss_lite.harmony.render import render

openai = pytest.importorskip("openai")

TOOLS, CALL, ANSWER = WEATHER_TOOLS, WEATHER_CALL, WEATHER_ANSWER
SEALED = ["reasoning.encrypted_content"]


@pytest.fixture(scope="module")
def served():
    with harmony_server(max_running=4, api_keys={"ka": "alice", "kb": "bob"}) as server:
        yield server


@pytest.fixture
def prompts(served, monkeypatch):
    """The prompt token ids of every request the engine is given during the test."""
    llm = served[0]
    seen: list[list[int]] = []
    add = llm.add_request

    def recording(prompt, sampling=None, **kwargs):
        seen.append(list(prompt.token_ids))
        return add(prompt, sampling, **kwargs)

    monkeypatch.setattr(llm, "add_request", recording)
    return seen


def client(live, key="ka"):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0)


def script(served, text):
    llm, state, _ = served
    llm.script(tokens_of(state.harmony.encoding, text))


def flipped(token: str, index: int) -> str:
    """`token` with one bit of its decoded byte `index` flipped (re-encoded as the server writes it)."""
    raw = bytearray(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    raw[index] ^= 0x01
    return base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()


# ---- GET and DELETE ---------------------------------------------------------------------------------------


def test_retrieve_returns_what_create_answered(served):
    """client.responses.retrieve gives the very Response the create call answered, streamed or not."""
    llm, _, live = served
    c = client(live)
    script(served, CALL)
    made = c.responses.create(model=llm.model_name, input="Weather in Paris?", tools=TOOLS, metadata={"k": "v"})
    assert c.responses.retrieve(made.id).model_dump() == made.model_dump()
    script(served, ANSWER)
    headers = {"Authorization": "Bearer ka"}
    body = {"model": llm.model_name, "input": "Weather?", "stream": True}
    r = httpx.post(f"{live.url}/v1/responses", json=body, headers=headers)
    final = json.loads([line for line in r.text.splitlines() if line.startswith("data: ")][-1][6:])
    assert final["type"] == "response.completed"
    assert httpx.get(f"{live.url}/v1/responses/{final['response']['id']}", headers=headers).json() == final["response"]


def test_delete_then_nothing_is_left(served):
    """client.responses.delete answers `deleted: true`; the id is then a 404 for GET, DELETE and
    previous_response_id."""
    llm, _, live = served
    c = client(live)
    script(served, ANSWER)
    made = c.responses.create(model=llm.model_name, input="hi")
    r = httpx.delete(f"{live.url}/v1/responses/{made.id}", headers={"Authorization": "Bearer ka"})
    assert r.status_code == 200 and r.json() == {"id": made.id, "object": "response", "deleted": True}
    script(served, ANSWER)
    again = c.responses.create(model=llm.model_name, input="hi")
    assert c.responses.delete(again.id) is None  # what the client makes of the answer
    for gone in (made.id, again.id):
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError):
            c.responses.delete(gone)
        with pytest.raises(openai.NotFoundError) as exc:
            c.responses.create(model=llm.model_name, input="more", previous_response_id=gone)
        assert exc.value.body["param"] == "previous_response_id"


def test_another_tenant_cannot_read_or_delete(served):
    """Another tenant's GET and DELETE of an id are 404s (the same as an unknown id), and the owner
    still has it afterwards."""
    llm, _, live = served
    script(served, ANSWER)
    made = client(live, "ka").responses.create(model=llm.model_name, input="mine")
    bob = client(live, "kb")
    with pytest.raises(openai.NotFoundError) as exc:
        bob.responses.retrieve(made.id)
    assert exc.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve("resp_unknown")
    assert client(live, "ka").responses.retrieve(made.id).id == made.id
    r = httpx.get(f"{live.url}/v1/responses/{made.id}")
    assert r.status_code == 401


def test_retrieve_options_are_refused_not_ignored(served):
    """GET /v1/responses/{id}?stream=true (a replay of the events) is a 400 naming the option."""
    llm, _, live = served
    script(served, ANSWER)
    made = client(live).responses.create(model=llm.model_name, input="hi")
    r = httpx.get(f"{live.url}/v1/responses/{made.id}?stream=true", headers={"Authorization": "Bearer ka"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_store_false_writes_nothing(served):
    """A response with store: false leaves no row (its id is a 404), sealed reasoning or not."""
    llm, state, live = served
    c = client(live)
    before = state.responses.count()
    for include in (None, SEALED):
        script(served, ANSWER)
        extra = {"include": include} if include else {}
        made = c.responses.create(model=llm.model_name, input="hi", store=False, **extra)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(made.id)
    assert state.responses.count() == before


# ---- sealed reasoning -------------------------------------------------------------------------------------


def first_turn(served, **kwargs):
    """A scripted reasoning + tool call, asked for with sealed reasoning and no store."""
    llm, _, live = served
    script(served, CALL)
    return client(live).responses.create(
        model=llm.model_name,
        input="Weather in Paris?",
        instructions="Be brief.",
        tools=TOOLS,
        reasoning={"effort": "low"},
        store=False,
        include=SEALED,
        **kwargs,
    )


def sent_back(first, reasoning: dict | None = None) -> list[dict]:
    """The next request's input: the question, the first turn's items and the tool's result."""
    items = [o.model_dump(exclude_none=True) for o in first.output]
    if reasoning is not None:
        items[0] = reasoning
    result = {"type": "function_call_output", "call_id": first.output[1].call_id, "output": '{"sky": "clear"}'}
    return [{"role": "user", "content": "Weather in Paris?"}, *items, result]


def expected_prompt(state, first) -> list[int]:
    call = first.output[1]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "reasoning_content": "Need the weather.",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "clear"}'},
    ]
    return render(state.harmony.encoding, messages, tools=TOOLS, effort="low")


def test_sealed_reasoning_round_trip_restores_the_chain_of_thought(served, prompts):
    """A reasoning item sent back with only its encrypted_content renders the earlier chain of
    thought into the next prompt: the same tokens as the conversation written out by hand."""
    llm, state, live = served
    first = first_turn(served)
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Need the weather."
    assert isinstance(reasoning.encrypted_content, str) and "Need" not in reasoning.encrypted_content
    assert state.sealer.open("alice", reasoning.encrypted_content) == "Need the weather."

    bare = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    script(served, ANSWER)
    second = client(live).responses.create(
        model=llm.model_name,
        input=sent_back(first, bare),
        instructions="Be brief.",
        tools=TOOLS,
        reasoning={"effort": "low"},
        store=False,
        include=SEALED,
    )
    assert second.output_text == "Sunny."
    assert prompts[-1] == expected_prompt(state, first)
    assert "<|channel|>analysis<|message|>Need the weather.<|end|>" in state.harmony.encoding.decode(prompts[-1])

    # The sealed text wins over plain text the item also carries.
    forged = {**bare, "content": [{"type": "reasoning_text", "text": "Something else entirely."}]}
    script(served, ANSWER)
    client(live).responses.create(
        model=llm.model_name,
        input=sent_back(first, forged),
        instructions="Be brief.",
        tools=TOOLS,
        reasoning={"effort": "low"},
        store=False,
    )
    assert prompts[-1] == expected_prompt(state, first)


def test_streamed_items_carry_encrypted_content(served):
    """Streamed, the reasoning item's response.output_item.done and the final response carry the
    same encrypted_content, and it opens to the streamed reasoning text."""
    llm, state, live = served
    script(served, ANSWER)
    done = []
    with client(live).responses.stream(model=llm.model_name, input="Weather?", include=SEALED, store=False) as stream:
        for event in stream:
            if event.type == "response.output_item.done" and event.item.type == "reasoning":
                done.append(event.item.encrypted_content)
        final = stream.get_final_response()
    assert done == [final.output[0].encrypted_content]
    assert state.sealer.open("alice", done[0]) == "It is sunny."


def test_without_include_no_encrypted_content(served):
    """Reasoning items carry no encrypted_content unless `include` asks for it."""
    llm, _, live = served
    script(served, ANSWER)
    out = client(live).responses.create(model=llm.model_name, input="Weather?")
    assert out.output[0].type == "reasoning" and out.output[0].encrypted_content is None


def test_a_changed_or_foreign_item_is_a_400(served, prompts):
    """One flipped byte anywhere in encrypted_content, another tenant sending the item, or a value
    that is not a string: a 400 naming `input`, nothing generated."""
    llm, _, live = served
    first = first_turn(served)
    token = first.output[0].encrypted_content
    size = len(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))

    def send(key: str, sealed) -> httpx.Response:
        item = {"type": "reasoning", "id": first.output[0].id, "summary": [], "encrypted_content": sealed}
        body = {"model": llm.model_name, "input": sent_back(first, item), "tools": TOOLS, "store": False}
        return httpx.post(f"{live.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"})

    for index in (0, 1, 12, 13, size - 1):  # version, nonce, ciphertext, tag
        r = send("ka", flipped(token, index))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("input", "invalid_encrypted_content")
        assert error["message"].startswith("input[1].encrypted_content: this server cannot read it")
    r = send("kb", token)
    assert r.status_code == 400 and "another API key" in r.json()["error"]["message"]
    r = send("ka", 12)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    with pytest.raises(openai.BadRequestError) as exc:
        item = {"type": "reasoning", "summary": [], "encrypted_content": flipped(token, 20)}
        client(live).responses.create(model=llm.model_name, input=sent_back(first, item), tools=TOOLS)
    assert exc.value.body["code"] == "invalid_encrypted_content"
    assert len(prompts) == 1  # the first turn's: none of the refused requests reached the engine
