"""A server over an engine with int4 blocks or a full-layer window answers what that engine generates, and its
metrics name the setting."""

from __future__ import annotations

import httpx
import pytest
from live_server import LiveServer, create_app, tiny_llm

from gptoss_lite.engine import SamplingParams

PROMPT = "The pass key is 52718. Remember it. " * 6 + "The pass key is"


@pytest.mark.parametrize("kwargs", [{"kv_format": "int4"}, {"full_window": 48, "enable_prefix_caching": False}])
def test_completion_equals_the_engines_generate(kwargs):
    llm = tiny_llm(**kwargs)
    want = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0))[0].text
    with LiveServer(create_app(llm)) as live:
        r = httpx.post(
            live.url + "/v1/completions",
            json={"model": live.state.model_name, "prompt": PROMPT, "max_tokens": 10, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
        metrics = httpx.get(live.url + "/metrics", timeout=30).text
        values = dict(line.split(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
        assert float(values[f'gptoss_kv_format{{format="{kwargs.get("kv_format", "dense")}"}}']) == 1
        assert float(values["gptoss_kv_cache_bytes"]) == llm.runner.kv_bytes
