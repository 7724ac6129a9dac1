"""Structured output: a JSON schema (or "any JSON object") as a logits processor, built with llguidance.

`JsonConstraint(tokenizer, schema)` is a per-request logits processor (SamplingParams'
`logits_processor`): before each token it masks every token the grammar does not allow, and once the
JSON is complete it allows only the end token. The grammar engine is llguidance (a Rust library
made for this: the token mask of a 200k vocabulary in well under a millisecond).

On a harmony model (`harmony=encoding`) only the `final` channel's text is constrained: the chain of
thought, the control tokens and any tool-call header stay free, and the answer's end is
`<|return|>`. Everything else constrains the whole completion and ends with the tokenizer's EOS.
"""

from __future__ import annotations

import json
import threading
from functools import cache

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
def _lltokenizer(key: tuple, tokenizer, vocab_size: int, eos: int):
    llg = _llguidance()
    path = getattr(tokenizer, "path", None)
    if path is not None:  # a tokenizer.json
        return llg.LLTokenizer(str(path), n_vocab=vocab_size, eos_token=eos, slices=llg.LLTokenizer.json_slices())
    wrapper = llg.TokenizerWrapper(_ByteTokens(tokenizer, vocab_size))
    return llg.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos, slices=llg.LLTokenizer.json_slices())


def lltokenizer(tokenizer, vocab_size: int, eos: int):
    """The llguidance tokenizer of one of ours, built once (about a second for a 200k vocabulary)."""
    with _lock:
        return _lltokenizer((id(tokenizer), vocab_size, eos), tokenizer, vocab_size, eos)


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
    """An llguidance grammar for `schema`, checked against the tokenizer (GrammarError if it fails)."""
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError or RuntimeError for bad schemas
        raise GrammarError(f"the JSON schema does not compile: {exc}") from None
    error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if error:
        raise GrammarError(f"the JSON schema does not compile: {messages[0] if messages else 'invalid'}")
    return grammar


class JsonConstraint:
    """A logits processor that keeps a completion (or a harmony model's `final` text) inside a grammar."""

    def __init__(self, lltok, grammar: str, *, harmony=None, end_token: int | None = None):
        llg = _llguidance()
        self.lltok, self.grammar, self.harmony, self.end_token = lltok, grammar, harmony, end_token
        self.matcher = llg.LLMatcher(lltok, grammar, log_level=0)
        self.words = (lltok.vocab_size + 31) // 32
        self._seen = 0  # output tokens looked at so far
        self._stream = None
        self._in_final = harmony is None  # a plain model is constrained from its first token
        if harmony is not None:
            from gptoss_lite.harmony.parse import HarmonyStream

            self._stream = HarmonyStream(harmony, tools=False)

    def fork(self) -> JsonConstraint:
        """A fresh constraint for another sample of the same request."""
        return JsonConstraint(self.lltok, self.grammar, harmony=self.harmony, end_token=self.end_token)

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        for token in token_ids[self._seen :]:
            self._advance(int(token))
        self._seen = len(token_ids)
        if not self._in_final or self.matcher.is_error():
            return logits
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]].astype(bool)
        if len(allowed) < logits.shape[-1]:  # ids past the grammar's vocabulary (padding rows)
            allowed = np.concatenate([allowed, np.zeros(logits.shape[-1] - len(allowed), dtype=bool)])
        if self.matcher.is_accepting() and self.end_token is not None:
            allowed[self.end_token] = True
        if not allowed.any():
            return logits
        return logits.masked_fill(~torch.from_numpy(allowed).to(logits.device), float("-inf"))

    def _advance(self, token: int) -> None:
        if self._stream is None:
            self.matcher.consume_token(token)
            return
        was_final = self._in_final
        self._stream.feed([token])
        if was_final:
            self.matcher.consume_token(token)
        self._in_final = self._stream.in_final_text


__all__ = ["GrammarError", "JsonConstraint", "compile_schema", "lltokenizer", "schema_of"]
