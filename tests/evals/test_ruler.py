"""RULER suite: the docs/ruler.md protocol (trials, prompts, haystacks, scoring), the evaluator and the CLI."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from gptoss_lite.evals import harness
from gptoss_lite.evals.haystacks import HAYSTACKS, clean_text, haystack_units, stdlib_code, stdlib_docs
from gptoss_lite.evals.ruler import (
    NONE_ANSWER,
    TASKS,
    RulerEvaluator,
    RulerSuite,
    answer_tokens,
    build_prompt,
    extract_values,
    overhead_tokens,
    score_answer,
)
from gptoss_lite.evals.ruler_splits import EVAL, TRAIN
from gptoss_lite.fixtures import resolve_config
from gptoss_lite.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model():
    from gptoss_lite.model import GPTOSS

    torch.manual_seed(0)
    return GPTOSS(resolve_config("lite-tiny").replace(train_context_length=128)).prepare_for_inference()


def _haystack_text(trial, prompt: str) -> str:
    """The prompt without its intro, needles and question."""
    body = prompt[len(trial.intro) : len(prompt) - len(trial.question)]
    for _, text in trial.inserts:
        body = body.replace(text, "", 1)
    return body


# ---- trials and prompts ---------------------------------------------------------------------------------


def test_trials_are_deterministic_and_shared_across_haystacks():
    """Same suite -> same trials and prompts; the needles and answers of a trial do not depend on the
    haystack; another seed draws other answers; families go round robin."""
    suite = RulerSuite(lengths=(1024,), n_trials=4)
    for task in TASKS:
        a = suite.trials(task, 1024, "noise")
        assert a == suite.trials(task, 1024, "noise")
        assert [build_prompt(t, TOK) for t in a] == [build_prompt(t, TOK) for t in suite.trials(task, 1024, "noise")]
        b = suite.trials(task, 1024, "stdlib-docs")
        assert [t.expected for t in a] == [t.expected for t in b] and [t.question for t in a] == [t.question for t in b]
        assert [t.family for t in a] == ["magic", "filed", "ledger", "magic"]
    other = RulerSuite(lengths=(1024,), n_trials=4, seed=7)
    assert [t.expected for t in other.trials("single-number", 1024, "noise")] != [
        t.expected for t in suite.trials("single-number", 1024, "noise")
    ]


@pytest.mark.parametrize("haystack", EVAL.haystacks + TRAIN.haystacks)
@pytest.mark.parametrize("length", [1024, 2500])
def test_prompts_fill_the_length_exactly(haystack, length):
    """With the byte tokenizer every prompt (BOS included) is exactly the requested length."""
    split = "eval" if haystack in EVAL.haystacks else "train"
    suite = RulerSuite(lengths=(length,), n_trials=3, split=split)
    for task in TASKS:
        for trial in suite.trials(task, length, haystack):
            assert len(TOK.encode_prompt(build_prompt(trial, TOK))) == length


@pytest.mark.parametrize("haystack", EVAL.haystacks)
def test_answers_are_in_the_prompt_at_the_depth_they_claim(haystack):
    """Every needle occurs once, at the unit boundary nearest its depth (within half the longest unit);
    every expected value is in the prompt; an abstention prompt holds no needle and no digit."""
    suite = RulerSuite(lengths=(3000,), n_trials=6)
    for task in TASKS:
        for trial in suite.trials(task, 3000, haystack):
            prompt = build_prompt(trial, TOK)
            hay = _haystack_text(trial, prompt)
            units = haystack_units(haystack, random.Random(trial.seed), len(hay), TOK)
            assert "".join(units) == hay
            slack = max(map(len, units)) / 2 + 1
            before = 0  # needle characters earlier in the prompt
            for depth, text in trial.inserts:
                assert prompt.count(text) == 1
                at = prompt.index(text) - len(trial.intro) - before
                assert abs(at - depth * len(hay)) <= slack, (task, depth, at, len(hay))
                before += len(text)
            assert prompt.endswith(trial.question)
            if task == "none":
                assert trial.inserts == () and trial.expected == (NONE_ANSWER,)
                assert not re.search(r"\d", prompt)
            else:
                assert all(v in "".join(t for _, t in trial.inserts) for v in trial.expected)
            if task.startswith("single-") or task == "multi-key":
                (label,) = [w for w in EVAL.labels if f"the {w} " in trial.question]
                asked = [t for _, t in trial.inserts if f"the {label} " in t]
                assert len(asked) == 1 and trial.expected[0] in asked[0]


def test_multi_tasks_hide_the_right_number_of_needles():
    """multi-key: 1 asked + 3 distractors; multi-value / multi-query: 4; var-track: 2 chains of 5; single: 1."""
    suite = RulerSuite(lengths=(2000,), n_trials=3)
    sizes = {"single-number": 1, "single-word": 1, "single-uuid": 1, "multi-key": 4, "multi-value": 4}
    sizes |= {"multi-query": 4, "var-track": 10, "none": 0}
    for task, n in sizes.items():
        for trial in suite.trials(task, 2000, "sentences"):
            assert len(trial.inserts) == n
            assert [d for d, _ in trial.inserts] == sorted(d for d, _ in trial.inserts)
    (trial,) = RulerSuite(lengths=(2000,), n_trials=1).trials("var-track", 2000, "noise")
    chain = trial.expected
    assert len(chain) == 5 and not any(n in trial.question for n in chain)
    links = "".join(t for _, t in trial.inserts)
    for prev, name in zip(chain, chain[1:]):  # each name copies the previous one, after it
        assert f"{name} = VAR {prev}" in links and links.index(f"VAR {prev} =") < links.index(f"VAR {name} =")


def test_haystacks_have_no_digits_and_no_eval_words():
    """No haystack kind holds a digit or a non-ASCII character (they would be accidental distractors or
    split by the byte tokenizer), and none holds a label or value word of either split."""
    texts = {"stdlib-docs": "".join(stdlib_docs()), "stdlib-code": "".join(stdlib_code())}
    for kind in ("noise", "sentences", "procedural", "varied"):
        texts[kind] = "".join(haystack_units(kind, random.Random(kind), 50_000, TOK))
    assert len(texts["stdlib-docs"]) > 100_000 and len(texts["stdlib-code"]) > 500_000
    words = {w.lower() for text in texts.values() for w in re.findall(r"[A-Za-z]+", text)}
    for kind, text in texts.items():
        assert not re.search(r"\d", text), kind
        assert text.isascii(), kind
    assert not words & (set(EVAL.labels) | set(EVAL.words) | set(TRAIN.labels) | set(TRAIN.words))
    assert clean_text("a1b2 \u00e9c") == "ab c"


def test_stdlib_haystack_windows_are_contiguous():
    """stdlib-code units are consecutive source lines from a seeded start; another seed starts elsewhere."""
    code = stdlib_code()
    units = haystack_units("stdlib-code", random.Random(1), 2000, TOK)
    start = random.Random(1).randrange(len(code))  # the stream's first draw
    assert list(code[start : start + len(units) - 1]) == units[:-1]
    assert haystack_units("stdlib-code", random.Random(2), 2000, TOK)[0] != units[0]
    assert all(u.startswith("\n") for u in units) and all(u.startswith(" ") for u in stdlib_docs())


# ---- scoring --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, text, expected",
    [
        ("number", " 12345, 67890 and 12345.", ["12345", "67890"]),
        ("number", " 123456 then 54321", ["54321"]),
        ("uuid", " 0a1b2c3d-0000-4aaa-8bbb-0123456789ab.", ["0a1b2c3d-0000-4aaa-8bbb-0123456789ab"]),
        ("name", " ABCDE, FGHIJ and ABCDEF.", ["ABCDE", "FGHIJ"]),
        ("word", " The Saffron, not marigold.", ["saffron", "marigold"]),
        ("none", " None.", [NONE_ANSWER]),
        ("none", " nonexistent", []),
        ("none", " it is none", []),
    ],
)
def test_extract_values(kind, text, expected):
    """Values of each kind in order, without repeats; words only from the vocabulary; `none` first."""
    assert extract_values(kind, text, EVAL.words) == expected


def test_score_is_the_share_of_the_first_k_values_that_are_expected():
    """One expected value: the first value found must be it; k values: |first k found & expected| / k."""
    suite = RulerSuite(lengths=(2000,), n_trials=1)
    (single,) = suite.trials("multi-key", 2000, "noise")
    (multi,) = suite.trials("multi-value", 2000, "noise")
    (none,) = suite.trials("none", 2000, "noise")
    v = single.expected[0]
    assert score_answer(single, f" {v}.") == 1.0
    assert score_answer(single, " 00000 or " + v) == (1.0 if v == "00000" else 0.0)  # a distractor first
    a, b, c, d = multi.expected
    assert score_answer(multi, f" {a}, {b}, {c} and {d}.") == 1.0
    assert score_answer(multi, f" {d}, 99999, 88888, {b}, {a}") == 0.5  # only the first four count
    assert score_answer(multi, f" {a}, {a}, {a}, {a}") == 0.25  # repeats count once
    assert score_answer(none, " none.") == 1.0 and score_answer(none, f" {v}") == 0.0


def test_answer_budget_fits_the_expected_answer():
    """The new-token budget holds every expected answer written out as ' a, b, c and d.' with room to spare."""
    suite = RulerSuite(lengths=(2000,), n_trials=5)
    for task in TASKS:
        for trial in suite.trials(task, 2000, "noise"):
            written = " " + ", ".join(trial.expected) + "."
            assert len(TOK.encode(written)) < answer_tokens(task, EVAL.words)


# ---- evaluator ------------------------------------------------------------------------------------------


def _oracle(answer_for):
    """A stand-in for greedy_new_texts that answers each prompt from a {prompt: answer} table."""

    def greedy_new_texts(model, tokenizer, ids, max_new_tokens, kv, prefill_chunk):
        return [answer_for(tokenizer.decode(row[1:])) for row in ids.tolist()], None

    return greedy_new_texts


@pytest.mark.parametrize("mode, score", [("right", 1.0), ("wrong", 0.0)])
def test_run_scores_what_the_model_answers(model, monkeypatch, mode, score):
    """An oracle that writes the expected answers scores 1 in every cell; one that writes 99999 scores 0."""
    suite = RulerSuite(lengths=(1500, 1800), n_trials=3, haystacks=("noise", "stdlib-code"))
    table = {}
    for h in suite.haystack_kinds:
        for task in TASKS:
            for n in suite.lengths:
                for t in suite.trials(task, n, h):
                    table[build_prompt(t, TOK)] = " " + ", ".join(t.expected) + "." if mode == "right" else " 99999."
    monkeypatch.setattr(harness, "greedy_new_texts", _oracle(table.__getitem__))
    result = RulerEvaluator(model, suite, batch_size=2).run()
    assert all(v == score for h in result.score.values() for row in h.values() for v in row.values())
    assert len(result.trials) == 2 * len(TASKS) * 2 * 3
    assert result.prompt_tokens == {1500: 1500, 1800: 1800}
    assert result.overall(1500) == score and result.mean("none", 1800) == score


def test_run_with_a_real_model_is_greedy_and_serialisable(model):
    """A cached greedy run gives scores in [0, 1], the same answers twice, and a JSON-able result."""
    suite = RulerSuite(lengths=(700,), n_trials=2, tasks=("single-number", "none"), haystacks=("noise",))
    first = RulerEvaluator(model, suite, prefill_chunk=128).run()
    again = RulerEvaluator(model, suite, prefill_chunk=128, batch_size=1).run()
    assert [t["answer"] for t in first.trials] == [t["answer"] for t in again.trials]
    assert all(0.0 <= v <= 1.0 for row in first.score["noise"].values() for v in row.values())
    data = json.loads(json.dumps(first.to_dict()))
    assert data["split"] == "eval" and data["haystacks"] == ["noise"] and data["train_context_length"] == 128


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tasks": ("needle",)}, "task 'needle': must be one of single-number"),
        ({"tasks": ()}, "tasks is empty"),
        ({"haystacks": ("procedural",)}, "haystack 'procedural': belongs to the other split, not eval"),
        ({"haystacks": ("web",)}, "haystack 'web': must be one of noise"),
        ({"families": ("code",)}, "template family 'code': not in the eval split, whose families are magic"),
        ({"split": "test"}, r"split='test': must be one of \('train', 'eval'\)"),
        ({"n_trials": 0}, "n_trials=0: must be >= 1"),
        ({"lengths": (0,)}, "context length=0: must be >= 1"),
    ],
)
def test_suite_rejects_bad_input(kwargs, match):
    """Bad suite arguments are ValueErrors naming the value and what is allowed."""
    with pytest.raises(ValueError, match=match):
        RulerSuite(**kwargs)


def test_evaluator_rejects_lengths_the_model_or_the_prompt_cannot_hold(model):
    """Lengths below a task's needles and question, or beyond the model's positions, fail before any generation."""
    short = RulerSuite(lengths=(300,), tasks=("multi-query",), n_trials=3)
    need = max(overhead_tokens(t, TOK) for t in short.trials("multi-query", 300, "noise"))
    with pytest.raises(ValueError, match=rf"context length 300: below the {need} tokens that task multi-query"):
        RulerEvaluator(model, short)
    with pytest.raises(ValueError, match="context length 100000: the model accepts 65536 positions"):
        RulerEvaluator(model, RulerSuite(lengths=(100_000,)))
    with pytest.raises(ValueError, match="batch_size=0: must be >= 1"):
        RulerEvaluator(model, RulerSuite(), batch_size=0)
    with pytest.raises(TypeError, match="suite: expected a RulerSuite"):
        RulerEvaluator(model, {"lengths": [1024]})


def test_every_haystack_kind_belongs_to_exactly_one_split():
    """The split's haystacks partition the known kinds; at least one kind is eval-only real text."""
    assert sorted(EVAL.haystacks + TRAIN.haystacks) == sorted(HAYSTACKS)
    assert {"stdlib-docs", "stdlib-code"} <= set(EVAL.haystacks)


# ---- CLI ------------------------------------------------------------------------------------------------


def test_cli_ruler_smoke(tmp_path, capsys):
    """`gptoss-lite ruler` prints a task x length table per haystack and the mean, writes the heatmap; exit 0."""
    from gptoss_lite.cli import main

    png = tmp_path / "ruler.png"
    argv = ["ruler", "--model", "lite-tiny", "--lengths", "400", "600", "--tasks", "single-number", "none"]
    argv += ["--haystacks", "noise", "stdlib-code", "--trials", "2", "--threads", "1", "--no-progress"]
    assert main(argv + ["--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "haystack noise" in out and "haystack stdlib-code" in out and "mean over 2 haystacks" in out
    assert re.search(r"single-number +\d+\.\d +\d+\.\d", out)
    assert out.strip().splitlines()[-1].startswith("mean score over all cells: ")
    assert png.is_file() and png.stat().st_size > 1000


def test_cli_ruler_json(capsys):
    """--json prints the result mapping: every cell, the means, every trial (here through an int8 cache)."""
    from gptoss_lite.cli import main

    argv = ["ruler", "--model", "lite-tiny", "--lengths", "500", "--tasks", "single-word", "--trials", "1"]
    argv += ["--kv-format", "int8"]
    assert main(argv + ["--haystacks", "sentences", "--json", "--no-progress", "--threads", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["score"]) == {"sentences"} and set(data["score"]["sentences"]["single-word"]) == {"500"}
    assert len(data["trials"]) == 1 and data["model"] == "lite-tiny"


def test_cli_ruler_workers_give_the_one_process_result(capsys):
    """--workers 2 splits the cells over two processes and merges them: every score and every trial's
    answer equal the one-process run's, in the same order."""
    from gptoss_lite.cli import main

    argv = ["ruler", "--model", "lite-tiny", "--lengths", "600", "700", "--tasks", "single-number", "none"]
    argv += ["--haystacks", "noise", "stdlib-code", "--trials", "2", "--json", "--no-progress", "--threads", "1"]
    assert main(argv) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(argv + ["--workers", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two == one and len(one["trials"]) == 16


def test_cli_ruler_out_writes_the_json_beside_the_table(tmp_path, capsys):
    from gptoss_lite.cli import main

    out = tmp_path / "r.json"
    argv = ["ruler", "--model", "lite-tiny", "--lengths", "600", "--tasks", "none", "--haystacks", "noise"]
    assert main(argv + ["--trials", "1", "--no-progress", "--threads", "1", "--out", str(out)]) == 0
    assert "RULER suite" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["tasks"] == ["none"] and len(data["trials"]) == 1 and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize(
    "args, match",
    [
        (["--workers", "0"], "--workers 0: must be >= 1"),
        (["--tasks", "needle"], "argument --tasks: invalid choice: 'needle'"),
        (["--haystacks", "varied"], "haystack 'varied': belongs to the other split, not eval"),
        (["--split", "train", "--templates", "magic"], "template family 'magic': not in the train split"),
        (["--trials", "0"], "n_trials=0: must be >= 1"),
        (["--lengths", "-5"], "context length=-5: must be >= 1"),
    ],
)
def test_cli_ruler_bad_input_fails_before_the_model_loads(monkeypatch, capsys, args, match):
    """Bad names, counts and lengths exit 2 with a clear message, without loading a model."""
    from gptoss_lite.cli import main
    from gptoss_lite.commands import common

    def boom(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(common, "load_model_and_tokenizer", boom)
    try:
        code = main(["ruler", "--no-progress", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code == 2
    assert match in capsys.readouterr().err


def test_cli_ruler_bad_plot_path_fails_before_the_model_loads(monkeypatch, tmp_path, capsys):
    """--plot into a missing directory exits 2 before anything runs."""
    from gptoss_lite.cli import main
    from gptoss_lite.commands import common

    monkeypatch.setattr(common, "load_model_and_tokenizer", lambda args: (_ for _ in ()).throw(AssertionError))
    assert main(["ruler", "--plot", str(tmp_path / "missing" / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
