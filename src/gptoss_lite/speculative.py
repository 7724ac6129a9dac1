"""Speculative decoding: draft k tokens cheaply, verify them in one target forward.

A step at cache position n: the target model runs on T = k + 1 tokens (the last chosen token, not
yet in the cache, followed by the k drafts d_1 … d_k) at `start_pos = n`, which gives the target's
next-token distribution p_0 … p_k after each prefix. Draft i is *accepted* while every earlier one
was and:

- greedy: d_i == argmax p_{i-1} (so every emitted token is the argmax plain greedy would choose);
- sampling: a uniform draw u < p_{i-1}(d_i) / q_{i-1}(d_i), q being the draft's distribution (a
  one-hot vector for prompt lookup, so the ratio is p_{i-1}(d_i)).

At the first rejected position j the token is drawn from the residual max(0, p_j - q_j),
renormalised (greedy: argmax p_j); when all drafts are accepted a bonus token comes from p_k. Each
emitted token is thereby distributed exactly as plain sampling's (the standard speculative-sampling
argument: P(token = x) = min(p, q)(x) + (1 - sum min(p, q)) · residual(x) = p(x)). The cache is then
truncated back to the accepted tokens (`RollbackKVCache.truncate`).

Batches: rows accept different numbers of drafts but a cache holds the same number of tokens in
every row, so a step keeps the minimum a over rows: every row emits a + 1 tokens (its accepted
drafts, then its own token at position a, which for a row that accepted more is its accepted draft
d_{a+1}). That keeps each emitted token exact (greedy) or p-distributed (sampling), at the cost of
the drafts the longer rows would have kept.

Drafters: `PromptLookup` (the most recent earlier occurrence of the longest context suffix of
`ngram` … `min_ngram` tokens; the k tokens that followed it) and `DraftModel` (a smaller model of the
same vocabulary, with its own rollback cache, decoding k tokens ahead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gptoss_lite.kv.mixed import MixedKVCache
from gptoss_lite.model.transformer import GPTOSS
from gptoss_lite.sampling import SamplingParams, greedy, probabilities
from gptoss_lite.validation import check_int


@dataclass(frozen=True)
class PromptLookup:
    """Draft k tokens by n-gram lookup in the sequence so far (prompt and generated text): find the
    most recent earlier occurrence of its last `ngram` tokens (then ngram - 1, … down to `min_ngram`)
    and propose the k tokens that followed it (continued periodically when the copy reaches the end:
    a repeating pattern is drafted as repeating). Costs no model call."""

    k: int = 8
    ngram: int = 8
    min_ngram: int = 3

    def __post_init__(self) -> None:
        check_int("k (draft tokens)", self.k, minimum=1)
        check_int("min_ngram", self.min_ngram, minimum=1)
        check_int("ngram", self.ngram, minimum=self.min_ngram)


@dataclass(frozen=True, eq=False)
class DraftModel:
    """Draft k tokens with a smaller `model` of the same vocabulary (prepared for inference),
    decoding greedily (or sampling with the same settings as the target)."""

    model: GPTOSS
    k: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.model, GPTOSS):
            raise TypeError(f"DraftModel.model: expected a GPTOSS, got {type(self.model).__name__}")
        check_int("k (draft tokens)", self.k, minimum=1)


Speculation = PromptLookup | DraftModel


@dataclass
class SpeculationStats:
    """Counters a speculative `generate` fills in (per row, summed over rows for draft tokens).

    `target_forwards` counts the target's decode forwards plus one for the prefill (which yields the
    first token), so plain decoding has tokens_per_forward == 1.
    """

    new_tokens: int = 0  # tokens emitted per row
    target_forwards: int = 0
    drafted: int = 0  # draft tokens proposed, summed over rows
    accepted: int = 0  # draft tokens kept, summed over rows

    @property
    def acceptance_rate(self) -> float:
        """Kept draft tokens / proposed draft tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per row per target forward (1.0 for plain decoding)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_forward": round(self.tokens_per_forward, 4),
        }


class NgramIndex:
    """One row's tokens and, for each n in [min_ngram, ngram], the latest end of every n-gram that
    has at least one token after it. Indexing is incremental: O(ngram) dict writes per token."""

    def __init__(self, ngram: int, min_ngram: int) -> None:
        self.tokens: list[int] = []
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, ngram + 1)}
        self.sizes = sorted(self.ends, reverse=True)
        self.indexed = 0  # n-grams ending before this index are in `ends`

    def index(self) -> None:
        """Register the n-grams ending at every e < len(tokens) (so that tokens[e] follows them)."""
        tokens, L = self.tokens, len(self.tokens)
        for e in range(self.indexed, L):
            for n, table in self.ends.items():
                if e >= n:
                    table[tuple(tokens[e - n : e])] = e
        self.indexed = L

    def draft(self, k: int) -> list[int]:
        self.index()
        tokens, L = self.tokens, len(self.tokens)
        for n in self.sizes:
            if L >= n:
                e = self.ends[n].get(tuple(tokens[L - n :]))
                if e is not None:
                    # Copy what followed the match; a copy that reaches the end of the sequence goes
                    # on with its own drafts (period L - e), so a loop like "ababab" keeps going.
                    draft = tokens[e : e + k]
                    while len(draft) < k:
                        draft.append(draft[len(draft) - (L - e)])
                    return draft
        return []


class _LookupDrafter:
    def __init__(self, spec: PromptLookup, input_ids: torch.Tensor) -> None:
        self.spec = spec
        self.rows = [NgramIndex(spec.ngram, spec.min_ngram) for _ in range(input_ids.shape[0])]
        for row, ids in zip(self.rows, input_ids.tolist()):
            row.tokens.extend(ids)
            row.index()  # the prompt's n-grams, once, with the prompt's processing (before prefill)

    def extend(self, tokens: torch.Tensor, accepted: int) -> None:
        for row, ids in zip(self.rows, tokens.tolist()):
            row.tokens.extend(ids)

    def propose(
        self, k: int, sampling: SamplingParams, generator: torch.Generator | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        drafts = [row.draft(k) for row in self.rows]
        width = max(map(len, drafts))
        out = torch.zeros(len(drafts), width, dtype=torch.long)
        for b, d in enumerate(drafts):
            out[b, : len(d)] = torch.tensor(d, dtype=torch.long)
        lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        return out.to(device), lengths.to(device), None


class _ModelDrafter:
    """The draft model's own MixedKVCache (rollback slack k) holds a prefix of the committed
    sequence plus its own unverified drafts; `extend` cuts it back to what was accepted."""

    def __init__(self, spec: DraftModel, input_ids: torch.Tensor, prefill_chunk: int, attn_impl: str) -> None:
        self.model, self.prefill_chunk, self.attn_impl = spec.model, prefill_chunk, attn_impl
        self.seq = input_ids
        self.cache = MixedKVCache(spec.model.config, batch_size=input_ids.shape[0], rollback_tokens=spec.k)

    def extend(self, tokens: torch.Tensor, accepted: int) -> None:
        old = self.seq.shape[1]
        self.seq = torch.cat((self.seq, tokens), dim=1)
        # The cache may hold old + (k - 1) drafted tokens of which the first `accepted` were kept.
        self.cache.truncate(min(self.cache.num_tokens, old + accepted))

    def propose(
        self, k: int, sampling: SamplingParams, generator: torch.Generator | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        B = self.seq.shape[0]
        if k == 0:
            return self.seq.new_zeros(B, 0), self.seq.new_zeros(B), None
        # Catch up on the tokens committed since the last proposal (at least the pending one).
        logits = self.model.prefill(self.seq, self.cache, self.prefill_chunk, self.attn_impl)[:, -1]
        drafts, dists = [], []
        for i in range(k):
            if sampling.greedy:
                token = greedy(logits)
            else:
                q = probabilities(logits, sampling)  # (B, V)
                token = torch.multinomial(q, 1, generator=generator).squeeze(-1)
                dists.append(q)
            drafts.append(token)
            if i + 1 < k:
                logits = self.model(
                    token[:, None],
                    cache=self.cache,
                    start_pos=self.cache.num_tokens,
                    last_only=True,
                    attn_impl=self.attn_impl,
                ).logits[:, -1]
        q = torch.stack(dists, dim=1) if dists else None  # (B, k, V)
        return torch.stack(drafts, dim=1), torch.full((B,), k, dtype=torch.long, device=device), q


def make_drafter(spec: Speculation, input_ids: torch.Tensor, prefill_chunk: int, attn_impl: str):
    """The stateful drafter for one generation."""
    if isinstance(spec, PromptLookup):
        return _LookupDrafter(spec, input_ids)
    return _ModelDrafter(spec, input_ids, prefill_chunk, attn_impl)


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    q: torch.Tensor | None,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verification rule (module docstring) for each row on its own. logits (B, k+1, V): the
    target after each prefix; drafts (B, k) with row b's first lengths[b] real (the rest padding, never
    accepted); q (B, k, V) the draft distributions, or None for one-hot drafts (prompt lookup, or any
    greedy drafter).

    Returns (accepted (B,), own (B,)): row b accepts its first accepted[b] drafts and then emits
    own[b], its target token at that position (argmax when greedy; else the residual sample after a
    rejection, or a draw from p after its last real draft).
    """
    B, k = drafts.shape
    rows = torch.arange(B, device=drafts.device)
    real = torch.arange(k, device=drafts.device)[None, :] < lengths[:, None]  # (B, k)
    if sampling.greedy:
        target = logits.argmax(dim=-1)  # (B, k+1)
        accepted = ((drafts == target[:, :k]) & real).long().cumprod(dim=1).sum(dim=1)
        return accepted, target[rows, accepted]
    p = probabilities(logits, sampling)  # (B, k+1, V)
    p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # (B, k): p_i(d_{i+1})
    q_d = torch.ones_like(p_d) if q is None else q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(B, k, generator=generator, device=drafts.device)
    ok = (u * q_d < p_d) & real  # u < p/q, without dividing by a zero q
    accepted = ok.long().cumprod(dim=1).sum(dim=1)  # (B,)
    dist = p[rows, accepted]  # (B, V)
    rejected = accepted < lengths
    if rejected.any():
        at = accepted.clamp(max=k - 1)
        if q is None:
            qd = torch.zeros_like(dist)
            qd[rows, drafts[rows, at]] = 1.0
        else:
            qd = q[rows, at]
        resid = (dist - qd).clamp(min=0)
        mass = resid.sum(dim=-1, keepdim=True)
        use = rejected[:, None] & (mass > 0)  # mass 0 means p == q: a rejection had probability 0
        dist = torch.where(use, resid / mass.clamp(min=1e-30), dist)
    return accepted, torch.multinomial(dist, 1, generator=generator).squeeze(-1)


def accept(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    q: torch.Tensor | None,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """`verify`, then the batch keeps a = min over rows of the accepted counts (module docstring).

    Returns (tokens (B, a+1), a, accepted (B,)): every row's first a drafts, then its token at
    position a (its own target token, or its accepted draft d_{a+1} when it accepted more).
    """
    accepted, own = verify(logits, drafts, lengths, q, sampling, generator)
    a = int(accepted.min())
    last = own if a == drafts.shape[1] else torch.where(accepted > a, drafts[:, a], own)
    return torch.cat((drafts[:, :a], last[:, None]), dim=1), a, accepted
