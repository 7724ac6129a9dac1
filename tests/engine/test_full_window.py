"""The engine under a full-layer window N: full layers attend to their last N keys, so a request's
tokens equal generate() on the same weights with that window on the full layers, whatever the
batching, chunking or preemption; the blocks held stay within the window; a window covering the
context changes nothing."""

import copy
import random

import pytest
import torch

from gptoss_lite.config import FULL
from gptoss_lite.engine import LLM, SamplingParams
from tests.engine.conftest import assert_nothing_leaks, assert_same_as_generate, random_workload, recording, run


def windowed(model, window):
    """The oracle: the same weights, full layers attending to the last `window` keys."""
    ref = copy.deepcopy(model)
    for layer in ref.config.full_layers:
        ref.blocks[layer].attn.window = window
    ref.prepare_for_inference()
    return ref


@pytest.mark.parametrize(
    "name,window,preempts", [("shipped", 64, True), ("shipped", 100, False), ("gpt-oss-tiny", 48, False)]
)
def test_full_window_equals_windowed_generate(models, name, window, preempts):
    model = models(name)
    work = random_workload(random.Random(window), model.config.vocab_size, 12, 300, 60, 4)
    llm = LLM(model, full_window=window, enable_prefix_caching=False, kv_blocks=30, max_batch_tokens=96, max_running=12)
    recording(llm)
    done = run(llm, work)
    assert len(done) == 12
    # under a full-layer window a request's blocks stop growing, so only a tight pool preempts at all
    assert llm.stats().preemptions > 0 or not preempts, "the pool was meant to force preemption"
    assert_same_as_generate(windowed(model, window), llm, work, done, exact=name == "shipped")
    assert_nothing_leaks(llm)


def test_window_covering_the_context_changes_nothing(models):
    model = models("shipped")
    work = random_workload(random.Random(1), model.config.vocab_size, 8, 200, 30, 3)
    llm = LLM(model, full_window=256, enable_prefix_caching=False, max_batch_tokens=128)
    done = run(llm, work)
    assert_same_as_generate(model, llm, work, done, exact=True)


def test_blocks_held_stay_within_the_window(models):
    """Before every step a request holds at most window + bs - 2 past tokens on the full layers (whole
    blocks reaching back to its query's window); a decoding request after its step at most window + bs - 1,
    and after a decode burst of K tokens K - 1 more (a burst releases blocks when it starts)."""
    model = copy.deepcopy(models("shipped")).prepare_for_inference(compile_decode=True)  # bursts too
    window, bs = 40, 16
    llm = LLM(model, full_window=window, enable_prefix_caching=False, max_batch_tokens=64)
    rng = random.Random(2)
    for _ in range(5):
        prompt = [rng.randrange(model.config.vocab_size) for _ in range(rng.randint(1, 250))]
        llm.add_request(prompt, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    group = llm.runner.store.group(FULL)
    assert group.window == window
    checked, bursts, schedule = 0, [], llm.scheduler.schedule

    def recorded():
        step = schedule()
        bursts.append(step.decode_steps)
        return step

    llm.scheduler.schedule = recorded
    while llm.has_unfinished():
        llm.step()
        for request in llm.scheduler.running:
            rid = request.request_id
            held = group.pool.num_tokens(rid) - group.released_tokens(rid)
            if request.num_computed > len(request.prompt_token_ids):  # decoding
                assert held <= window + bs - 1 + bursts[-1] - 1, (held, request.num_computed, bursts[-1])
                checked += 1
            else:
                assert held <= window + bs - 2 + llm.scheduler.max_batch_tokens
    assert checked > 30 and max(bursts) > 1


def test_needle_beyond_the_window_is_gone(models):
    """The negative control at engine level: a needle further back than the receptive field of the
    windows (layers x max(sliding window, full-layer window) tokens) cannot reach the answer, so the
    logits do not depend on it at all, bit for bit; without the full-layer window they do."""
    model = models("shipped")
    cfg = model.config
    reach = cfg.n_layers * max(cfg.sliding_window, 64)
    rng = random.Random(3)
    filler = [rng.randrange(cfg.vocab_size) for _ in range(reach + 40)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def logits(needle, **kw):
        llm = LLM(model, enable_prefix_caching=False, **kw)
        runner = recording(llm)
        llm.generate([filler[:20] + needle + filler[20:]], params)
        return torch.stack(next(iter(runner.logits.values())))

    a, b = ([11, 12, 13], [91, 92, 93])
    torch.testing.assert_close(logits(a, full_window=64), logits(b, full_window=64), rtol=0, atol=0)
    assert not torch.equal(logits(a), logits(b))


def test_bad_full_windows_are_refused(models):
    model = models("gpt-oss-tiny")
    with pytest.raises(ValueError, match="prefix"):
        LLM(model, full_window=64)
    with pytest.raises(ValueError, match="one of them"):
        LLM(model, full_window=64, kv_format="int8", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="full_window"):
        LLM(model, full_window=0, enable_prefix_caching=False)
    with pytest.raises(TypeError, match="kv_budget"):  # the old name is not taken silently
        LLM(model, kv_budget=64, enable_prefix_caching=False)


def test_planner_figures_count_the_full_window(models):
    """bench-serve's planner line under a full-layer window charges a full layer full_window tokens, not
    the context: more requests fit than without one, exactly the free bytes over the windowed payload."""
    from gptoss_lite.engine.bench import planner_figures
    from gptoss_lite.plan.presets import geometry_from_model_config

    model = models("shipped")
    plain = LLM(model, enable_prefix_caching=False, kv_blocks=64)
    windowed_llm = LLM(model, full_window=64, enable_prefix_caching=False, kv_blocks=64)
    geometry = geometry_from_model_config(model.config, bytes_per_element=4)
    per_token = geometry.bytes_per_token_per_layer
    payload = geometry.full_layers * 64 * per_token + geometry.sliding_layers * model.config.sliding_window * per_token
    free = windowed_llm.runner.kv_bytes
    fits = planner_figures(windowed_llm, 1000)["max_resident_requests"]
    assert fits == free // payload > planner_figures(plain, 1000)["max_resident_requests"]
    # a window covering the context changes nothing
    assert planner_figures(windowed_llm, 50) == planner_figures(plain, 50)
