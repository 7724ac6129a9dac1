"""Server test fixtures: an app over a fake or real LLM, served by uvicorn on a loopback port."""

from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import time

import pytest

if importlib.util.find_spec("gptoss_lite.engine") is None:  # TEMPORARY until the engine lands
    import engine_stub

    sys.modules["gptoss_lite.engine"] = engine_stub

import uvicorn  # noqa: E402

from gptoss_lite.server import create_app  # noqa: E402


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
    try:
        from gptoss_lite.engine import LLM
    except ImportError:  # TEMPORARY until the engine lands: the fake keeps the same contract
        from fake_engine import FakeLLM

        return FakeLLM(**kwargs)
    return LLM("lite-tiny", **kwargs)
