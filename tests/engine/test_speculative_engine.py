"""Speculative decoding inside the engine (LLM(speculate=PromptLookup(...))): prompt-lookup drafts for
every decoding request, verified in the one batched forward, rejected tokens rolled back with the
pools' truncate. Greedy output is the same as without speculation, token for token."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import make_model
from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.speculative import DraftModel, PromptLookup
from tests.engine.conftest import Workload, assert_nothing_leaks, run

LOOKUP = PromptLookup(k=6, ngram=4, min_ngram=2)


def copy_heavy_workload(rng: random.Random, vocab: int, n: int, spread: int, max_new: int = 48) -> Workload:
    """Mixed requests: half repeat a span of themselves (what prompt lookup drafts well), half are noise."""
    prompts = []
    for i in range(n):
        if i % 2:
            span = [rng.randrange(vocab) for _ in range(rng.randint(4, 30))]
            prompts.append((span * 8)[: rng.randint(8, 240)])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(rng.randint(1, 240))])
    params = [SamplingParams(max_tokens=rng.randint(1, max_new), temperature=0, ignore_eos=True) for _ in prompts]
    return Workload(prompts, params, [rng.randrange(spread) for _ in prompts])


def both(model, work: Workload, **engine):
    """(outputs without speculation, outputs with it, the speculating engine)."""
    plain = run(LLM(model, **engine), work)
    llm = LLM(model, speculate=LOOKUP, **engine)
    return plain, run(llm, work), llm


@pytest.mark.parametrize("compiled", [False, True])
def test_greedy_is_identical_with_and_without_speculation(models, compiled):
    model = models("shipped")
    work = copy_heavy_workload(random.Random(3), model.config.vocab_size, 32, 30)
    plain, spec, llm = both(model, work, kv_blocks=2000, max_batch_tokens=256, max_running=16, compile_decode=compiled)
    assert len(plain) == len(spec) == 32
    for i in range(32):
        assert spec[i].token_ids == plain[i].token_ids, f"request {i}"
    stats = llm.stats()
    assert stats.spec_accepted > 0 and stats.spec_verifications > 0
    assert stats.spec_tokens / stats.spec_verifications > 1.5  # tokens per verification: drafts were kept
    if compiled:  # drafts are verified by the compiled step too, one fixed-shape row per token
        assert llm.runner.compiled_verifications > 0
    assert_nothing_leaks(llm)


def test_compiled_verification_logits_equal_the_eager_forward(models):
    """A step of decode rows and drafts run compiled (each request a group of rows over one gathered
    table) gives the logits of the eager causal forward over the same batch, as closely as a plain
    compiled decode step does: within 1e-5 of the logits' scale (f32; the shipped model's logits
    reach about 20, and the compiled plain step differs from eager by about 1e-4 there too)."""
    model = models("shipped")
    work = copy_heavy_workload(random.Random(11), model.config.vocab_size, 8, 1)
    llm = LLM(model, speculate=LOOKUP, kv_blocks=800, max_batch_tokens=256, max_running=8, compile_decode=True)
    runner, forward, checked = llm.runner, llm.runner.forward, {"plain": [], "verify": []}

    def both_ways(step):
        input_ids, batch, _ = runner.build_batch(step)  # changes no request
        with torch.inference_mode():
            eager = model.forward_batch(input_ids, batch)
        logits, samplers = forward(step)
        if batch.static() is not None:
            kind = "verify" if any(entry.num_tokens > 1 for entry in step.scheduled) else "plain"
            checked[kind].append(float((logits - eager).abs().max() / eager.abs().max()))
        return logits, samplers

    runner.forward = both_ways
    graphs = counters["stats"]["unique_graphs"]
    run(llm, work)
    assert checked["verify"] and checked["plain"], "the workload was meant to run both kinds of compiled step"
    assert max(checked["verify"]) < 1e-5 and max(checked["plain"]) < 1e-5
    # start-up compiled both graphs (one row per request; groups of rows): every draft length and
    # batch size after that reuses them
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a graph of its own"


def test_speculation_under_preemption_keeps_outputs(models):
    model = models("shipped")
    work = copy_heavy_workload(random.Random(5), model.config.vocab_size, 12, 3, max_new=120)
    plain, spec, llm = both(model, work, kv_blocks=60, max_batch_tokens=128, max_running=12)
    assert llm.stats().preemptions > 0, "the pool was meant to force preemption"
    assert {i: o.token_ids for i, o in spec.items()} == {i: o.token_ids for i, o in plain.items()}
    assert_nothing_leaks(llm)


def test_requests_whose_logits_depend_on_their_tokens_do_not_speculate(models):
    """logprobs, penalties, logit bias and logits processors: one token a step, as without speculation."""
    model = models("lite-tiny")
    prompt = [5, 6, 7, 8] * 20
    llm = LLM(model, speculate=LOOKUP)
    for params in (
        SamplingParams(max_tokens=20, temperature=0, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0, presence_penalty=0.5),
        SamplingParams(max_tokens=20, temperature=0, logits_processor=lambda ids, logits: logits),
    ):
        out = llm.generate([prompt], params)[0]
        ref = LLM(model).generate([prompt], params)[0]
        assert out.token_ids == ref.token_ids
    assert llm.stats().spec_drafted == 0


def test_sampling_speculates_unless_seeded(models):
    """Unseeded sampled requests speculate (drafts verified by the sampling rule) and stop where asked;
    a seeded one decodes a token a step, so it draws what it draws without speculation."""
    model = models("lite-tiny")
    prompt = [9, 10, 11, 12, 13] * 30
    # a low temperature: the random model then falls into loops that prompt lookup drafts (still sampled)
    free = SamplingParams(max_tokens=40, temperature=0.05, top_p=0.9, ignore_eos=True)
    llm = LLM(model, speculate=LOOKUP)
    outs = llm.generate([prompt, prompt[:50]], free)
    assert all(len(o.token_ids) == 40 for o in outs)  # drafts never run past max_tokens
    assert llm.stats().spec_drafted > 0
    seeded = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)
    before = llm.stats().spec_drafted
    assert llm.generate([prompt], seeded)[0].token_ids == LLM(model).generate([prompt], seeded)[0].token_ids
    assert llm.stats().spec_drafted == before
    assert_nothing_leaks(llm)


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_there(models):
    model = models("lite-tiny")
    prompt = [1, 2, 3, 4] * 30
    plain = LLM(model).generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    stop = plain.token_ids[7]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(stop,))
    llm = LLM(model, speculate=LOOKUP)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == plain.token_ids[: plain.token_ids.index(stop) + 1]
    assert out.finish_reason == "stop"
    assert_nothing_leaks(llm)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_draft_model_keeps_greedy_output(models, compiled):
    """LLM(speculate=DraftModel(...)): any draft model leaves greedy output unchanged; the target as its
    own draft is accepted throughout, a random-weight draft of the same vocabulary mostly not."""
    model = models("shipped")
    work = copy_heavy_workload(random.Random(7), model.config.vocab_size, 12, 4, max_new=40)
    engine = dict(kv_blocks=800, max_batch_tokens=256, max_running=12, compile_decode=compiled)
    plain = run(LLM(model, **engine), work)
    same = LLM(model, speculate=DraftModel(copy.deepcopy(model).prepare_for_inference(), k=4), **engine)
    assert {i: o.token_ids for i, o in run(same, work).items()} == {i: o.token_ids for i, o in plain.items()}
    stats = same.stats()
    assert stats.spec_verifications > 0 and stats.spec_accepted == stats.spec_drafted
    assert (same._drafter.decoder is not None) == compiled  # the draft model's one-token steps compiled too
    assert_nothing_leaks(same)
    other = make_model("lite-tiny", seed=5)  # random weights, the shipped model's vocabulary
    assert other.config.vocab_size == model.config.vocab_size
    noisy = LLM(model, speculate=DraftModel(other, k=3), **engine)
    assert {i: o.token_ids for i, o in run(noisy, work).items()} == {i: o.token_ids for i, o in plain.items()}
    assert noisy.stats().spec_accepted < noisy.stats().spec_drafted
    assert_nothing_leaks(noisy)


def test_a_draft_model_of_another_vocabulary_is_refused(models):
    model = models("shipped")
    other = make_model("lite-tiny", vocab_size=model.config.vocab_size + 1)
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(model, speculate=DraftModel(other), kv_blocks=100)
