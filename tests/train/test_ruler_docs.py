"""RULER-style training documents (gptoss_lite.train.ruler_docs): what they ask is answerable from what
they hold, an absent label is really absent, and every train haystack kind assembles to seq_len + 1."""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from gptoss_lite.evals.ruler_splits import TRAIN
from gptoss_lite.train.config import DataConfig
from gptoss_lite.train.data import IGNORE_INDEX, SyntheticRetrievalData
from gptoss_lite.train.ruler_docs import MIXES, RELATIONS, RULER_TASKS, ruler_document

N_DOCS = 600
MIX = pytest.mark.parametrize("mix", sorted(MIXES))


def docs(mix: int = 1):
    return [ruler_document(random.Random(f"ruler-docs-test/{i}"), mix=mix) for i in range(N_DOCS)]


@MIX
def test_every_task_occurs_and_the_answer_is_in_a_needed_needle(mix):
    seen = Counter()
    for doc in docs(mix):
        seen[doc.task] += 1
        values = re.findall(r"[^ ,.]+(?:-[0-9a-f]+)*", doc.answer)
        if doc.task == "none":
            assert doc.answer == " none." and not any(doc.needed)
            continue
        needed = [n for n, k in zip(doc.needles, doc.needed) if k]
        assert needed, doc
        for value in values:
            assert any(value in n for n in needed), (value, doc)
        if doc.task in ("single", "multi-key"):
            assert len(values) == 1 and sum(doc.needed) == 1
            assert not any(values[0] in n for n, k in zip(doc.needles, doc.needed) if not k)  # distractors differ
        if doc.task in ("multi-value", "multi-query"):
            assert len(values) == len(needed) >= 2
    assert set(seen) == set(RULER_TASKS) and min(seen.values()) >= 20


@MIX
def test_the_asked_label_is_in_the_question_and_absent_only_for_none(mix):
    """The question names the asked labels; the needed needles name them and the distractors do not; a
    `none` document has no needle naming its asked label. The label vocabulary is large."""
    labels_seen = set()
    for doc in docs(mix):
        assert doc.asked and all(a.lower() in doc.question.lower() for a in doc.asked)
        labels_seen.update(doc.asked)
        for needle, needed in zip(doc.needles, doc.needed):
            names_asked = any(a.lower() in needle.lower() for a in doc.asked)
            assert names_asked == needed, doc
    assert len(labels_seen) > 300


@MIX
def test_no_eval_word_and_values_have_their_kinds(mix):
    from gptoss_lite.evals.ruler_splits import EVAL

    banned = set(EVAL.labels) | set(EVAL.words)
    kinds, digits = Counter(), Counter()
    for doc in docs(mix):
        text = doc.intro + "".join(doc.needles) + doc.question + doc.answer
        assert not banned & {w.lower() for w in re.findall(r"[A-Za-z]+", text)}
        value = doc.answer.strip(" .").split(", ")[0]
        if re.fullmatch(r"\d+", value):
            digits[len(value)] += 1
            kinds["number"] += 1
        elif re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}", value):
            kinds["uuid"] += 1
        elif value != "none":
            assert re.fullmatch(r"[a-z]+", value), value
            kinds["word"] += 1
    assert min(kinds.values()) >= 50 and len(kinds) == 3
    assert set(digits) == set(MIXES[mix].number_digits)


def test_mix_2_adds_cues_that_end_on_a_preposition_and_asks_more_distractors():
    """The second grammar holds every relation of the first plus cues ending on a preposition; its
    multi-key documents carry at least 2 distractors and its values are more often words and UUIDs."""
    two = MIXES[2]
    assert set(RELATIONS) < set(two.relations)
    endings = {cue.split()[-1] for r in two.relations for cue in r.cues}
    assert {"under", "in", "to", "for", "with", "at", "as"} <= endings
    sample = docs(2)
    many = [doc for doc in sample if doc.task == "multi-key"]
    assert many and all(len(doc.needles) >= 3 for doc in many)
    non_numbers = sum(not re.fullmatch(r" [\d, ]+\.", doc.answer) for doc in sample if doc.task == "single")
    singles = sum(doc.task == "single" for doc in sample)
    assert non_numbers > 0.45 * singles


def test_an_unknown_mix_is_refused():
    for bad in (0, 3, "2", True):
        with pytest.raises(ValueError, match="ruler_mix"):
            DataConfig(ruler_mix=bad)


@pytest.mark.parametrize("kind", TRAIN.haystacks)
def test_documents_assemble_in_every_train_haystack(kind):
    """seq_len + 1 tokens; the question ends the prompt, the answer (and EOS) the document; only the
    answer is scored; on code every needle is a line of its own."""
    cfg = DataConfig(
        seq_len=256, batch_size=8, seed=3, passkey_weight=0, kv_weight=0, copy_weight=0, ruler_weight=1,
        ruler_haystacks=(kind,), loss_on="answer",
    )  # fmt: skip
    data = SyntheticRetrievalData(cfg)
    tok = data.tokenizer
    for i in range(40):
        tokens, start, doc, used = data.ruler_tokens(random.Random(f"assemble/{kind}/{i}"))
        assert used == kind
        assert len(tokens) == 257 and tokens[0] == tok.bos_id and tokens[-1] == tok.eos_id
        prompt, answer = tok.decode(tokens[1:start]), tok.decode(tokens[start:-1])
        assert prompt.endswith(doc.question) and answer == doc.answer
        for needle, needed in zip(doc.needles, doc.needed):
            shown = "\n" + needle.lstrip(" ") if kind == "train-code" else needle
            assert shown in prompt or not needed  # only distractors may be dropped for room
            if kind == "train-code" and shown in prompt:
                assert prompt.index(shown) + len(shown) == len(prompt) - len(doc.question) or (
                    prompt[prompt.index(shown) + len(shown)] == "\n"
                )  # a line of its own
    x, y = data.batch(0)
    for row in y:
        kept = (row != IGNORE_INDEX).nonzero().flatten()
        assert 3 <= len(kept) <= 60 and kept[-1].item() == 255
