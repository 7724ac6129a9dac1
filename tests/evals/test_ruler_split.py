"""The RULER suite's eval split shares nothing with its train split or with the training data generator."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from gptoss_lite.evals.passkey import CLASSIC_FILLER, FILLER_SENTENCES
from gptoss_lite.evals.ruler_splits import EVAL, SPLITS, TRAIN
from gptoss_lite.prompts import CLASSIC_NEEDLE, CLASSIC_QUESTION, NEEDLE_TEMPLATE, QUESTION

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(REPO.glob("configs/demo_cpu*.yaml"))
MIN_FRAGMENT = 8  # characters (spaces not counted): shorter pieces such as ' ->' or ' is' are ordinary text


def fragments(template: str) -> set[str]:
    """The fixed pieces of a template between its placeholders, long enough to be distinctive."""
    return {p for p in re.split(r"\{\w+\}", template) if len(p.replace(" ", "")) >= MIN_FRAGMENT}


def eval_fragments() -> set[str]:
    return {p for f in EVAL.families for s in f.strings() for p in fragments(s)}


def train_documents(config: Path, n: int = 400) -> str:
    """`n` documents of the training data generator under `config`, decoded and joined."""
    from gptoss_lite.train.config import load_train_config
    from gptoss_lite.train.data import SyntheticRetrievalData

    data = SyntheticRetrievalData(load_train_config(config).data)
    docs = []
    for i in range(n):
        tokens, _ = data.document(random.Random(f"ruler-split-test/{config.name}/{i}"))
        docs.append(data.tokenizer.decode(tokens))
    return "\n".join(docs)


def test_the_configs_are_found():
    """The training configs the data check samples from exist (so the check below is not vacuous)."""
    names = [p.name for p in CONFIGS]
    assert names == ["demo_cpu.yaml", "demo_cpu_stage2.yaml", "demo_cpu_stage3.yaml", "demo_cpu_stage4.yaml"]


def test_splits_share_no_family_word_or_haystack():
    """No family name, label word, value word or haystack kind is in both splits."""
    assert set(SPLITS) == {"train", "eval"}
    assert not {f.name for f in EVAL.families} & {f.name for f in TRAIN.families}
    every_train_word = set(TRAIN.labels) | set(TRAIN.words)
    assert not (set(EVAL.labels) | set(EVAL.words)) & every_train_word
    assert not set(EVAL.labels) & set(EVAL.words)
    assert not set(EVAL.haystacks) & set(TRAIN.haystacks)


def test_no_eval_template_piece_is_in_a_train_template_and_back():
    """No distinctive fixed piece of an eval template occurs in a train template, nor a train piece in
    an eval template; the training data's passkey wording is in no eval template either."""
    train_text = "\n".join(s for f in TRAIN.families for s in f.strings())
    assert eval_fragments() and not [p for p in eval_fragments() if p in train_text]
    eval_text = "\n".join(s for f in EVAL.families for s in f.strings())
    train_pieces = {p for f in TRAIN.families for s in f.strings() for p in fragments(s)}
    for s in (NEEDLE_TEMPLATE, QUESTION, CLASSIC_NEEDLE, CLASSIC_QUESTION):
        train_pieces |= fragments(s)
    assert train_pieces and not [p for p in train_pieces if p in eval_text]


def test_eval_words_are_in_no_training_word_bank():
    """Eval label and value words are in none of the training filler's word banks."""
    from gptoss_lite import filler

    banks = {
        w.lower()
        for name in dir(filler)
        if isinstance(getattr(filler, name), tuple)
        for item in getattr(filler, name)
        if isinstance(item, str)
        for w in re.findall(r"[A-Za-z]+", item)
    }
    assert len(banks) > 500  # the varied bank is really read
    assert not (set(EVAL.labels) | set(EVAL.words)) & banks


def test_train_split_haystacks_are_the_training_fillers():
    """Every filler the training data can use is a train-split haystack kind (so never an eval one), and
    the RULER documents accept train-split kinds only."""
    from gptoss_lite.filler import FILLERS
    from gptoss_lite.train.config import DataConfig

    assert set(FILLERS) < set(TRAIN.haystacks)
    DataConfig(ruler_haystacks=TRAIN.haystacks)
    for kind in EVAL.haystacks:
        with pytest.raises(ValueError, match="never trained on"):
            DataConfig(ruler_haystacks=("varied", kind))


def test_the_code_haystacks_read_disjoint_modules_and_training_code_has_no_docstrings():
    """`train-code` reads none of the eval haystacks' modules, and holds no docstring sentence of them
    nor of its own modules (prose stays an untrained kind)."""
    from gptoss_lite.evals.haystacks import STDLIB_MODULES, TRAIN_STDLIB_MODULES, stdlib_code, train_code

    assert TRAIN_STDLIB_MODULES and not set(TRAIN_STDLIB_MODULES) & set(STDLIB_MODULES)
    code = {line.strip() for line in train_code()}
    shared = code & {line.strip() for line in stdlib_code()}  # common lines such as 'return result'
    assert len(code) > 10_000 and len(shared) < 0.05 * len(code)
    text = "".join(train_code())
    assert '"""Heap queue algorithm' not in text and "Support to pretty-print lists" not in text
    assert "def pformat(" in text  # pprint's code is there, its module docstring is not


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_training_documents_hold_no_eval_material(config):
    """Sampled documents of gptoss_lite.train.data hold no eval template piece, no eval label or value
    word and no sentence of an eval haystack."""
    text = train_documents(config)
    words = {w.lower() for w in re.findall(r"[A-Za-z]+", text)}
    assert len(text) > 100_000 and "The passkey is" in text  # documents really were generated
    assert not [p for p in eval_fragments() if p in text]
    assert not (set(EVAL.labels) | set(EVAL.words)) & words
    assert not [s for s in FILLER_SENTENCES + CLASSIC_FILLER if s.strip() in text]
