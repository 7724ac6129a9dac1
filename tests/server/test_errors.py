"""Bad requests get the right status and an OpenAI-shaped error body, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import live_server
import pytest
from fake_engine import FakeLLM
from live_server import wait_until

serve = live_server.serve  # the fixture

KEY = "key-a"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 << 10


def completion(**fields):
    return {"model": "fake", "prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


C, CH = "/v1/completions", "/v1/chat/completions"

# (id, method, path, body (dict -> JSON, bytes -> raw), headers, status, param or None, message fragment)
CASES = [
    ("bad-json", "POST", C, b"{bad", AUTH, 400, None, "not valid JSON"),
    ("empty-body", "POST", C, b"", AUTH, 400, None, "not valid JSON"),
    ("json-array", "POST", C, b"[1, 2]", AUTH, 400, None, "JSON object"),
    ("missing-model", "POST", C, without(completion(), "model"), AUTH, 400, "model", "missing"),
    ("unknown-model", "POST", C, completion(model="gpt-4"), AUTH, 404, "model", "does not exist"),
    ("max-tokens-string", "POST", C, completion(max_tokens="8"), AUTH, 400, "max_tokens", "integer"),
    ("max-tokens-negative", "POST", C, completion(max_tokens=-1), AUTH, 400, "max_tokens", "greater than"),
    ("max-tokens-zero", "POST", C, completion(max_tokens=0), AUTH, 400, "max_tokens", "greater than"),
    ("max-tokens-float", "POST", C, completion(max_tokens=1.5), AUTH, 400, "max_tokens", "integer"),
    ("temperature-high", "POST", C, completion(temperature=3), AUTH, 400, "temperature", "less than"),
    ("temperature-string", "POST", C, completion(temperature="hot"), AUTH, 400, "temperature", "number"),
    ("top-p-zero", "POST", C, completion(top_p=0), AUTH, 400, "top_p", "greater than"),
    ("seed-negative", "POST", C, completion(seed=-1), AUTH, 400, "seed", "greater than"),
    ("n-zero", "POST", C, completion(n=0), AUTH, 400, "n", "greater than"),
    ("n-too-many", "POST", C, completion(n=129), AUTH, 400, "n", "less than"),
    ("unknown-field", "POST", C, completion(max_token=4), AUTH, 400, "max_token", "Unrecognized"),
    ("stream-string", "POST", C, completion(stream="yes"), AUTH, 400, "stream", "boolean"),
    ("stream-options-alone", "POST", C, completion(stream_options={"include_usage": True}), AUTH, 400, None, "stream"),
    ("missing-prompt", "POST", C, without(completion(), "prompt"), AUTH, 400, "prompt", "missing"),
    ("empty-prompt", "POST", C, completion(prompt=""), AUTH, 400, "prompt", "empty"),
    ("two-prompts", "POST", C, completion(prompt=["a", "b"]), AUTH, 400, "prompt", "one per request"),
    ("ids-out-of-vocab", "POST", C, completion(prompt=[1, 99999]), AUTH, 400, None, "[0, 264)|vocab|range"),
    ("over-context", "POST", C, completion(prompt="x" * 600), AUTH, 400, "prompt", "maximum context length"),
    ("max-tokens-over-context", "POST", C, completion(max_tokens=600), AUTH, 400, "prompt", "context length"),
    ("huge-body", "POST", C, completion(prompt="x" * (MAX_BODY + 1)), AUTH, 413, None, "larger than"),
    ("penalty-range", "POST", C, completion(frequency_penalty=2.5), AUTH, 400, "frequency_penalty", "less than"),
    ("logit-bias-key", "POST", C, completion(logit_bias={"x": 1}), AUTH, 400, "logit_bias", "token ids"),
    ("logit-bias-range", "POST", C, completion(logit_bias={"1": 101}), AUTH, 400, "logit_bias", "less than"),
    ("logprobs-range", "POST", C, completion(logprobs=6), AUTH, 400, "logprobs", "less than"),
    ("echo-logprobs", "POST", C, completion(echo=True, logprobs=1), AUTH, 400, "echo", "prompt's logprobs"),
    ("suffix", "POST", C, completion(suffix="end"), AUTH, 400, "suffix", "fill-in-the-middle"),
    ("audio-out", "POST", CH, chat(modalities=["text", "audio"]), AUTH, 400, "modalities", "text only"),
    (
        "background",
        "POST",
        "/v1/responses",
        {"model": "fake", "input": "hi", "background": True},
        AUTH,
        400,
        "background",
        "background",
    ),
    ("too-many-stops", "POST", C, completion(stop=["a", "b", "c", "d", "e"]), AUTH, 400, "stop", "at most 4"),
    ("empty-stop", "POST", C, completion(stop=""), AUTH, 400, "stop", "at least 1"),
    ("empty-messages", "POST", CH, chat(messages=[]), AUTH, 400, "messages", "at least 1"),
    ("bad-role", "POST", CH, chat(messages=[{"role": "robot", "content": "x"}]), AUTH, 400, "messages", "role"),
    ("content-int", "POST", CH, chat(messages=[{"role": "user", "content": 5}]), AUTH, 400, "messages", "string"),
    ("missing-messages", "POST", CH, without(chat(), "messages"), AUTH, 400, "messages", "missing"),
    ("top-logprobs-alone", "POST", CH, chat(top_logprobs=2), AUTH, 400, "top_logprobs", "needs logprobs"),
    ("chat-tools", "POST", CH, chat(tools=[{"type": "function"}]), AUTH, 400, "tools", "does not call tools"),
    ("both-limits", "POST", CH, chat(max_completion_tokens=4), AUTH, 400, "max_tokens", "not both"),
    ("bad-key", "POST", C, completion(), {"Authorization": "Bearer nope"}, 401, None, "Incorrect API key"),
    ("missing-key", "POST", C, completion(), {}, 401, None, "Missing API key"),
    ("bad-key-models", "GET", "/v1/models", None, {"Authorization": "Basic x"}, 401, None, "API key"),
    ("unknown-route", "GET", "/v1/nothing", None, AUTH, 404, None, "Not Found"),
    ("wrong-method", "GET", C, None, AUTH, 405, None, "Method Not Allowed"),
]


@pytest.fixture(scope="module")
def live():
    from live_server import LiveServer, create_app

    with LiveServer(create_app(FakeLLM(max_model_len=512), api_keys={KEY: "alice"}, max_body_bytes=MAX_BODY)) as s:
        yield s


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_openai_error(live, case):
    """Each malformed request: its status, and {"error": {message, type, param, code}} naming the problem."""
    _, method, path, body, headers, status, param, fragment = case
    content = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    r = httpx.request(
        method, live.url + path, content=content, headers={"Content-Type": "application/json", **headers}, timeout=30
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and isinstance(err["type"], str)
    assert any(f.lower() in err["message"].lower() for f in fragment.split("|")), err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err
    # The server keeps serving after every bad request.
    ok = httpx.post(live.url + C, json=completion(temperature=0), headers=AUTH, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) == 4


def test_table_is_large_and_counted(live):
    """The table has >= 20 cases, and /metrics counts requests by status (400s and 200s seen); on this
    keyed server /metrics and /stats need a key (they name tenants)."""
    assert len(CASES) >= 20
    for path in ("/metrics", "/stats"):
        assert httpx.get(live.url + path).status_code == 401
    text = httpx.get(live.url + "/metrics", headers=AUTH).text
    assert 'gptoss_requests_total{endpoint="/v1/completions",status="200"}' in text


def test_full_queue_gets_429_and_draining_gets_503(serve):
    """With one running and max_waiting waiting, the next request is a 429; while draining, a 503."""
    live = serve(FakeLLM(max_running=1, step_delay=0.02), max_waiting=1)
    body = completion(max_tokens=200, ignore_eos=True, stream=True)
    with httpx.Client(base_url=live.url, timeout=30) as c:
        with c.stream("POST", C, json=body) as first:
            assert first.status_code == 200
            wait_until(lambda: c.get("/stats").json()["num_running"] == 1)
            with c.stream("POST", C, json=body) as second:
                assert second.status_code == 200
                third = c.post(C, json=completion())
                assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
        live.state.draining = True
        r = c.post(C, json=completion())
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert c.get("/health").status_code == 503
        live.state.draining = False
        assert c.post(C, json=completion()).status_code == 200


class FailingLLM(FakeLLM):
    """Raises inside step() on its `fail_at`-th call."""

    def __init__(self, fail_at: int, **kw):
        super().__init__(**kw)
        self.fail_at = fail_at

    def step(self):
        if self.steps + 1 == self.fail_at:
            self.steps += 1
            raise RuntimeError("boom")
        return super().step()


def test_engine_failure_is_a_500_and_the_server_recovers(serve):
    """An exception in step() fails the running request (500, or an error event mid-stream) and frees
    its blocks; the next request is served."""
    llm = FailingLLM(fail_at=3)
    live = serve(llm)
    with httpx.Client(base_url=live.url, timeout=30) as c:
        r = c.post(C, json=completion(max_tokens=10))
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        llm.fail_at = llm.steps + 3
        r = c.post(C, json=completion(max_tokens=10, stream=True))
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"
        assert c.post(C, json=completion()).status_code == 200
        assert c.get("/stats").json()["kv_blocks_used"] == 0


def test_admin_routes_need_the_admin_key(serve):
    """With API keys, /admin needs the admin key (a tenant's key is a 401); without an admin key it is a 404."""
    live = serve(FakeLLM(), api_keys={KEY: "alice"}, admin_key="root")
    url = live.url + "/admin/reset_prefix_cache"
    assert httpx.post(url, headers=AUTH).status_code == 401
    r = httpx.post(url, headers={"Authorization": "Bearer root"})
    assert r.status_code == 200 and r.json()["cleared"] and r.json()["kv_blocks_used"] == 0
    closed = serve(FakeLLM(), api_keys={KEY: "alice"})
    r = httpx.post(closed.url + "/admin/reset_prefix_cache", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_chat_template_refusal_is_a_400(serve):
    """A checkpoint template's raise_exception reaches the client as a 400 with the template's words."""
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}x"
    live = serve(FakeLLM(chat_template=template))
    r = httpx.post(live.url + CH, json=chat(messages=[{"role": "assistant", "content": "hi"}]))
    assert r.status_code == 400 and "first message must be user" in r.json()["error"]["message"]
    assert httpx.post(live.url + CH, json=chat()).status_code == 200
