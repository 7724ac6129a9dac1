"""The step budget's default: the library's `LLM` takes the first offline budget (4,096 tokens a step, then
2,048) whose step its pools hold and 512 where they hold neither; a number given is kept; `serve` and
`bench-serve` keep 512 of their own."""

import pytest
import torch

from conftest import make_model
from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.engine.config import (
    DEFAULT_MAX_BATCH_TOKENS,
    OFFLINE_MAX_BATCH_TOKENS,
    OFFLINE_STEP_BUDGETS,
    EngineConfig,
)
from gptoss_lite.generation import generate


def test_llm_takes_the_offline_budget_where_the_pools_hold_it():
    model = make_model()
    assert EngineConfig().max_batch_tokens is None
    assert LLM(model).engine_config.max_batch_tokens == OFFLINE_MAX_BATCH_TOKENS == 4096
    assert OFFLINE_STEP_BUDGETS == (4096, 2048)
    middle = LLM(model, kv_blocks=200)  # a 2,048-token step beside a window, not a 4,096-token one
    assert middle.engine_config.max_batch_tokens == middle.scheduler.max_batch_tokens == 2048
    small = LLM(model, kv_blocks=100)  # too few blocks for a 2,048-token step beside a window
    assert small.engine_config.max_batch_tokens == DEFAULT_MAX_BATCH_TOKENS == 512
    assert small.scheduler.max_batch_tokens == 512
    assert LLM(model, kv_blocks=100, max_batch_tokens=300).engine_config.max_batch_tokens == 300
    with pytest.raises(ValueError, match="too few for one step of max_batch_tokens=2048"):
        LLM(model, kv_blocks=100, max_batch_tokens=2048)  # a number given is never lowered


def test_both_budgets_give_generate_s_tokens():
    model = make_model()
    prompts = [torch.randint(0, 264, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (700, 90, 300)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for llm in (LLM(model), LLM(model, kv_blocks=100)):
        outs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outs):
            want = generate(model, torch.tensor([prompt]), max_new_tokens=6, temperature=0)[0, len(prompt) :]
            assert out.token_ids == want.tolist(), llm.engine_config.max_batch_tokens


def test_a_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        EngineConfig(max_batch_tokens=0)


def test_the_server_commands_keep_512():
    import argparse

    from gptoss_lite.commands import bench_serve, serve

    sub = argparse.ArgumentParser().add_subparsers()
    serve.register(sub)
    bench_serve.register(sub)
    assert set(sub.choices) == {"serve", "bench-serve"}
    for name, parser in sub.choices.items():
        assert parser.get_default("max_batch_tokens") == 512, name


@pytest.mark.parametrize("preset", ["lite-tiny", "gpt-oss-tiny"])
@pytest.mark.parametrize("length", [300, 2176])
def test_one_request_whose_context_is_one_step_builds_and_serves(preset, length):
    """max_running 1 with max_batch_tokens = max_model_len (one request, its whole prompt one step, as
    the peers' single-request cells ask): the pools the engine sizes hold that step beside each window
    (they had held the request's tokens and no more, so the engine refused to build), and a prompt
    that fills the context decodes generate()'s tokens."""
    model = make_model(preset)
    llm = LLM(model, max_running=1, max_model_len=length, max_batch_tokens=length, enable_prefix_caching=False)
    prompt = torch.randint(1, 264, (length - 6,), generator=torch.Generator().manual_seed(length)).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    want = generate(model, torch.tensor([prompt]), max_new_tokens=6, temperature=0)[0, len(prompt) :]
    assert out.token_ids == want.tolist()
