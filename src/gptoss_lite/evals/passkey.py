"""Passkey retrieval (needle in a haystack) by context length and depth (docs/passkey.md).

Protocol, pinned by tests:

- Prompt: BOS when the tokenizer's rule adds one (`encode_prompt`), about `context_length` tokens
  of deterministic filler (sentences drawn from `FILLER_SENTENCES` by `random.Random(context_length)`;
  the last one is picked to land on the target), the needle `The passkey is NNNNN.` at a sentence
  boundary at the requested depth (0.0 start, 0.5 middle, 1.0 end; the boundary closest to that
  fraction of the filler's tokens), then `QUESTION`. The prompt is within 2% of the target length.
- Score: generate 16 tokens greedily through the cached path (prefill in bounded chunks), decode only
  the new tokens, take the first `\\b(\\d{5})\\b`, compare with the truth.
- Trials: per length a fresh `random.Random(base_seed + length)` (base_seed 42) draws `n_trials`
  distinct keys from range(100000), formatted `%05d`; the filler is fixed per length, so trials
  differ only in the key. Every key is asked at every depth.

`template="classic"` is the template of the long-context literature (an instruction, the grass/sky/
sun filler repeated, `The pass key is N. Remember it. N is the pass key.`).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# The phrasing shared with the training data lives in gptoss_lite.prompts; re-exported here.
from gptoss_lite.evals.harness import (
    check_model_fits,
    equal_length_batches,
    greedy_new_texts,
    peak_rss_bytes,
    progress_bar,
)
from gptoss_lite.prompts import CLASSIC_NEEDLE, CLASSIC_QUESTION, NEEDLE_TEMPLATE, QUESTION
from gptoss_lite.validation import check_int

if TYPE_CHECKING:
    import torch

    from gptoss_lite.kv.mixed import MixedKVCache
    from gptoss_lite.kv.settings import KVSettings
    from gptoss_lite.speculative import Speculation
    from gptoss_lite.tokenizer import Tokenizer

DEFAULT_LENGTHS: tuple[int, ...] = (4096, 8192, 32768, 65536, 131072)  # tokens (docs/passkey.md)
DEFAULT_DEPTHS: tuple[float, ...] = (0.0, 0.5, 1.0)  # start, middle, end
DEFAULT_TRIALS = 100
BASE_SEED = 42  # keys of length L are drawn by random.Random(BASE_SEED + L) (docs/passkey.md)
NEW_TOKENS = 16  # generated per trial (docs/passkey.md)
MIN_SHARED_PREFIX = 64  # tokens: a shorter common prefix is prefilled with each trial
TARGET_ACCURACY = 0.85  # headline target at the longest length (docs/passkey.md)
N_KEYS = 100_000  # five-digit keys 00000..99999
PASSKEY_RE = re.compile(r"\b(\d{5})\b")
TEMPLATES = ("default", "classic")

# Evaluator filler: digit-free, varied lengths (so the last sentence can land the prompt on target).
# NOTE: the training data (gptoss_lite.train.data) uses a different, procedural generator; keep
# these sentences out of it so the evaluation haystack is never trained on.
FILLER_SENTENCES: tuple[str, ...] = (
    " Rain fell softly on the tin roof.",
    " The library closed early on Sundays.",
    " A cat slept in the warm window light.",
    " Bread rises faster in a warm kitchen.",
    " The museum guide spoke about old maps and forgotten roads.",
    " Clouds gathered over the valley in the late afternoon.",
    " Most rivers carry silt from the mountains down to the sea.",
    " The choir practiced the same hymn until it sounded effortless.",
    " Tea tastes different when the water is too hot.",
    " Snow covered the garden, and the birds searched for seeds.",
    " The train was late, so the travelers read their newspapers twice.",
    " Lighthouses once needed keepers who trimmed the wicks every night.",
    " A good map shows what matters and leaves out the rest.",
    " The children built a fort from blankets and kitchen chairs.",
    " Autumn leaves turned the park into a patchwork of red and gold.",
    " Some people prefer the quiet of early mornings to the noise of evenings.",
    " The baker greeted every customer by name and remembered their usual order.",
    " Fog rolled in from the bay and hid the bridge from view.",
    " An old clock ticked in the hallway, steady and patient.",
    " Gardeners know that patience matters more than any tool in the shed.",
    " The market smelled of oranges, fresh herbs and roasted nuts.",
    " Wind turned the pages of a book left open on the bench.",
    " Many languages borrow words from their neighbors over the centuries.",
    " The mountain path was steep, but the view from the top was worth every step.",
    " Candles flickered while the storm knocked out the power across the town.",
    " A letter arrived without a stamp, and nobody knew who had sent it.",
    " The orchestra tuned their instruments as the audience found their seats.",
    " Bees visit thousands of flowers to make a single spoonful of honey.",
    " Old bridges were built of stone because stone outlasts the people who lay it.",
    " The fisherman mended his nets on the dock while gulls circled overhead.",
    " Ink.",
    " Dusk came.",
    " Owls hunt at night.",
    " The kettle sang.",
    " Waves broke.",
)

CLASSIC_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
CLASSIC_FILLER: tuple[str, ...] = (
    " The grass is green.",
    " The sky is blue.",
    " The sun is yellow.",
    " Here we go.",
    " There and back again.",
)


@dataclass(frozen=True)
class _Template:
    intro: str
    needle: str
    question: str


_TEMPLATES = {
    "default": _Template("", NEEDLE_TEMPLATE, QUESTION),
    "classic": _Template(CLASSIC_INTRO, CLASSIC_NEEDLE, CLASSIC_QUESTION),
}


def extract_passkey(text: str) -> str | None:
    """The first standalone 5-digit number in `text`, or None."""
    match = PASSKEY_RE.search(text)
    return match.group(1) if match else None


def passkey_keys(context_length: int, n_trials: int, base_seed: int = BASE_SEED) -> list[str]:
    """`n_trials` distinct keys for one length: random.Random(base_seed + length).sample(range(100000))."""
    n_trials = check_int("n_trials", n_trials, 1, N_KEYS)  # distinct 5-digit keys
    rng = random.Random(base_seed + context_length)
    return [f"{k:05d}" for k in rng.sample(range(N_KEYS), n_trials)]


def prompt_overhead(tokenizer: Tokenizer, template: str = "default") -> int:
    """Tokens of a prompt with no filler: BOS (when the tokenizer's rule adds one), intro, needle, question."""
    t = _template(template)
    return int(tokenizer.add_bos) + sum(
        len(tokenizer.encode(s)) for s in (t.intro, t.needle.format(key="00000"), t.question)
    )


def _template(name: str) -> _Template:
    if name not in _TEMPLATES:
        raise ValueError(f"template={name!r}: must be one of {TEMPLATES}")
    return _TEMPLATES[name]


def filler_sentences(context_length: int, tokenizer: Tokenizer, template: str = "default") -> list[str]:
    """The fixed filler of one context length: sentences totalling about length - overhead tokens."""
    target = context_length - prompt_overhead(tokenizer, template)
    if target < 0:
        raise ValueError(
            f"context_length={context_length}: below the prompt overhead of "
            f"{context_length - target} tokens (BOS, needle, question); use a longer length"
        )
    return list(_filler(context_length, target, tokenizer, template))


def _filler(seed: int, target: int, tokenizer: Tokenizer, template: str) -> tuple[str, ...]:
    bank = CLASSIC_FILLER if template == "classic" else FILLER_SENTENCES
    sizes = _sizes(bank, tokenizer)
    longest = max(sizes)
    rng = random.Random(seed)
    out: list[str] = []
    used = 0
    while target - used > longest:
        i = len(out) % len(bank) if template == "classic" else rng.randrange(len(bank))
        out.append(bank[i])
        used += sizes[i]
    gap = target - used
    while gap > 0:
        # Land on the target: the sentence whose size is closest to the gap (first in bank order).
        i = min(range(len(bank)), key=lambda j: abs(sizes[j] - gap))
        if abs(sizes[i] - gap) >= gap:
            break
        out.append(bank[i])
        gap -= sizes[i]
    return tuple(out)


def _sizes(bank: tuple[str, ...], tokenizer: Tokenizer) -> list[int]:
    return [len(tokenizer.encode(s)) for s in bank]


def build_passkey_prompt(
    context_length: int,
    key: str,
    depth: float,
    tokenizer: Tokenizer,
    template: str = "default",
    filler: Sequence[str] | None = None,
) -> str:
    """Prompt text (without BOS) of about `context_length` tokens with the needle at `depth`."""
    t = _template(template)
    _check_depth(depth)
    if not (len(key) == 5 and key.isdigit()):
        raise ValueError(f"key={key!r}: must be 5 digits, e.g. '04217'")
    sentences = filler_sentences(context_length, tokenizer, template) if filler is None else list(filler)
    cut = _boundary(sentences, depth, tokenizer)
    return t.intro + "".join(sentences[:cut]) + t.needle.format(key=key) + "".join(sentences[cut:]) + t.question


def _boundary(sentences: Sequence[str], depth: float, tokenizer: Tokenizer) -> int:
    """Index of the sentence boundary closest to `depth` of the filler's tokens (first on ties)."""
    size = {s: len(tokenizer.encode(s)) for s in set(sentences)}
    target = depth * sum(size[s] for s in sentences)
    best, best_err, used = 0, target, 0
    for i, s in enumerate(sentences, start=1):
        used += size[s]
        if abs(used - target) < best_err:
            best, best_err = i, abs(used - target)
    return best


def _check_depth(depth: float) -> None:
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth!r}: must be a fraction in [0, 1] (0 start, 0.5 middle, 1 end)")


@dataclass
class PasskeyResult:
    """Accuracies by length and by (length, depth), KV bytes, extrapolation ratios."""

    lengths: list[int]  # requested context lengths, tokens
    depths: list[float]
    n_trials: int
    template: str
    accuracy: dict[int, float]  # over all depths and trials
    accuracy_by_depth: dict[int, dict[float, float]]
    prompt_tokens: dict[int, int]  # actual prompt length (incl. BOS) of the first trial
    kv_payload_bytes: dict[int, int]  # valid K/V bytes per sequence at the end of generation
    kv_allocated_bytes: dict[int, int]  # allocated K/V bytes per sequence
    train_context_length: int | None = None
    trials: list[dict[str, Any]] = field(default_factory=list)  # (length, depth, key, answer, correct)
    speculation: dict[str, Any] | None = None  # SpeculationStats.to_dict() over all trials, when on
    seconds: dict[int, float] = field(default_factory=dict)  # wall time of each length's trials
    peak_rss_bytes: dict[int, int] = field(default_factory=dict)  # the process's peak RSS once a length is done

    @property
    def extrapolation(self) -> dict[int, float] | None:
        """length / train_context_length, or None when the checkpoint does not record it."""
        if self.train_context_length is None:
            return None
        return {n: n / self.train_context_length for n in self.lengths}

    @property
    def headline(self) -> tuple[int, float]:
        """(longest length, its accuracy)."""
        longest = max(self.lengths)
        return longest, self.accuracy[longest]

    @property
    def passed(self) -> bool:
        return self.headline[1] >= TARGET_ACCURACY

    def verdict(self) -> str:
        """`PASS: 97.0% at 8192 tokens (>= 85%)` or `FAIL: ...`."""
        length, acc = self.headline
        ratio = f", {length / self.train_context_length:g}x the training context" if self.train_context_length else ""
        return (
            f"{'PASS' if self.passed else 'FAIL'}: {100 * acc:.1f}% at {length} tokens "
            f"({'>=' if self.passed else '<'} {100 * TARGET_ACCURACY:.0f}%{ratio})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "lengths": self.lengths,
            "depths": self.depths,
            "n_trials": self.n_trials,
            "template": self.template,
            "accuracy": {str(k): v for k, v in self.accuracy.items()},
            "accuracy_by_depth": {
                str(n): {str(d): a for d, a in row.items()} for n, row in self.accuracy_by_depth.items()
            },
            "prompt_tokens": {str(k): v for k, v in self.prompt_tokens.items()},
            "kv_payload_bytes": {str(k): v for k, v in self.kv_payload_bytes.items()},
            "kv_allocated_bytes": {str(k): v for k, v in self.kv_allocated_bytes.items()},
            "train_context_length": self.train_context_length,
            "extrapolation": None if self.extrapolation is None else {str(k): v for k, v in self.extrapolation.items()},
            "target_accuracy": TARGET_ACCURACY,
            "passed": self.passed,
            "verdict": self.verdict(),
            "speculation": self.speculation,
            "seconds": {str(k): v for k, v in self.seconds.items()},
            "peak_rss_bytes": {str(k): v for k, v in self.peak_rss_bytes.items()},
            "trials": [dict(t) for t in self.trials],  # every trial's length, depth, key, answer and score
        }


class PasskeyEvaluator:
    """Runs the docs/passkey.md protocol on a model; validate everything in the constructor, work in `run()`."""

    def __init__(
        self,
        model,
        tokenizer: Tokenizer | None = None,
        lengths: Sequence[int] = DEFAULT_LENGTHS,
        depths: Sequence[float] = DEFAULT_DEPTHS,
        n_trials: int = DEFAULT_TRIALS,
        base_seed: int = BASE_SEED,
        template: str = "default",
        prefill_chunk: int = 2048,
        batch_size: int = 1,
        speculate: Speculation | None = None,
        kv: KVSettings | None = None,
        share_prefix: bool = True,
    ):
        """`speculate` (a `gptoss_lite.speculative.PromptLookup` or `DraftModel`) decodes the answers
        speculatively; greedy, so the answers are the same, only faster (or not). `kv`
        (`gptoss_lite.kv.settings.KVSettings`) sets the full layers' storage: bits or a token budget
        (prefill pieces are then cut to the budget). `share_prefix`: the trials of one length and depth
        share their haystack up to the needle, so that prefix is prefilled once and copied into each
        batch's cache (16-bit caches; the answers are those of prefilling each prompt whole)."""
        from gptoss_lite.speculative import DraftModel, PromptLookup
        from gptoss_lite.tokenizer import ByteTokenizer

        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.template = template
        _template(template)
        check_int("n_trials", n_trials, 1, N_KEYS)  # distinct 5-digit keys
        if not depths:
            raise ValueError("depths is empty: give at least one depth in [0, 1], e.g. 0.0 0.5 1.0")
        for d in depths:
            _check_depth(d)
        if not lengths:
            raise ValueError("lengths is empty: give at least one context length in tokens, e.g. 4096")
        overhead = prompt_overhead(self.tokenizer, template)
        for n in lengths:
            if isinstance(n, bool) or not isinstance(n, int) or n <= overhead:
                raise ValueError(
                    f"context length {n!r}: below the prompt overhead of {overhead} tokens "
                    f"(BOS, needle, question); use lengths > {overhead}"
                )
            check_model_fits(model, self.tokenizer, n, NEW_TOKENS)
        check_int("prefill_chunk", prefill_chunk, minimum=1)
        check_int("batch_size", batch_size, minimum=1)
        self.lengths = sorted(set(int(n) for n in lengths))
        self.depths = [float(d) for d in depths]
        self.n_trials = n_trials
        self.base_seed = base_seed
        self.prefill_chunk = prefill_chunk
        self.batch_size = batch_size
        if speculate is not None and not isinstance(speculate, (PromptLookup, DraftModel)):
            raise TypeError(f"speculate: expected None, a PromptLookup or a DraftModel, got {type(speculate).__name__}")
        self.speculate = speculate
        from gptoss_lite.kv.settings import KVSettings

        if kv is not None and not isinstance(kv, KVSettings):
            raise TypeError(f"kv: expected None or a KVSettings, got {type(kv).__name__}")
        if kv is not None and kv.budget is not None and speculate is not None:
            raise ValueError("kv budget and speculate: an evicting cache cannot roll back; give one of them")
        self.kv = KVSettings() if kv is None else kv
        self.speculation_stats = None  # a SpeculationStats summed over the answers() calls
        self.share_prefix = bool(share_prefix) and self.kv.budget is None and not self.kv.format.quantized
        self.shared_tokens = 0  # prompt tokens prefilled once instead of once per trial (last run)

    def keys(self, length: int) -> list[str]:
        """The trial keys of one length."""
        return passkey_keys(length, self.n_trials, self.base_seed)

    def prompt_ids(self, length: int, key: str, depth: float, filler: Sequence[str] | None = None) -> list[int]:
        """Token ids of one trial's prompt (BOS first when the tokenizer's rule adds one)."""
        text = build_passkey_prompt(length, key, depth, self.tokenizer, self.template, filler)
        return self.tokenizer.encode_prompt(text)

    def shared_prefix(self, prompts: Sequence[Sequence[int]]) -> MixedKVCache | None:
        """A batch-1 cache holding the prompts' longest common prefix (one depth's haystack up to the
        needle's key), prefilled once; None where sharing is off or the prefix is too short to pay."""
        import torch

        if not self.share_prefix or len(prompts) < 2:
            return None
        first, n = prompts[0], min(len(p) for p in prompts) - 1  # at least one token left per prompt
        for p in prompts[1:]:
            n = next((i for i in range(n) if p[i] != first[i]), n)
        if n < MIN_SHARED_PREFIX:
            return None
        slack = 0 if self.speculate is None else self.speculate.k
        cache = self.kv.build(self.model.config, batch_size=1, rollback_tokens=slack)
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            self.model.prefill(
                torch.tensor([first[:n]], device=device), cache, self.kv.prefill_chunk(self.prefill_chunk)
            )
        return cache

    def answers(self, ids: torch.Tensor, cache: MixedKVCache | None = None) -> tuple[list[str | None], MixedKVCache]:
        """Score-ready answers of a (B, T) batch of equal-length prompts: greedy NEW_TOKENS tokens
        through the cached path, the first 5-digit number of each (None if none); and the cache used.
        `cache` may already hold a prefix of every row (`shared_prefix`)."""
        from gptoss_lite.speculative import SpeculationStats

        if self.speculate is not None and self.speculation_stats is None:
            self.speculation_stats = SpeculationStats()
        texts, cache = greedy_new_texts(
            self.model,
            self.tokenizer,
            ids,
            NEW_TOKENS,
            self.kv,
            self.prefill_chunk,
            self.speculate,
            self.speculation_stats,
            cache,
        )
        return [extract_passkey(text) for text in texts], cache

    def run(self, progress: bool = False) -> PasskeyResult:
        """Every (length, depth, key) trial; a tqdm bar on stderr when `progress`."""
        import torch

        device = next(self.model.parameters()).device
        self.speculation_stats = None
        self.shared_tokens = 0
        bar = progress_bar(len(self.lengths) * len(self.depths) * self.n_trials, "passkey", progress)
        acc, by_depth, tokens, payload, allocated, records = {}, {}, {}, {}, {}, []
        seconds, peak = {}, {}
        try:
            for length in self.lengths:
                started = time.perf_counter()
                filler = filler_sentences(length, self.tokenizer, self.template)
                keys = self.keys(length)
                by_depth[length] = {}
                for depth in self.depths:
                    prompts = [self.prompt_ids(length, key, depth, filler) for key in keys]
                    tokens.setdefault(length, len(prompts[0]))
                    correct = 0
                    shared = self.shared_prefix(prompts)
                    if shared is not None:
                        self.shared_tokens += shared.num_tokens * (len(prompts) - 1)
                    for group in equal_length_batches(prompts, self.batch_size):
                        ids = torch.tensor([prompts[i] for i in group], dtype=torch.long, device=device)  # (B, T)
                        start = None if shared is None else shared.repeat_rows(len(group))
                        answers, cache = self.answers(ids, start)
                        payload[length] = max(payload.get(length, 0), cache.payload_bytes // len(group))
                        allocated[length] = max(allocated.get(length, 0), cache.nbytes // len(group))
                        for answer, i in zip(answers, group):
                            hit = answer == keys[i]
                            correct += hit
                            records.append(
                                {"length": length, "depth": depth, "key": keys[i], "answer": answer, "correct": hit}
                            )
                        if bar is not None:
                            bar.update(len(group))
                    by_depth[length][depth] = correct / self.n_trials
                acc[length] = sum(by_depth[length].values()) / len(self.depths)
                seconds[length] = time.perf_counter() - started
                peak[length] = peak_rss_bytes()
        finally:
            if bar is not None:
                bar.close()
        return PasskeyResult(
            lengths=self.lengths,
            depths=self.depths,
            n_trials=self.n_trials,
            template=self.template,
            accuracy=acc,
            accuracy_by_depth=by_depth,
            prompt_tokens=tokens,
            kv_payload_bytes=payload,
            kv_allocated_bytes=allocated,
            train_context_length=self.model.config.train_context_length,
            trials=records,
            speculation=None if self.speculation_stats is None else self.speculation_stats.to_dict(),
            seconds=seconds,
            peak_rss_bytes=peak,
        )
