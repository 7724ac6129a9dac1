"""Synthetic long-context training data, generated on the fly (no downloads).

Every document is exactly `seq_len + 1` tokens (inputs are the first `seq_len`, targets the last
`seq_len`) and teaches copying from far away:

- `passkey`: a needle `The passkey is NNNNN.` at a random depth in filler, then the question and the
  answer digits. A share of the documents (`eval_phrasing_prob`) uses exactly the evaluator's
  wording (`gptoss_lite.prompts`, which the evaluator imports too); the rest use other phrasings.
- `kv`: several facts `The code for the red lantern is NNNNN.` scattered through the filler, then a
  query about one of them (the other numbers are distractors).
- `copy`: a sequence of random letter codes, 5-digit numbers and made-up words (up to
  `COPY_MAX_TOKENS` tokens) early on,
  repeated at the end. Every repeated token is an induction target, so this task gives the dense
  copy-from-far-away signal that makes induction heads form early; the sparse passkey answers
  (5 digits per document) alone barely move a small model off chance in its first thousands of steps.
- `ruler`: label matching over many phrasings, with distractors and absent labels (answer `none`),
  in the RULER train split's haystacks (`gptoss_lite.train.ruler_docs`, `data.ruler_haystacks`).

NOTE: the filler here is NOT the evaluator's filler: it comes from `gptoss_lite.filler`
(`data.filler`: `procedural` or `varied`; own word banks, no digits, never an evaluator sentence)
with a seed stream derived from the training seed, never `42 + context_length`. A model therefore
cannot score on the passkey evaluation by memorising its haystack.

Determinism: the batch of step k depends only on (data seed, k) — each row seeds its own
`random.Random` from (seed, step, global row) — so a resumed run reproduces the stream exactly, and
each DDP rank / gradient-accumulation micro-step draws different rows.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from gptoss_lite.filler import ADJ, NOUN, SYLLABLES, sentence_generator
from gptoss_lite.prompts import CLASSIC_NEEDLE, CLASSIC_QUESTION, NEEDLE_TEMPLATE, QUESTION
from gptoss_lite.tokenizer import ByteTokenizer
from gptoss_lite.train.ruler_docs import RulerDocument, ruler_document

if TYPE_CHECKING:
    from gptoss_lite.train.config import DataConfig

IGNORE_INDEX = -100  # targets with this value are not scored (torch cross_entropy convention)

# Passkey phrasings other than the evaluator's default: (needle template, question). The first is the
# evaluator's `classic` template. Leading space / newline as in the eval.
_PASSKEY_VARIANTS = (
    (CLASSIC_NEEDLE, CLASSIC_QUESTION),
    (" The secret number is {key}.", "\nWhat is the secret number? The secret number is"),
    (" Passkey: {key}. Keep it safe.", "\nWhat was the passkey? The passkey is"),
    (" Remember that the passkey is {key}.", "\nRecall the passkey. The passkey is"),
)
ANSWER_TEMPLATE = " {key}."
COPY_MAX_TOKENS = 60  # longest copy sequence, tokens (bytes); each document holds it twice


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))


_CODE_CHARS = "abcdefghijkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ"


def _code(rng: random.Random) -> str:
    """A random letter code such as 'kXq': near-unique bytes, so one previous byte locates the copy."""
    return "".join(rng.choice(_CODE_CHARS) for _ in range(rng.randint(3, 6)))


def _copy_sequence(rng: random.Random) -> str:
    """Space-separated letter codes, 5-digit numbers and made-up words, at most COPY_MAX_TOKENS bytes.

    NOTE: high-entropy letter codes are what bootstraps induction: with them a single previous byte
    identifies where to copy from; the low-entropy numbers and words then need longer contexts.
    """
    makers = (_code, _code, _key, _word)
    items = [rng.choice(makers)(rng) for _ in range(rng.randint(4, 12))]
    while len(" ".join(items)) > COPY_MAX_TOKENS:
        items.pop()
    return " ".join(items)


def _key(rng: random.Random) -> str:
    return f"{rng.randrange(100_000):05d}"


def pose_positions(seq_len: int, length: int, chunks: int, rng: random.Random, anchor: float = 0.0) -> torch.Tensor:
    """PoSE-style positions for one sequence: seq_len increasing positions in [0, length), cut into
    `chunks` runs of consecutive positions (random cut points) with random gaps between the runs, the
    gaps together at most length - seq_len. The first run starts at position 0 only if its gap draws
    0; the relative distances inside a run are the document's own. (LongTensor (seq_len,).)

    anchor: the chance that the runs are pinned to both ends instead, the first starting at 0 and the
    last ending at length - 1. Two random gaps rarely add up to the whole range, so without it the
    farthest distances (a needle at a prompt's start, its question at the end) are almost never seen.
    At 0 no extra draw is made: the positions are those of a run without the option."""
    cuts = sorted(rng.sample(range(1, seq_len), chunks - 1)) if chunks > 1 else []
    spare = length - seq_len
    skips = sorted(rng.randint(0, spare) for _ in range(chunks))  # cumulative offset of each run
    if anchor > 0 and chunks > 1 and rng.random() < anchor:
        skips[0], skips[-1] = 0, spare
    bounds = [0, *cuts, seq_len]
    parts = [torch.arange(bounds[i], bounds[i + 1]) + skips[i] for i in range(chunks)]
    return torch.cat(parts)


class SyntheticRetrievalData:
    """Deterministic (input_ids, targets) batches of retrieval documents; see the module docstring.

    `batch(step)` returns two LongTensors of shape (B, T) with B = `batch_size`, T = `seq_len`;
    `targets[:, t]` is the token after `input_ids[:, t]` (IGNORE_INDEX where not scored).
    """

    def __init__(self, config: DataConfig, rank: int = 0, world_size: int = 1, grad_accum_steps: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps={grad_accum_steps}: must be >= 1")
        self.config = config
        self.rank, self.world_size, self.grad_accum_steps = rank, world_size, grad_accum_steps
        self.tokenizer = ByteTokenizer()
        self._tasks = ("passkey", "kv", "copy", "ruler")
        self._weights = (config.passkey_weight, config.kv_weight, config.copy_weight, config.ruler_weight)
        self._sentence = sentence_generator(config.filler)
        need = self.max_overhead_tokens()
        if config.seq_len < need + 16:
            raise ValueError(
                f"data.seq_len={config.seq_len}: too short for the retrieval documents, whose "
                f"fixed parts take up to {need} tokens; use seq_len >= {need + 16}"
            )

    def max_overhead_tokens(self, n_facts: int = 2) -> int:
        """Upper bound on the non-filler tokens of a document (BOS under the tokenizer's rule, needles,
        question, answer, EOS).

        kv documents hold up to `max_facts` facts, but fewer when they would leave less than a quarter
        of the sequence for filler; the bound uses `n_facts` facts.
        """
        enc = lambda s: len(self.tokenizer.encode(s))  # noqa: E731
        key = "00000"
        passkey = max(enc(n.format(key=key)) + enc(q) for n, q in ((NEEDLE_TEMPLATE, QUESTION), *_PASSKEY_VARIANTS))
        longest_name = max(len(a) for a in ADJ) + max(len(n) for n in NOUN)
        fact = enc(" The code for the  is 00000.") + longest_name
        query = enc("\nWhat is the code for the ? The code for the  is") + 2 * longest_name
        kv = n_facts * fact + query
        copy = enc(" Remember this sequence: .") + enc("\nRepeat the sequence:") + 2 * COPY_MAX_TOKENS
        return int(self.tokenizer.add_bos) + 1 + enc(ANSWER_TEMPLATE.format(key=key)) + max(passkey, kv, copy)

    # ---- documents ------------------------------------------------------------------------------
    def document(self, rng: random.Random) -> tuple[list[int], int]:
        """(tokens of length seq_len + 1, index of the first answer token) for one random document."""
        task = rng.choices(self._tasks, weights=self._weights)[0]
        if task == "ruler":
            return self.ruler_tokens(rng)[:2]
        if task == "passkey":
            key = _key(rng)
            if rng.random() < self.config.eval_phrasing_prob:
                needle, question = NEEDLE_TEMPLATE, QUESTION
            else:
                needle, question = rng.choice(_PASSKEY_VARIANTS)
            inserts = [needle.format(key=key)]
            answer = ANSWER_TEMPLATE.format(key=key)
        elif task == "kv":
            n = rng.randint(2, self.config.max_facts)
            while n > 2 and self.max_overhead_tokens(n) > (3 * self.config.seq_len) // 4:
                n -= 1  # keep at least a quarter of the document as filler
            names = set()
            while len(names) < n:
                names.add(f"{rng.choice(ADJ)} {rng.choice(NOUN)}")
            names = sorted(names)
            rng.shuffle(names)
            keys = [_key(rng) for _ in names]
            inserts = [f" The code for the {name} is {key}." for name, key in zip(names, keys)]
            asked = rng.randrange(n)
            question = f"\nWhat is the code for the {names[asked]}? The code for the {names[asked]} is"
            answer = ANSWER_TEMPLATE.format(key=keys[asked])
        else:
            words = _copy_sequence(rng)
            inserts = [f" Remember this sequence: {words}."]
            question = "\nRepeat the sequence:"
            answer = f" {words}."
        return self._assemble(rng, inserts, question, answer)

    def _assemble(self, rng: random.Random, inserts: list[str], question: str, answer: str) -> tuple[list[int], int]:
        tok = self.tokenizer
        insert_ids = [tok.encode(s) for s in inserts]
        answer_ids = tok.encode(answer) + [tok.eos_id]
        return self._place(rng, lambda: self._sentence(rng), [], insert_ids, tok.encode(question), answer_ids)

    def _place(
        self,
        rng: random.Random,
        next_unit,
        head: list[int],
        insert_ids: list[list[int]],
        tail: list[int],
        answer_ids: list[int],
    ) -> tuple[list[int], int]:
        """(tokens, index of the first answer token) of BOS (under the tokenizer's rule, as a prompt
        gets it from `encode_prompt`), `head`, haystack units from `next_unit()` with the inserts at unit
        boundaries, `tail` and `answer_ids`: exactly seq_len + 1 tokens."""
        tok = self.tokenizer
        total = self.config.seq_len + 1
        start = [tok.bos_id] if tok.add_bos else []
        budget = total - len(start) - len(head) - sum(map(len, insert_ids)) - len(tail) - len(answer_ids)
        assert budget >= 0, f"document overhead exceeds seq_len={self.config.seq_len}"
        # Haystack units until the budget is covered; the last one is cut at the token level.
        units: list[list[int]] = []
        used = 0
        while used < budget:
            ids = tok.encode(next_unit())[: budget - used]
            units.append(ids)
            used += len(ids)
        # Each insert goes at a unit boundary chosen by a uniform random depth.
        slots = sorted(rng.randint(0, len(units)) for _ in insert_ids)
        body: list[int] = [*start, *head]
        pending = list(zip(slots, insert_ids))
        for i in range(len(units) + 1):
            while pending and pending[0][0] == i:
                body.extend(pending.pop(0)[1])
            if i < len(units):
                body.extend(units[i])
        body.extend(tail)
        answer_start = len(body)
        body.extend(answer_ids)
        assert len(body) == total, f"document has {len(body)} tokens, expected {total}"
        return body, answer_start

    def ruler_tokens(self, rng: random.Random) -> tuple[list[int], int, RulerDocument, str]:
        """A label-matching document (train/ruler_docs.py) in one of `ruler_haystacks`: its tokens, the
        index of its first answer token, its parts and its haystack kind.

        Parts that leave less than a quarter of the document to the haystack are dropped: first the
        intro, then needles that are not asked for (never those the answer needs); a document whose
        needed parts still leave less than an eighth is drawn again.
        """
        from gptoss_lite.evals.haystacks import LINE_KINDS, unit_stream

        tok = self.tokenizer
        total = self.config.seq_len + 1
        while True:  # a document whose needed parts leave too little haystack is drawn again
            doc = ruler_document(rng, mix=self.config.ruler_mix)
            kind = rng.choice(self.config.ruler_haystacks)
            needles = [tok.encode(("\n" + n.lstrip(" ")) if kind in LINE_KINDS else n) for n in doc.needles]
            needed = list(doc.needed)  # line kinds above: a needle is a line of its own
            intro = tok.encode(doc.intro)
            tail = tok.encode(doc.question)
            answer_ids = tok.encode(doc.answer) + [tok.eos_id]
            fixed = int(tok.add_bos) + len(tail) + len(answer_ids)  # BOS, question, answer and EOS
            room = total - fixed - len(intro) - sum(map(len, needles))
            if room < total // 4 and intro:
                room, intro = room + len(intro), []
            while room < total // 4 and not all(needed):
                drop = max(i for i, k in enumerate(needed) if not k)
                room += len(needles[drop])
                del needles[drop], needed[drop]
            if room >= total // 8:
                break
        body, answer_start = self._place(rng, unit_stream(kind, rng), intro, needles, tail, answer_ids)
        return body, answer_start, doc, kind

    # ---- batches --------------------------------------------------------------------------------
    def batch(self, step: int, micro_step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, targets), each (B, T) long, for this rank's share of optimiser step `step`."""
        if step < 0 or not 0 <= micro_step < self.grad_accum_steps:
            raise ValueError(
                f"step={step}, micro_step={micro_step}: need step >= 0 and "
                f"0 <= micro_step < grad_accum_steps={self.grad_accum_steps}"
            )
        cfg = self.config
        B, T = cfg.batch_size, cfg.seq_len
        first_row = (micro_step * self.world_size + self.rank) * B
        docs = torch.empty(B, T + 1, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.bool)
        for i in range(B):
            rng = random.Random(f"gptoss-lite-train/{cfg.seed}/{step}/{first_row + i}")
            tokens, answer_start = self.document(rng)
            docs[i] = torch.tensor(tokens, dtype=torch.long)
            mask[i, answer_start - 1 :] = True  # target position t predicts token t + 1
        inputs, targets = docs[:, :-1], docs[:, 1:].clone()  # (B, T), (B, T)
        if cfg.loss_on == "answer":
            targets[~mask] = IGNORE_INDEX
        return inputs.contiguous(), targets

    def batches(self, start_step: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Endless (step, input_ids, targets) from `start_step` on (micro-step 0 of each step)."""
        step = start_step
        while True:
            yield (step, *self.batch(step))
            step += 1
