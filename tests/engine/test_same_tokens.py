"""The engine's greedy output equals generate() on each request alone, token for token."""

import random

import pytest

from gptoss_lite.engine import LLM, SamplingParams
from tests.engine.conftest import (
    assert_nothing_leaks,
    assert_same_as_generate,
    random_workload,
    recording,
    run,
)

# (model, requests, longest prompt) arriving over 40 steps: the default run keeps prompts to 800
# tokens; the slow run is the full check, 32 requests of 1 … 3,000 tokens on every model.
MODELS = ("lite-tiny", "gpt-oss-tiny", "shipped")
CASES = [(m, 32, 800) for m in MODELS] + [pytest.param(m, 32, 3000, marks=pytest.mark.slow) for m in MODELS]


@pytest.mark.parametrize("name,n,max_len", CASES)
def test_random_arrivals_match_generate(models, name, n, max_len):
    model = models(name)
    work = random_workload(random.Random(n + max_len), model.config.vocab_size, n, max_len, 12, 40)
    llm = LLM(model, kv_blocks=2000, max_batch_tokens=512, max_running=32)
    recording(llm)
    done = run(llm, work)
    assert len(done) == n
    assert_same_as_generate(model, llm, work, done, exact=name == "shipped")
    assert_nothing_leaks(llm)


@pytest.mark.parametrize("name", ["gpt-oss-tiny", "shipped"])
def test_preemption_keeps_outputs(models, name):
    """A pool that fits only a few requests: newer requests are preempted and recomputed, outputs unchanged."""
    model = models(name)
    # Admission reserves only the prompt: long outputs then outgrow the pool and force preemption.
    work = random_workload(random.Random(7), model.config.vocab_size, 12, 200, 120, 3)
    llm = LLM(model, kv_blocks=60, max_batch_tokens=128, max_running=12)
    recording(llm)
    done = run(llm, work)
    assert llm.stats().preemptions > 0, "the pool was meant to force preemption"
    assert len(done) == 12
    assert_same_as_generate(model, llm, work, done, exact=name == "shipped")
    assert_nothing_leaks(llm)


def test_prefix_hits_skip_prefill_and_keep_outputs(models):
    """Requests sharing a long prefix: later ones reuse its blocks (counted) and still match generate()."""
    model = models("shipped")
    rng = random.Random(3)
    shared = [rng.randrange(model.config.vocab_size) for _ in range(700)]
    prompts = [shared + [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    prompts.append(list(shared))  # the whole prompt cached but its last token
    work = random_workload(rng, model.config.vocab_size, 2, 10, 2, 1)
    work.prompts = prompts
    work.params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * len(prompts)
    work.arrivals = [0] + [3] * (len(prompts) - 1)  # the first is prefilled and cached before the rest arrive
    llm = LLM(model, kv_blocks=800, max_batch_tokens=1024)
    done = run(llm, work)
    assert_same_as_generate(model, llm, work, done, exact=True)
    assert all(done[i].num_cached_tokens == 688 for i in range(1, len(prompts)))  # 43 blocks of 16
    assert done[0].num_cached_tokens == 0
    stats = llm.stats()
    assert stats.prefix_hits == 688 * (len(prompts) - 1)
    assert_nothing_leaks(llm)


def test_prefix_scope_and_revision_isolate(models):
    """A prefix cached under one scope (tenant) or revision (weights) is never a hit under another."""
    model = models("shipped")
    prompt = list(range(1, 200))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm = LLM(model, kv_blocks=400, revision="a")
    llm.generate([prompt], params, scope="tenant-a")
    assert llm.generate([prompt], params, scope="tenant-b")[0].num_cached_tokens == 0
    assert llm.generate([prompt], params, scope="tenant-a")[0].num_cached_tokens == 192
    llm.kv.revision = "b"  # new weights: old entries must not match
    assert llm.generate([prompt], params, scope="tenant-a")[0].num_cached_tokens == 0
    assert_nothing_leaks(llm)


def test_seeded_sampling_matches_generate(models):
    """A seeded sampled request draws the same tokens in the engine, next to others, as alone."""
    import torch

    from gptoss_lite.generation import generate

    model = models("shipped")
    prompts = [[5, 6, 7, 8] * 10, [9] * 3, [20, 30] * 50]
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.8, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    llm = LLM(model, kv_blocks=200)
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        want = generate(model, torch.tensor([prompt]), max_new_tokens=20, temperature=0.9, top_p=0.8, seed=p.seed)
        assert out.token_ids == want[0, len(prompt) :].tolist()
    assert_nothing_leaks(llm)
