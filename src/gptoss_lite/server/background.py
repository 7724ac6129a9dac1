"""`BackgroundServer`: an app served by uvicorn on a free loopback port in a daemon thread, for tests,
benchmarks and notebooks that talk to the server over real HTTP in the same process.

```python
with BackgroundServer(create_app(llm)) as live:
    httpx.post(live.url + "/v1/completions", json={...})
```
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from gptoss_lite.server.http import DEFAULT_HEADER_TIMEOUT, uvicorn_config


class BackgroundServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a background thread (a context manager)."""

    def __init__(self, app, start_timeout: float = 20.0, header_timeout: float = DEFAULT_HEADER_TIMEOUT):
        self.app = app
        self.start_timeout = start_timeout
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, header_timeout=header_timeout, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def state(self):
        """The app's server state (`app.state.server`): model name, engine loop, metrics."""
        return self.app.state.server

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()
