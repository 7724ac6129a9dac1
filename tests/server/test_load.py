"""Load through the committed script (benchmarks/serve_load.py) against `gptoss-lite serve` on loopback:
concurrent streaming clients with mixed prompt lengths, 0 errors, every KV block free afterwards."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "gptoss_lite.cli", "serve", "--model", "lite-tiny", "--port", str(port)]
    cmd += ["--data-dir", str(tmp_path_factory.mktemp("store"))]  # not the user's cache
    proc = subprocess.Popen(cmd + ["--threads", "1", "--log-level", "warning"], env=env, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def run_load(url: str, clients: int, requests: int) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--url", url, "--json"]
    cmd += ["--clients", str(clients), "--requests", str(requests), "--prompt-lengths", "4", "60", "300"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


def check(result: dict, clients: int, requests: int) -> None:
    assert result["requests"] == clients * requests
    assert result["errors"] == 0, result["first_errors"]
    assert result["generated_tokens"] == clients * requests * 16  # ignore_eos: every request runs to max_tokens
    assert result["kv_blocks_used_after"] == 0 and result["kv_blocks_free_after"] == result["kv_blocks_total"]
    assert 0 < result["ttft_p50_s"] <= result["ttft_p99_s"]


def test_small_load_no_errors_no_leaks(server_url):
    """16 streaming clients x 2 requests: 0 errors, all tokens, every block free afterwards."""
    check(run_load(server_url, 16, 2), 16, 2)


@pytest.mark.slow
def test_64_clients_x_4_requests(server_url):
    """The acceptance load: 64 concurrent streaming clients x 4 requests, mixed prompt lengths."""
    check(run_load(server_url, 64, 4), 64, 4)
