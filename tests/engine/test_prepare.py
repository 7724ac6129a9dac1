"""LLM.prepare: tokenise and check once, outside the engine's state; add_request takes the result."""

from __future__ import annotations

import threading

import pytest

from gptoss_lite.engine import LLM, PreparedRequest, SamplingParams


def test_prepared_requests_run_as_prompts_do(models):
    llm = LLM(models("lite-tiny"))
    params = SamplingParams(max_tokens=8, temperature=0)
    prepared = llm.prepare("The pass key is", params)
    assert isinstance(prepared, PreparedRequest) and prepared.token_ids == llm.encode("The pass key is")
    by_prompt = llm.generate(["The pass key is"], params)[0].token_ids
    rid = llm.add_request(prepared)
    while llm.has_unfinished():
        outs = [o for o in llm.step() if o.finished and o.request_id == rid]
    assert outs[0].token_ids == by_prompt


def test_prepare_refuses_what_add_request_would_and_changes_nothing(models):
    llm = LLM(models("lite-tiny"), max_model_len=64)
    before = llm.stats()
    for prompt, params, words in [
        ("", None, "empty prompt"),
        ([1, 999], None, "out of vocabulary"),
        ("x" * 60, SamplingParams(max_tokens=10), "exceeds max_model_len"),
        ("x", SamplingParams(logit_bias={9999: 1.0}), "logit_bias"),
    ]:
        with pytest.raises(ValueError, match=words):
            llm.prepare(prompt, params)
    assert llm.stats() == before and not llm.has_unfinished()
    with pytest.raises(ValueError, match="carries its sampling"):
        llm.add_request(llm.prepare("x"), SamplingParams())


def test_prepare_from_many_threads_while_the_engine_steps(models):
    """The server prepares in its handlers while the engine thread steps: same ids as alone."""
    llm = LLM(models("lite-tiny"))
    texts = [f"request {i}: " + "abc" * i for i in range(40)]
    expected = [llm.encode(t) for t in texts]
    got: dict[int, list[int]] = {}

    def worker(lo: int) -> None:
        for i in range(lo, len(texts), 4):
            got[i] = llm.prepare(texts[i], SamplingParams(max_tokens=2)).token_ids

    threads = [threading.Thread(target=worker, args=(lo,)) for lo in range(4)]
    llm.add_request("stepping meanwhile", SamplingParams(max_tokens=30, ignore_eos=True))
    for t in threads:
        t.start()
    while llm.has_unfinished():
        llm.step()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(texts))] == expected
