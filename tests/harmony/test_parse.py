"""HarmonyStream against openai-harmony's own parser, streamed against whole, and under fuzzing."""

from __future__ import annotations

import functools
import random

import pytest
from harmony_fixture import tokenizer_json, tokens_of
from hypothesis import given, settings
from hypothesis import strategies as st

oh = pytest.importorskip("openai_harmony")
from openai_harmony import Message, Role  # noqa: E402

from gptoss_lite.harmony.parse import Delta, HarmonyStream  # noqa: E402
from gptoss_lite.harmony.vocabulary import HARMONY_SPECIALS, load_encoding  # noqa: E402

ENC = None


def encoding():
    global ENC
    if ENC is None:
        ENC = load_encoding(tokenizer_json())
    return ENC


def parse_whole(tokens, **kwargs) -> HarmonyStream:
    stream = HarmonyStream(encoding(), **kwargs)
    stream.feed(tokens)
    stream.finish()
    return stream


def parse_in_pieces(tokens, cuts, **kwargs) -> tuple[HarmonyStream, Delta]:
    """Feed the tokens in the pieces `cuts` makes; the deltas joined."""
    stream = HarmonyStream(encoding(), **kwargs)
    joined = Delta()
    start = 0
    for cut in [*sorted(cuts), len(tokens)]:
        joined.extend(stream.feed(tokens[start:cut]))
        start = max(start, cut)
    joined.extend(stream.finish())
    return stream, joined


def reference(tokens) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, [(name, arguments)]) from openai-harmony's parse_messages_from_completion_tokens."""
    reasoning, content, calls = "", "", []
    for message in encoding().parse_messages_from_completion_tokens(tokens, Role.ASSISTANT):
        text = "".join(c.text for c in message.content)
        if message.recipient and message.recipient.startswith("functions."):
            calls.append((message.recipient.removeprefix("functions."), text))
        elif message.channel == "analysis" and not message.recipient:
            reasoning += text
        else:
            content += text
    return reasoning, content, calls


# ---- well-formed completions ----------------------------------------------------------------------------

TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="<|>"), min_size=1, max_size=40
)


@st.composite
def completions(draw) -> list[int]:
    """A well-formed assistant completion: analysis, preambles, calls and a final, rendered by harmony."""
    kinds = draw(st.lists(st.sampled_from(["analysis", "commentary", "call", "final"]), min_size=1, max_size=5))
    tokens: list[int] = []
    for i, kind in enumerate(kinds):
        text = draw(TEXT)
        if kind == "call":
            name = draw(st.sampled_from(["get_weather", "lookup", "f_2"]))
            msg = Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary")
            msg = msg.with_recipient(f"functions.{name}").with_content_type("<|constrain|>json")
        else:
            msg = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(kind)
        rendered = encoding().render(msg)
        if i == 0:  # the prompt already ends with <|start|>assistant
            rendered = rendered[len(encoding().encode("<|start|>assistant", allowed_special="all")) :]
        tokens += rendered
    if draw(st.booleans()) and tokens[-1] == HARMONY_SPECIALS["<|end|>"]:
        tokens[-1] = HARMONY_SPECIALS["<|return|>"]
    return tokens


@settings(max_examples=300, deadline=None)
@given(completions(), st.lists(st.integers(0, 200), max_size=6))
def test_parse_equals_openai_harmony_streamed_or_whole(tokens, cuts):
    whole = parse_whole(tokens)
    assert whole.malformed is None
    assert (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.tool_calls]) == reference(tokens)
    pieces, joined = parse_in_pieces(tokens, cuts)
    assert (joined.reasoning, joined.content) == (whole.reasoning, whole.content)
    assert [c.arguments for c in pieces.tool_calls] == [c.arguments for c in whole.tool_calls]
    # The streamed call pieces rebuild the calls: an id and a name first, then the argument text.
    rebuilt: dict[int, list[str]] = {}
    for piece in joined.calls:
        if piece.id is not None:
            assert piece.name == pieces.tool_calls[piece.index].name
        rebuilt.setdefault(piece.index, []).append(piece.arguments)
    assert ["".join(rebuilt[i]) for i in sorted(rebuilt)] == [c.arguments for c in pieces.tool_calls]


def test_a_typical_tool_turn():
    tokens = tokens_of(
        encoding(),
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
    )
    stream = parse_whole(tokens)
    assert stream.reasoning == "Need the weather."
    assert stream.content == ""
    assert [(c.name, c.arguments) for c in stream.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert stream.ended_in_call and stream.malformed is None


def test_a_call_on_the_analysis_channel_is_still_a_call():
    """gpt-oss sometimes addresses a tool from the analysis channel."""
    tokens = tokens_of(encoding(), "<|channel|>analysis to=functions.lookup code<|message|>{}<|call|>")
    assert [(c.name, c.arguments) for c in parse_whole(tokens).tool_calls] == [("lookup", "{}")]


def test_with_tools_off_a_call_is_content():
    tokens = tokens_of(encoding(), "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>")
    stream = parse_whole(tokens, tools=False)
    assert stream.tool_calls == [] and stream.content == "{}" and not stream.ended_in_call


def test_multibyte_text_split_across_tokens():
    text = "Grüße, 日本語, 🎉 done"
    tokens = tokens_of(encoding(), f"<|channel|>final<|message|>{text}<|return|>")
    for cut in range(len(tokens)):
        _, joined = parse_in_pieces(tokens, [cut])
        assert joined.content == text


# ---- malformed completions ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("plain text with no header<|return|>", "plain text with no header"),  # the model forgot the header
        ("<|channel|>final<|message|>done<|end|>junk<|start|>x", "donejunkx"),  # text where <|start|> belongs
        ("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>fin", "assistantfin"),  # cut header
        ("<|end|><|end|>hello", "hello"),
    ],
)
def test_malformed_streams_fall_back_to_content(text, content):
    tokens = tokens_of(encoding(), text)
    stream = parse_whole(tokens)
    assert stream.malformed is not None
    assert stream.content == content
    _, joined = parse_in_pieces(tokens, [1, 3])
    assert joined.content == stream.content


SPECIALS = list(HARMONY_SPECIALS.values()) + [199998, 199999, 200018]
WORDS = ["analysis", "final", "commentary", "assistant", " to=", "functions.", "browser.search", "json", "{", "}"]


@functools.cache
def _ids(text: str) -> tuple[int, ...]:
    return tuple(encoding().encode(text, allowed_special="all"))


def fuzzed_stream(rng: random.Random) -> list[int]:
    """Random specials, truncated headers, unknown channels and recipients, and interleaved junk."""
    tokens: list[int] = []
    for _ in range(rng.randint(1, 12)):
        pick = rng.random()
        if pick < 0.35:
            tokens.append(rng.choice(SPECIALS))
        elif pick < 0.6:
            tokens += _ids(rng.choice(WORDS))
        elif pick < 0.8:
            channel = rng.choice(["analysis", "final", "commentary", "weird", ""])
            recipient = rng.choice(["", " to=functions.f", " to=browser.open", " to="])
            header = f"<|channel|>{channel}{recipient}<|message|>"
            cut = rng.randint(1, len(header))
            tokens += _ids(header[:cut]) if "<|" not in header[cut - 2 : cut] else ()
        else:
            tokens += [rng.randrange(0, 199_998) for _ in range(rng.randint(1, 4))]
    return tokens or [rng.randrange(0, 199_998)]


def test_ten_thousand_fuzzed_streams_never_raise():
    rng = random.Random(0)
    fell_back = 0
    for _ in range(10_000):
        tokens = fuzzed_stream(rng)
        whole = parse_whole(tokens)
        fell_back += whole.malformed is not None
        _, joined = parse_in_pieces(tokens, [rng.randint(0, len(tokens))])
        assert joined.reasoning == whole.reasoning and joined.content == whole.content
    assert 1_000 < fell_back < 10_000  # the fuzzer reaches both the parser and the fallback
