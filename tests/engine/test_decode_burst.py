"""Decode bursts: while every running request decodes greedily and nothing waits, one scheduling
round runs several compiled steps back to back (`Scheduler._burst_length`, `ModelRunner.decode_burst`,
`paged_batch.DecodeBurst`). Checked against what they replace: each burst step's state against
`plain_decode` built for that step, the tokens against generate() and against the engine one token a
round, the pools after every burst against the pools after the same tokens appended one at a time."""

import copy
import random

import pytest
import torch

from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.engine import scheduler as scheduler_module
from gptoss_lite.engine.config import EngineConfig
from gptoss_lite.engine.paged_batch import plain_decode
from tests.engine.conftest import (
    assert_nothing_leaks,
    assert_same_as_generate,
    random_workload,
    recording,
    run,
)


@pytest.fixture(autouse=True)
def any_step_time(monkeypatch):
    """Bursts whatever this machine's step time (the time bound has a test of its own)."""
    monkeypatch.setattr(scheduler_module, "MAX_BURST_SECONDS", 1e6)


def _compiled(model, **kwargs) -> LLM:
    return LLM(copy.deepcopy(model).prepare_for_inference(compile_decode=True), **kwargs)


def _count_bursts(llm: LLM) -> list[int]:
    """The length of every burst the engine runs, from now on."""
    lengths, schedule = [], llm.scheduler.schedule

    def counted():
        step = schedule()
        if step.decode_steps > 1:
            lengths.append(step.decode_steps)
        return step

    llm.scheduler.schedule = counted
    return lengths


@pytest.mark.parametrize(
    "knobs", [{}, {"full_window": 48, "enable_prefix_caching": False}], ids=["whole context", "full-layer window"]
)
def test_each_burst_step_is_the_state_plain_decode_builds(models, knobs):
    """Before every compiled step of a burst, its state holds what `plain_decode` builds for that step
    from the burst's plans (the position j on, the j-th slots, the same tables), keys hidden exactly
    where plain_decode hides them; over requests past the sliding window, bursts crossing blocks."""
    model = models("gpt-oss-tiny")
    llm = _compiled(model, kv_blocks=400, max_batch_tokens=128, max_running=8, **knobs)
    runner = llm.runner
    burst_of, compiled, checked = runner.decode_burst, runner._compiled, []
    current = {}

    def recorded(step):
        current.update(step=step, j=0)
        try:
            return burst_of(step)
        finally:
            current.clear()

    def checked_step(ids, state):
        if current:
            step, j, bs = current["step"], current["j"], runner.store.block_size
            rows = [
                (
                    request.num_computed + j,
                    {kind: plan.slots[j][0] * bs + plan.slots[j][1] for kind, plan in plans.items()},
                    tables,
                )
                for request, _, plans, tables in step.scheduled
            ]
            want = plain_decode(runner.store, rows, runner.store.full_window)
            assert torch.equal(state.positions, want.positions)
            for kind in want.tables:
                assert torch.equal(state.tables[kind], want.tables[kind])
                assert torch.equal(state.slots[kind], want.slots[kind])
                got, expect = state.distances[kind], want.distances[kind]
                assert torch.equal(got.clamp(min=-1), expect.clamp(min=-1)), (kind, j)
            assert torch.equal(ids, torch.tensor([r.last_token_id for r, *_ in step.scheduled])) or j > 0
            current["j"] = j + 1
            checked.append(j)
        return compiled(ids, state)

    runner.decode_burst, runner._compiled = recorded, checked_step
    work = random_workload(random.Random(11), model.config.vocab_size, 8, 200, 90, 6)
    work.prompts[3] = work.prompts[2][:150] + work.prompts[3][:20]  # a prefix hit
    run(llm, work)
    assert len(checked) > 30 and max(checked) >= 3, "the workload was meant to burst"
    assert_nothing_leaks(llm)


@pytest.mark.parametrize("model_name", ["gpt-oss-tiny", "lite-tiny"])
def test_bursts_give_generates_tokens(models, model_name):
    """Random arrivals, lengths past the sliding window and max_tokens cutting bursts short: every
    request's tokens are generate()'s alone (near-ties allowed as everywhere in the engine tests), and
    bursts ran, of several lengths."""
    model = copy.deepcopy(models(model_name)).prepare_for_inference(compile_decode=True)
    llm = LLM(model, kv_blocks=300, max_batch_tokens=96, max_running=6)
    recording(llm)
    bursts = _count_bursts(llm)
    work = random_workload(random.Random(3), model.config.vocab_size, 10, 150, 60, 4)
    done = run(llm, work)
    assert len(done) == len(work.prompts)
    assert_same_as_generate(model, llm, work, done, exact=False)
    assert len(bursts) > 5 and len(set(bursts)) > 1, bursts
    assert_nothing_leaks(llm)


def test_a_stop_inside_a_burst_ends_the_request_there(models):
    """Stop tokens met in the middle of a burst: the output ends at the stop (finish reason "stop"),
    as one token a round ends it, and the other requests of the burst go on unchanged."""
    model = models("gpt-oss-tiny")
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(20 + 9 * i)] for i in range(4)]
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    one = _compiled(model, kv_blocks=200, decode_steps=1)
    plain = [o.token_ids for o in one.generate(prompts, free)]
    # request 0 stops at the token it draws 13th (with 8-token bursts after the first token: mid-burst)
    stop = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(plain[0][12],))
    params = [stop] + [free] * 3
    burst = _compiled(model, kv_blocks=200)
    lengths = _count_bursts(burst)
    outs = burst.generate(prompts, params)
    again = one.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]
    first = plain[0].index(plain[0][12])
    assert outs[0].token_ids == plain[0][: first + 1] and outs[0].finish_reason == "stop"
    assert [o.token_ids for o in outs[1:]] == plain[1:]
    assert lengths and max(lengths) == 8
    assert_nothing_leaks(burst)


def test_a_burst_leaves_the_pools_as_single_steps_do(models):
    """After a burst of K, every sequence holds in every pool the tokens K single decode steps leave,
    in as many blocks or (a window's block released a round later) one more; at the end every block
    is free in both."""
    model = models("gpt-oss-tiny")
    prompts = [[(5 * i + j) % 400 + 1 for j in range(30 + 37 * i)] for i in range(3)]
    params = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    engines = {steps: _compiled(model, kv_blocks=120, decode_steps=steps) for steps in (1, 8)}
    for llm in engines.values():
        for p in prompts:
            llm.add_request(p, params)
    tokens, compared = {1: 0, 8: 0}, 0
    while engines[8].has_unfinished():
        tokens[8] += sum(len(o.new_token_ids) for o in engines[8].step())
        while tokens[1] < tokens[8]:
            tokens[1] += sum(len(o.new_token_ids) for o in engines[1].step())
        assert tokens[1] == tokens[8]
        for one, burst in zip(engines[1].kv.groups, engines[8].kv.groups):
            assert one.pool.sequences == burst.pool.sequences
            for rid in burst.pool.sequences:
                assert one.pool.num_tokens(rid) == burst.pool.num_tokens(rid)
                extra = len(burst.pool.resident(rid)[0]) - len(one.pool.resident(rid)[0])
                assert 0 <= extra <= 1, (one.name, rid, extra)
                compared += 1
    assert compared > 20
    for llm in engines.values():
        assert_nothing_leaks(llm)


def _burst_after_warm_up(llm: LLM, prompts, params) -> list[int]:
    for p, sp in zip(prompts, params):
        llm.add_request(p, sp)
    lengths = _count_bursts(llm)
    while llm.has_unfinished():
        llm.step()
    return lengths


@pytest.mark.parametrize(
    "why,params",
    [
        ("sampled", SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True)),
        ("logprobs", SamplingParams(max_tokens=30, temperature=0, logprobs=2, ignore_eos=True)),
        ("penalty", SamplingParams(max_tokens=30, temperature=0, presence_penalty=0.5, ignore_eos=True)),
    ],
)
def test_requests_that_need_their_logits_never_burst(models, why, params):
    """A burst only keeps argmax tokens: a batch holding a sampled request, one asking for logprobs or
    one whose logits are adjusted runs one token a round, all of it."""
    model = models("gpt-oss-tiny")
    llm = _compiled(model, kv_blocks=200)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    assert _burst_after_warm_up(llm, [[1, 2, 3], [4, 5, 6, 7]], [greedy, params]) == [], why
    assert _burst_after_warm_up(llm, [[1, 2, 3], [4, 5, 6, 7]], [greedy, greedy]) != []


def test_a_burst_stops_at_the_nearest_max_tokens(models):
    """After the first round (the prompts and their first tokens) and one single step (the step time
    a burst is judged by), request 0 has 4 tokens left: a burst of 4, then request 1 alone in bursts
    of 8 and a last one of what is left."""
    model = models("gpt-oss-tiny")
    llm = _compiled(model, kv_blocks=200)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 50)]
    assert _burst_after_warm_up(llm, [[1, 2], [3, 4]], params) == [4, 8, 8, 8, 8, 8, 4]
    assert [len(o.token_ids) for o in llm.generate([[1, 2], [3, 4]], params)] == [6, 50]


def test_no_burst_while_a_request_waits(models):
    """With one running slot, the second request waits until the first finishes: no burst before."""
    model = models("gpt-oss-tiny")
    llm = _compiled(model, kv_blocks=200, max_running=1)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for p in ([1, 2, 3], [4, 5]):
        llm.add_request(p, params)
    seen, schedule = [], llm.scheduler.schedule

    def watched():
        waiting = len(llm.scheduler.waiting)
        step = schedule()
        seen.append((waiting, step.decode_steps))
        return step

    llm.scheduler.schedule = watched
    while llm.has_unfinished():
        llm.step()
    assert all(steps == 1 for waiting, steps in seen if waiting)
    assert any(steps > 1 for waiting, steps in seen if not waiting)


def test_no_burst_where_a_step_is_slow(models, monkeypatch):
    """A burst must be expected to end within MAX_BURST_SECONDS: with a bound no step meets, none runs."""
    monkeypatch.setattr(scheduler_module, "MAX_BURST_SECONDS", 1e-9)
    llm = _compiled(models("gpt-oss-tiny"), kv_blocks=200)
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 2
    assert _burst_after_warm_up(llm, [[1, 2], [3, 4]], params) == []


def test_bursts_only_where_the_compiled_step_runs_16_bit_blocks(models):
    """Eager engines, quantised full-layer blocks, speculation and decode_steps=1 decode one token a
    round; decode_steps is checked like every count."""
    model = models("gpt-oss-tiny")
    prompts, params = [[1, 2, 3], [4, 5]], [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 2
    assert _burst_after_warm_up(LLM(model, kv_blocks=200, compile_decode=False), prompts, params) == []
    assert _burst_after_warm_up(_compiled(model, kv_blocks=200, kv_format="int8"), prompts, params) == []
    assert _burst_after_warm_up(_compiled(model, kv_blocks=200, decode_steps=1), prompts, params) == []
    assert _burst_after_warm_up(_compiled(model, kv_blocks=200, decode_steps=4), prompts, params) == [4] * 4 + [2]
    with pytest.raises(ValueError, match="decode_steps"):
        EngineConfig(decode_steps=0)


def test_a_fault_in_a_burst_fails_its_request_alone(models):
    """The fault hook raising for one request of a burst finishes it with an error; the others keep
    their tokens."""
    model = models("gpt-oss-tiny")
    llm = _compiled(model, kv_blocks=200)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in _compiled(model, kv_blocks=200).generate([[1, 2, 3], [4, 5, 6]], params)]
    ids = [llm.add_request(p, params) for p in ([1, 2, 3], [4, 5, 6])]
    lengths = _count_bursts(llm)
    llm.step()  # the prompts and first tokens
    llm.step()  # a one-token round: the step time to judge a burst by
    doomed = ids[0]

    def fault(request):
        if request.request_id == doomed:
            raise RuntimeError("injected")

    llm.runner.fault_hook = fault
    outs = {}
    while llm.has_unfinished():
        for o in llm.step():
            outs[o.request_id] = o
    assert lengths, "the fault was meant to land in a burst"
    assert outs[doomed].finish_reason == "error" and "RuntimeError" in outs[doomed].error
    assert outs[ids[1]].token_ids == want[1]
    assert_nothing_leaks(llm)
