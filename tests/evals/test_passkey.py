"""Passkey evaluator: the docs/passkey.md protocol (prompts, keys, scoring) and the CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch

from gptoss_lite.evals import passkey as pk
from gptoss_lite.evals.passkey import (
    CLASSIC_NEEDLE,
    NEEDLE_TEMPLATE,
    QUESTION,
    PasskeyEvaluator,
    build_passkey_prompt,
    extract_passkey,
    filler_sentences,
    passkey_keys,
    prompt_overhead,
)
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model():
    from gptoss_lite.model import GPTOSS

    torch.manual_seed(0)
    return GPTOSS(resolve_config("lite-tiny").replace(train_context_length=128)).prepare_for_inference()


# ---- keys ---------------------------------------------------------------------------------------------


def test_keys_are_distinct_five_digit_and_seeded_by_length():
    """n_trials distinct %05d keys from random.Random(42 + length), different per length."""
    keys = passkey_keys(4096, 100)
    assert len(set(keys)) == 100 and all(len(k) == 5 and k.isdigit() for k in keys)
    expected = [f"{k:05d}" for k in random.Random(42 + 4096).sample(range(100_000), 100)]
    assert keys == expected and passkey_keys(4096, 100) == keys
    assert passkey_keys(8192, 100) != keys
    assert len(set(passkey_keys(131072, 100_000))) == 100_000


@pytest.mark.parametrize("n", [0, 100_001, -3])
def test_trial_counts_out_of_range_are_rejected(n):
    """Zero, negative or more trials than there are 5-digit keys is a ValueError."""
    with pytest.raises(ValueError, match=rf"n_trials={n}: must be in \[1, 100000\]"):
        passkey_keys(4096, n)


# ---- prompts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [2048, 4096, 8192, 32768])
@pytest.mark.parametrize("template", ["default", "classic"])
def test_prompt_length_is_within_two_percent(length, template):
    """Prompts (with BOS) are within 2% of the requested context length at every depth."""
    filler = filler_sentences(length, TOK, template)
    for depth in (0.0, 0.5, 1.0):
        ids = TOK.encode_prompt(build_passkey_prompt(length, "00042", depth, TOK, template, filler))
        assert abs(len(ids) - length) <= 0.02 * length


def test_prompts_are_reproducible_and_differ_only_in_the_key():
    """Same (length, key, depth) -> same prompt; two keys -> prompts equal outside the needle digits."""
    a = build_passkey_prompt(4096, "12345", 0.5, TOK)
    assert a == build_passkey_prompt(4096, "12345", 0.5, TOK)
    b = build_passkey_prompt(4096, "67890", 0.5, TOK)
    assert len(a) == len(b) and a.replace("12345", "67890") == b
    assert build_passkey_prompt(8192, "12345", 0.5, TOK)[:2000] != a[:2000]


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_appears_once_at_the_requested_depth(depth):
    """The needle occurs exactly once, at a sentence boundary, at the requested fraction of the filler."""
    key = "04217"
    filler = filler_sentences(4096, TOK)
    text = build_passkey_prompt(4096, key, depth, TOK, filler=filler)
    needle = NEEDLE_TEMPLATE.format(key=key)
    assert text.count(needle) == 1 and text.count(key) == 1
    assert text.endswith(QUESTION)
    before = text.index(needle)
    filler_chars = len(text) - len(needle) - len(QUESTION)
    longest = max(len(s) for s in filler)
    assert abs(before - depth * filler_chars) <= longest / 2  # byte tokenizer: chars == tokens
    assert before == 0 or text[before - 1] == "."  # a sentence boundary
    assert not any(ch.isdigit() for ch in text[: -len(QUESTION)].replace(key, ""))  # digit-free filler


def test_classic_template_uses_the_literature_wording():
    """template='classic': instruction, grass/sky/sun filler, the pass-key needle and question."""
    text = build_passkey_prompt(2048, "31415", 0.5, TOK, template="classic")
    assert text.startswith("There is an important info hidden inside a lot of irrelevant text.")
    assert "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again." in text
    assert text.count(CLASSIC_NEEDLE.format(key="31415")) == 1
    assert text.endswith("What is the pass key? The pass key is")


def test_filler_is_fixed_per_length():
    """The filler depends on the length only (random.Random(length)), not on the key or depth."""
    assert filler_sentences(4096, TOK) == filler_sentences(4096, TOK)
    assert filler_sentences(4096, TOK) != filler_sentences(4097, TOK)


def test_bad_prompt_inputs_are_rejected():
    """Lengths below the overhead, depths outside [0, 1], malformed keys and templates raise ValueError."""
    overhead = prompt_overhead(TOK)
    with pytest.raises(ValueError, match="below the prompt overhead"):
        filler_sentences(overhead - 1, TOK)
    with pytest.raises(ValueError, match=r"depth=1.5: must be a fraction in \[0, 1\]"):
        build_passkey_prompt(4096, "12345", 1.5, TOK)
    with pytest.raises(ValueError, match="key='1234': must be 5 digits"):
        build_passkey_prompt(4096, "1234", 0.5, TOK)
    with pytest.raises(ValueError, match="template='fancy': must be one of"):
        build_passkey_prompt(4096, "12345", 0.5, TOK, template="fancy")


# ---- scoring ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (" 12345.", "12345"),
        (" 01234 and 56789", "01234"),
        ("key: 123456 then 54321", "54321"),  # 6 digits is not a 5-digit number
        ("abc 1234.", None),
        ("x12345", None),  # \b: glued to a word is not a standalone number
        ("", None),
    ],
)
def test_extract_takes_the_first_standalone_five_digit_number(text, expected):
    """Extraction is the first \\b(\\d{5})\\b match."""
    assert extract_passkey(text) == expected


def _fake_generate(answer_for):
    """A stand-in for generate() that answers from the prompt text, to pin the scoring path."""

    def generate(model, input_ids, max_new_tokens, temperature, top_p, stop_tokens, prefill_chunk, cache):
        assert temperature == 0.0 and cache is not None and max_new_tokens == 16 and prefill_chunk == 64
        rows = []
        for row in input_ids.tolist():
            text = TOK.decode(row)
            new = TOK.encode(answer_for(text))[:max_new_tokens]
            rows.append(row + new + [TOK.eos_id] * (max_new_tokens - len(new)))
        return torch.tensor(rows)

    return generate


@pytest.mark.parametrize(
    "answer_for, accuracy",
    [
        (lambda text: " " + pk.PASSKEY_RE.search(text).group(1) + ".", 1.0),  # an oracle reads the needle
        (lambda text: " 1" + pk.PASSKEY_RE.search(text).group(1)[1:] + ".", 0.0),  # wrong first digit
        (lambda text: " " + text[-1] * 3, 0.0),  # no number
    ],
)
def test_scoring_reads_only_the_new_tokens(model, monkeypatch, answer_for, accuracy):
    """Accuracy counts new-token answers equal to the key, per (length, depth) and per length."""
    import gptoss_lite.generation

    monkeypatch.setattr(gptoss_lite.generation, "generate", _fake_generate(answer_for))
    result = PasskeyEvaluator(
        model, lengths=[400, 600], depths=[0.0, 1.0], n_trials=3, prefill_chunk=64, batch_size=2
    ).run()
    assert result.accuracy == {400: accuracy, 600: accuracy}
    assert result.accuracy_by_depth[400] == {0.0: accuracy, 1.0: accuracy}
    assert len(result.trials) == 2 * 2 * 3
    assert {t["key"] for t in result.trials if t["length"] == 400} == set(passkey_keys(400, 3))


def test_run_with_a_real_model_reports_kv_bytes_and_extrapolation(model):
    """A cached greedy run returns accuracies in [0, 1], KV bytes growing with length, length/train ratios."""
    result = PasskeyEvaluator(model, lengths=[150, 300], depths=[0.5], n_trials=2, prefill_chunk=64, batch_size=2).run()
    assert set(result.accuracy) == {150, 300} and all(0.0 <= a <= 1.0 for a in result.accuracy.values())
    assert result.extrapolation == {150: 150 / 128, 300: 300 / 128}
    assert 0 < result.kv_payload_bytes[150] < result.kv_payload_bytes[300] <= result.kv_allocated_bytes[300]
    assert abs(result.prompt_tokens[300] - 300) <= 6
    assert result.verdict().startswith(("PASS: ", "FAIL: ")) and "at 300 tokens" in result.verdict()
    trials = json.loads(json.dumps(result.to_dict()))["trials"]  # every answer, to read a miss from the JSON
    assert len(trials) == 4 and {t["length"] for t in trials} == {150, 300}
    assert all(set(t) == {"length", "depth", "key", "answer", "correct"} for t in trials)


def test_speculative_run_gives_the_same_answers_and_reports_acceptance(model):
    """With prompt lookup the greedy answers are the plain run's; the result carries the speculation
    counters (in to_dict too)."""
    from gptoss_lite.speculative import PromptLookup

    kw = dict(lengths=[150], depths=[0.0, 1.0], n_trials=2, prefill_chunk=64, batch_size=2)
    plain = PasskeyEvaluator(model, **kw).run()
    spec = PasskeyEvaluator(model, speculate=PromptLookup(k=4, min_ngram=2), **kw).run()
    assert [t["answer"] for t in spec.trials] == [t["answer"] for t in plain.trials]
    assert plain.speculation is None
    s = spec.speculation
    assert s["new_tokens"] == 4 * 16 // 2 and s["target_forwards"] <= s["new_tokens"]  # per row, 2 batches
    assert 0.0 <= s["acceptance_rate"] <= 1.0 and json.loads(json.dumps(spec.to_dict()))["speculation"] == s
    with pytest.raises(TypeError, match="speculate: expected None, a PromptLookup or a DraftModel"):
        PasskeyEvaluator(model, speculate="lookup", **kw)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lengths": [20]}, r"context length 20: below the prompt overhead of \d+ tokens"),
        ({"n_trials": 0}, r"n_trials=0: must be in \[1, 100000\]"),
        ({"n_trials": 100_001}, r"n_trials=100001"),
        ({"depths": [-0.1]}, r"depth=-0.1: must be a fraction in \[0, 1\]"),
        ({"depths": []}, "depths is empty"),
        ({"lengths": [10**6]}, "context length 1000000: the model accepts 65536 positions"),
        ({"template": "fancy"}, "template='fancy'"),
        ({"prefill_chunk": 0}, "prefill_chunk=0: must be >= 1"),
    ],
)
def test_evaluator_rejects_bad_input(model, kwargs, match):
    """Bad evaluator arguments raise ValueError before any generation."""
    with pytest.raises(ValueError, match=match):
        PasskeyEvaluator(model, **{"lengths": [400], **kwargs})


def test_verdict_line_format():
    """The final line reads `PASS: 97.0% at 8192 tokens (>= 85%, ...)` / `FAIL: ...`."""
    result = pk.PasskeyResult(
        lengths=[4096, 8192],
        depths=[0.5],
        n_trials=100,
        template="default",
        accuracy={4096: 1.0, 8192: 0.97},
        accuracy_by_depth={4096: {0.5: 1.0}, 8192: {0.5: 0.97}},
        prompt_tokens={},
        kv_payload_bytes={},
        kv_allocated_bytes={},
        train_context_length=256,
    )
    assert result.verdict() == "PASS: 97.0% at 8192 tokens (>= 85%, 32x the training context)"
    result.accuracy[8192] = 0.5
    assert result.verdict().startswith("FAIL: 50.0% at 8192 tokens (< 85%")


# ---- CLI ----------------------------------------------------------------------------------------------


def test_cli_passkey_smoke(tmp_path, capsys):
    """`gptoss-lite passkey` prints the table, the depth grid, a PASS/FAIL line, writes the heatmap; exit 0."""
    from gptoss_lite.cli import main

    png = tmp_path / "heat.png"
    code = main(
        [
            "passkey",
            "--model",
            "lite-tiny",
            "--lengths",
            "300",
            "--depths",
            "start",
            "end",
            "--trials",
            "2",
            "--prefill-chunk",
            "128",
            "--batch-size",
            "2",
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "accuracy by depth" in out and "KV payload" in out
    assert out.strip().splitlines()[-1].startswith(("PASS: ", "FAIL: "))
    assert png.is_file() and png.stat().st_size > 1000


def test_cli_passkey_json(capsys):
    """--json prints the result mapping with the verdict."""
    from gptoss_lite.cli import main

    assert (
        main(
            [
                "passkey",
                "--model",
                "lite-tiny",
                "--lengths",
                "300",
                "--depths",
                "0.5",
                "--trials",
                "1",
                "--json",
                "--no-progress",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert set(data["accuracy"]) == {"300"} and data["verdict"].startswith(("PASS", "FAIL"))


def test_cli_passkey_zero_trials_exits_2(capsys):
    """--trials 0 is a clear error with exit code 2."""
    from gptoss_lite.cli import main

    assert main(["passkey", "--model", "lite-tiny", "--lengths", "300", "--trials", "0", "--no-progress"]) == 2
    assert "n_trials=0" in capsys.readouterr().err


# ---- the shipped demo model ---------------------------------------------------------------------


def test_shipped_demo_model_retrieves_at_2x_its_training_context():
    """The embedded default model finds the passkey at 2x its training context at every depth.

    A small regression guard on the model, the loader and the cached generation path together
    (4 keys x 3 depths at 8,192 tokens, a few seconds); the full curve to 131,072 tokens in
    docs/passkey.md#the-shipped-models-curve is the claim.
    """
    from gptoss_lite.checkpoint import DEFAULT_MODEL, load_model

    model = load_model(DEFAULT_MODEL)
    length = 2 * model.config.train_context_length
    result = PasskeyEvaluator(model, lengths=[length], n_trials=4, batch_size=4).run()
    assert result.accuracy[length] >= 0.8, result.accuracy_by_depth


def test_a_shared_haystack_gives_the_same_answers():
    """The trials of one length and depth share the haystack up to the needle: prefilled once and copied
    (the default), the shipped model gives every trial the answer it gives when each prompt is
    prefilled whole; and the shared tokens are counted."""
    from gptoss_lite.checkpoint import default_model_source, load_model
    from gptoss_lite.tokenizer import load_tokenizer

    source = default_model_source()
    model, tok = load_model(source), load_tokenizer(source)
    runs = {}
    for share in (True, False):
        ev = PasskeyEvaluator(
            model, tok, lengths=[700], depths=[0.0, 0.6, 1.0], n_trials=3, batch_size=2, share_prefix=share
        )
        runs[share] = (ev.run().trials, ev.shared_tokens)
    assert [t["answer"] for t in runs[True][0]] == [t["answer"] for t in runs[False][0]]
    assert runs[False][1] == 0 and runs[True][1] > 2 * 700  # depths 0.6 and 1.0 share most of 700 tokens
