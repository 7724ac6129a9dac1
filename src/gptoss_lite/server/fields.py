"""Request fields the OpenAI API documents that are hints, echoes or requests this server cannot serve.

Real clients send documented fields unasked (the Agents SDK `include: []`, Codex `store: false` and
`prompt_cache_key`, LangChain `metadata` and `service_tier`), so every documented field parses. What
each one does on each endpoint is the table in docs/server.md#request-fields, which
tests/server/test_request_surface.py holds the request models to. Here: the types those fields share,
the nearest gpt-oss reasoning effort, and the mapping of chat's legacy `functions`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    """A request object parsed strictly: no coercion, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


# The API's limits (its reference: 16 pairs, keys of 64 characters, values of 512).
Metadata = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]], Field(max_length=16)
]
Identifier = Annotated[str, Field(max_length=256)]  # user, prompt_cache_key: opaque client strings
SafetyIdentifier = Annotated[str, Field(max_length=128)]  # the API's documented maximum
# `priority` (an extension, as vLLM takes it): lower runs first within the tenant's share of the engine
# (docs/server.md#sharing-between-tenants). Bounded to a signed 64-bit integer, what every client can send.
Priority = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]

# Every tier the API names; this server has one, and answers "default" whichever was asked.
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"]
SERVED_TIER = "default"

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
Verbosity = Literal["low", "medium", "high"]
CacheRetention = Literal["in_memory", "24h"]

# gpt-oss has three efforts (its harmony system message says `Reasoning: low|medium|high`) and always
# reasons, so the API's other efforts map to the nearest of them.
NEAREST_EFFORT = {
    "none": "low",
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}


def nearest_effort(effort: str | None) -> str | None:
    """The gpt-oss effort for an API effort (None stays None: the renderer's default)."""
    return None if effort is None else NEAREST_EFFORT[effort]


class StreamOptions(Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; no `obfuscation` padding is sent


class PromptCacheOptions(Strict):
    """`prompt_cache_options` (accepted; the prefix cache here needs no breakpoints or lifetimes)."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None
    comparison_response_id: Identifier | None = None  # responses only, in the API
    prewarm: bool | None = None  # responses only, in the API


class PredictionText(Strict):
    type: Literal["text"]
    text: str


class Prediction(Strict):
    """Chat `prediction` (Predicted Outputs): a latency hint; the answer never depends on it."""

    type: Literal["content"]
    content: str | list[PredictionText]


class FunctionDef(Strict):
    """One of chat's legacy `functions` (a function tool without the `{"type": "function"}` wrapper)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionName(Strict):
    name: str


def legacy_tools(functions: list[FunctionDef] | None) -> list[dict] | None:
    """Chat's legacy `functions` as `tools` of type function."""
    if functions is None:
        return None
    return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in functions]


def legacy_tool_choice(function_call: str | FunctionName | None):
    """Chat's legacy `function_call` as a `tool_choice`: "none" and "auto" as they are, {"name": X} as
    the named-function choice."""
    if isinstance(function_call, FunctionName):
        return {"type": "function", "function": {"name": function_call.name}}
    return function_call


__all__ = [
    "Strict",
    "Metadata",
    "ServiceTier",
    "SERVED_TIER",
    "Priority",
    "Effort",
    "nearest_effort",
    "StreamOptions",
    "PromptCacheOptions",
    "Prediction",
    "FunctionDef",
    "FunctionName",
    "legacy_tools",
    "legacy_tool_choice",
]
