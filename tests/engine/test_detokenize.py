"""The engine's output text, a token at a time (engine/detokenize.py): deltas that never need taking
back, stop strings found across tokens, and a cost per token that does not grow with the output."""

from __future__ import annotations

import random
import time

from gptoss_lite.engine.detokenize import TextStream
from gptoss_lite.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def run(text_or_ids, stops=()) -> tuple[list[str], TextStream]:
    """Push every token, taking the deltas as the engine does after each one; then finish."""
    ids = TOK.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
    ts = TextStream(TOK, tuple(stops))
    deltas = []
    for t in ids:
        if ts.push(t):
            break
        deltas.append(ts.take())
    ts.finish()
    deltas.append(ts.take())
    return deltas, ts


def reference(ids: list[int], stops) -> str:
    """What the engine used to do on every token: decode everything, cut at the earliest stop."""
    for k in range(1, len(ids) + 1):
        text = TOK.decode(ids[:k])
        cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
        if cuts:
            return text[: min(cuts)]
    return TOK.decode(ids)


def test_a_possible_stop_string_is_held_back():
    """A tail that could start a stop string waits; once the stop string is complete the text ends
    before it, and the partial stop string was never handed out."""
    deltas, ts = run("Hello\nUser: hi", stops=("\nUser",))
    assert ts.stopped and ts.text == "Hello" and "".join(deltas) == "Hello"
    assert all("\n" not in d for d in deltas)
    deltas, ts = run("a\nUx", stops=("\nUser",))  # not a stop after all: handed out once decided
    assert not ts.stopped and "".join(deltas) == "a\nUx" and deltas[1] == "" and deltas[-2:] == ["\nUx", ""]


def test_a_cut_multibyte_character_waits_for_its_last_byte():
    """'é' is two bytes: nothing is handed out after the first, the character after the second; a
    byte that never completes a character becomes U+FFFD, as a whole-text decode gives."""
    deltas, _ = run("café")
    assert deltas == ["c", "a", "f", "", "é", ""]
    deltas, ts = run([ord("a"), 0xC3, ord("b")])
    assert "".join(deltas) == ts.text == TOK.decode([ord("a"), 0xC3, ord("b")]) == "a\ufffdb"
    _, ts = run([ord("a"), 0xE2, 0x82])  # cut mid-character at the end: flushed as U+FFFD
    assert ts.text == TOK.decode([ord("a"), 0xE2, 0x82])


def test_random_streams_equal_the_whole_text_reference():
    """3,000 random byte streams (ASCII, multi-byte characters, invalid bytes, EOS) with random stop
    strings: the deltas join to the text a whole-text decode and cut gives."""
    rng = random.Random(0)
    alphabet = list(b"ab") + list("é€😀".encode()) + [0xFF, TOK.eos_id]
    for _ in range(3000):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(0, 30))]
        stops = tuple("".join(rng.choice("abé") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3)))
        deltas, ts = run(ids, stops)
        assert "".join(deltas) == ts.text == reference(ids, stops), (ids, stops)


def test_earliest_starting_stop_wins_within_a_step():
    """Two stops ending in the same step: the text is cut before the one that starts first."""
    ts = TextStream(TOK, ("bcd", "c"))
    for t in b"a":
        ts.push(t)
    assert ts.take() == "a"
    ts._commit("bcd")  # one step's text (a multi-byte token would bring several characters at once)
    assert ts.stopped and ts.text == "a"


def test_cost_per_token_does_not_grow_with_output_or_stop_length():
    """Token 20,000 costs about what token 1,000 does, with four 4,096-character stop strings that
    share long prefixes with the text (a naive suffix scan would be quadratic in both)."""
    stops = tuple("a" * 4095 + c for c in "xyzw")
    ts = TextStream(TOK, stops)

    def push(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            ts.push(ord("a"))
            ts.take()
        return time.perf_counter() - start

    push(1000)
    early = min(push(1000) for _ in range(3))
    push(15000)
    late = min(push(1000) for _ in range(3))
    assert not ts.stopped
    assert late < 3 * early, (early, late)


def test_a_tokenizer_json_stream_equals_its_whole_decode(tmp_path):
    """A byte-level BPE `tokenizer.json` (tokens of several bytes, characters split across tokens):
    the deltas of 300 random id streams and 300 encoded texts join to the tokenizer's own decode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from gptoss_lite.tokenizer import HFTokenizer

    words = "the pass key café naïve 😀 €uro über straße 日本語 テキスト 52718 , .".split(" ")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator([" ".join(words)] * 100, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path)
    rng = random.Random(1)
    for i in range(600):
        if i % 2:
            ids = [rng.randrange(hf.vocab_size) for _ in range(rng.randint(1, 40))]
        else:
            ids = hf.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))))
        ts = TextStream(hf)
        deltas = []
        for t in ids:
            ts.push(t)
            deltas.append(ts.take())
        ts.finish()
        deltas.append(ts.take())
        assert "".join(deltas) == ts.text == hf.decode(ids), ids
