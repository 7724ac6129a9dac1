"""The harmony encoding of a gpt-oss checkpoint, built from the checkpoint's own `tokenizer.json`.

openai-harmony renders and parses with tiktoken's `o200k_base` ranks, which it would download on
first use. Nothing here downloads: the ranks are the checkpoint's BPE vocabulary (ids 0..199,997 of
the released `tokenizer.json`, byte-level strings), re-serialised as tiktoken's text format
(`base64(token bytes) rank` per line). That file must hash to O200K_BASE_SHA256, the hash
openai-harmony itself checks, so a tokenizer that is not the released vocabulary is refused with a
clear reason instead of rendering prompts the model never saw.

The file is written once under `$XDG_CACHE_HOME/gptoss-lite/harmony` (or `$GPTOSS_LITE_HARMONY_DIR`),
and openai-harmony is pointed at it with its `TIKTOKEN_ENCODINGS_BASE` variable while it loads.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
import threading
from functools import cache
from pathlib import Path

O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_BASE_FILE = "o200k_base.tiktoken"
O200K_BASE_SIZE = 199_998  # ranks in o200k_base; ids from here on are special tokens
# The harmony control tokens and their ids in the released vocabulary.
HARMONY_SPECIALS = {
    "<|return|>": 200002,
    "<|constrain|>": 200003,
    "<|channel|>": 200005,
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|call|>": 200012,
}

_load_lock = threading.Lock()


class HarmonyUnavailable(ValueError):
    """The checkpoint's tokenizer is not the gpt-oss (o200k_harmony) vocabulary; `str()` says why."""


def is_harmony_tokenizer(tokenizer_json: dict) -> bool:
    """Whether a parsed tokenizer.json declares the harmony control tokens at their released ids."""
    added = {t.get("content"): t.get("id") for t in tokenizer_json.get("added_tokens", [])}
    return all(added.get(name) == tid for name, tid in HARMONY_SPECIALS.items())


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte is spelt with -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def tiktoken_ranks(tokenizer_json: dict) -> bytes:
    """The tiktoken file of a byte-level BPE tokenizer.json's first O200K_BASE_SIZE ids.

    Raises HarmonyUnavailable when the vocabulary is not byte-level BPE or is too small."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise HarmonyUnavailable("tokenizer.json is not a BPE tokenizer")
    by_rank: list[bytes | None] = [None] * O200K_BASE_SIZE
    decoder = _byte_decoder()
    for text, rank in model["vocab"].items():
        if not isinstance(rank, int) or not 0 <= rank < O200K_BASE_SIZE:
            continue
        try:
            by_rank[rank] = bytes(decoder[ch] for ch in text)
        except KeyError:
            raise HarmonyUnavailable(f"tokenizer.json token {text[:20]!r} is not byte-level BPE") from None
    missing = [r for r, b in enumerate(by_rank) if b is None]
    if missing:
        raise HarmonyUnavailable(
            f"tokenizer.json has no token for {len(missing):,} of the o200k ranks (first {missing[0]})"
        )
    return b"".join(base64.b64encode(b) + b" %d\n" % r for r, b in enumerate(by_rank))  # type: ignore[arg-type]


def cache_dir() -> Path:
    if os.environ.get("GPTOSS_LITE_HARMONY_DIR"):
        return Path(os.environ["GPTOSS_LITE_HARMONY_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gptoss-lite" / "harmony"


def write_ranks(data: bytes, directory: Path) -> Path:
    """Write the tiktoken file into `directory` (atomically; kept if it is already there)."""
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / O200K_BASE_FILE
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == O200K_BASE_SHA256:
        return target
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".o200k-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


@cache
def load_encoding(tokenizer_path: str | Path):
    """The openai-harmony `HarmonyEncoding` (HARMONY_GPT_OSS) for a checkpoint's tokenizer.json.

    Raises HarmonyUnavailable (with the reason) when the tokenizer is not the gpt-oss vocabulary, or
    openai-harmony is not installed. Cached per path."""
    path = Path(tokenizer_path)
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    except ImportError:
        raise HarmonyUnavailable("openai-harmony is not installed (pip install openai-harmony)") from None
    try:
        parsed = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise HarmonyUnavailable(f"{path}: not a readable tokenizer.json ({exc})") from None
    if not is_harmony_tokenizer(parsed):
        raise HarmonyUnavailable(f"{path}: no harmony control tokens (<|start|>, <|channel|>, ...) at their ids")
    data = tiktoken_ranks(parsed)
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_BASE_SHA256:
        raise HarmonyUnavailable(
            f"{path}: its vocabulary is not o200k_base (sha256 {digest[:12]}…, expected {O200K_BASE_SHA256[:12]}…)"
        )
    ranks = write_ranks(data, cache_dir())
    with _load_lock:  # the variable is read by openai-harmony's loader, process-wide
        saved = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(ranks.parent)
        try:
            return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as exc:  # noqa: BLE001 - the Rust loader raises one error type for every cause
            raise HarmonyUnavailable(f"openai-harmony could not load the vocabulary: {exc}") from None
        finally:
            if saved is None:
                os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
            else:
                os.environ["TIKTOKEN_ENCODINGS_BASE"] = saved
