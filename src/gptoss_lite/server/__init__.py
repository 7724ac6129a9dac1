"""The OpenAI-compatible HTTP server (`gptoss-lite serve`): FastAPI app over the engine's LLM.

`create_app(llm, api_keys=..., max_waiting=...)` builds the app; `protocol` holds the wire format,
`engine_loop` the one thread that drives the LLM, `metrics` the Prometheus figures, `chat` the chat
template, `static/` the playground page. This package imports only `gptoss_lite.engine` from the
rest of the project (docs/architecture.md#who-imports-whom).
"""

from gptoss_lite.server.openai_api import create_app

__all__ = ["create_app"]
