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
    assert out.usage.prompt_tokens == 1 + len(PROMPT)  # BOS (the byte model's rule), then one id per byte
    assert 1 <= out.usage.completion_tokens <= MAX_TOKENS
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


def test_logprobs_through_the_client(setup):
    """chat `logprobs=True, top_logprobs=5` and completions `logprobs=3`: one entry per generated
    token, its alternatives ordered, the chosen token's logprob no higher than the best; streamed
    chat logprobs concatenate to the non-streamed ones."""
    live, _, _ = setup
    c = client(live)
    chat = c.chat.completions.create(
        model="lite-tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=5
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6
        assert entry.logprob == pytest.approx(tops[0], abs=1e-6)  # greedy: the chosen token is the best
        assert isinstance(entry.bytes, list)
    streamed = []
    for chunk in c.chat.completions.create(
        model="lite-tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    done = c.completions.create(model="lite-tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == done.usage.completion_tokens
    assert lp.text_offset[0] == 0 and all(len(d) <= 3 for d in lp.top_logprobs)


def test_penalties_and_logit_bias_through_the_client(setup):
    """A +100 bias on '*' (byte 42) makes every token '*'; penalties are accepted and change the
    greedy text of a model that repeats itself."""
    live, want_completion, _ = setup
    c = client(live)
    forced = c.completions.create(
        model="lite-tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == "*" * 8
    penalised = c.completions.create(
        model="lite-tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, frequency_penalty=2, presence_penalty=2
    )
    assert penalised.choices[0].text != want_completion
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        c.completions.create(model="lite-tiny", prompt=PROMPT, max_tokens=2, logit_bias={"99999": 1})


def test_n_samples_through_the_client(setup):
    """`n=3` with a seed: three choices (index 0..2), each the text of a single request with seed + i;
    usage counts all three; streamed chunks, grouped by index, join to the same three texts."""
    live, _, _ = setup
    c = client(live)
    kwargs = dict(model="lite-tiny", max_tokens=MAX_TOKENS, temperature=1.0, seed=11)
    out = c.chat.completions.create(messages=MESSAGES, n=3, **kwargs)
    texts = [ch.message.content for ch in sorted(out.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in sorted(out.choices, key=lambda ch: ch.index)] == [0, 1, 2]
    singles = [c.chat.completions.create(messages=MESSAGES, **{**kwargs, "seed": 11 + i}) for i in range(3)]
    assert texts == [s.choices[0].message.content for s in singles]
    assert len(set(texts)) == 3
    assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    streamed = ["", "", ""]
    for chunk in c.chat.completions.create(messages=MESSAGES, n=3, stream=True, **kwargs):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == texts
    done = c.completions.create(prompt=PROMPT, n=2, **kwargs)
    assert sorted(ch.index for ch in done.choices) == [0, 1]


def test_best_of_answers_the_n_most_likely_of_its_samples(setup):
    """best_of=5, n=2: the two of five seeded samples with the highest total logprob, best first; the
    same five samples as n=5 (sample i draws with seed + i), and every token generated is billed."""
    live, _, _ = setup
    c = client(live)
    args = {"model": "lite-tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3, "logprobs": 0}
    every = c.completions.create(n=5, **args)
    ranked = sorted(every.choices, key=lambda ch: (-sum(ch.logprobs.token_logprobs), ch.index))
    best = c.completions.create(n=2, extra_body={"best_of": 5}, **args)
    assert [ch.text for ch in best.choices] == [ch.text for ch in ranked[:2]]
    assert [ch.index for ch in best.choices] == [0, 1]
    assert best.usage.completion_tokens == every.usage.completion_tokens == 30
    quiet = c.completions.create(n=2, best_of=5, **{k: v for k, v in args.items() if k != "logprobs"})
    assert [ch.text for ch in quiet.choices] == [ch.text for ch in ranked[:2]]
    assert all(ch.logprobs is None for ch in quiet.choices)  # computed to rank, not asked for
    for bad in ({"n": 3, "best_of": 2}, {"n": 1, "best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError, match="best_of"):
            c.completions.create(**{**args, **bad})
