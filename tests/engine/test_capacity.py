"""The engine holds as many requests at once as the planner says the same KV memory holds."""

import pytest

from gptoss_lite.engine import LLM, SamplingParams
from gptoss_lite.plan.core import ServingHardware, max_resident_requests
from gptoss_lite.plan.presets import geometry_from_model_config


def peak_decoding(llm: LLM, prompts, params) -> int:
    """Most requests decoding (prompt fully in the cache) at once over the run."""
    for prompt in prompts:
        llm.add_request(prompt, params)
    peak = 0
    while llm.has_unfinished():
        llm.step()
        peak = max(peak, sum(r.num_computed >= len(r.prompt_token_ids) for r in llm.scheduler.running))
    return peak


@pytest.mark.parametrize("fits", [4, 8, pytest.param(12, marks=pytest.mark.slow)])
def test_measured_capacity_matches_planner(models, fits):
    model = models("shipped")
    cfg = model.config
    context = 1024  # each request ends at 1,024 tokens (64 full-layer blocks): 1,008 prompt + 16 generated
    # The full-layer pool holds `fits` requests; the sliding-layer pool gets the engine's own sizing
    # for max_running requests (a window + 1 block each) plus one prefill chunk of headroom, which
    # the planner's steady-state figure does not count: that headroom is the one request of slack.
    llm = LLM(model, kv_blocks=64 * fits, max_batch_tokens=1024, max_running=fits + 4, enable_prefix_caching=False)
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(context - 16)] for i in range(fits + 6)]
    measured = peak_decoding(llm, prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    hw = ServingHardware(
        weight_bytes=1,  # the planner subtracts resident weights: 1 B, so the KV gets everything else
        bandwidth_bytes_per_second=1.0,
        peak_flops_per_second=1.0,
        parameter_count=1,
        device_capacity_bytes=llm.runner.kv_bytes + 1,  # every byte of both pools
    )
    geometry = geometry_from_model_config(cfg, bytes_per_element=4)
    predicted = max_resident_requests(hw, geometry, context)
    assert measured == fits and abs(measured - predicted) <= 1, (fits, measured, predicted)
    assert measured < len(prompts)  # memory, not the number of requests, was the limit
    llm.validate()
    assert llm.all_blocks_free()
