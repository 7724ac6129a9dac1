"""Tenants share the engine (engine/fairness.py): a flood from one tenant does not queue another's
request behind it, flooding tenants get tokens in proportion to their shares, priorities order a
tenant's own requests, and the quotas refuse or expire requests without changing anything else."""

from __future__ import annotations

import pytest

from gptoss_lite.engine import LLM, QuotaExceeded, SamplingParams, TenantLimits, TenantPolicy
from tests.engine.conftest import assert_nothing_leaks

GREEDY = dict(temperature=0, ignore_eos=True)


def _prompt(seed: int, n: int = 12) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 1 for i in range(n)]


def _engine(models, policy=None, **knobs):
    knobs = {"kv_blocks": 400, "max_batch_tokens": 64, "max_running": 8, **knobs}
    return LLM(models("gpt-oss-tiny"), tenants=policy, **knobs)


def _flood(llm, tenant, count, max_tokens=30, start=0, **kw):
    return [
        llm.add_request(_prompt(start + i), SamplingParams(max_tokens=max_tokens, **GREEDY), tenant=tenant, **kw)
        for i in range(count)
    ]


def _steps_until_done(llm, rid, limit=2000):
    for n in range(1, limit + 1):
        for out in llm.step():
            if out.request_id == rid and out.finished:
                return n, out
    raise AssertionError(f"{rid} did not finish in {limit} steps")


@pytest.mark.parametrize("fair", [True, False])
def test_a_flood_does_not_queue_another_tenant_behind_it(models, fair):
    """Tenant a queues 40 requests of 30 tokens on 8 slots; tenant b then sends one of 8 tokens. Fair
    sharing gives b a slot at the next step (one of a's requests yields) and b finishes in about its
    own 8 steps; arrival order makes b wait for most of a's flood."""
    llm = _engine(models, TenantPolicy(fair=fair))
    _flood(llm, "a", 40)
    for _ in range(3):
        llm.step()
    assert llm.num_running == 8
    rid = llm.add_request(_prompt(99), SamplingParams(max_tokens=8, **GREEDY), tenant="b")
    steps, out = _steps_until_done(llm, rid)
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    if fair:
        assert steps <= 8 + 1
        assert llm.stats().preemptions >= 1
    else:
        assert steps > 100
    while llm.has_unfinished():
        llm.step()
    assert_nothing_leaks(llm)


def test_the_yielded_request_keeps_its_tokens(models):
    """A request that yields its slot to another tenant resumes later and ends exactly as it would alone."""
    llm = _engine(models, max_running=2)
    first = _flood(llm, "a", 2, max_tokens=20)
    for _ in range(5):
        llm.step()
    llm.add_request(_prompt(50), SamplingParams(max_tokens=4, **GREEDY), tenant="b")
    done = {}
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    assert llm.stats().preemptions >= 1
    alone = _engine(models, max_running=2)
    want = alone.generate([_prompt(0), _prompt(1)], SamplingParams(max_tokens=20, **GREEDY))
    assert [done[r].token_ids for r in first] == [w.token_ids for w in want]
    assert_nothing_leaks(llm)


@pytest.mark.parametrize("shares", [(1, 1), (3, 1)])
def test_flooding_tenants_get_tokens_in_proportion_to_their_shares(models, shares):
    """Both tenants keep far more requests queued than there are slots; over 200 steps the tokens
    each generated follow the shares within 10%."""
    policy = TenantPolicy(tenants={"a": TenantLimits(share=shares[0]), "b": TenantLimits(share=shares[1])})
    llm = _engine(models, policy)
    _flood(llm, "a", 100, max_tokens=20)
    _flood(llm, "b", 100, max_tokens=20, start=100)
    for _ in range(200):
        llm.step()
    tenants = llm.stats().tenants
    ratio = tenants["a"].generated_tokens / tenants["b"].generated_tokens
    want = shares[0] / shares[1]
    assert abs(ratio - want) <= 0.1 * want, (ratio, tenants)
    assert tenants["a"].waiting and tenants["b"].waiting  # both still flooding at the end


def test_priority_orders_a_tenants_own_requests(models):
    llm = _engine(models, max_running=1)
    low = llm.add_request(_prompt(1), SamplingParams(max_tokens=3, **GREEDY), priority=5)
    high = llm.add_request(_prompt(2), SamplingParams(max_tokens=3, **GREEDY), priority=-1)
    mid = llm.add_request(_prompt(3), SamplingParams(max_tokens=3, **GREEDY))
    order = []
    while llm.has_unfinished():
        order += [o.request_id for o in llm.step() if o.finished]
    assert order == [high, mid, low]
    with pytest.raises(TypeError, match="priority"):
        llm.add_request(_prompt(4), priority="high")


def test_max_running_per_tenant_leaves_slots_to_others(models):
    policy = TenantPolicy(tenants={"a": TenantLimits(max_running=2)})
    llm = _engine(models, policy)
    _flood(llm, "a", 10)
    _flood(llm, "b", 10, start=50)
    for _ in range(4):
        llm.step()
        tenants = llm.stats().tenants
        assert tenants["a"].running <= 2
    assert tenants["b"].running == 6


def test_the_quota_refuses_the_request_beyond_running_plus_waiting_and_changes_nothing(models):
    policy = TenantPolicy(default=TenantLimits(max_running=2, max_waiting=1))
    llm = _engine(models, policy)
    _flood(llm, "a", 3)
    before = llm.stats()
    with pytest.raises(QuotaExceeded, match="quota") as refused:
        _flood(llm, "a", 1, start=9)
    assert refused.value.retry_after >= 1 and refused.value.tenant == "a"
    after = llm.stats()
    assert after.num_waiting == before.num_waiting and after.tenants["a"].rejected == 1
    _flood(llm, "b", 3, start=20)  # another tenant is unaffected
    while llm.has_unfinished():
        llm.step()
    assert_nothing_leaks(llm)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_tokens_per_minute_refills_and_refunds(models):
    policy = TenantPolicy(default=TenantLimits(tokens_per_minute=100))
    llm = _engine(models, policy)
    clock = llm.scheduler.waiting.clock = FakeClock()
    llm.add_request(_prompt(1, 20), SamplingParams(max_tokens=40, **GREEDY), tenant="a")  # 60 of 100
    with pytest.raises(QuotaExceeded, match="tokens_per_minute") as refused:
        llm.add_request(_prompt(2, 20), SamplingParams(max_tokens=40, **GREEDY), tenant="a")
    assert refused.value.retry_after == pytest.approx(12.0)  # 20 tokens short at 100/60 per second
    llm.add_request(_prompt(3, 20), SamplingParams(max_tokens=40, **GREEDY), tenant="b")  # b has its own
    with pytest.raises(ValueError, match="more than tenant 'a'"):
        llm.add_request(_prompt(4, 20), SamplingParams(max_tokens=90, **GREEDY), tenant="a")
    clock.now += 12.0
    llm.add_request(_prompt(2, 20), SamplingParams(max_tokens=40, **GREEDY), tenant="a")
    while llm.has_unfinished():
        llm.step()
    assert_nothing_leaks(llm)


def test_a_request_that_waits_past_max_queue_time_ends_with_a_clear_error(models):
    policy = TenantPolicy(default=TenantLimits(max_queue_time=5.0))
    llm = _engine(models, policy, max_running=1)
    clock = llm.scheduler.waiting.clock = FakeClock()
    _flood(llm, "a", 1, max_tokens=10)
    late = llm.add_request(_prompt(7), SamplingParams(max_tokens=10, **GREEDY), tenant="a")
    llm.step()  # the first is admitted; the second waits
    clock.now += 6.0
    outs = {o.request_id: o for o in llm.step()}
    out = outs[late]
    assert out.finished and out.finish_reason == "error" and out.error_code == "queue_timeout"
    assert "max_queue_time=5 s" in out.error and out.token_ids == []
    assert llm.stats().tenants["a"].expired == 1
    while llm.has_unfinished():
        llm.step()
    assert_nothing_leaks(llm)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"tenants": {"a": {"share": 0}}}, "share"),
        ({"tenants": {"a": {"shares": 2}}}, "unknown key"),
        ({"default": {"max_running": 1.5}}, "max_running"),
        ({"default": {"max_queue_time": -1}}, "max_queue_time"),
        ({"tenant": {}}, "unknown key"),
        ({"tenants": ["a"]}, "tenant names"),
    ],
)
def test_bad_policies_say_what_is_wrong(data, message):
    with pytest.raises(ValueError, match=message):
        TenantPolicy.from_mapping(data)


def test_a_named_tenant_takes_the_defaults_it_does_not_set():
    policy = TenantPolicy.from_mapping({"default": {"max_waiting": 4}, "tenants": {"a": {"share": 3}}})
    assert policy.limits("a") == TenantLimits(share=3, max_waiting=4)
    assert policy.limits("zzz") == TenantLimits(max_waiting=4)


@pytest.mark.parametrize("max_running, tenants", [(1, "ab"), (8, "abc")])
def test_a_slot_does_not_flap_between_tenants_whose_share_is_not_whole(models, max_running, tenants):
    """Shares of half a slot (1 slot, 2 tenants) or 2.67 slots (8 slots, 3 tenants): a slot moves only
    from a tenant that keeps its share to one that stays within its own, so after the first steps
    no request is preempted again and again."""
    llm = _engine(models, max_running=max_running)
    for k, tenant in enumerate(tenants):
        _flood(llm, tenant, 2 * max_running, max_tokens=20, start=40 * k)
    for _ in range(40):
        llm.step()
        assert sum(llm.stats().tenants[t].running for t in tenants) <= max_running
    assert llm.stats().preemptions <= len(tenants)


def test_a_light_tenant_keeps_its_steps_short_and_the_heavy_rows_take_turns(models):
    """While b's one request runs beside a's 7 (a yielded one of its 8 slots), a runs at most
    ceil(1 + F) rows a step, and the rows that sit out are a's least recently run: every one of a's
    running requests still moves."""
    llm = _engine(models, max_running=8)
    llm.scheduler.waiting.step_cost.fixed_rows = lambda: 2.0  # F = 2: a may run ceil(1 + 2) = 3 rows
    heavy = _flood(llm, "a", 8, max_tokens=60)
    for _ in range(4):
        llm.step()
    llm.add_request(_prompt(90), SamplingParams(max_tokens=12, **GREEDY), tenant="b")
    before = {r.request_id: len(r.output_token_ids) for r in llm.scheduler.running}
    rows = []
    for _ in range(10):
        step = llm.scheduler.schedule()
        rows.append(sum(1 for e in step.scheduled if e.request.tenant == "a"))
        sampled, failed = llm._execute(step)
        llm.scheduler.postprocess(step, sampled, failed)
    assert max(rows[1:]) <= 3  # the first step admits b
    moved = {
        r.request_id: len(r.output_token_ids) - before[r.request_id] for r in llm.scheduler.running if r.tenant == "a"
    }
    assert len(moved) == 7 and set(moved) <= set(heavy) and min(moved.values()) >= 2
    while llm.has_unfinished():
        llm.step()
    assert_nothing_leaks(llm)


def test_the_step_cost_fit_recovers_fixed_and_per_row_costs():
    from gptoss_lite.engine.fairness import StepCost

    cost = StepCost()
    assert cost.fixed_rows() == StepCost.PRIOR_FIXED_ROWS
    for i in range(200):
        rows = 1 + (i * 7) % 64
        cost.record(rows, 0.006 + 0.0005 * rows)
    assert cost.fixed_rows() == pytest.approx(12.0, rel=1e-6)
    steady = StepCost()
    for _ in range(50):
        steady.record(64, 0.03)  # no spread in rows: nothing to fit
    assert steady.fixed_rows() == StepCost.PRIOR_FIXED_ROWS


def test_preemption_for_blocks_takes_from_the_tenant_furthest_over_its_share(models):
    """A pool too small for every output: when a request needs a block, the victim is a request of
    the tenant holding more than its share of the slots (a, 3 of 4 with equal shares), not the newest
    running request (b's)."""
    llm = _engine(models, kv_blocks=40, max_running=4, enable_prefix_caching=False)
    preempted = []
    original = llm.scheduler._preempt

    def record(request):
        preempted.append(request.tenant)
        original(request)

    llm.scheduler._preempt = record
    _flood(llm, "a", 3, max_tokens=150)
    llm.step()
    llm.add_request(_prompt(80), SamplingParams(max_tokens=150, **GREEDY), tenant="b")
    while llm.has_unfinished() and not preempted:
        llm.step()
    assert preempted and preempted[0] == "a"
    while llm.has_unfinished():
        llm.step()
    assert_nothing_leaks(llm)
