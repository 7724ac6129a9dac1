"""Requests joining, leaving and being aborted at any step: nothing leaks, bad input changes nothing,
and the facade's errors say what to fix."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from gptoss_lite.engine import LLM, QuotaExceeded, SamplingParams, TenantLimits, TenantPolicy
from gptoss_lite.generation import generate
from tests.engine.conftest import assert_nothing_leaks, random_workload, run


def test_aborts_at_random_steps_free_everything(models):
    model = models("gpt-oss-tiny")
    rng = random.Random(11)
    work = random_workload(rng, model.config.vocab_size, 16, 400, 20, 6)
    work.aborts = {i: rng.randrange(12) for i in rng.sample(range(16), 6)}
    llm = LLM(model, kv_blocks=120, max_batch_tokens=96, max_running=8)
    done = run(llm, work)
    assert set(done) <= set(range(16))
    assert llm.stats().aborted >= 1
    for i, out in done.items():  # the survivors are still right
        want = generate(model, torch.tensor([work.prompts[i]]), max_new_tokens=work.params[i].max_tokens, temperature=0)
        assert out.token_ids == want[0, len(work.prompts[i]) :].tolist()
    assert_nothing_leaks(llm)


# Three tenants with unequal shares; "c" may run one request at a time and queue two more.
POLICY = TenantPolicy(
    tenants={"a": TenantLimits(share=3), "b": TenantLimits(share=1), "c": TenantLimits(max_running=1, max_waiting=2)}
)


class EngineMachine(RuleBasedStateMachine):
    """add / step / abort in any order on a small pool shared by three tenants with shares, priorities
    and a quota; the pool and the tenants' counts validate after every rule, no tenant runs more than
    its max_running, a refused request changes nothing, and every request either finishes with its
    max_tokens (greedy, EOS ignored) or was aborted."""

    model = None

    @initialize()
    def setup(self):
        self.llm = LLM(self.model, kv_blocks=60, max_batch_tokens=48, max_running=4, tenants=POLICY)
        self.live: set[str] = set()
        self.expected: dict[str, int] = {}

    @rule(
        length=st.integers(1, 200),
        max_tokens=st.integers(1, 6),
        seed=st.integers(0, 5),
        tenant=st.sampled_from("abc"),
        priority=st.integers(-1, 2),
    )
    def add(self, length, max_tokens, seed, tenant, priority):
        prompt = [(seed * 31 + i * 7) % self.model.config.vocab_size for i in range(length)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        queued = self.llm.num_running + self.llm.num_waiting
        try:
            rid = self.llm.add_request(prompt, params, tenant=tenant, priority=priority)
        except QuotaExceeded:
            c = self.llm.stats().tenants["c"]
            assert tenant == "c" and c.running + c.waiting == 3
            assert self.llm.num_running + self.llm.num_waiting == queued
            return
        self.live.add(rid)
        self.expected[rid] = max_tokens

    @precondition(lambda self: self.live)
    @rule()
    def step(self):
        for out in self.llm.step():
            if out.finished:
                assert out.finish_reason == "length" and len(out.token_ids) == self.expected[out.request_id]
                self.live.discard(out.request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        assert self.llm.abort(rid)
        assert not self.llm.abort(rid)
        self.live.discard(rid)

    @invariant()
    def consistent(self):
        self.llm.validate()
        assert self.llm.num_running + self.llm.num_waiting == len(self.live)
        tenants = self.llm.stats().tenants
        assert "c" not in tenants or tenants["c"].running <= 1

    def teardown(self):
        while self.llm.has_unfinished():
            self.llm.step()
        assert_nothing_leaks(self.llm)


def test_engine_state_machine(models):
    EngineMachine.model = models("gpt-oss-tiny")
    run_state_machine_as_test(
        EngineMachine,
        settings=settings(
            max_examples=15, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], None, "empty prompt"),
        ([1, 2, 10**6], None, "out of vocabulary"),
        ([1, -2], None, "prompt token id"),
        ("text", None, None),  # fine: the shipped model has a byte tokenizer
        ([1] * 40000, SamplingParams(max_tokens=1000), "exceeds max_model_len"),  # 2,000 blocks hold 32,000
        (3, None, "expected a str or a list"),
    ],
)
def test_bad_requests_raise_and_change_nothing(models, prompt, params, message):
    llm = LLM(models("shipped"), kv_blocks=2000)
    before = (llm.num_waiting, llm.stats())
    if message is None:
        llm.add_request(prompt, params)
        assert llm.num_waiting == 1
        return
    with pytest.raises((ValueError, TypeError), match=message):
        llm.add_request(prompt, params)
    assert (llm.num_waiting, llm.stats()) == before


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": "ab"}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_are_checked(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SamplingParams(**kwargs)


def test_stop_rules(models):
    """EOS, a stop token id and a stop string each end a request with finish_reason 'stop'."""
    llm = LLM(models("shipped"), kv_blocks=200)
    free = llm.generate(["The passkey is"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 40
    first = free.token_ids[3]
    by_id = llm.generate(
        ["The passkey is"], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[first], ignore_eos=True)
    )[0]
    stop_at = free.token_ids.index(first)
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: stop_at + 1]
    piece = free.text[5:8]
    by_text = llm.generate(
        ["The passkey is"], SamplingParams(max_tokens=40, temperature=0, stop=[piece], ignore_eos=True)
    )[0]
    assert by_text.finish_reason == "stop" and by_text.text == free.text[: free.text.index(piece)]
    eos = llm.tokenizer.eos_id
    if eos in free.token_ids:  # the model does end this text: EOS stops it unless ignored
        by_eos = llm.generate(["The passkey is"], SamplingParams(max_tokens=40, temperature=0))[0]
        assert by_eos.finish_reason == "stop" and by_eos.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert_nothing_leaks(llm)


def test_outputs_report_timings_and_request_ids(models):
    llm = LLM(models("shipped"), kv_blocks=200)
    rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        llm.add_request([1], request_id="a")
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    assert [o.request_id for o in outs] == [rid] * 5
    assert [len(o.new_token_ids) for o in outs] == [1] * 5
    final = outs[-1]
    assert final.finished and final.metrics.ttft > 0 and len(final.metrics.itl) == 4
    assert all(t >= 0 for t in final.metrics.itl)


def test_token_range_is_a_slice_of_all_tokens():
    from gptoss_lite.engine.request import Request

    request = Request("r", [1, 2, 3, 4], SamplingParams(), "default", None)
    request.output_token_ids = [5, 6, 7]
    everything = request.all_token_ids
    for start in range(len(everything) + 1):
        for n in range(len(everything) - start + 1):
            assert request.token_range(start, n) == everything[start : start + n]


def test_prompt_is_inserted_once_per_new_block_not_every_step(models, monkeypatch):
    """cache_prompt hashes the prompt only when a step completed prompt blocks: a 200-token prompt in
    64-token chunks is inserted 3 times per layer kind (64, 128 and 192 tokens of whole blocks), and
    its last chunk and 50 decode steps add nothing."""
    from gptoss_lite.kv.prefix import PrefixCache

    calls = []
    original = PrefixCache.insert

    def counting(self, tokens, *args, **kwargs):
        calls.append(len(tokens))
        return original(self, tokens, *args, **kwargs)

    monkeypatch.setattr(PrefixCache, "insert", counting)
    model = models("shipped")
    llm = LLM(model, max_batch_tokens=64)
    llm.generate([list(range(1, 201))], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    kinds = len(llm.runner.store.pools)
    assert sorted(set(calls)) == [64, 128, 192]
    assert len(calls) == 3 * kinds
