"""Sharing the server between tenants: the API key's tenant and the request's `priority` reach the
engine, a tenant's quotas answer 429 with Retry-After (never a 5xx) while other tenants are served, a
request that times out in the queue is a 429 `queue_timeout`, and /metrics and /health show each
tenant's queue. The serve flags build the TenantPolicy and refuse bad values in one line.
(docs/server.md#sharing-between-tenants)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import live_server
import pytest
from fake_engine import FakeLLM
from live_server import tiny_llm, wait_until

from gptoss_lite.cli import build_parser, main
from gptoss_lite.commands.serve import tenant_policy
from gptoss_lite.engine import RequestOutput, TenantLimits, TenantPolicy

serve = live_server.serve  # the fixture

C, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
KEYS = {"key-a": "alice", "key-b": "bob"}
A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
LONG = 4000  # tokens of a stream that holds its slot for the whole test (it is aborted when closed)


def completion(live, **fields) -> dict:
    return {"model": live.state.model_name, "prompt": "Hi", "max_tokens": 2, "temperature": 0, **fields}


def hold(client: httpx.Client, live, headers=None, **fields):
    """A streaming request that generates LONG tokens: opened, it keeps a slot (or a place in the queue)
    until the `with` block closes it."""
    body = completion(live, max_tokens=LONG, ignore_eos=True, stream=True) | fields
    return client.stream("POST", C, json=body, headers=headers)


def health(client: httpx.Client, headers=None) -> dict:
    return client.get("/health", headers=headers).json()


def assert_retry_after(r: httpx.Response, at_least: int = 1) -> int:
    value = r.headers.get("retry-after")
    assert value is not None and value.isdigit() and int(value) >= at_least, r.headers
    return int(value)


def metric(text: str, name: str, labels: str = "") -> float | None:
    """A sample of /metrics text (labels as Prometheus writes them, sorted by name), or None."""
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


# ---- quotas ------------------------------------------------------------------------------------------------


def test_the_request_past_running_plus_waiting_is_a_429_and_another_tenant_is_served(serve):
    """max_running 1 + max_waiting 1: alice's third concurrent request is a 429 rate_limit_exceeded with
    Retry-After, before anything is queued; bob's request meanwhile gets its 200; /metrics counts the 429."""
    policy = TenantPolicy(default=TenantLimits(max_running=1, max_waiting=1))
    live = serve(tiny_llm(max_running=4, tenants=policy), api_keys=KEYS)
    with httpx.Client(base_url=live.url, timeout=60) as c:
        with hold(c, live, A) as first, hold(c, live, A) as second:
            assert first.status_code == second.status_code == 200
            wait_until(lambda: health(c, A)["queue"]["tenants"]["alice"] == {"running": 1, "waiting": 1})
            third = c.post(C, json=completion(live), headers=A)
            assert third.status_code == 429, third.text
            assert assert_retry_after(third) == 1
            error = third.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and "alice" in error["message"], error
            other = c.post(C, json=completion(live), headers=B)
            assert other.status_code == 200, other.text
            assert health(c, A)["queue"]["tenants"]["alice"] == {"running": 1, "waiting": 1}  # nothing queued
        text = c.get("/metrics", headers=A).text
    labels = '{code="rate_limit_exceeded",tenant="alice"}'
    assert metric(text, "gptoss_tenant_rejected_requests_total", labels) == 1
    assert metric(text, "gptoss_tenant_rejected_requests_total", labels.replace("alice", "bob")) is None


def test_tokens_per_minute_is_a_429_with_the_wait_and_an_impossible_request_a_400(serve):
    """tokens_per_minute 100: a request of 3 + 60 tokens passes, the next one is a 429 whose Retry-After is
    the seconds until 63 tokens are back (about 16); bob's bucket is his own; a request that needs more
    than a minute's tokens could never pass: a 400 saying so, not a 429."""
    policy = TenantPolicy(default=TenantLimits(tokens_per_minute=100))
    live = serve(tiny_llm(max_running=4, tenants=policy), api_keys=KEYS)
    body = completion(live, max_tokens=60, ignore_eos=True)
    with httpx.Client(base_url=live.url, timeout=60) as c:
        assert c.post(C, json=body, headers=A).status_code == 200
        r = c.post(C, json=body, headers=A)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and "tokens_per_minute" in r.text
        assert 10 <= assert_retry_after(r) <= 17  # (63 - 37) tokens at 100/60 per second, rounded up
        assert c.post(C, json=body, headers=B).status_code == 200
        too_big = c.post(C, json=completion(live, max_tokens=200), headers=B)
        assert too_big.status_code == 400 and "tokens_per_minute=100" in too_big.text, too_big.text


def test_queue_full_429_carries_retry_after(serve):
    """The server-wide --max-waiting 429 (queue_full) has a Retry-After too, and counts for its tenant."""
    live = serve(FakeLLM(max_running=1, step_delay=0.02), max_waiting=1)
    with httpx.Client(base_url=live.url, timeout=30) as c:
        with hold(c, live, max_tokens=400) as first:  # the fake's context is 512
            assert first.status_code == 200
            wait_until(lambda: health(c)["queue"]["running"] == 1)
            with hold(c, live, max_tokens=400) as second:
                assert second.status_code == 200
                r = c.post(C, json=completion(live))
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
                assert_retry_after(r)
        text = c.get("/metrics").text
    assert metric(text, "gptoss_tenant_rejected_requests_total", '{code="queue_full",tenant="default"}') == 1


# ---- time in the queue ---------------------------------------------------------------------------------------


def test_a_queue_timeout_is_a_429_streamed_or_not(serve):
    """max_queue_time 0.3 s, one slot held: a request that waits past it is a 429 queue_timeout with
    Retry-After, as JSON and as a stream that had sent nothing yet (never a 5xx); /health counts no
    failure; /metrics counts both and their time in the queue."""
    policy = TenantPolicy(default=TenantLimits(max_queue_time=0.3))
    live = serve(tiny_llm(max_running=1, tenants=policy))
    with httpx.Client(base_url=live.url, timeout=60) as c:
        with hold(c, live) as first:
            assert first.status_code == 200
            for stream in (False, True):
                started = time.monotonic()
                r = c.post(C, json=completion(live, stream=stream))
                assert r.status_code == 429, r.text
                assert 0.3 <= time.monotonic() - started < 10
                assert r.json()["error"]["code"] == "queue_timeout" and "max_queue_time=0.3" in r.text
                assert_retry_after(r)
        wait_until(lambda: health(c)["queue"]["running"] == 0)
        assert c.post(C, json=completion(live)).status_code == 200  # a free slot: admitted in time
        status = health(c)
        text = c.get("/metrics").text
    assert status["failed_requests"] == 0 and "last_failure" not in status, status
    assert metric(text, "gptoss_tenant_queue_timeouts_total", '{tenant="default"}') == 2
    assert metric(text, "gptoss_tenant_queue_time_seconds_count", '{tenant="default"}') >= 3
    assert metric(text, "gptoss_tenant_queue_time_seconds_bucket", '{le="0.25",tenant="default"}') >= 1


class ExpiringLLM(FakeLLM):
    """Ends every request after its first token as the engine ends one that timed out in the queue:
    the only way a stream can have begun before such an end (a later round of a response does)."""

    def step(self) -> list[RequestOutput]:
        outs = super().step()
        for i, out in enumerate(outs):
            if out.num_output_tokens == 2 and not out.finished:
                self.abort(out.request_id)
                outs[i] = RequestOutput(
                    out.request_id, out.prompt_token_ids, [], [], "", True, "error", 0, out.metrics,
                    error="the request waited 9.0 s for a slot", error_code="queue_timeout",
                )  # fmt: skip
        return outs


def test_a_stream_that_had_begun_ends_with_its_error_event(serve):
    """A queue timeout after a stream's first chunk: its usual error event (code queue_timeout), then
    [DONE]; the status was already 200."""
    live = serve(ExpiringLLM(step_delay=0.01))
    with httpx.Client(base_url=live.url, timeout=30) as c:
        r = c.post(C, json=completion(live, max_tokens=8, stream=True))
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "queue_timeout", events


# ---- priority -------------------------------------------------------------------------------------------------


def _engine_calls(llm, monkeypatch) -> list[dict]:
    """The tenant and priority of every request the server adds to the engine from now on."""
    seen: list[dict] = []
    add = llm.add_request

    def spy(prompt, sampling=None, **kwargs):
        seen.append({"tenant": kwargs.get("tenant"), "priority": kwargs.get("priority")})
        return add(prompt, sampling, **kwargs)

    monkeypatch.setattr(llm, "add_request", spy)
    return seen


def test_priority_and_tenant_reach_the_engine_and_a_bad_priority_is_a_400(serve, monkeypatch):
    """`priority` on all three endpoints goes to the engine with the key's tenant; a string, a float, a
    bool or a number past 64 bits is a 400 naming the field."""
    llm = tiny_llm(max_running=4)
    live = serve(llm, api_keys=KEYS)
    seen = _engine_calls(llm, monkeypatch)
    name = live.state.model_name
    bodies = {
        C: {"model": name, "prompt": "Hi", "max_tokens": 2},
        CHAT: {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        RESPONSES: {"model": name, "input": "Hi", "max_output_tokens": 2},
    }
    with httpx.Client(base_url=live.url, timeout=60) as c:
        for route, body in bodies.items():
            assert c.post(route, json={**body, "priority": -7}, headers=B).status_code == 200
            assert c.post(route, json=body, headers=A).status_code == 200
            for bad in ("1", 1.5, True, 2**63):
                r = c.post(route, json={**body, "priority": bad}, headers=A)
                assert r.status_code == 400 and r.json()["error"]["param"] == "priority", (route, bad, r.text)
    assert seen == [{"tenant": "bob", "priority": -7}, {"tenant": "alice", "priority": 0}] * 3


def test_a_lower_priority_value_is_admitted_first_within_a_tenant(serve):
    """One slot, held: priority 5 then priority 0 queue behind it; when the slot frees, the priority 0
    request runs (and finishes) first, although it came second."""
    live = serve(tiny_llm(max_running=1))
    done: list[int] = []

    def ask(priority: int) -> None:
        r = httpx.post(live.url + C, json=completion(live, max_tokens=20, priority=priority), timeout=60)
        assert r.status_code == 200, r.text
        done.append(priority)

    with httpx.Client(base_url=live.url, timeout=60) as c:
        with hold(c, live) as first:
            assert first.status_code == 200
            threads = []
            for priority, waiting in ((5, 1), (0, 2)):
                threads.append(threading.Thread(target=ask, args=(priority,)))
                threads[-1].start()
                wait_until(lambda n=waiting: health(c)["queue"]["waiting"] == n)
        for t in threads:
            t.join(60)
    assert done == [0, 5]


# ---- visibility -----------------------------------------------------------------------------------------------


def test_metrics_show_each_tenants_queue_and_tokens(serve):
    """/metrics has running and waiting gauges, admitted and generated token counters and the queue-time
    histogram per tenant; a keyed server shows them to a key only (the existing rule)."""
    live = serve(tiny_llm(max_running=4), api_keys=KEYS, admin_key="sk-admin")
    with httpx.Client(base_url=live.url, timeout=60) as c:
        assert c.post(C, json=completion(live, max_tokens=5, ignore_eos=True), headers=A).status_code == 200
        with hold(c, live, B) as held:
            assert held.status_code == 200
            running = '{tenant="bob"}'
            wait_until(
                lambda: metric(c.get("/metrics", headers=A).text, "gptoss_tenant_requests_running", running) == 1
            )
            text = c.get("/metrics", headers={"Authorization": "Bearer sk-admin"}).text
        assert c.get("/metrics").status_code == 401
    assert metric(text, "gptoss_tenant_requests_running", '{tenant="alice"}') == 0
    assert metric(text, "gptoss_tenant_requests_waiting", '{tenant="bob"}') == 0
    assert metric(text, "gptoss_tenant_admitted_requests_total", '{tenant="alice"}') == 1
    assert metric(text, "gptoss_tenant_admitted_tokens_total", '{tenant="alice"}') == 3  # "Hi" with its BOS
    assert metric(text, "gptoss_tenant_generated_tokens_total", '{tenant="alice"}') == 5
    assert metric(text, "gptoss_tenant_queue_time_seconds_count", '{tenant="alice"}') == 1
    assert metric(text, "gptoss_tenant_queue_timeouts_total", '{tenant="alice"}') == 0


def test_health_shows_the_queue_and_tenants_only_to_whom_may_see_them(serve):
    """/health has the running and waiting totals for everyone; each tenant's only for a key (on a keyed
    server) and for anyone on an open one."""
    live = serve(tiny_llm(max_running=2), api_keys=KEYS)
    with httpx.Client(base_url=live.url, timeout=60) as c:
        assert health(c)["queue"] == {"running": 0, "waiting": 0}
        with hold(c, live, A) as first, hold(c, live, B) as second, hold(c, live, A) as third:
            assert first.status_code == second.status_code == third.status_code == 200
            wait_until(lambda: health(c)["queue"] == {"running": 2, "waiting": 1})
            tenants = health(c, B)["queue"]["tenants"]
            assert tenants == {"alice": {"running": 1, "waiting": 1}, "bob": {"running": 1, "waiting": 0}}
            assert "tenants" not in health(c, {"Authorization": "Bearer wrong"})["queue"]
    open_server = serve(tiny_llm())
    assert health(httpx.Client(base_url=open_server.url))["queue"]["tenants"] == {}


# ---- flags -------------------------------------------------------------------------------------------------------


def policy_of(*argv: str, keys: dict[str, str] | None = None):
    args = build_parser().parse_args(["serve", *argv])
    return tenant_policy(args, keys)


def test_flags_build_the_policy():
    """No flag: None (the engine's default, today's behaviour); the four limit flags set every tenant's
    default, --tenant-share names a tenant's weight over those defaults, --admission fcfs is fair=False;
    a config file is loaded whole, and --admission overrides its 'fair'."""
    assert policy_of() is None
    policy = policy_of(
        "--tenant-share", "alice=3", "--tenant-share", "bob=1.5", "--tenant-max-running", "8",
        "--tenant-max-waiting", "0", "--tenant-tokens-per-minute", "6000", "--max-queue-time", "2.5",
        keys=KEYS,
    )  # fmt: skip
    default = TenantLimits(max_running=8, max_waiting=0, tokens_per_minute=6000, max_queue_time=2.5)
    assert policy == TenantPolicy(
        default=default,
        tenants={"alice": TenantLimits(3.0, 8, 0, 6000, 2.5), "bob": TenantLimits(1.5, 8, 0, 6000, 2.5)},
    )
    assert policy_of("--admission", "fcfs") == TenantPolicy(fair=False)
    assert policy_of("--tenant-share", "default=2").tenants["default"].share == 2  # an open server's tenant


def test_a_config_file_is_the_whole_policy(tmp_path):
    """YAML and JSON files load as TenantPolicy.load reads them; --admission overrides the file's 'fair'."""
    yaml_file = tmp_path / "tenants.yaml"
    yaml_file.write_text("default:\n  max_queue_time: 30\ntenants:\n  alice: {share: 3}\n  bob: {share: 1}\n")
    policy = policy_of("--tenant-config", str(yaml_file), keys=KEYS)
    assert policy.tenants["alice"] == TenantLimits(share=3, max_queue_time=30) and policy.fair
    json_file = tmp_path / "tenants.json"
    json_file.write_text(json.dumps({"fair": False, "default": {"max_running": 4}}))
    assert policy_of("--tenant-config", str(json_file)) == TenantPolicy(TenantLimits(max_running=4), fair=False)
    assert policy_of("--tenant-config", str(json_file), "--admission", "fair").fair


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--tenant-share", "alice"], "--tenant-share 'alice': expected NAME=WEIGHT"),
        (["--tenant-share", "alice=0"], "WEIGHT > 0"),
        (["--tenant-share", "alice=nan"], "WEIGHT > 0"),
        (["--tenant-share", "=3"], "expected NAME=WEIGHT"),
        (["--tenant-share", "default=1", "--tenant-share", "default=2"], "'default' given twice"),
        (["--tenant-share", "alice=3"], "no API key maps to tenant 'alice' (a server without --api-key has one"),
        (["--api-key", "bob=k1", "--tenant-share", "alice=3"], "no API key maps to tenant 'alice' (the --api-key"),
        (["--tenant-max-running", "0"], "--tenant-max-running"),
        (["--tenant-max-waiting", "-1"], "--tenant-max-waiting"),
        (
            ["--max-running", "8", "--tenant-max-running", "9"],
            "max_running=9 for every tenant is more than --max-running 8",
        ),
        (["--tenant-tokens-per-minute", "0"], "--tenant-tokens-per-minute"),
        (["--max-queue-time", "0"], "--max-queue-time 0.0: must be a positive number of seconds"),
        (["--max-queue-time", "inf"], "--max-queue-time"),
        (["--tenant-config", "/no/such/file.yaml"], "--tenant-config: tenant policy /no/such/file.yaml"),
    ],
)
def test_bad_tenant_flags_fail_before_loading(argv, match, capsys):
    """A bad tenant flag is one clear error line and exit status 2, before the model loads."""
    assert main(["serve", "--model", "no-such-model-is-loaded", *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and "no-such-model" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "text,match",
    [
        ("default: [1, 2\n", "not valid YAML"),
        ("defaults: {}\n", "unknown key(s) ['defaults']"),
        ("default: {max_runing: 4}\n", "unknown key(s) ['max_runing']"),
        ("tenants: {alice: {share: -1}}\n", "tenant 'alice': share=-1: must be a finite number > 0"),
        ("tenants: {carol: {share: 2}}\n", "no API key maps to tenant 'carol'"),
    ],
)
def test_a_bad_config_file_fails_before_loading(text, match, tmp_path, capsys):
    """A config file that does not parse, names an unknown key, holds a bad value or a tenant no key
    maps to: one line naming the file and the problem, exit status 2."""
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    argv = ["serve", "--model", "no-such-model-is-loaded", "--api-key", "alice=k1", "--tenant-config", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and str(path) in err and "no-such-model" not in err, err


def test_limit_flags_with_a_config_file_are_refused(tmp_path, capsys):
    """--tenant-config is the whole policy: a limit flag or --tenant-share as well is refused, naming them."""
    path = tmp_path / "tenants.json"
    path.write_text("{}")
    argv = ["serve", "--model", "no-such-model-is-loaded", "--tenant-config", str(path)]
    assert main([*argv, "--max-queue-time", "5", "--tenant-share", "default=2"]) == 2
    err = capsys.readouterr().err
    assert "--max-queue-time, --tenant-share with --tenant-config: the file is the whole policy" in err, err


@pytest.mark.slow
def test_the_fairness_benchmark_shows_b_ahead_of_the_flood(tmp_path):
    """benchmarks/serve_fairness.py, one round and a flood of 100 streams (about a minute): B's request
    behind A's flood takes under a quarter of what it takes in arrival order, and A's throughput
    stays within 20% of arrival order's (one round is noisy; the committed figures are medians of 3)."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "fair.json"
    cmd = [sys.executable, str(root / "benchmarks" / "serve_fairness.py"), "--rounds", "1", "--flood", "100",
           "--skip-shares", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["b_fair_s"] < 0.25 * summary["b_fcfs_s"], summary
    assert summary["a_fair_over_fcfs"] > 0.8, summary
