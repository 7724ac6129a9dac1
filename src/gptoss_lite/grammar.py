"""Structured output: a JSON schema (or "any JSON object") as a logits processor, built with llguidance.

`JsonConstraint` is a per-request logits processor (SamplingParams' `logits_processor`): before each
token it masks every token the grammar does not allow, and once the JSON is complete it allows only
the end token (the tokenizer's EOS). The grammar engine is llguidance (a Rust library made for this:
the token mask of a 200k vocabulary in well under a millisecond).

On a harmony model, `HarmonyConstraint` constrains only where the format says JSON belongs: the text
of a `final` message (a `response_format`), ending with `<|return|>`, and the arguments of a call to
a function tool (its `parameters` schema), ending with `<|call|>`. The chain of thought, the headers
and the control tokens stay free.
"""

from __future__ import annotations

import json
import threading
from functools import cache, lru_cache

import numpy as np
import torch

_lock = threading.Lock()


class GrammarError(ValueError):
    """A schema llguidance cannot compile (or llguidance is missing); `str()` says why."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured output needs llguidance (pip install llguidance)") from None
    return llguidance


class _ByteTokens:
    """The byte tokenizer as llguidance's TokenizerWrapper expects it (ids 0..255 are bytes)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(256, vocab_size)]

    def __call__(self, text):
        return list(text.encode("utf-8") if isinstance(text, str) else text)


@cache
def _lltokenizer(tokenizer, vocab_size: int, eos: int):
    llg = _llguidance()
    path = getattr(tokenizer, "path", None)
    if path is not None:  # a tokenizer.json
        return llg.LLTokenizer(str(path), n_vocab=vocab_size, eos_token=eos, slices=llg.LLTokenizer.json_slices())
    wrapper = llg.TokenizerWrapper(_ByteTokens(tokenizer, vocab_size))
    return llg.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos, slices=llg.LLTokenizer.json_slices())


def lltokenizer(tokenizer, vocab_size: int, eos: int):
    """The llguidance tokenizer of one of ours, built once (about a second for a 200k vocabulary)."""
    with _lock:
        return _lltokenizer(tokenizer, vocab_size, eos)


def schema_of(response_format: dict) -> dict:
    """The JSON schema a `response_format` asks for: `json_object` is any object; `json_schema`
    gives its `json_schema.schema` (GrammarError for any other shape)."""
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("response_format.json_schema: expected {'name': ..., 'schema': {...}}")
        return spec.get("schema") or {"type": "object"}
    raise GrammarError(f"response_format type {str(kind)[:40]!r}: expected 'text', 'json_object' or 'json_schema'")


def compile_schema(schema: dict, lltok) -> str:
    """An llguidance grammar for `schema`, checked against the tokenizer (GrammarError if it fails).
    The last 256 compiled are kept: a client sends the same tools and formats request after request."""
    return _compile(json.dumps(schema), lltok)  # key order kept: it is the order properties are written in


@lru_cache(maxsize=256)
def _compile(schema: str, lltok) -> str:
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError or RuntimeError for bad schemas
        raise GrammarError(f"the JSON schema does not compile: {exc}") from None
    error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if error:
        raise GrammarError(f"the JSON schema does not compile: {messages[0] if messages else 'invalid'}")
    return grammar


class _Masker:
    """One grammar's token mask over a logits row (the shared part of both constraints)."""

    def __init__(self, lltok, grammar: str, end_token: int):
        llg = _llguidance()
        self.matcher = llg.LLMatcher(lltok, grammar, log_level=0)
        self.end_token = end_token
        self.eos = lltok.eos_token

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        matcher = self.matcher
        if matcher.is_error():
            return logits  # cannot happen for sampled tokens; never fail a request over it
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").astype(bool)
        size = logits.shape[-1]
        allowed = allowed[:size] if len(allowed) >= size else np.pad(allowed, (0, size - len(allowed)))
        if self.eos < size:
            allowed[self.eos] = False  # the grammar's end is this constraint's end token
        if matcher.is_accepting():
            allowed[self.end_token] = True
        if not allowed.any():
            return logits
        return logits.masked_fill(~torch.from_numpy(allowed).to(logits.device), float("-inf"))


class JsonConstraint:
    """A logits processor that keeps a whole completion inside a grammar, ending with `end_token`."""

    def __init__(self, lltok, grammar: str, *, end_token: int):
        self.lltok, self.grammar, self.end_token = lltok, grammar, end_token
        self._masker = _Masker(lltok, grammar, end_token)
        self._seen = 0  # output tokens consumed so far

    def fork(self) -> JsonConstraint:
        """A fresh constraint for another sample of the same request."""
        return JsonConstraint(self.lltok, self.grammar, end_token=self.end_token)

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for token in token_ids[self._seen :]:
            self._masker.consume(int(token))
        self._seen = len(token_ids)
        return self._masker.mask(logits)


class HarmonyConstraint:
    """A logits processor for a harmony model: the text of a `final` message follows `final` (a
    grammar, or free when None) and ends with <|return|>; the arguments of a call to
    `functions.NAME` follow `calls[NAME]` and end with <|call|>. Everything else (the chain of
    thought, headers, control tokens) is free."""

    def __init__(self, lltok, encoding, *, final: str | None, calls: dict[str, str], ends: tuple[int, int]):
        from gptoss_lite.harmony.parse import HarmonyStream

        self.lltok, self.encoding, self.final, self.calls, self.ends = lltok, encoding, final, calls, ends
        self._stream = HarmonyStream(encoding, tools=True)
        self._masker: _Masker | None = None  # the grammar of the message being written, if any
        self._seen = 0

    def fork(self) -> HarmonyConstraint:
        return HarmonyConstraint(self.lltok, self.encoding, final=self.final, calls=self.calls, ends=self.ends)

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for token in token_ids[self._seen :]:
            self._advance(int(token))
        self._seen = len(token_ids)
        return logits if self._masker is None else self._masker.mask(logits)

    def _advance(self, token: int) -> None:
        if self._masker is not None:
            self._masker.consume(token)
        stream = self._stream
        was_in_text = stream.in_text
        stream.feed([token])
        if not stream.in_text:
            self._masker = None
        elif not was_in_text:  # a message's text begins: pick its grammar
            grammar, end = None, None
            recipient = stream.last_recipient or ""
            if recipient.startswith("functions."):
                grammar, end = self.calls.get(recipient.removeprefix("functions.")), self.ends[1]
            elif stream.channel == "final" and not recipient:
                grammar, end = self.final, self.ends[0]
            self._masker = None if grammar is None else _Masker(self.lltok, grammar, end)


__all__ = ["GrammarError", "HarmonyConstraint", "JsonConstraint", "compile_schema", "lltokenizer", "schema_of"]
