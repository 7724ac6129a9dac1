"""The admission watermark (decode_reserve): long outputs that outgrow a small pool preempt each other
today; keeping blocks for every running request's next decode tokens preempts far less, outputs unchanged."""

from __future__ import annotations

import random

from gptoss_lite.engine import LLM, SamplingParams
from tests.engine.conftest import assert_nothing_leaks


def test_a_decode_reserve_preempts_at_least_twice_less_with_the_same_outputs(models):
    model = models("lite-tiny")
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(32, 128))] for _ in range(16)]
    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    blocks = 4 * -(-(128 + 160) // 16)  # a pool for about 4 requests at their full length
    runs = {}
    for reserve in (0, 128):
        llm = LLM(model, kv_blocks=blocks, block_size=16, max_running=16, max_batch_tokens=128, decode_reserve=reserve)
        runs[reserve] = ([o.token_ids for o in llm.generate(prompts, params)], llm.stats().preemptions)
        assert_nothing_leaks(llm)
    (plain, preempted), (reserved, fewer) = runs[0], runs[128]
    assert preempted > 0, "the pool was meant to force preemption"
    assert fewer * 2 <= preempted, (preempted, fewer)
    assert reserved == plain


def test_a_request_alone_is_admitted_whatever_the_reserve(models):
    """The reserve never keeps the only request out (it would wait forever)."""
    llm = LLM(models("lite-tiny"), kv_blocks=20, block_size=16, max_batch_tokens=64, decode_reserve=10_000)
    out = llm.generate([[1, 2, 3] * 20], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 200
