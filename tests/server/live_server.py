"""Server test helpers: an app over a fake or real LLM, served by uvicorn on a loopback port.

Not a conftest.py: the root conftest is imported by name (`from conftest import make_model`), and a
second conftest module would shadow it. Test modules bind the `serve` fixture with
`serve = live_server.serve` (importing it by name would read as shadowed by the test parameter).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from gptoss_lite.engine import LLM
from gptoss_lite.server import create_app


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


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
