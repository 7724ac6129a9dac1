"""A long decode through the engine does not grow the sliding pool: once its prompt is in, each
request holds at most its window's blocks plus the one being filled, ceil(W / bs) + 1, after every
step (docs/paged.md). (A prompt chunk may hold its own blocks beside the window while it runs.)"""

from __future__ import annotations

import math

from conftest import make_model
from gptoss_lite.config import SLIDING
from gptoss_lite.engine import LLM, SamplingParams
from tests.engine.conftest import assert_nothing_leaks


def test_a_long_decode_keeps_each_request_within_its_window_of_sliding_blocks():
    window, bs = 40, 8
    model = make_model("lite-tiny", sliding_window=window).eval()
    llm = LLM(model, kv_blocks=400, block_size=bs, max_batch_tokens=64)
    bound = math.ceil(window / bs) + 1
    step, decoding = llm.step, []

    def watched():
        outputs = step()
        for request in llm.scheduler.running:
            if request.num_computed > len(request.prompt_token_ids):  # decoding
                decoding.append(len(llm.kv.tables(request)[SLIDING][0]))
        return outputs

    llm.step = watched
    prompts = [[(5 * i + j) % 90 + 1 for j in range(30 + 17 * i)] for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [300] * 3  # decodes of 7x the window
    assert len(decoding) > 800 and max(decoding) == bound  # reached, never passed
    assert_nothing_leaks(llm)
