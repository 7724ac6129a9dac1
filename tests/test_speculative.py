"""Speculative decoding: greedy output identical to plain greedy, sampling distribution unchanged."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from scipy.stats import chisquare

from conftest import make_model
from gptoss_lite.checkpoint import DEFAULT_MODEL, load_model
from gptoss_lite.generation import generate, generate_reference, stream_generate
from gptoss_lite.kv.mixed import MixedKVCache
from gptoss_lite.sampling import SamplingParams, probabilities
from gptoss_lite.speculative import DraftModel, PromptLookup, SpeculationStats, accept, verify
from gptoss_lite.tokenizer import ByteTokenizer

P_MIN = 1e-3  # the chi-squared tests fail when a p-value drops below this (seeded: deterministic)


def _copy_prompt(B: int, seed: int) -> torch.Tensor:
    """A prompt that repeats itself, so prompt lookup finds drafts (rows differ)."""
    base = torch.randint(0, 256, (B, 24), generator=torch.Generator().manual_seed(seed))
    return torch.cat((base, base, base[:, :8]), dim=1)


@functools.cache
def _model(preset: str, seed: int = 0):
    return make_model(preset, seed=seed)


@functools.cache
def _near_copy(preset: str, noise: float = 0.1):
    """A draft that agrees with `_model(preset)` often but not always: its weights plus noise."""
    draft = make_model(preset)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().nan_to_num(0.0))
    return draft.prepare_for_inference()


@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny"])
@pytest.mark.parametrize("drafter", ["lookup", "draft"])
@pytest.mark.parametrize("B", [1, 2])
def test_greedy_speculative_equals_plain_greedy(preset, drafter, B):
    """Greedy speculative decoding emits exactly plain greedy's tokens, with drafts both accepted and
    rejected along the way."""
    model = _model(preset)
    spec = PromptLookup(k=4, ngram=4, min_ngram=1) if drafter == "lookup" else DraftModel(_near_copy(preset), k=3)
    ids = _copy_prompt(B, seed=B)
    plain = generate(model, ids, 40, temperature=0)
    stats = SpeculationStats()
    out = generate(model, ids, 40, temperature=0, speculate=spec, stats=stats)
    assert torch.equal(out, plain)
    assert stats.new_tokens == 40 and stats.accepted > 0 and stats.target_forwards < 40


def test_draft_model_that_always_agrees_is_exact_and_fast(tiny_model):
    """A draft equal to the target accepts every draft: k + 1 tokens per target forward, same output."""
    ids = _copy_prompt(2, seed=3)
    stats = SpeculationStats()
    out = generate(tiny_model, ids, 21, temperature=0, speculate=DraftModel(tiny_model, k=4), stats=stats)
    assert torch.equal(out, generate_reference(tiny_model, ids, 21, temperature=0))
    assert stats.acceptance_rate == 1.0 and stats.target_forwards == 1 + 4  # 1 + 4 x 5 tokens


@pytest.mark.parametrize("B", [1, 2])
def test_shipped_model_greedy_speculative_equals_plain(B):
    """On the shipped demo model, prompt lookup and a random tiny draft model give plain greedy's tokens."""
    model = load_model(DEFAULT_MODEL)
    tok = ByteTokenizer()
    texts = [
        "The passkey is 40391. Remember it. The grass is green. The sky is blue. What is the passkey? The passkey is",
        "The sky is blue. The sun is yellow. The grass is green. The sky is blue. The sun is",
    ][:B]
    rows = [tok.encode(t) for t in texts]
    n = min(map(len, rows))
    ids = torch.tensor([r[-n:] for r in rows])
    plain = generate(model, ids, 24, temperature=0)
    draft = make_model("lite-tiny", seed=11)
    assert draft.config.vocab_size == model.config.vocab_size
    for spec in (PromptLookup(k=6), DraftModel(draft, k=3)):
        assert torch.equal(generate(model, ids, 24, temperature=0, speculate=spec), plain), spec


def test_speculation_with_stop_tokens(tiny_model):
    """Stop tokens end rows exactly as in plain decoding."""
    ids = _copy_prompt(2, seed=4)
    plain = generate(tiny_model, ids, 30, temperature=0)
    stop = [int(plain[0, ids.shape[1] + 5]), int(plain[1, ids.shape[1] + 9])]
    want = list(stream_generate(tiny_model, ids, 30, temperature=0, stop_tokens=stop))
    got = list(
        stream_generate(tiny_model, ids, 30, temperature=0, stop_tokens=stop, speculate=PromptLookup(k=4, min_ngram=1))
    )
    assert len(got) == len(want) < 30 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_bad_speculation_arguments_are_rejected(tiny_model):
    """Wrong drafter types, k < 1, a draft of another vocabulary, a cache without enough rollback
    slack and a non-rollback cache raise before anything runs."""
    ids = _copy_prompt(1, seed=0)
    with pytest.raises(TypeError, match="speculate: expected None, a PromptLookup or a DraftModel"):
        generate(tiny_model, ids, 4, speculate="lookup")
    with pytest.raises(ValueError, match="k \\(draft tokens\\)"):
        PromptLookup(k=0)
    with pytest.raises(ValueError, match="ngram"):
        PromptLookup(ngram=2, min_ngram=3)
    other = make_model("lite-tiny", vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size=300 differs"):
        generate(tiny_model, ids, 4, speculate=DraftModel(other))

    with pytest.raises(ValueError, match="rollback_tokens=0 but speculating 4 tokens may take back 3"):
        generate(tiny_model, ids, 4, cache=MixedKVCache(tiny_model.config), speculate=PromptLookup(k=4))

    class NoRollback:
        batch_size, num_tokens = 1, 0

        def update(self, layer, k, v, start_pos):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="cache that can roll back"):
        generate(tiny_model, ids, 4, cache=NoRollback(), speculate=PromptLookup())


def _exact_distribution(model, prompt: torch.Tensor, cfg: SamplingParams, n: int) -> torch.Tensor:
    """P(t1 … tn | prompt) over all V**n continuations (flattened, t1 most significant), from
    uncached forwards over every prefix: the oracle."""
    V = model.config.vocab_size
    joint = torch.ones(1, dtype=torch.float64)
    with torch.inference_mode():
        for step in range(n):
            prefixes = torch.tensor(list(itertools.product(range(V), repeat=step)), dtype=torch.long)
            seqs = torch.cat((prompt.expand(V**step, -1), prefixes.view(V**step, step)), dim=1)
            p = probabilities(model(seqs).logits[:, -1], cfg).double()  # (V**step, V)
            joint = (joint[:, None] * p).flatten()
    return joint


def _fits(sample: torch.Tensor, exact: torch.Tensor, V: int) -> float:
    """Chi-squared goodness-of-fit p-value of the rows' token tuples against `exact`, lumping the
    cells with expected counts < 5 into one."""
    n = sample.shape[1]
    code = sum(sample[:, i] * V ** (n - 1 - i) for i in range(n))
    counts = torch.bincount(code, minlength=V**n).double()
    N = sample.shape[0]
    keep = exact * N >= 5
    obs = torch.cat((counts[keep], counts[~keep].sum()[None]))
    exp = torch.cat((exact[keep], exact[~keep].sum()[None])) * N
    if exp[-1] < 1e-9:  # nothing to lump
        assert obs[-1] == 0
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * (obs.sum() / exp.sum())
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_speculative_sampling_keeps_the_distribution(drafter):
    """Over 2000 independent rows, the (t1, t2, t3) frequencies of speculative sampling fit the exact
    joint distribution (chi-squared goodness of fit), as plain sampling's do."""
    V, N, n = 6, 2000, 3
    model = make_model("lite-tiny", vocab_size=V)
    cfg = SamplingParams(temperature=1.3, top_p=0.95)
    prompt = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 1, 2]])
    exact = _exact_distribution(model, prompt, cfg, n)
    spec = (
        PromptLookup(k=3, ngram=2, min_ngram=1)
        if drafter == "lookup"
        else DraftModel(make_model("lite-tiny", seed=5, vocab_size=V), k=2)
    )
    stats = SpeculationStats()
    kw = dict(temperature=cfg.temperature, top_p=cfg.top_p)
    out = generate(model, prompt.expand(N, -1), n, seed=123, speculate=spec, stats=stats, **kw)
    assert stats.drafted > 0
    plain = generate(model, prompt.expand(N, -1), n, seed=321, **kw)
    assert _fits(plain[:, -n:], exact, V) > P_MIN
    assert _fits(out[:, -n:], exact, V) > P_MIN


def test_acceptance_rule_is_exact_over_several_positions():
    """The verification rule alone, on fixed distributions, 200k independent rows: the first token is
    distributed as p_0 and, after an accepted d_1, the second as p_1, for one-hot (lookup) and soft
    (draft model) drafts; greedy accepts exactly the argmax matches and the batch keeps the minimum."""
    V, k, N = 5, 2, 200_000
    g = torch.Generator().manual_seed(1)
    p_logits = torch.randn(k + 1, V, generator=g) * 1.5
    q_probs = torch.softmax(torch.randn(k, V, generator=g), dim=-1)
    cfg = SamplingParams(temperature=1.0, top_p=1.0)
    p = probabilities(p_logits, cfg)
    logits = p_logits.expand(N, k + 1, V)
    for one_hot in (True, False):
        if one_hot:  # lookup: an unlikely first draft (many rejections), a likely second
            drafts = torch.tensor([int(p[0].argmin()), int(p[1].argmax())]).expand(N, k)
            q = None
        else:
            drafts = torch.stack(
                [torch.multinomial(q_probs[i], N, replacement=True, generator=g) for i in range(k)], dim=1
            )
            q = q_probs.expand(N, k, V)
        accepted, own = verify(logits, drafts, torch.full((N,), k), q, cfg, g)
        first = torch.where(accepted >= 1, drafts[:, 0], own)
        assert _fits(first[:, None], p[0].double(), V) > P_MIN
        # The second token exists when d_1 was accepted; its target is then p_1.
        second = torch.where(accepted >= 2, drafts[:, 1], own)[accepted >= 1]
        assert len(second) > 1000
        assert _fits(second[:, None], p[1].double(), V) > P_MIN
    greedy = SamplingParams(temperature=0)
    top = p.argmax(dim=-1)
    d = torch.tensor([[int(top[0]), int(top[1])], [int(top[0]), int(p[1].argmin())]])
    tokens, a, per_row = accept(p_logits.expand(2, k + 1, V), d, torch.tensor([2, 2]), None, greedy, None)
    assert per_row.tolist() == [2, 1] and a == 1
    assert tokens.tolist() == [[int(top[0]), int(top[1])], [int(top[0]), int(top[1])]]
