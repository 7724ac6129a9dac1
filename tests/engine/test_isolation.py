"""A fault in one request stays in that request: it finishes with finish_reason "error", its blocks
are freed, and every other request of the same steps gets exactly the tokens it gets without it."""

from __future__ import annotations

from gptoss_lite.engine import LLM, SamplingParams

PROMPTS = {f"r{i}": [(7 * i + 3 * j) % 250 for j in range(5 + 9 * i)] for i in range(6)}


def params(rid: str) -> SamplingParams:
    """Greedy and seeded-sampled requests side by side (a seed draws the same alone or batched)."""
    i = int(rid[1:])
    if i % 2:
        return SamplingParams(max_tokens=24, temperature=0.9, top_p=0.8, seed=100 + i, ignore_eos=True)
    return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def run(llm: LLM, rids) -> dict[str, object]:
    for rid in rids:
        llm.add_request(PROMPTS[rid], params(rid), request_id=rid)
    final = {}
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                final[out.request_id] = out
    return final


def clean_llm() -> LLM:
    return LLM("lite-tiny", max_model_len=256, max_running=8, max_batch_tokens=64)


def check_pool(llm: LLM) -> None:
    llm.validate()
    llm.clear_prefix_cache()
    assert llm.all_blocks_free()


def test_a_fault_in_one_requests_sampling_ends_only_that_request():
    """The test-only hook raises in r3's sampling at its 5th token: r3 ends with "error" after 4
    tokens, and the five others equal a run without r3 at all."""
    want = run(clean_llm(), [r for r in PROMPTS if r != "r3"])
    llm = clean_llm()
    seen = {"n": 0}

    def fault(request):
        if request.request_id == "r3":
            seen["n"] += 1
            if seen["n"] == 5:
                raise RuntimeError("injected")

    llm.runner.fault_hook = fault
    got = run(llm, PROMPTS)
    bad = got.pop("r3")
    assert bad.finish_reason == "error" and "RuntimeError" in bad.error and len(bad.token_ids) == 4
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}
    assert all(o.finish_reason == "length" for o in got.values())
    assert llm.stats().failed == 1
    check_pool(llm)


def test_a_forward_that_fails_because_of_one_request_is_retried_without_it():
    """The batched forward raises whenever r2 is in it: the step is run again one request at a time,
    r2 fails alone, and the others' tokens equal a run without r2."""
    want = run(clean_llm(), [r for r in PROMPTS if r != "r2"])
    llm = clean_llm()
    forward = llm.runner.forward

    def poisoned(step):
        if any(entry.request.request_id == "r2" for entry in step.scheduled):
            raise RuntimeError("r2 breaks the forward")
        return forward(step)

    llm.runner.forward = poisoned
    got = run(llm, PROMPTS)
    bad = got.pop("r2")
    assert bad.finish_reason == "error" and "forward" in bad.error and bad.token_ids == []
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}
    check_pool(llm)
    assert run(llm, ["r0"])["r0"].token_ids == want["r0"].token_ids  # and it keeps serving


def test_any_allowed_top_p_and_temperature_sample():
    """The extremes the API allows (top_p down to 5e-324, temperature down to the smallest float and
    up to 2) sample a token; a top_p below float32's resolution is the most likely token."""
    llm = clean_llm()
    greedy = run(llm, ["r0"])["r0"].token_ids
    for top_p in (5e-324, 1e-46, 1e-8):
        p = SamplingParams(max_tokens=24, temperature=1.0, top_p=top_p, seed=1, ignore_eos=True)
        llm.add_request(PROMPTS["r0"], p, request_id="x")
        while llm.has_unfinished():
            outs = llm.step()
        assert outs[-1].finish_reason == "length" and outs[-1].token_ids == greedy
    for temperature in (5e-324, 1e-39, 2.0):
        p = SamplingParams(max_tokens=8, temperature=temperature, seed=1, ignore_eos=True)
        llm.add_request(PROMPTS["r0"], p, request_id="y")
        while llm.has_unfinished():
            outs = llm.step()
        assert outs[-1].finish_reason == "length"
    check_pool(llm)
