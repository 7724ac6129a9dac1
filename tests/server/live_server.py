"""Server test helpers: an app over a fake or real LLM, served by uvicorn on a loopback port.

Not a conftest.py: the root conftest is imported by name (`from conftest import make_model`), and a
second conftest module would shadow it. Test modules bind the `serve` fixture with
`serve = live_server.serve` (importing it by name would read as shadowed by the test parameter).
"""

from __future__ import annotations

import time

import pytest

from gptoss_lite.engine import LLM
from gptoss_lite.server import create_app
from gptoss_lite.server.background import BackgroundServer

LiveServer = BackgroundServer  # the name the server tests use


@pytest.fixture
def serve():
    """serve(llm, **create_app_kwargs) -> a started LiveServer (stopped after the test)."""
    started = []

    def start(llm, **kwargs):
        live = LiveServer(create_app(llm, **kwargs)).__enter__()
        started.append(live)
        return live

    yield start
    for live in started:
        live.__exit__(None, None, None)


def tiny_llm(**kwargs):
    """The engine's LLM on the lite-tiny fixture (seeded random weights, byte tokenizer)."""
    return LLM("lite-tiny", **kwargs)


def wait_until(pred, timeout: float = 10.0) -> None:
    """Poll pred() every 10 ms until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
