"""RULER-style training documents: retrieval by label matching, over many phrasings (docs/training.md).

The `ruler` task of `gptoss_lite.train.data`. A document hides facts ("the anvil" -> 41377) in a
haystack and asks for one of them, or for one that is not there (the answer is then `none`). Unlike
the passkey documents it never relies on one wording: every part is drawn from a small grammar.

- Labels: the train split's label words, the filler's nouns and made-up words, mostly rendered
  "the <word>"; a fact's value is a 5-digit number, a word or a UUID-like hex code.
- A needle states a fact in one of `RELATIONS`; the question is an `ASKS` sentence, an optional
  `HINTS` sentence (says that `none` is an answer) and a cue: the relation's own cue (with or
  without the label) or a generic one. So the cue often does not repeat the words that precede the
  value in the needle, and the model has to find the label, not a fixed phrase.
- Tasks (`RULER_TASKS`): single (one needle), multi-key (the asked needle and 1-3 of other labels,
  in the same relation), none (the asked label is absent; other needles may be there), multi-value
  (2-3 values of one label, all asked) and multi-query (2-3 labels, all asked, in order).
- Haystacks: the train split's kinds (`ruler_haystacks` of the data config): filler sentences, the
  `echo` repetition and `train-code` (source lines of stdlib modules the evaluation never uses, no
  docstrings); on a line kind each needle is a line of its own.

NOTE: nothing here may overlap the evaluation split (`gptoss_lite.evals.ruler_splits.EVAL`): its
template pieces, label and value words are checked against sampled documents by
tests/evals/test_ruler_split.py, and `_word_bank` drops any eval word outright.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from gptoss_lite.evals.ruler import NONE_ANSWER

RULER_TASKS = ("single", "multi-key", "none", "multi-value", "multi-query")
RULER_TASK_WEIGHTS = (0.36, 0.30, 0.20, 0.07, 0.07)
VALUE_KINDS = ("number", "word", "uuid")

# What a value is called in a question: "the {attr} of the anvil".
ATTRS = (
    "code",
    "number",
    "secret value",
    "key",
    "password",
    "tag",
    "pin",
    "token",
    "serial",
    "reference",
    "mark",
    "setting",
    "answer",
    "entry",
    "combination",
    "ticket",
    "value",
    "word",
    "record",
    "id",
)


@dataclass(frozen=True)
class Relation:
    """How a fact is stated ({L} label, {V} value, {A} attribute) and the cues that belong to it."""

    needle: str
    cues: tuple[str, ...]  # each may hold {L} and {A}; the answer follows


RELATIONS = (
    Relation(" The {A} for {L} is {V}.", (" The {A} for {L} is", " The {A} is", " For {L} it is")),
    Relation(" The {A} of {L} is {V}.", (" The {A} of {L} is", " Its {A} is", " The {A} of {L}, as given, is")),
    Relation(" {Lc} has the {A} {V}.", (" {Lc} has the {A}", " It has the {A}", " The {A} it has is")),
    Relation(" Remember: {L} -> {V}.", (" {L} ->", " Remembered: {L} ->", " Answer:")),
    Relation(" {Lc} = {V}.", (" {Lc} =", " {Lc} equals", " Value:")),
    Relation(" Record for {L}: {V}.", (" Record for {L}:", " Record:", " The record says")),
    Relation(" {Lc} is paired with {V}.", (" {Lc} is paired with", " It is paired with", " Its partner is")),
    Relation(" {Lc} was assigned {V}.", (" {Lc} was assigned", " It was assigned", " Assigned:")),
    Relation(" The {A} assigned to {L} is {V}.", (" The {A} assigned to {L} is", " Assigned to {L}:", " It is")),
    Relation(" For {L}, the {A} is {V}.", (" For {L}, the {A} is", " The {A} is", " For {L}, it is")),
    Relation(" Keep this in mind: {L} goes with {V}.", (" {Lc} goes with", " It goes with", " The answer is")),
    Relation(" {Lc} maps to {V}.", (" {Lc} maps to", " It maps to", " The mapping gives")),
    Relation(" Entry - {L}: {V}.", (" Entry - {L}:", " {Lc}:", " The entry reads")),
    Relation(" {Lc} is linked to the {A} {V}.", (" {Lc} is linked to the {A}", " It is linked to", " Linked {A}:")),
    Relation(" Hidden {A} of {L}: {V}.", (" Hidden {A} of {L}:", " The hidden {A} is", " Found:")),
    Relation(" We wrote down {V} for {L}.", (" For {L} we wrote down", " We wrote down", " What was written:")),
    Relation(" {V} is the {A} of {L}.", (" The {A} of {L} is", " It is", " The answer:")),
    Relation(" Store {V} with {L}.", (" Stored with {L}:", " The stored {A} is", " Stored:")),
    Relation(" {Lc} reads {V}.", (" {Lc} reads", " It reads", " Reading:")),
    Relation(" Fact: {L} carries {V}.", (" {Lc} carries", " It carries", " The fact gives")),
)
ASKS = (
    "\nWhat is the {A} for {L}?",
    "\nWhat is the {A} of {L}?",
    "\nWhich {A} belongs to {L}?",
    "\nTell me the {A} that goes with {L}.",
    "\nQuestion: what was {L} paired with?",
    "\nFind the {A} of {L}.",
    "\nRecall what {L} maps to.",
    "\nWhat did the text say about {L}?",
    "\nGive the {A} recorded for {L}.",
    "\nWhat goes with {L}?",
    "\n{Lc}: which {A}?",
    "\nQuestion: the {A} for {L}?",
    "\nSearch the text for {L}. What {A} does it have?",
    "\nI need the {A} of {L}.",
)
HINTS = (
    " If there is none, say none.",
    " Answer none if it is missing.",
    " If it does not appear, reply none.",
    " When absent, the answer is none.",
    " Reply none if not given.",
    " If you cannot find it, write none.",
)
# Mix 2 adds relations whose cue ends on a preposition, a verb or a participle ("It was stored
# under"), the shape of a cue that does not end on "is", ":" or "->".
RELATIONS_2 = (
    Relation(" {Lc} was stored under {V}.", (" {Lc} was stored under", " It was stored under", " Stored under")),
    Relation(" {Lc} was kept in {V}.", (" {Lc} was kept in", " It was kept in", " It is kept in")),
    Relation(" {Lc} was sent to {V}.", (" {Lc} was sent to", " It was sent to", " They sent it to")),
    Relation(" {Lc} is listed as {V}.", (" {Lc} is listed as", " It is listed as", " Listed as")),
    Relation(" {Lc} is known as {V}.", (" {Lc} is known as", " It is known as", " Known as")),
    Relation(" {Lc} was traded for {V}.", (" {Lc} was traded for", " It was traded for", " Traded for")),
    Relation(" {Lc} was marked with {V}.", (" {Lc} was marked with", " It was marked with", " Marked with")),
    Relation(" {Lc} ended up in {V}.", (" {Lc} ended up in", " It ended up in", " In the end it was in")),
    Relation(" {Lc} was sorted into {V}.", (" {Lc} was sorted into", " It was sorted into", " Sorted into")),
    Relation(" {Lc} points to {V}.", (" {Lc} points to", " It points to", " Pointing to")),
    Relation(" {Lc} was left at {V}.", (" {Lc} was left at", " It was left at", " Where it was left:")),
    Relation(" {Lc} got renamed {V}.", (" {Lc} got renamed", " It got renamed", " The new name is")),
    Relation(" They labelled {L} {V}.", (" They labelled {L}", " They labelled it", " The label became")),
    Relation(" {Lc} belongs with {V}.", (" {Lc} belongs with", " It belongs with", " It goes along with")),
)
ASKS_2 = (
    "\nWhere was {L} stored?",
    "\nUnder which {A} was {L} kept?",
    "\nWhat was {L} sent to?",
    "\nHow is {L} listed?",
    "\nWhat became of {L}?",
    "\nCheck the text: what about {L}?",
    "\nWhat is {L} known as?",
    "\nTell me where {L} went.",
)
GENERIC_CUES = (" Answer:", " The answer is", " It is", "\nAnswer:", " Result:", " Here it is:")
ASK_ALL = (
    "\nList every {A} of {L}.",
    "\nWhat are all the {A}s of {L}?",
    "\nGive each {A} given for {L}.",
)
CUE_ALL = (" All of them:", " The {A}s of {L} are", " They are")
ASK_EACH = (
    "\nWhat are the {A}s of {Ls}?",
    "\nGive the {A}s for {Ls}, in that order.",
    "\nRecall {Ls}.",
)
CUE_EACH = (" In order:", " The {A}s are", " In that order they are")
INTROS = (
    "Read the text below and answer the question.\n",
    "Several facts are hidden in this text.\n",
    "Pay attention to the values given below.\n",
    "Here is a document.\n",
    "Memorise every value in the following passage.\n",
    "A question follows the text.\n",
)
_HEX = "0123456789abcdef"


@cache
def _word_bank() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(label words, value words): train-split words and the filler's nouns/adjectives, never an eval word."""
    from gptoss_lite import filler
    from gptoss_lite.evals.ruler_splits import EVAL, TRAIN

    banned = set(EVAL.labels) | set(EVAL.words)
    labels = tuple(w for w in dict.fromkeys(TRAIN.labels + filler.NOUN + filler._V_NOUNS) if w not in banned)
    values = tuple(w for w in dict.fromkeys(TRAIN.words + filler.ADJ + filler._V_ADJS) if w not in banned)
    return labels, values


def _made_up(rng: random.Random) -> str:
    from gptoss_lite.filler import SYLLABLES

    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def _labels(rng: random.Random, k: int) -> list[str]:
    """k distinct rendered labels: 'the anvil' mostly, sometimes 'the <adj> <noun>' or a made-up name."""
    words, adjs = _word_bank()
    out: list[str] = []
    while len(out) < k:
        r = rng.random()
        if r < 0.72:
            label = f"the {rng.choice(words)}"
        elif r < 0.84:
            label = f"the {rng.choice(adjs)} {rng.choice(words)}"
        elif r < 0.94:
            label = f"the {_made_up(rng)}"
        else:
            label = _made_up(rng).capitalize()
        if label not in out and not any(label in x or x in label for x in out):
            out.append(label)
    return out


def _value(rng: random.Random, kind: str, digits: int = 5) -> str:
    if kind == "number":
        return f"{rng.randrange(10**digits):0{digits}d}"
    if kind == "word":
        return rng.choice(_word_bank()[1]) if rng.random() < 0.7 else _made_up(rng)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _fill(template: str, label: str = "", value: str = "", attr: str = "", labels: str = "") -> str:
    cap = label[:1].upper() + label[1:]
    return (
        template.replace("{Lc}", cap)
        .replace("{L}", label)
        .replace("{Ls}", labels)
        .replace("{A}", attr)
        .replace("{V}", value)
    )


def _join(labels: list[str]) -> str:
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


@dataclass(frozen=True)
class RulerMix:
    """What a recipe's RULER documents are drawn from; `MIXES[data.ruler_mix]`."""

    task_weights: tuple[float, ...]  # over RULER_TASKS
    kind_weights: tuple[float, ...]  # over VALUE_KINDS, for single, multi-key and none
    relations: tuple[Relation, ...]
    asks: tuple[str, ...]
    multi_key_others: Callable[[random.Random], int]  # draws the distractor count of a multi-key document
    none_others: tuple[int, ...]  # other-label needles of a `none` document
    number_digits: tuple[int, ...]  # digits of a number value, drawn uniformly unless there is one
    # (which draws nothing); multi-value and multi-query always use 5


MIXES = {
    1: RulerMix(  # stage 3 (configs/demo_cpu_stage3.yaml); its stream is pinned, never change it
        task_weights=RULER_TASK_WEIGHTS,
        kind_weights=(0.6, 0.2, 0.2),
        relations=RELATIONS,
        asks=ASKS,
        multi_key_others=lambda rng: rng.randint(1, 3),
        none_others=(0, 0, 1, 2, 3),
        number_digits=(5,),
    ),
    2: RulerMix(  # stage 4: cues ending on prepositions, more words/UUIDs, more and harder multi-key,
        # numbers of 4-8 digits so that an answer is copied up to the needle's end, not for 5 characters
        task_weights=(0.28, 0.36, 0.20, 0.08, 0.08),
        kind_weights=(0.4, 0.3, 0.3),
        relations=RELATIONS + RELATIONS_2,
        asks=ASKS + ASKS_2,
        multi_key_others=lambda rng: rng.choice((2, 3, 3)),
        none_others=(0, 0, 0, 1, 2, 3),
        number_digits=(5, 5, 5, 4, 6, 7, 8),
    ),
}


@dataclass(frozen=True)
class RulerDocument:
    """The parts of one training document apart from its haystack."""

    task: str
    intro: str
    needles: tuple[str, ...]  # in prompt order
    needed: tuple[bool, ...]  # per needle: the answer depends on it (the others are distractors)
    asked: tuple[str, ...]  # the labels the question names, rendered as in the text
    question: str
    answer: str  # starts with a space, ends with a full stop


def ruler_document(rng: random.Random, max_needles: int = 4, mix: int = 1) -> RulerDocument:
    """One random document's needles, question and answer (see the module docstring), drawn from
    `MIXES[mix]`."""
    m = MIXES[mix]
    task = rng.choices(RULER_TASKS, weights=m.task_weights)[0]
    relation = rng.choice(m.relations)
    attr = rng.choice(ATTRS)
    kind = rng.choices(VALUE_KINDS, weights=m.kind_weights)[0]
    if task in ("multi-value", "multi-query"):
        kind = "number"
    intro = rng.choice(INTROS) if rng.random() < 0.3 else ""
    hint = rng.choice(HINTS) if rng.random() < 0.6 else ""
    if task in ("single", "multi-key", "none"):
        # both counts are drawn for every task, in this order: the pinned streams depend on it
        others = {"single": 0, "multi-key": m.multi_key_others(rng), "none": rng.choice(m.none_others)}[task]
        others = min(others, max_needles - 1)
        labels = _labels(rng, 1 + others)
        digits = m.number_digits[0] if len(m.number_digits) == 1 else rng.choice(m.number_digits)
        values = list(dict.fromkeys(_value(rng, kind, digits) for _ in range(4 * len(labels))))[: len(labels)]
        facts = list(zip(labels, values))
        if task == "none":
            facts = facts[1:]  # the asked label is the one left out
        asked, value = [labels[0]], values[0]
        r = rng.random()
        if r < 0.55:
            cue = rng.choice(relation.cues)
        elif r < 0.8:
            cue = rng.choice(GENERIC_CUES)
        else:
            cue = rng.choice(m.relations).cues[0]  # another relation's wording, with the label
        question = _fill(rng.choice(m.asks) + hint + cue, label=asked[0], attr=attr)
        answer = f" {NONE_ANSWER}." if task == "none" else f" {value}."
    else:
        n = rng.randint(2, 3)
        values = [f"{v:05d}" for v in rng.sample(range(100_000), n)]
        if task == "multi-value":
            label = _labels(rng, 1)[0]
            asked = [label]
            facts = [(label, v) for v in values]
            question = _fill(rng.choice(ASK_ALL) + rng.choice(CUE_ALL), label=label, attr=attr)
        else:
            labels = _labels(rng, n)
            asked = labels
            facts = list(zip(labels, values))
            question = _fill(rng.choice(ASK_EACH) + rng.choice(CUE_EACH), labels=_join(labels), attr=attr)
        answer = " " + ", ".join(values) + "."
    needles = [
        (
            _fill(relation.needle, label=label, value=v, attr=attr),
            task in ("single", "multi-value", "multi-query") or (task == "multi-key" and i == 0),
        )
        for i, (label, v) in enumerate(facts)
    ]
    if task in ("multi-key", "none", "multi-query"):
        rng.shuffle(needles)
    return RulerDocument(
        task=task,
        intro=intro,
        needles=tuple(n for n, _ in needles),
        needed=tuple(k for _, k in needles),
        asked=tuple(asked),
        question=question,
        answer=answer,
    )
