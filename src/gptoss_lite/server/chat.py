"""Chat messages -> one prompt string, through a Jinja chat template.

A Hugging Face checkpoint's own `chat_template` is rendered the way transformers renders it: a
sandboxed Jinja environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension,
`raise_exception` and `strftime_now` as globals, a `tojson` filter that keeps non-ASCII characters,
and the variables `messages`, `add_generation_prompt=True`, `bos_token` and `eos_token`. The server
passes the tokenizer's BOS text as `bos_token` and tokenises the rendered text as a whole prompt
(`encode_prompt`), which puts BOS first under the model's rule unless the template already wrote it
(docs/checkpoints.md#the-bos-rule).

A model without one (the shipped byte-level demo model) gets BYTE_CHAT_TEMPLATE, a plain transcript
(docs/server.md#the-chat-template):

    System: You are terse.
    User: Hello
    Assistant:

one line per message (`Role: content`), then `Assistant:` for the reply. The byte model has no chat
tokens, so the template adds none (its BOS comes from the tokenizer's rule); generation stops at EOS,
at max_tokens, or at a `stop` string (clients often send `stop: ["\\nUser:"]`).
"""

from __future__ import annotations

import json
from datetime import datetime

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (its raise_exception) or failed to render."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; `render(messages)` gives the prompt text."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = ""):
        self.source = source if source is not None else BYTE_CHAT_TEMPLATE
        self.is_default = source is None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except TemplateError as exc:
            raise ValueError(f"chat_template does not compile: {exc}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict]) -> str:
        """messages [{"role", "content"}, ...] -> prompt text ending where the assistant's reply begins."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None
