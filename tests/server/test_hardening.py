"""The defects hostile-but-realistic clients found (docs/server.md#limits), one test each (and the
fuzzer's later finds at the end): each failed before the fix and holds after it."""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time

import httpx
import live_server
import pytest
from fake_engine import FakeLLM
from live_server import tiny_llm, wait_until

from gptoss_lite.server import headers as H
from gptoss_lite.server import protocol as P

serve = live_server.serve  # the fixture

C, CH = "/v1/completions", "/v1/chat/completions"
KEYS = {"key-alice": "alice", "key-bob": "bob"}
ALICE = {"Authorization": "Bearer key-alice"}
BOB = {"Authorization": "Bearer key-bob"}


def completion(model: str, **fields) -> dict:
    return {"model": model, "prompt": "hello", "max_tokens": 4, **fields}


def raw(port: int, data: bytes, *, timeout: float = 10.0, close_after_send: bool = False) -> bytes:
    """Send raw bytes on a new connection; what the server answers until it closes (or the timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if close_after_send:
            return b""
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def status_and_json(response: bytes) -> tuple[int, dict | None]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def stream_events(url: str, body: dict, headers: dict) -> list[str]:
    with httpx.Client(timeout=60) as c, c.stream("POST", url + C, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def streamed_text(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices"))


# 1 ---------------------------------------------------------------------------------------------------------


def test_1_a_tiny_top_p_harms_nobody(serve):
    """top_p 1e-46 (0 in float32) is a valid request: it samples the most likely token (200), and the
    three greedy streams another tenant runs beside it in the same steps finish unharmed, with the
    same text as when they ran alone."""
    live = serve(tiny_llm(max_running=8, max_model_len=256), api_keys=KEYS)
    name = live.state.model_name
    victim = completion(name, prompt="victim", max_tokens=48, temperature=0, ignore_eos=True, stream=True)
    want = streamed_text(stream_events(live.url, victim, BOB))
    results: list[list[str]] = []
    threads = [threading.Thread(target=lambda: results.append(stream_events(live.url, victim, BOB))) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    for _ in range(4):
        r = httpx.post(live.url + C, json=completion(name, top_p=1e-46, temperature=1.0), headers=ALICE, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
    for t in threads:
        t.join(60)
    assert len(results) == 3
    for events in results:
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        assert streamed_text(events) == want
    assert live.state.engine.failed_requests == 0


# 2 ---------------------------------------------------------------------------------------------------------


def test_2_a_client_that_stops_reading_is_aborted_and_its_blocks_freed(serve):
    """A stream whose client never reads (a 4 KB receive buffer) fills the socket, its sends wait,
    and after the stall timeout the request is aborted: the stalled counter rises, nothing runs, and
    every block is free again. Meanwhile what waits for it is bounded: outputs are deltas."""
    llm = tiny_llm(max_running=4, max_model_len=4096)
    live = serve(llm, stall_timeout=1.0)
    # A small send buffer on the server's side too (accepted sockets inherit it), so that the 4,000
    # events fill both buffers; Linux would otherwise grow the server's to megabytes.
    live.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    body = json.dumps(completion(live.state.model_name, max_tokens=4000, ignore_eos=True, stream=True)).encode()
    request = (
        f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", live.port))
    try:
        s.sendall(request)
        deadline = time.monotonic() + 60
        while live.state.metrics.stalled._value.get() < 1:
            assert time.monotonic() < deadline, "the stalled stream was never aborted"
            time.sleep(0.1)
        # The server dropped the connection at once, without waiting for the client to read what it
        # buffers (a plain close would keep it open until then) ...
        wait_until(lambda: not live.server.server_state.connections, timeout=10)
        # ... with a reset: reading ends, where it would block on an open one (TimeoutError fails).
        s.settimeout(10)
        try:
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass
    finally:
        s.close()
    wait_until(lambda: httpx.get(live.url + "/stats").json()["num_running"] == 0, timeout=30)
    assert "gptoss_stalled_client_aborts_total 1.0" in httpx.get(live.url + "/metrics").text
    reset = httpx.post(live.url + "/admin/reset_prefix_cache").json()
    assert reset["kv_blocks_used"] == 0


def test_2_running_outputs_carry_deltas_only():
    """While a request runs, each output holds the step's tokens and text, not copies of all so far."""
    from gptoss_lite.engine import SamplingParams

    llm = tiny_llm(max_model_len=256)
    llm.add_request("abc", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    outs = []
    while llm.has_unfinished():
        outs += llm.step()
    running, final = outs[:-1], outs[-1]
    assert all(o.token_ids == [] and o.text == "" and len(o.new_token_ids) == 1 for o in running)
    assert [o.num_output_tokens for o in outs] == list(range(1, 31))
    assert "".join(o.text_delta for o in outs) == final.text == llm.tokenizer.decode(final.token_ids)


# 3 ---------------------------------------------------------------------------------------------------------


def test_3_an_absurdly_long_integer_is_a_400_naming_its_field(serve):
    """max_tokens of 4,300 digits: refused before conversion, a 400 that names max_tokens and leaks nothing."""
    live = serve(FakeLLM())
    body = b'{"model": "fake", "prompt": "x", "max_tokens": ' + b"9" * 4300 + b"}"
    r = httpx.post(live.url + C, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "ValueError" not in r.text and "limit" not in r.text  # not Python's int-string limit message
    for field in ("temperature", "seed", "top_p"):
        body = f'{{"model": "fake", "prompt": "x", "{field}": {"1" * 5000}.5}}'.encode()
        r = httpx.post(live.url + C, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# 4 ---------------------------------------------------------------------------------------------------------


def test_4_incomplete_requests_time_out_with_a_json_408(serve):
    """A body that never finishes gets a 408 at the body timeout; a header that never ends gets one at
    the header timeout; both close the connection."""
    live = serve(FakeLLM(), body_timeout=1.0)
    start = time.monotonic()
    head = f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    status, body = status_and_json(raw(live.port, head.encode() + b'{"model": '))
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 8

    from live_server import LiveServer, create_app

    with LiveServer(create_app(FakeLLM()), header_timeout=1.0) as slow:
        start = time.monotonic()
        status, body = status_and_json(raw(slow.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0"))
        assert status == 408 and body["error"]["code"] == "request_timeout"
        assert time.monotonic() - start < 8
        assert httpx.get(slow.url + "/health").status_code == 200


def test_4_a_client_leaving_mid_body_leaves_no_traceback(serve):
    """A client that sends half its body and disconnects: nothing is logged at error level."""
    live = serve(FakeLLM())
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.ERROR)
    handler.emit = seen.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "uvicorn", "")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        head = f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
        for _ in range(3):
            raw(live.port, head.encode() + b'{"model": "fake", "pro', close_after_send=True)
        time.sleep(0.5)
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    assert not seen, [r.getMessage() for r in seen]


# 5 ---------------------------------------------------------------------------------------------------------


def test_5_foreign_hosts_origins_and_content_types_are_refused(serve):
    """On an open server: a foreign Host (DNS rebinding) is 403, a cross-origin page is 403, a text/plain
    POST (what a page may send without a preflight) is 415, admin reset included; the playground's own
    origin and --allowed-host names are served."""
    live = serve(FakeLLM())
    ok = completion("fake")
    assert httpx.post(live.url + C, json=ok).status_code == 200
    r = httpx.post(live.url + C, json=ok, headers={"Host": "evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert httpx.get(live.url + "/v1/models", headers={"Host": f"evil.example:{live.port}"}).status_code == 403
    r = httpx.post(live.url + C, json=ok, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    own = f"http://127.0.0.1:{live.port}"
    assert httpx.post(live.url + C, json=ok, headers={"Origin": own}).status_code == 200
    for path in (C, "/admin/reset_prefix_cache"):
        r = httpx.post(live.url + path, content=json.dumps(ok), headers={"Content-Type": "text/plain"})
        assert r.status_code == 415, (path, r.text)
    assert httpx.post(live.url + "/admin/reset_prefix_cache").status_code == 200  # no body, no type: fine
    named = serve(FakeLLM(), allowed_hosts=["llm.internal"])
    assert httpx.post(named.url + C, json=ok, headers={"Host": "llm.internal:8000"}).status_code == 200
    assert httpx.post(named.url + C, json=ok).status_code == 403  # only the names given
    keyed = serve(FakeLLM(), api_keys=KEYS)  # a key is the guard: any Host
    assert httpx.post(keyed.url + C, json=ok, headers={"Host": "evil.example", **ALICE}).status_code == 200


def test_5_host_names_parse():
    """Host headers with ports, IPv6 brackets and case all reduce to the name."""
    assert H.host_name("LocalHost:8000") == "localhost"
    assert H.host_name("[::1]:8000") == "::1" and H.host_name("[::1]") == "::1"
    assert H.host_name("127.0.0.1") == "127.0.0.1"
    assert H.allowed_host_set(None, "0.0.0.0", keyed=False) == {"localhost", "127.0.0.1", "::1"}
    assert H.allowed_host_set(None, "10.1.2.3", keyed=False) == {"localhost", "127.0.0.1", "::1", "10.1.2.3"}
    assert H.allowed_host_set(["*"], "127.0.0.1", keyed=False) is None
    assert H.allowed_host_set(None, "127.0.0.1", keyed=True) is None


# 6 ---------------------------------------------------------------------------------------------------------


def test_6_stop_strings_are_bounded_and_checked_incrementally(serve):
    """At most 4 stops of at most MAX_STOP_CHARS characters; four maximum-length stops that share long
    prefixes with the output leave the answer and its time as without them (the engine checks only
    the new text against each stop, off the event loop)."""
    live = serve(tiny_llm(max_model_len=2048))
    name = live.state.model_name
    long_stops = ["a" * (P.MAX_STOP_CHARS - 1) + c for c in "\x01\x02\x03\x04"]
    r = httpx.post(live.url + C, json=completion(name, stop=["a" * (P.MAX_STOP_CHARS + 1)]))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("stop")
    body = completion(name, prompt="a" * 64, max_tokens=800, temperature=0, ignore_eos=True)

    def timed(**extra) -> tuple[float, str]:
        start = time.perf_counter()
        r = httpx.post(live.url + C, json={**body, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        return time.perf_counter() - start, r.json()["choices"][0]["text"]

    timed()  # warm up
    plain = [timed() for _ in range(2)]
    stopped = [timed(stop=long_stops) for _ in range(2)]
    assert stopped[0][1] == plain[0][1]
    assert min(t for t, _ in stopped) < 2.0 * min(t for t, _ in plain) + 0.5, (plain, stopped)


# 7, 8 ------------------------------------------------------------------------------------------------------


def test_7_metrics_and_stats_need_a_key_on_a_keyed_server(serve):
    """/metrics and /stats name tenants: on a keyed server they need a key, unless --metrics-open."""
    live = serve(FakeLLM(), api_keys=KEYS, admin_key="root")
    for path in ("/metrics", "/stats"):
        assert httpx.get(live.url + path).status_code == 401
        assert httpx.get(live.url + path, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(live.url + path, headers=ALICE).status_code == 200
        assert httpx.get(live.url + path, headers={"Authorization": "Bearer root"}).status_code == 200
    assert httpx.get(live.url + "/health").status_code == 200  # for load balancers: always open
    opened = serve(FakeLLM(), api_keys=KEYS, metrics_open=True)
    assert httpx.get(opened.url + "/metrics").status_code == 200


def test_8_two_authorization_headers_are_a_400(serve):
    """alice's key then bob's: neither is guessed; a 400 naming the header (also on admin routes)."""
    live = serve(FakeLLM(), api_keys=KEYS, admin_key="root")
    two = [("Authorization", "Bearer key-alice"), ("Authorization", "Bearer key-bob")]
    r = httpx.post(live.url + C, json=completion("fake"), headers=httpx.Headers(two))
    assert r.status_code == 400 and r.json()["error"]["param"] == "authorization", r.text
    same = httpx.Headers([("Authorization", "Bearer key-alice")] * 2)
    assert httpx.post(live.url + C, json=completion("fake"), headers=same).status_code == 400
    admin = httpx.Headers([("Authorization", "Bearer root")] * 2)
    assert httpx.post(live.url + "/admin/reset_prefix_cache", headers=admin).status_code == 400


# 9 ---------------------------------------------------------------------------------------------------------


def test_9_max_tokens_null_is_the_documented_16_on_completions(serve):
    """`"max_tokens": null` on /v1/completions is the API's default, 16; on chat, the rest of the context."""
    live = serve(FakeLLM(max_model_len=200))
    r = httpx.post(live.url + C, json=completion("fake", max_tokens=None, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": None, "ignore_eos": True}
    r = httpx.post(live.url + CH, json=chat)
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 200


# 10, 11 ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nNo-Colon-Here\r\n\r\n",
    ],
    ids=["bad-request-line", "negative-length", "two-lengths", "header-without-colon"],
)
def test_10_protocol_errors_are_json(serve, request_bytes):
    """What h11 cannot parse gets a 400 in the same JSON error shape as every other error."""
    live = serve(FakeLLM())
    status, body = status_and_json(raw(live.port, request_bytes))
    assert status == 400 and body is not None and set(body["error"]) == {"message", "type", "param", "code"}


def test_11_content_type_and_encoding_are_checked(serve):
    """A form, a missing Content-Type with a body, or a gzip body: 415, not a guess at the bytes."""
    live = serve(FakeLLM())
    data = json.dumps(completion("fake"))
    for headers in (
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "application/json", "Content-Encoding": "gzip"},
    ):
        r = httpx.post(live.url + C, content=data, headers=headers)
        assert r.status_code == 415 and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    no_type = f"POST {C} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(data)}\r\n\r\n{data}"
    assert status_and_json(raw(live.port, no_type.encode(), timeout=3))[0] == 415
    charset = {"Content-Type": "application/json; charset=utf-8"}
    assert httpx.post(live.url + C, content=data, headers=charset).status_code == 200


# 12: drain, in tests/commands/test_serve_cli.py (it needs a real process and a signal) ----------------------


def test_error_bodies_never_carry_internals(serve):
    """An unexpected exception in a handler is a 500 that names only the exception type."""
    llm = FakeLLM()
    live = serve(llm)

    def broken(*a, **k):
        raise RuntimeError("secret internal detail /etc/passwd")

    live.state.template.render = broken  # a bug in our own code, not the client's
    r = httpx.post(live.url + CH, json={"model": "fake", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 500 and "secret" not in r.text and re.search("RuntimeError", r.text)


def test_a_websocket_upgrade_gets_the_apps_json_answer(serve):
    """With the `websockets` package installed (the Agents SDK brings it), uvicorn answered a GET with
    `Upgrade: websocket` itself: a text/plain 400. The server has no WebSocket route, so it runs no
    WebSocket protocol, and the request gets the app's own JSON answer."""
    live = serve(tiny_llm(), api_keys=KEYS)
    request = (
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer key-alice\r\n"
        b"Connection: close\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    )
    status, body = status_and_json(raw(live.port, request, timeout=5))
    assert status == 200 and body is not None and body["object"] == "list"


def test_an_sse_line_holds_no_character_a_line_splitter_breaks_on(serve):
    """U+0085, U+2028 and U+2029 are legal raw in JSON, and Python's str.splitlines (and older
    JavaScript) break lines on them: echoed in a stream's `metadata`, they cut an SSE `data:` line in two
    for such a client (the slow fuzz found it). The server escapes them, and the events still parse."""
    live = serve(tiny_llm())
    tricky = "a\x85b\u2028c\u2029d"
    body = {"model": "lite-tiny", "input": "hi", "max_output_tokens": 2, "stream": True, "metadata": {"k": tricky}}
    with httpx.Client(timeout=60) as c, c.stream("POST", live.url + "/v1/responses", json=body) as r:
        text = r.read().decode()
    assert r.status_code == 200 and not {"\x85", "\u2028", "\u2029"} & set(text)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["metadata"] == {"k": tricky}


def test_a_prompt_over_the_context_without_a_limit_says_so_plainly(serve):
    """Without max_tokens, a prompt that fills the context was reported as "-62 more were requested"; it
    now says the prompt leaves no room, and with a limit the arithmetic is as before."""
    live = serve(tiny_llm(max_model_len=128))
    long_input = "word " * 200
    r = httpx.post(live.url + "/v1/responses", json={"model": "lite-tiny", "input": long_input})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    message = r.json()["error"]["message"]
    assert "leaves no room for an answer" in message and not re.search(r"-\d", message), message
    r = httpx.post(live.url + C, json=completion("lite-tiny", prompt="hi", max_tokens=500))
    assert r.status_code == 400 and "500 more were requested" in r.json()["error"]["message"]
