"""Clients that go away mid-request: each request is aborted, its blocks are freed, and the server
keeps serving."""

from __future__ import annotations

import random
import re
import threading
import time

import httpx
import live_server
from live_server import tiny_llm

serve = live_server.serve  # the fixture

N_CLIENTS = 20


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _leave_mid_stream(url: str, model: str, rng: random.Random, want: int, seen: list) -> None:
    """Open a long greedy stream, read `want` events (0 = leave right after the headers, possibly
    before the first token), then close the connection."""
    body = {
        "model": model,
        "prompt": "x" * rng.randint(1, 64),
        "max_tokens": 4000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = 0
        for line in r.iter_lines():
            if lines >= want:
                break
            lines += line.startswith("data: ")
        seen.append(lines)


def _leave_before_answer(url: str, model: str) -> None:
    """A non-streaming request whose client gives up (read timeout) long before the answer."""
    body = {"model": model, "prompt": "y", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    try:
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    except httpx.ReadTimeout:
        return
    raise AssertionError("the request finished before its client left; raise max_tokens")


def test_disconnects_abort_and_free_blocks(serve):
    """20 clients (17 streaming, 3 not) leave at random moments: the server aborts all 20, every KV
    block is free afterwards, and the next request is answered."""
    llm = tiny_llm(max_running=8)
    # A step must take long enough that 400 tokens outlast every client.
    if hasattr(llm, "step_delay"):
        llm.step_delay = 0.005
    live = serve(llm)
    model = live.state.model_name
    rng = random.Random(0)
    seen: list[int] = []
    threads = [
        threading.Thread(target=_leave_mid_stream, args=(live.url, model, rng, rng.randint(0, 12) * (i > 0), seen))
        for i in range(N_CLIENTS - 3)
    ] + [threading.Thread(target=_leave_before_answer, args=(live.url, model)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(seen) == N_CLIENTS - 3 and min(seen) == 0 and max(seen) > 3  # left before and after tokens

    deadline = time.monotonic() + 20
    while True:
        stats = httpx.get(live.url + "/stats").json()
        text = httpx.get(live.url + "/metrics").text
        if _metric(text, "gptoss_client_aborts_total") == N_CLIENTS and stats["num_running"] == 0:
            break
        assert time.monotonic() < deadline, (stats, _metric(text, "gptoss_client_aborts_total"))
        time.sleep(0.05)
    assert stats["aborted"] == N_CLIENTS and stats["finished"] == 0
    # Blocks still in use now are prefix-cache pins; once the cache is dropped every block is free.
    after = httpx.post(live.url + "/admin/reset_prefix_cache").json()
    assert after["kv_blocks_used"] == 0 and after["kv_blocks_free"] == after["kv_blocks_total"]
    r = httpx.post(live.url + "/v1/completions", json={"model": model, "prompt": "ok", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
