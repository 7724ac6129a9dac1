"""A RULER-style long-context suite by task x length x haystack (docs/ruler.md).

Protocol, pinned by tests/evals/test_ruler.py:

- A trial is (task, length, haystack, index). Its content (template family, labels, values, depths)
  comes from `random.Random("gptoss-lite-ruler/{seed}/{task}/{length}/{index}")`, the same for
  every haystack, so haystacks are compared on the same questions; its haystack from that string
  plus `/{haystack}`. The family is the index-th of the chosen families, round robin.
- Prompt: BOS when the tokenizer's rule adds one (`encode_prompt`), the family's intro, haystack
  units with the needles at the unit boundaries closest to their depths (fractions of the haystack's
  tokens), then the question. The haystack fills the length exactly (with the byte tokenizer;
  within a few tokens with others).
- Answer: greedy through the cached path, `answer_tokens(task)` new tokens at most.
- Score of a trial in [0, 1]: the values of the task's kind found in the answer, in order and
  without repeats; the first k (k = number of expected values) are compared with the expected set:
  score = |hits| / k. Abstention (`none`) scores 1 when the answer starts with the word `none`.
  A cell is the mean score of its trials.
"""

from __future__ import annotations

import random
import re
import sys
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gptoss_lite.evals.haystacks import HAYSTACKS, LINE_KINDS, haystack_units
from gptoss_lite.evals.ruler_splits import TemplateFamily, get_split
from gptoss_lite.validation import check_int

if TYPE_CHECKING:
    from gptoss_lite.kv.settings import KVSettings
    from gptoss_lite.tokenizer import Tokenizer

TASKS: tuple[str, ...] = (
    "single-number",  # one needle, a 5-digit number
    "single-word",  # one needle, a word of the split's value words
    "single-uuid",  # one needle, a UUID-like hex code
    "multi-key",  # one asked needle among 3 needles of other labels (numbers)
    "multi-value",  # 4 needles of one label; all 4 values asked
    "multi-query",  # 4 needles of 4 labels; all 4 asked
    "var-track",  # a chain of 5 variables (one value, 4 links) and a distractor chain; the chain asked
    "none",  # abstention: no needle at all; the answer is `none`
)
DEFAULT_LENGTHS: tuple[int, ...] = (4096, 8192)  # 16x and 32x the shipped model's 256-token training
DEFAULT_TRIALS = 30  # per cell: the smallest count the acceptance criteria allow (docs/ruler.md)
BASE_SEED = 42
NONE_ANSWER = "none"
N_DISTRACTORS = 3  # other-label needles of multi-key
N_VALUES = 4  # values of multi-value, labels of multi-query
CHAIN_HOPS = 4  # links after the assignment: 5 names per chain (RULER's default)
ANSWER_SLACK = 8  # new tokens beyond the longest expected answer

_KIND = {
    "single-number": "number",
    "single-word": "word",
    "single-uuid": "uuid",
    "multi-key": "number",
    "multi-value": "number",
    "multi-query": "number",
    "var-track": "name",
    "none": "none",
}
_WIDTH = {"number": 5, "uuid": 36, "name": 5, "none": len(NONE_ANSWER)}  # characters of one value
_PATTERN = {
    "number": re.compile(r"\b\d{5}\b"),
    "uuid": re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"),
    "name": re.compile(r"\b[A-Z]{5}\b"),
    "word": re.compile(r"[A-Za-z]+"),
}
_NONE = re.compile(rf"\s*{NONE_ANSWER}\b", re.IGNORECASE)
_NAME_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class Trial:
    """One question: what goes into the prompt (apart from the haystack) and what answers it."""

    task: str
    n_tokens: int  # target prompt tokens, BOS included
    haystack: str
    index: int
    family: str
    intro: str
    inserts: tuple[tuple[float, str], ...]  # (depth in [0, 1], text), in prompt order
    question: str
    expected: tuple[str, ...]  # (NONE_ANSWER,) for abstention
    seed: str  # the haystack's random.Random seed

    @property
    def kind(self) -> str:
        """What the answer is made of: number, word, uuid, name (var-track) or none (abstention)."""
        return _KIND[self.task]


def answer_tokens(task: str, words: tuple[str, ...] = ()) -> int:
    """New tokens generated for `task`: room for its expected values written out, plus ANSWER_SLACK
    (byte tokens; an upper bound for other tokenizers)."""
    kind = _KIND[task]
    width = max(map(len, words)) if kind == "word" else _WIDTH[kind]
    k = {"multi-value": N_VALUES, "multi-query": N_VALUES, "var-track": CHAIN_HOPS + 1}.get(task, 1)
    return k * (width + 2) + ANSWER_SLACK


def _the(labels: list[str]) -> str:
    """'the a', 'the a and the b', 'the a, the b and the c'."""
    parts = [f"the {x}" for x in labels]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _number(rng: random.Random) -> str:
    return f"{rng.randrange(100_000):05d}"


def _numbers(rng: random.Random, k: int) -> list[str]:
    return [f"{n:05d}" for n in rng.sample(range(100_000), k)]


def _names(rng: random.Random, k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        name = "".join(rng.choice(_NAME_LETTERS) for _ in range(5))
        if name not in out:
            out.append(name)
    return out


def make_trial(
    task: str, n_tokens: int, haystack: str, index: int, family: TemplateFamily, split_name: str, seed: int
) -> Trial:
    """The trial `index` of a cell; deterministic in (seed, task, n_tokens, index) apart from the haystack."""
    split = get_split(split_name)
    rng = random.Random(f"gptoss-lite-ruler/{seed}/{task}/{n_tokens}/{index}")
    f = family
    inserts: list[tuple[float, str]] = []
    if task.startswith("single-") or task in ("multi-key", "none"):
        labels = rng.sample(split.labels, 1 + (N_DISTRACTORS if task == "multi-key" else 0))
        kind = _KIND[task]
        if kind == "word":
            value = rng.choice(split.words)
        elif kind == "uuid":
            value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        else:
            value = _number(rng)
        if task == "none":
            expected: tuple[str, ...] = (NONE_ANSWER,)
        else:
            expected = (value,)
            inserts.append((rng.random(), f.needle.format(label=_the(labels[:1]), value=value)))
        for label, v in zip(labels[1:], _numbers(rng, len(labels) - 1)):
            inserts.append((rng.random(), f.needle.format(label=_the([label]), value=v)))
        question = f.ask.format(label=_the(labels[:1])) + f.hint + f.cue.format(label=_the(labels[:1]))
    elif task == "multi-value":
        label = _the(rng.sample(split.labels, 1))
        values = _numbers(rng, N_VALUES)
        expected = tuple(values)
        inserts = [(rng.random(), f.needle.format(label=label, value=v)) for v in values]
        question = f.ask_all.format(label=label) + f.cue_all.format(label=label)
    elif task == "multi-query":
        labels = rng.sample(split.labels, N_VALUES)
        values = _numbers(rng, N_VALUES)
        expected = tuple(values)
        inserts = [(rng.random(), f.needle.format(label=_the([x]), value=v)) for x, v in zip(labels, values)]
        question = f.ask_each.format(labels=_the(labels)) + f.cue_each
    elif task == "var-track":
        asked, other = _numbers(rng, 2)
        names = _names(rng, 2 * (CHAIN_HOPS + 1))
        expected = tuple(names[: CHAIN_HOPS + 1])
        for value, chain in ((asked, names[: CHAIN_HOPS + 1]), (other, names[CHAIN_HOPS + 1 :])):
            depths = sorted(rng.random() for _ in chain)  # a link comes after what it copies
            inserts.append((depths[0], f.assign.format(name=chain[0], value=value)))
            inserts += [(d, f.link.format(name=n, other=p)) for d, n, p in zip(depths[1:], chain[1:], chain)]
        question = f.chain_ask.format(value=asked) + f.chain_cue.format(value=asked)
    else:
        raise ValueError(f"task {task!r}: must be one of {TASKS}")
    if haystack in LINE_KINDS:  # a needle is a line of its own
        inserts = [(d, "\n" + text.lstrip(" ")) for d, text in inserts]
    inserts.sort(key=lambda item: item[0])  # stable: equal depths keep their order
    return Trial(
        task=task,
        n_tokens=n_tokens,
        haystack=haystack,
        index=index,
        family=f.name,
        intro=f.intro,
        inserts=tuple(inserts),
        question=question,
        expected=expected,
        seed=f"gptoss-lite-ruler/{seed}/{task}/{n_tokens}/{index}/{haystack}",
    )


def overhead_tokens(trial: Trial, tokenizer: Tokenizer) -> int:
    """Tokens of the prompt apart from the haystack: BOS (when the tokenizer's rule adds one), intro,
    needles, question."""
    parts = [trial.intro, *(text for _, text in trial.inserts), trial.question]
    return int(tokenizer.add_bos) + sum(len(tokenizer.encode(s)) for s in parts)


def build_prompt(trial: Trial, tokenizer: Tokenizer) -> str:
    """Prompt text (without BOS) of about `trial.n_tokens` tokens: intro, haystack with needles, question."""
    budget = trial.n_tokens - overhead_tokens(trial, tokenizer)
    if budget < 1:
        raise ValueError(
            f"context length {trial.n_tokens}: task {trial.task} (family {trial.family}) needs "
            f"{trial.n_tokens - budget} tokens for BOS, intro, needles and question; use a longer length"
        )
    units = haystack_units(trial.haystack, random.Random(trial.seed), budget, tokenizer)
    sizes = [len(tokenizer.encode(u)) for u in units]
    cut_at, used = [0], 0  # cut_at[i]: tokens before unit boundary i
    for n in sizes:
        used += n
        cut_at.append(used)
    pieces = [trial.intro]
    boundary = 0
    for depth, text in trial.inserts:
        # The boundary closest to depth x haystack tokens (first on ties), never before the previous needle.
        best = min(range(boundary, len(units) + 1), key=lambda i: abs(cut_at[i] - depth * used))
        pieces += units[boundary:best] + [text]
        boundary = best
    pieces += units[boundary:] + [trial.question]
    return "".join(pieces)


def extract_values(kind: str, text: str, words: tuple[str, ...] = ()) -> list[str]:
    """Values of `kind` in `text`, in order, without repeats (a `word` is one of `words`, any case)."""
    if kind == "none":
        return [NONE_ANSWER] if _NONE.match(text) else []
    found = _PATTERN[kind].findall(text)
    if kind == "word":
        vocab = set(words)
        found = [w.lower() for w in found if w.lower() in vocab]
    return list(dict.fromkeys(found))


def score_answer(trial: Trial, text: str, words: tuple[str, ...] = ()) -> float:
    """|first k values found in `text` that are expected| / k, k = len(trial.expected)."""
    found = extract_values(trial.kind, text, words)
    k = len(trial.expected)
    return len(set(found[:k]) & set(trial.expected)) / k


@dataclass(frozen=True)
class RulerSuite:
    """What to evaluate: checked in full before any model is loaded."""

    lengths: tuple[int, ...] = DEFAULT_LENGTHS  # prompt tokens, BOS included
    tasks: tuple[str, ...] = TASKS
    haystacks: tuple[str, ...] | None = None  # None: every haystack kind of the split
    families: tuple[str, ...] | None = None  # None: every template family of the split
    split: str = "eval"
    n_trials: int = DEFAULT_TRIALS  # per (task, length, haystack) cell
    seed: int = BASE_SEED

    def __post_init__(self) -> None:
        split = get_split(self.split)
        if not self.tasks:
            raise ValueError(f"tasks is empty: give at least one of {', '.join(TASKS)}")
        for task in self.tasks:
            if task not in TASKS:
                raise ValueError(f"task {task!r}: must be one of {', '.join(TASKS)}")
        if not self.lengths:
            raise ValueError("lengths is empty: give at least one prompt length in tokens, e.g. 4096")
        for n in self.lengths:
            check_int("context length", n, minimum=1)
        if self.haystacks is not None:
            if not self.haystacks:
                raise ValueError("haystacks is empty: give at least one, or None for the split's own")
            for h in self.haystacks:
                if h not in HAYSTACKS:
                    raise ValueError(f"haystack {h!r}: must be one of {', '.join(HAYSTACKS)}")
                if h not in split.haystacks:
                    raise ValueError(
                        f"haystack {h!r}: belongs to the other split, not {self.split} "
                        f"({', '.join(split.haystacks)}); pick from those or change the split"
                    )
        if self.families is not None:
            if not self.families:
                raise ValueError("families is empty: give at least one, or None for the split's own")
            for name in self.families:
                split.family(name)
        check_int("n_trials", self.n_trials, minimum=1)
        check_int("seed", self.seed)

    @property
    def haystack_kinds(self) -> tuple[str, ...]:
        """The haystacks evaluated: the chosen ones, else the split's."""
        return self.haystacks if self.haystacks is not None else get_split(self.split).haystacks

    @property
    def family_names(self) -> tuple[str, ...]:
        """The template families used round robin: the chosen ones, else the split's."""
        split = get_split(self.split)
        return self.families if self.families is not None else tuple(f.name for f in split.families)

    def trials(self, task: str, n_tokens: int, haystack: str) -> list[Trial]:
        """The n_trials trials of one cell."""
        split = get_split(self.split)
        families = [split.family(name) for name in self.family_names]
        return [
            make_trial(task, n_tokens, haystack, i, families[i % len(families)], self.split, self.seed)
            for i in range(self.n_trials)
        ]


@dataclass
class RulerResult:
    """Scores by haystack, task and length; every trial's answer."""

    suite: RulerSuite
    score: dict[str, dict[str, dict[int, float]]]  # haystack -> task -> length -> mean score
    prompt_tokens: dict[int, int]  # length -> largest prompt (BOS included) of that length
    train_context_length: int | None = None
    python_version: str = field(default_factory=lambda: sys.version.split()[0])  # the stdlib haystacks'
    trials: list[dict[str, Any]] = field(default_factory=list)

    def mean(self, task: str, n_tokens: int) -> float:
        """Mean score of (task, length) over the haystacks."""
        return sum(self.score[h][task][n_tokens] for h in self.score) / len(self.score)

    def overall(self, n_tokens: int) -> float:
        """Mean score of every cell of one length."""
        return sum(self.mean(t, n_tokens) for t in self.suite.tasks) / len(self.suite.tasks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the suite, every cell, the means over haystacks, every trial."""
        s = self.suite
        return {
            "split": s.split,
            "lengths": list(s.lengths),
            "tasks": list(s.tasks),
            "haystacks": list(s.haystack_kinds),
            "families": list(s.family_names),
            "n_trials": s.n_trials,
            "seed": s.seed,
            "train_context_length": self.train_context_length,
            "python_version": self.python_version,
            "prompt_tokens": {str(n): v for n, v in self.prompt_tokens.items()},
            "score": {
                h: {t: {str(n): v for n, v in row.items()} for t, row in by.items()} for h, by in self.score.items()
            },
            "mean": {t: {str(n): self.mean(t, n) for n in s.lengths} for t in s.tasks},
            "overall": {str(n): self.overall(n) for n in s.lengths},
            "trials": self.trials,
        }


class RulerEvaluator:
    """Runs a RulerSuite on a model; validates in the constructor, works in `run()`."""

    def __init__(
        self,
        model,
        suite: RulerSuite,
        tokenizer: Tokenizer | None = None,
        prefill_chunk: int = 2048,
        batch_size: int = 8,
        kv: KVSettings | None = None,
    ):
        from gptoss_lite.evals.harness import check_model_fits
        from gptoss_lite.kv.settings import KVSettings
        from gptoss_lite.tokenizer import ByteTokenizer

        if not isinstance(suite, RulerSuite):
            raise TypeError(f"suite: expected a RulerSuite, got {type(suite).__name__}")
        if kv is not None and not isinstance(kv, KVSettings):
            raise TypeError(f"kv: expected None or a KVSettings, got {type(kv).__name__}")
        check_int("prefill_chunk", prefill_chunk, minimum=1)
        check_int("batch_size", batch_size, minimum=1)
        self.model, self.suite = model, suite
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.words = get_split(suite.split).words
        new = max(answer_tokens(t, self.words) for t in suite.tasks)
        for n in suite.lengths:
            check_model_fits(model, self.tokenizer, n, new)
        # Every trial's needles and question must leave room for a haystack: found now, not hours in.
        for task in suite.tasks:
            for n, haystack in ((n, h) for n in suite.lengths for h in suite.haystack_kinds):
                for trial in suite.trials(task, n, haystack):
                    if overhead_tokens(trial, self.tokenizer) >= n:
                        raise ValueError(
                            f"context length {n}: below the {overhead_tokens(trial, self.tokenizer)} tokens "
                            f"that task {task} (family {trial.family}) needs for BOS, intro, needles and "
                            "question; use a longer length"
                        )
        self.prefill_chunk, self.batch_size = prefill_chunk, batch_size
        self.kv = KVSettings() if kv is None else kv

    def run(self, progress: bool = False) -> RulerResult:
        """Every (haystack, task, length, trial); a tqdm bar on stderr when `progress`."""
        import torch

        from gptoss_lite.evals.harness import equal_length_batches, greedy_new_texts, progress_bar

        s, tok = self.suite, self.tokenizer
        device = next(self.model.parameters()).device
        bar = progress_bar(len(s.haystack_kinds) * len(s.tasks) * len(s.lengths) * s.n_trials, "ruler", progress)
        score: dict[str, dict[str, dict[int, float]]] = {}
        tokens: dict[int, int] = {}
        records: list[dict[str, Any]] = []
        try:
            for haystack in s.haystack_kinds:
                score[haystack] = {}
                for task in s.tasks:
                    score[haystack][task] = {}
                    new = answer_tokens(task, self.words)
                    for n in s.lengths:
                        trials = s.trials(task, n, haystack)
                        prompts = [tok.encode_prompt(build_prompt(t, tok)) for t in trials]
                        tokens[n] = max(tokens.get(n, 0), *map(len, prompts))
                        total = 0.0
                        for group in equal_length_batches(prompts, self.batch_size):
                            ids = torch.tensor([prompts[i] for i in group], dtype=torch.long, device=device)  # (B, T)
                            texts, _ = greedy_new_texts(self.model, tok, ids, new, self.kv, self.prefill_chunk)
                            for text, i in zip(texts, group):
                                t = trials[i]
                                hit = score_answer(t, text, self.words)
                                total += hit
                                records.append(
                                    {
                                        "haystack": haystack,
                                        "task": task,
                                        "length": n,
                                        "index": t.index,
                                        "family": t.family,
                                        "depths": [d for d, _ in t.inserts],
                                        "expected": list(t.expected),
                                        "answer": text,
                                        "score": hit,
                                    }
                                )
                            if bar is not None:
                                bar.update(len(group))
                        score[haystack][task][n] = total / len(trials)
        finally:
            if bar is not None:
                bar.close()
        return RulerResult(
            suite=s,
            score=score,
            prompt_tokens=tokens,
            train_context_length=self.model.config.train_context_length,
            trials=records,
        )
