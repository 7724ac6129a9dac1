"""`gptoss-lite serve`: flags checked before the model loads; SIGTERM drains running requests, then exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from gptoss_lite.cli import main
from gptoss_lite.commands.serve import parse_api_keys

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--port", "70000"], "--port"),
        (["--max-waiting", "0"], "--max-waiting"),
        (["--admin-key", "x"], "--admin-key needs --api-key"),
        (["--api-key", "a=k1", "--api-key", "b=k1"], "two tenants"),
        (["--api-key", "a="], "non-empty"),
        (["--drain-timeout", "-1"], "--drain-timeout"),
        (["--api-key-file", "/no/such/file"], "No such file"),
        (["--full-window", "512"], "--no-prefix-caching"),
        (["--full-window", "512", "--no-prefix-caching", "--kv-format", "int8"], "give one of them"),
        (["--stalled-client-timeout", "0"], "--stalled-client-timeout"),
        (["--header-timeout", "nan"], "--header-timeout"),
        (["--allowed-host", "http://x"], "--allowed-host"),
        (["--max-tool-calls", "-1"], "--max-tool-calls"),
        (["--tool-timeout", "0"], "--tool-timeout"),
        (["--browser-corpus", "/no/such/dir"], "--browser-corpus '/no/such/dir': not a directory"),
        (["--tool-server", "ftp://host/mcp"], "expected an http:// or https:// URL"),
        (["--tool-server", "python=http://127.0.0.1:1/mcp"], "label 'python' must"),
    ],
)
def test_bad_flags_fail_before_loading(argv, match, capsys):
    """A bad flag is one clear error line and exit status 2 (nothing is loaded or bound)."""
    assert main(["serve", "--model", "no-such-model-is-loaded", *argv]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "bench-serve"])
def test_the_old_kv_budget_flag_names_full_window(command, capsys):
    """The engine's full-layer window is --full-window; the old --kv-budget is an argparse error naming
    it (not taken silently), and --help does not list it."""
    with pytest.raises(SystemExit) as exc:
        main([command, "--model", "no-such-model-is-loaded", "--kv-budget", "512", "--no-prefix-caching"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-budget: renamed to --full-window N" in err and "eviction budget" in err
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "--full-window N" in out and "--kv-budget" not in out


def test_api_keys_map_to_tenants(tmp_path):
    """TENANT=KEY names the tenant; a bare key gets a stable tenant of its own, not the key itself."""
    keys = parse_api_keys(["alice=k1", "bob=k2", "k3"])
    assert keys["k1"] == "alice" and keys["k2"] == "bob"
    assert keys["k3"].startswith("key-") and "k3" not in keys["k3"]
    assert parse_api_keys(["k3"]) == {"k3": keys["k3"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(*extra: str) -> tuple[subprocess.Popen, str]:
    """`gptoss-lite serve --model lite-tiny --no-compile` on a free port, once /health answers 200 (the
    drain is the subject here, not the compiled step, whose start-up compile would cost each test tens
    of seconds on an empty inductor cache)."""
    return _healthy(*_spawn_server(*extra))


def _spawn_server(*extra: str) -> tuple[subprocess.Popen, str]:
    """The server process, started (not yet answering); its response store in a fresh temporary
    directory unless `extra` names one (a test never writes into the user's cache)."""
    port = _free_port()
    if "--data-dir" not in extra:
        extra = (*extra, "--data-dir", tempfile.mkdtemp(prefix="gptoss-lite-serve-"))
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptoss_lite.cli", "serve", "--model", "lite-tiny", "--port", str(port)]
        + ["--threads", "1", "--log-level", "warning", "--no-compile", *extra],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, f"http://127.0.0.1:{port}"


def _healthy(proc: subprocess.Popen, url: str) -> tuple[subprocess.Popen, str]:
    """(proc, url) once /health answers 200; the server's stderr in the failure if it never does."""
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.ConnectError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(proc.stderr.read())
        time.sleep(0.1)


def test_sigterm_drains_then_exits(tmp_path):
    """After SIGTERM the running stream still gets every token and [DONE], the listening socket is
    closed to new connections, a request on a connection that was already open gets the documented
    503, and the process exits 0."""
    proc, url = _start_server()
    try:
        body = {"model": "lite-tiny", "prompt": "drain me", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        events = []
        with httpx.Client(timeout=120) as kept, httpx.Client(timeout=120) as c:
            assert kept.get(url + "/health").status_code == 200  # a keep-alive connection, open before the signal
            with c.stream("POST", url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
                        break
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                with pytest.raises(httpx.ConnectError):
                    httpx.get(url + "/health")
                late = kept.post(url + "/v1/completions", json={"model": "lite-tiny", "prompt": "x", "max_tokens": 2})
                assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
                assert kept.get(url + "/health").status_code == 503
                after = [line[6:] for line in lines if line.startswith("data: ")]
        assert len(after) > 10  # tokens still came after the signal: the request was running when it came
        events += after
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 1500
        assert proc.wait(60) == 0
        assert "draining" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain_timeout_ends_streams_with_an_error_event_and_done():
    """A stream still running when --drain-timeout passes ends with an error event, then [DONE], and
    the process still exits 0."""
    proc, url = _start_server("--drain-timeout", "1")
    try:
        body = {"model": "lite-tiny", "prompt": "long", "max_tokens": 60000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "shutting_down" and "drain timeout" in err["message"]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_python_tool_without_a_sandbox_refuses_to_start(monkeypatch, tmp_path, capsys):
    """--python-tool where no sandbox works is one error line naming --python-tool-unsandboxed, before
    the model loads; with --python-tool-unsandboxed the start goes on (to the model, here)."""
    from gptoss_lite.tools import python_tool

    def no_sandbox(*args, sandbox="auto", **kwargs):
        if sandbox != "none":
            raise python_tool.SandboxUnavailable("no sandbox:\nunshare failed; bwrap is not installed")
        return "a pool"

    monkeypatch.setattr(python_tool, "PythonToolPool", no_sandbox)
    argv = ["serve", "--model", "no-such-model-is-loaded", "--data-dir", str(tmp_path)]
    assert main([*argv, "--python-tool"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--python-tool-unsandboxed" in err and "no-such-model" not in err
    assert "unshare failed; bwrap is not installed" in err
    assert main([*argv, "--python-tool-unsandboxed"]) == 2
    assert "no-such-model" in capsys.readouterr().err  # it got as far as loading the model


def test_unusable_data_dir_or_key_fails_before_loading(tmp_path, capsys):
    """A data directory whose store is not one, a --secret-file that is not a key, or a bad
    --response-ttl: one clear line and exit status 2, before the model loads."""
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "responses.sqlite3").write_bytes(b"not a database " * 100)
    (tmp_path / "short.key").write_text("0123")
    for argv, match in [
        (["--data-dir", str(tmp_path / "bad")], "responses.sqlite3: not a usable response store"),
        (["--data-dir", str(tmp_path / "ok"), "--secret-file", str(tmp_path / "short.key")], "64 hex digits"),
        (["--data-dir", str(tmp_path / "ok"), "--secret-file", str(tmp_path / "none")], "No such file"),
        (["--response-ttl", "0"], "--response-ttl"),
        (["--response-ttl", "nan"], "--response-ttl"),
    ]:
        assert main(["serve", "--model", "no-such-model-is-loaded", *argv]) == 2
        err = capsys.readouterr().err
        assert match in err and "no-such-model" not in err, err


def test_the_default_data_dir_follows_xdg_cache_home(tmp_path, monkeypatch, capsys):
    """Without --data-dir the store and key are made under $XDG_CACHE_HOME/gptoss-lite/server."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["serve", "--model", "no-such-model-is-loaded"]) == 2
    assert "no-such-model" in capsys.readouterr().err  # it got as far as loading the model
    made = tmp_path / "gptoss-lite" / "server"
    assert {"responses.sqlite3", "sealing.key"} <= {p.name for p in made.iterdir()}


def test_responses_outlive_the_process_and_are_shared(tmp_path):
    """Two servers started together on one --data-dir read each other's stored responses; after
    SIGTERM a fresh server on it answers GET with the same bodies and continues with
    previous_response_id exactly as if the conversation were sent whole."""
    data = ["--data-dir", str(tmp_path / "data")]
    started = [_spawn_server(*data), _spawn_server(*data)]  # racing to make the store and the key
    procs = [started[0][0], started[1][0]]
    try:
        (_, url_a), (_, url_b) = (_healthy(*s) for s in started)
        ask = {"model": "lite-tiny", "max_output_tokens": 4, "temperature": 0}
        first = httpx.post(url_a + "/v1/responses", json={**ask, "input": "Hello"}, timeout=60).json()
        assert httpx.get(f"{url_b}/v1/responses/{first['id']}").json() == first
        more = {**ask, "input": "More", "previous_response_id": first["id"]}
        second = httpx.post(url_b + "/v1/responses", json=more, timeout=60).json()
        assert second["previous_response_id"] == first["id"]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(60) for proc in procs] == [0, 0]

        proc, url = _start_server(*data)
        procs.append(proc)
        for made in (first, second):
            assert httpx.get(f"{url}/v1/responses/{made['id']}").json() == made
        third = httpx.post(
            url + "/v1/responses", json={**ask, "input": "Again", "previous_response_id": second["id"]}, timeout=60
        ).json()
        whole = [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": first["output_text"]},
            {"role": "user", "content": "More"},
            {"role": "assistant", "content": second["output_text"]},
            {"role": "user", "content": "Again"},
        ]
        stateless = httpx.post(url + "/v1/responses", json={**ask, "input": whole, "store": False}, timeout=60).json()
        assert third["usage"]["input_tokens"] == stateless["usage"]["input_tokens"] > first["usage"]["input_tokens"]
        assert third["output_text"] == stateless["output_text"]
        key = tmp_path / "data" / "sealing.key"
        assert len(key.read_bytes()) == 32 and key.stat().st_mode & 0o777 == 0o600
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_built_in_tools_need_a_harmony_model(tmp_path, capsys):
    """--browser-corpus on a model that does not speak harmony is one error line (exit 2): only gpt-oss
    was trained to call the built-in tools."""
    (tmp_path / "docs").mkdir()
    argv = ["serve", "--model", "lite-tiny", "--no-compile", "--data-dir", str(tmp_path / "data")]
    assert main([*argv, "--browser-corpus", str(tmp_path / "docs")]) == 2
    assert "need a harmony (gpt-oss) model" in capsys.readouterr().err
