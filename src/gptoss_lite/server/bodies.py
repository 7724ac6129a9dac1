"""The OpenAI response bodies: completion and chat bodies, their choices, stream chunks, usage and
logprobs (the requests and errors are protocol.py's)."""

from __future__ import annotations

import time
from typing import Any

from gptoss_lite.server import fields as F


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _envelope(rid: str, model: str, kind: str, choices: list[dict], use: dict | None) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices, "usage": use}


def completion_body(rid: str, model: str, choices: list[dict], use: dict | None) -> dict:
    """A completion: choices from `completion_choice`, one per sample."""
    return _envelope(rid, model, "text_completion", choices, use)


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_body(rid: str, model: str, choices: list[dict], use: dict | None, metadata: dict | None = None) -> dict:
    """A chat completion: choices from `chat_choice`, one per sample; `service_tier` is the one tier
    served, and the request's `metadata` is echoed when it sent one."""
    body = {**_envelope(rid, model, "chat.completion", choices, use), "service_tier": F.SERVED_TIER}
    if metadata is not None:
        body["metadata"] = metadata
    return body


def chat_choice(index: int, text: str | dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """A chat choice: `text` is the answer, or the whole message (a harmony model's, with reasoning and
    tool calls)."""
    message = text if isinstance(text, dict) else {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(
    rid: str,
    model: str,
    text: str | None,
    finish_reason: str | None,
    use=None,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    """A streamed completion event; text None gives the usage-only chunk (empty choices)."""
    choices = [] if text is None else [completion_choice(index, text, finish_reason, logprobs)]
    return _envelope(rid, model, "text_completion", choices, use)


def chat_chunk(
    rid: str,
    model: str,
    delta: dict | None,
    finish_reason: str | None,
    use=None,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    """A streamed chat event; delta None gives the usage-only chunk (empty choices)."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    chunk = _envelope(rid, model, "chat.completion.chunk", [] if delta is None else [choice], use)
    return {**chunk, "service_tier": F.SERVED_TIER}


def chat_logprobs(entries: list[tuple[str, bytes, float, list[tuple[str, bytes, float]]]]) -> dict:
    """choices[].logprobs of a chat answer: {"content": [{token, logprob, bytes, top_logprobs}]}, from
    (token text, token bytes, logprob, [(text, bytes, logprob) of the top alternatives]) per token."""
    return {
        "content": [
            {
                "token": text,
                "logprob": lp,
                "bytes": list(raw),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, b, v in top],
            }
            for text, raw, lp, top in entries
        ]
    }


def completion_logprobs(entries: list[tuple[str, bytes, float, list[tuple[str, bytes, float]]]], offset: int) -> dict:
    """choices[].logprobs of a completion: tokens, token_logprobs, top_logprobs ({text: logprob}) and
    text_offset (each token's start in the text, counting from `offset`)."""
    offsets = []
    for text, _, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [text for text, _, _, _ in entries],
        "token_logprobs": [lp for _, _, lp, _ in entries],
        "top_logprobs": [{t: v for t, _, v in top} for _, _, _, top in entries],
        "text_offset": offsets,
    }
