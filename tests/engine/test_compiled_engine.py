"""The engine with its all-decode steps compiled (LLM(compile_decode=True)): greedy outputs equal
generate() on each request alone under random arrivals, preemption, prefix hits and a full-layer window; one
graph serves every batch size and context length; quantised blocks stay eager."""

import copy
import random

import pytest
from torch._dynamo.utils import counters

from gptoss_lite.engine import LLM, SamplingParams
from tests.engine.conftest import assert_nothing_leaks, assert_same_as_generate, random_workload, recording, run
from tests.engine.test_full_window import windowed


def _compiled_llm(model, **kwargs) -> LLM:
    """An engine over a copy of `model` (compiling re-packs the weights out-major; the shared model
    stays as the other tests expect it)."""
    llm = LLM(copy.deepcopy(model).prepare_for_inference(compile_decode=True), **kwargs)  # compile_decode: as prepared
    assert (llm.compile_seconds is None) == ("kv_format" in kwargs)  # quantised blocks: nothing to compile
    recording(llm)
    return llm


@pytest.mark.parametrize("name", ["gpt-oss-tiny", "shipped"])
def test_random_arrivals_match_generate(models, name):
    model = models(name)
    work = random_workload(random.Random(5), model.config.vocab_size, 24, 600, 16, 30)
    llm = _compiled_llm(model, kv_blocks=2000, max_batch_tokens=512, max_running=24)
    graphs = counters["stats"]["unique_graphs"]
    done = run(llm, work)
    assert len(done) == 24
    assert llm.runner.compiled_steps > 10, "the workload was meant to have all-decode steps"
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a graph of its own"
    assert_same_as_generate(model, llm, work, done, exact=name == "shipped")
    assert_nothing_leaks(llm)


def test_preemption_and_prefix_hits_keep_outputs(models):
    model = models("shipped")
    rng = random.Random(11)
    shared = [rng.randrange(model.config.vocab_size) for _ in range(300)]
    work = random_workload(rng, model.config.vocab_size, 12, 200, 100, 3)
    work.prompts[:4] = [shared + p[:20] for p in work.prompts[:4]]  # prefix hits
    llm = _compiled_llm(model, kv_blocks=60, max_batch_tokens=128, max_running=12)
    done = run(llm, work)
    assert llm.stats().preemptions > 0, "the pool was meant to force preemption"
    assert llm.stats().prefix_hits > 0 and llm.runner.compiled_steps > 0
    assert len(done) == 12
    assert_same_as_generate(model, llm, work, done, exact=True)
    assert_nothing_leaks(llm)


def test_full_window_equals_windowed_generate(models):
    model = models("shipped")
    work = random_workload(random.Random(64), model.config.vocab_size, 12, 300, 60, 4)
    llm = _compiled_llm(model, full_window=64, enable_prefix_caching=False, kv_blocks=30, max_batch_tokens=96)
    done = run(llm, work)
    assert len(done) == 12 and llm.runner.compiled_steps > 0
    assert_same_as_generate(windowed(model, 64), llm, work, done, exact=True)
    assert_nothing_leaks(llm)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantised_blocks_stay_eager_and_equal(models, bits):
    model = models("shipped")
    prompts = [[random.Random(i).randrange(model.config.vocab_size) for _ in range(40 + 30 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(model, kv_format=f"int{bits}").generate(prompts, params)]
    llm = _compiled_llm(model, kv_format=f"int{bits}")
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.runner.decoder is None and llm.runner.compiled_steps == 0
