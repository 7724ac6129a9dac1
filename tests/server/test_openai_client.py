"""The official `openai` client against a live server: completions, streamed chat, models.list; greedy
streamed text equals non-streamed text and the engine's own generate()."""

from __future__ import annotations

import pytest
from live_server import tiny_llm

from gptoss_lite.engine import SamplingParams
from gptoss_lite.server.chat import ChatTemplate

openai = pytest.importorskip("openai")

PROMPT = "The pass key is 52718. Remember it. The pass key is"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the pass key?"},
]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def setup():
    """(live server, expected completion text, expected chat text); expectations come from generate()
    on the same LLM before the server owns it."""
    from live_server import LiveServer, create_app

    llm = tiny_llm()
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    chat_prompt = ChatTemplate(llm.chat_template).render(MESSAGES)
    want_completion, want_chat = (o.text for o in llm.generate([PROMPT, chat_prompt], greedy, scope="oracle"))
    with LiveServer(create_app(llm, api_keys={"sk-test": "tester"})) as live:
        yield live, want_completion, want_chat


def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="sk-test", max_retries=0, timeout=60)


def test_models_list(setup):
    """models.list() names the one served model."""
    live, _, _ = setup
    assert [m.id for m in client(live).models.list().data] == [live.state.model_name]


def test_completion_equals_generate(setup):
    """A greedy completion (plain and streamed) is generate()'s text, with usage counted."""
    live, want, _ = setup
    c = client(live)
    name = live.state.model_name
    out = c.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == want
    assert out.usage.prompt_tokens == len(PROMPT) and 1 <= out.usage.completion_tokens <= MAX_TOKENS
    stream = c.completions.create(
        model=name,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_streamed_chat_equals_plain_chat_and_generate(setup):
    """A greedy streamed chat completion's deltas join to the non-streamed answer and to generate()
    of the rendered chat prompt; the first delta carries the role, the last the finish reason."""
    live, _, want = setup
    c = client(live)
    name = live.state.model_name
    plain = c.chat.completions.create(model=name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    assert plain.choices[0].message.content == want
    assert plain.choices[0].message.role == "assistant"
    chunks = list(
        c.chat.completions.create(model=name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert len(chunks) >= 3  # role, at least one piece of text, the finish


def test_seeded_sampling_is_reproducible_and_errors_raise(setup):
    """The same seed gives the same sampled text; a bad request raises the client's BadRequestError."""
    live, _, _ = setup
    c = client(live)
    name = live.state.model_name
    texts = {
        c.completions.create(model=name, prompt="abc", max_tokens=8, temperature=1.0, seed=7).choices[0].text
        for _ in range(2)
    }
    assert len(texts) == 1
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model=name, prompt="abc", max_tokens=-3)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="no-such-model", prompt="abc")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_stop_string_streamed_equals_plain(setup):
    """With a stop string taken from the greedy text, streamed and plain answers are equal, cut
    before it, and end with finish_reason 'stop'."""
    live, want, _ = setup
    stop = next((want[i : i + 2] for i in range(3, len(want) - 1) if "\ufffd" not in want[i : i + 2]), None)
    if stop is None:
        pytest.skip(f"no usable stop string in {want!r}")
    c = client(live)
    name = live.state.model_name
    plain = c.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop], stream=True
        )
    )
    assert plain.choices[0].text == streamed == want[: want.index(stop)]
    assert plain.choices[0].finish_reason == "stop"
