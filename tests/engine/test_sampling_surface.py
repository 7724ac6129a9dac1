"""The OpenAI sampling options in the engine, against references written here: logprobs are the
log_softmax of the model's own logits, and logit_bias and the presence/frequency penalties change
the logits exactly as the API defines, in a batch as alone."""

from __future__ import annotations

import math

import pytest
import torch

from gptoss_lite.engine import LLM, SamplingParams

PROMPTS = [[(5 * i + 11 * j) % 250 for j in range(6 + 7 * i)] for i in range(4)]


def tiny() -> LLM:
    return LLM("lite-tiny", max_model_len=256, max_running=8, max_batch_tokens=32)


def run(llm: LLM, params: list[SamplingParams]) -> list:
    return llm.generate(PROMPTS[: len(params)], params)


@torch.inference_mode()
def reference_logits(llm: LLM, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """(len(generated), V) fp32: the logits the model gives, in one dense forward, before each token."""
    ids = torch.tensor([prompt + generated])
    logits = llm.model(ids).logits[0].float()  # (T, V)
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def adjust(logits: torch.Tensor, generated: list[int], p: SamplingParams) -> torch.Tensor:
    """The API's rule, spelled out: bias added; each generated token's logit lowered by
    frequency_penalty per occurrence plus presence_penalty once."""
    out = logits.clone()
    for token, bias in p.logit_bias:
        out[token] += bias
    for token in set(generated):
        out[token] -= p.frequency_penalty * generated.count(token) + p.presence_penalty
    return out


def test_logprobs_are_log_softmax_of_the_models_logits():
    """For every generated token (greedy and sampled rows batched together): the chosen token's
    logprob and the top-k list equal log_softmax of a dense forward within 1e-5, most likely first."""
    llm = tiny()
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),  # asks for none
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0),
    ]
    outs, deltas = {}, {}
    for rid, prompt, p in zip("abcd", PROMPTS, params):
        llm.add_request(prompt, p, request_id=rid)
    while llm.has_unfinished():
        for out in llm.step():
            deltas.setdefault(out.request_id, []).extend(out.logprobs or [])
            if out.finished:
                outs[out.request_id] = out
    assert outs["c"].logprobs is None and "c" not in deltas or deltas["c"] == []
    for rid, prompt, p in zip("abd", [PROMPTS[0], PROMPTS[1], PROMPTS[3]], [params[0], params[1], params[3]]):
        tokens, got = outs[rid].token_ids, deltas[rid]
        assert [g.token_id for g in got] == tokens
        want = torch.log_softmax(reference_logits(llm, prompt, tokens), dim=-1)
        for i, g in enumerate(got):
            assert math.isclose(g.logprob, float(want[i, g.token_id]), abs_tol=1e-5)
            assert len(g.top) == p.logprobs
            values, ids = want[i].topk(p.logprobs) if p.logprobs else (torch.tensor([]), torch.tensor([]))
            assert [t for t, _ in g.top] == ids.tolist()
            assert all(math.isclose(v, float(w), abs_tol=1e-5) for (_, v), w in zip(g.top, values))
            assert all(a[1] >= b[1] for a, b in zip(g.top, g.top[1:]))  # ordered


def test_generate_outputs_hold_every_tokens_logprobs():
    """generate()'s final output carries the logprobs of all its tokens (not only its last step's),
    equal to log_softmax of a dense forward within 1e-5; a request that asks for none gets None."""
    llm = tiny()
    asks = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    outs = run(llm, [asks, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)])
    tokens = outs[0].token_ids
    assert len(tokens) == 12 and [g.token_id for g in outs[0].logprobs] == tokens
    want = torch.log_softmax(reference_logits(llm, PROMPTS[0], tokens), dim=-1)
    assert all(
        math.isclose(g.logprob, float(want[i, g.token_id]), abs_tol=1e-5) for i, g in enumerate(outs[0].logprobs)
    )
    assert outs[1].logprobs is None


def test_penalties_and_bias_equal_the_direct_reference():
    """Greedy with penalties and a bias: each token is the argmax of the reference rule applied to a
    dense forward's logits. Requests without options in the same batch are unchanged."""
    llm = tiny()
    adjusted = [
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, presence_penalty=2.0, frequency_penalty=-0.5),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logit_bias={7: 3.5, 100: -2.0}),
    ]
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = run(llm, [*adjusted, plain])
    for prompt, p, out in zip(PROMPTS, adjusted, outs):
        tokens: list[int] = []
        for _ in range(p.max_tokens):
            logits = reference_logits(llm, prompt, tokens + [0])[-1]  # the logits before the next token
            tokens.append(int(adjust(logits, tokens, p).argmax()))
        assert out.token_ids == tokens
    alone = tiny().generate([PROMPTS[3]], plain)[0]
    assert outs[3].token_ids == alone.token_ids


def test_a_bias_of_100_forces_and_minus_100_bans():
    """+100 on a token makes every token it (greedy and sampled); -100 on the greedy choice removes it."""
    llm = tiny()
    forced = [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logit_bias={42: 100}),
        SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, logit_bias={42: 100}),
    ]
    for out in run(llm, forced):
        assert out.token_ids == [42] * 10
    greedy = run(llm, [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)])[0].token_ids
    banned = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logit_bias={greedy[0]: -100})
    assert greedy[0] not in run(llm, [banned])[0].token_ids


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias": {1: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": [(1, 2, 3)]}, "logit_bias"),
    ],
)
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kwargs)


def test_n_samples_share_the_prompt_and_each_equals_its_single_run():
    """n=4 with a seed: four distinct samples, sample i equal to a single request with seed + i; while
    they run, every prompt block is held by all four (the pool's copy-on-write fork), and afterwards
    every block is free."""
    llm = tiny()
    prompt = list(range(40, 90))  # 50 tokens: 3 full blocks of 16 and a partial one
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True, n=4)
    llm.add_request(prompt, p, request_id="r")
    finals, shared = {}, None
    while llm.has_unfinished():
        outs = llm.step()
        if shared is None and len(llm.scheduler.running) == 4:
            for pool in llm.runner.store.pools.values():
                table = pool._seq("r").table
                assert all(pool.refcount(b) >= 4 for b in table), [pool.refcount(b) for b in table]
            shared = True
        for out in outs:
            assert out.request_id == "r"
            if out.finished:
                finals[out.index] = out
    assert shared and sorted(finals) == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in finals.values()}) == 4
    for i, out in finals.items():
        single = tiny().generate([prompt], p.for_sample(i))[0]
        assert out.token_ids == single.token_ids and out.text == single.text
    llm.validate()
    llm.clear_prefix_cache()
    assert llm.all_blocks_free()


def test_aborting_an_n_request_stops_every_sample():
    """abort(id) ends all n samples, forked or still waiting to fork, and frees their blocks."""
    llm = tiny()
    llm.add_request(
        list(range(30)), SamplingParams(max_tokens=50, temperature=0.5, ignore_eos=True, n=3), request_id="x"
    )
    llm.step()  # the prompt (30 tokens, within one 32-token step): the two others fork from it
    llm.step()
    assert len(llm.scheduler.running) == 3
    assert llm.abort("x") and not llm.has_unfinished() and not llm.abort("x")
    llm.validate()
    llm.clear_prefix_cache()
    assert llm.all_blocks_free()
    with pytest.raises(ValueError, match="add_request"):
        llm.generate([[1, 2]], SamplingParams(n=2))
