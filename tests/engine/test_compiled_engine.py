"""The engine with its all-decode steps compiled (LLM(compile_decode=True)): greedy outputs equal
generate() on each request alone under random arrivals, preemption, prefix hits and a full-layer window; one
graph serves every batch size and context length; quantised blocks compile too and equal the eager engine."""

import copy
import random

import pytest
from torch._dynamo.utils import counters

from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.kv.quant import CODECS
from gptoss_lite.speculative import PromptLookup
from tests.engine.conftest import (
    Workload,
    assert_nothing_leaks,
    assert_same_as_generate,
    random_workload,
    recording,
    run,
)
from tests.engine.test_full_window import windowed


def _compiled_llm(model, **kwargs) -> LLM:
    """An engine over a copy of `model` (compiling re-packs the weights out-major; the shared model
    stays as the other tests expect it)."""
    llm = LLM(copy.deepcopy(model).prepare_for_inference(compile_decode=True), **kwargs)  # compile_decode: as prepared
    assert llm.compile_seconds is not None
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


def test_lone_request_runs_its_own_graph(models):
    """One request decoding alone runs unpadded, on the one-row graph the warm-up compiled (its
    projections are fused reductions, not the several-row product), and equals generate()."""
    model = models("shipped")
    rng = random.Random(3)
    work = Workload(
        [[rng.randrange(model.config.vocab_size) for _ in range(70)]],
        [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)],
        [0],
    )
    llm = _compiled_llm(model, enable_prefix_caching=False)
    rows = []
    step = llm.runner.decoder.step
    llm.runner.decoder.step = lambda static, ids: rows.append(len(ids)) or step(static, ids)
    graphs = counters["stats"]["unique_graphs"]
    done = run(llm, work)
    assert counters["stats"]["unique_graphs"] == graphs, "the lone request compiled a graph of its own"
    assert len(rows) == 39 and set(rows) == {1}, rows
    assert_same_as_generate(model, llm, work, done, exact=True)


def test_replayed_steps_give_the_tokens_of_steps_through_dynamo(models):
    """Most compiled steps of a workload skip dynamo's frame (they run the graph the step before ran,
    where its guards hold: `CompiledDecoder.replay`); with that off, every step through dynamo, the
    outputs are the same, token for token."""
    model = models("gpt-oss-tiny")
    work = random_workload(random.Random(9), model.config.vocab_size, 12, 300, 20, 20)
    outs = {}
    for replay in (True, False):
        llm = _compiled_llm(model, kv_blocks=1000, max_batch_tokens=256, max_running=12)
        decoder = llm.runner.decoder
        decoder.replay, before = replay, decoder.replayed
        done = run(llm, work)
        outs[replay] = {i: o.token_ids for i, o in done.items()}
        replayed = decoder.replayed - before
        steps = llm.runner.compiled_steps
        assert replayed > steps // 2 if replay else replayed == 0, (replayed, steps)
    assert len(outs[True]) == 12 and outs[True] == outs[False]


def test_another_pool_size_compiles_nothing(models):
    """The pools' block counts are dynamic in the compiled step: an engine over the same model with
    other pool sizes (another KV budget) runs on the graphs the first one compiled and gives its tokens."""
    model = copy.deepcopy(models("shipped")).prepare_for_inference(compile_decode=True)
    rng = random.Random(8)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in (30, 75, 140)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    first = LLM(model, kv_blocks=300, max_batch_tokens=128)
    want = [o.token_ids for o in first.generate(prompts, params)]
    graphs = counters["stats"]["unique_graphs"]
    second = LLM(model, kv_blocks=41, max_batch_tokens=128)
    assert second.runner.store.k[0].shape[1] != first.runner.store.k[0].shape[1]
    assert [o.token_ids for o in second.generate(prompts, params)] == want
    assert counters["stats"]["unique_graphs"] == graphs, "another pool size compiled a graph of its own"
    assert second.runner.compiled_steps > 20


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


@pytest.mark.parametrize(
    "fmt",
    # int8 in the default run (the compile costs about a minute a format); the others with -m slow
    [f if f == "int8" else pytest.param(f, marks=pytest.mark.slow) for f in sorted(CODECS)],
)
def test_quantised_blocks_compile_and_equal_eager(models, fmt):
    """On quantised full-layer blocks the all-decode steps run compiled (codes read in place, the last
    block from its tail, each completed block quantised inside the step) and give the eager engine's
    tokens: prompts that end inside a block and on its last slot, decodes across block boundaries,
    preemption and prefix hits; on int8 also speculation (drafts verified in compiled steps)."""
    model = models("shipped")
    rng = random.Random(21)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in (40, 47, 64, 95, 130, 31)]
    prompts[5] = prompts[4][:100] + prompts[5]  # a prefix hit
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    eager = LLM(model, kv_format=fmt, kv_blocks=30, max_batch_tokens=128)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    llm = _compiled_llm(model, kv_format=fmt, kv_blocks=30, max_batch_tokens=128)
    graphs = counters["stats"]["unique_graphs"]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert counters["stats"]["unique_graphs"] == graphs, "a step compiled a graph of its own"
    assert llm.runner.compiled_steps > 20 and llm.stats().preemptions > 0 and llm.stats().prefix_hits > 0
    assert_nothing_leaks(llm)
    if fmt != "int8":
        return
    spec = _compiled_llm(model, kv_format=fmt, speculate=PromptLookup(k=3), max_batch_tokens=128)
    repeats = [p[:20] * 3 for p in prompts[:3]]  # lookup drafts that the model partly accepts
    plain = LLM(model, kv_format=fmt, max_batch_tokens=128)  # eager, no drafts
    want = [o.token_ids for o in plain.generate(repeats, params)]
    assert [o.token_ids for o in spec.generate(repeats, params)] == want
    assert spec.runner.compiled_verifications > 0
    assert_nothing_leaks(spec)
