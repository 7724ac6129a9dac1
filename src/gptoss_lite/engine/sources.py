"""What the engine reads from the model it is given: the weights' revision (the prefix cache's key),
the checkpoint's tokenizer and its chat template."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from gptoss_lite.model.transformer import GPTOSS
from gptoss_lite.tokenizer import ByteTokenizer, load_tokenizer


def checkpoint_revision(source: str, model_dir: Path | None, config: object) -> str:
    """The weights' revision from the checkpoint's identity, without reading a tensor: for a directory,
    every file's name, size and modification time (a rewritten or replaced checkpoint gets a new
    revision); for a preset name (seeded weights), the name and its config. The engine's prefix cache
    keys on it, so a prefix cached under one checkpoint is never a hit under another."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(config).encode())
    if model_dir is None:
        h.update(f"preset:{source}".encode())
        return h.hexdigest()
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            stat = path.stat()
            h.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return h.hexdigest()


def weights_revision(model: GPTOSS) -> str:
    """The revision of a model handed to the engine as an object, which has no checkpoint to name it:
    its config and every parameter's name, shape, dtype, storage and version counter, so reading no
    tensor. The prefix cache lives in the engine, and within the engine's life a model changes only
    in place, which bumps the changed tensor's version (pass `revision=` to name the weights yourself)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(model.config).encode())
    for name, p in model.named_parameters():
        h.update(f"{name}{tuple(p.shape)}{p.dtype}{p.data_ptr()}:{p._version}\0".encode())
    return h.hexdigest()


def own_tokenizer(model_dir: Path | None, config) -> object | None:
    """The checkpoint's tokenizer (the byte tokenizer for a byte-vocabulary model without one; None,
    ids only, for any other model without a tokenizer.json)."""
    tokenizer = load_tokenizer(model_dir)
    if isinstance(tokenizer, ByteTokenizer) and config.vocab_size != tokenizer.vocab_size:
        return None
    return tokenizer


def read_chat_template(model_dir: Path | None) -> str | None:
    """The checkpoint's chat template (`tokenizer_config.json`'s `chat_template`), or None."""
    if model_dir is None:
        return None
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    return template if isinstance(template, str) else None
