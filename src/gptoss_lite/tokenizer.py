"""Tokenizers: a byte-level tokenizer for the demo models, and `tokenizer.json` via `tokenizers`.

Both expose the same small API: `encode_prompt(text)` (a whole prompt's ids under the model's BOS
rule), `encode(text)` (a fragment's ids, never a BOS), `decode(ids) -> str`, `vocab_size`, the rule
itself `add_bos`, and the special ids `bos_id` / `eos_id` / `pad_id` (None where a tokenizer has
none) with `bos_token`, BOS as text (None where it has no text form). Nothing is downloaded at run
time (docs/checkpoints.md).

NOTE: the BOS rule lives here and nowhere else (docs/checkpoints.md#the-bos-rule). A caller that
tokenises a prompt calls `encode_prompt`; one that measures or assembles pieces of a prompt calls
`encode` and counts the BOS as `add_bos`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Union

# Byte tokenizer layout: ids 0..255 are the raw bytes, then the specials, then reserved slots so the
# embedding table is a multiple of 8 (264 = 256 + 8).
BYTE_VOCAB = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
BYTE_TOKENIZER_VOCAB_SIZE = 264

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # transformers' file: add_bos_token, chat_template, ...
BOS_NAMES = ("<|startoftext|>", "<|begin_of_text|>", "<s>", "[BOS]", "<bos>")  # a tokenizer.json's BOS, first found


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus BOS=256, EOS=257, PAD=258 (259..263 reserved)."""

    vocab_size: int = BYTE_TOKENIZER_VOCAB_SIZE
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID
    bos_token: str | None = None  # BOS has no text form: no text encodes to it
    add_bos: bool = True  # our byte-level models are trained with BOS first in every document (train/data.py)

    def encode(self, text: str) -> list[int]:
        """Token ids of a piece of text (one per UTF-8 byte), never a BOS; a whole prompt: `encode_prompt`."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a whole prompt under the model's rule: BOS first (`add_bos`), then the bytes."""
        return _with_bos(self, self.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; specials and reserved ids are skipped, invalid UTF-8 becomes U+FFFD."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} out of range: the byte tokenizer has ids 0..{self.vocab_size - 1}")
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (b"" for specials): what an incremental decoder is fed."""
        return bytes((token_id,)) if 0 <= token_id < BYTE_VOCAB else b""

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=264)"


class HFTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers` library) behind the ByteTokenizer API."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer  # lazy: only checkpoints that ship one need it

        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no {TOKENIZER_FILE} there; pass a directory that holds one")
        self.path = file
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - `tokenizers` raises plain Exception for every parse error
            raise ValueError(
                f"{file}: not a readable {TOKENIZER_FILE} ({e}); replace it with the model's own tokenizer file"
            ) from None
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._first_token_id(BOS_NAMES)
        self.eos_id = self._first_token_id(("<|endoftext|>", "<|end_of_text|>", "<|return|>", "</s>", "[EOS]", "<eos>"))
        self.pad_id = self._first_token_id(("<|pad|>", "<pad>", "[PAD]"))
        self.bos_token: str | None = None if self.bos_id is None else self._tok.id_to_token(self.bos_id)
        self.add_bos: bool = self._read_add_bos(file.parent / TOKENIZER_CONFIG_FILE)

    def _read_add_bos(self, config: Path) -> bool:
        """`add_bos_token` of the tokenizer_config.json beside tokenizer.json; False without one (gpt-oss's
        harmony format has no BOS, and neither has a tokenizer.json that says nothing)."""
        if not config.is_file():
            return False
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{config}: not readable JSON ({e}); fix or remove it") from None
        if not isinstance(data, dict):
            raise ValueError(f"{config}: expected a JSON object, got {type(data).__name__}; fix or remove it")
        add_bos = data.get("add_bos_token", False)
        if not isinstance(add_bos, bool):
            raise ValueError(f"{config}: add_bos_token={add_bos!r}: must be true or false")
        if add_bos and self.bos_id is None:
            raise ValueError(
                f"{config}: add_bos_token is true but {self.path} has no BOS token (none of "
                f"{', '.join(BOS_NAMES)}); set add_bos_token to false or use the model's own tokenizer.json"
            )
        return add_bos

    def token_to_id(self, name: str) -> int | None:
        """The id of a token by its text (a special token such as "<|channel|>"), or None."""
        return self._tok.token_to_id(name)

    def _first_token_id(self, names: tuple[str, ...]) -> int | None:
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        return None

    def encode(self, text: str) -> list[int]:
        """Token ids of a piece of text without the tokenizer's own post-processing, so no BOS is added
        (special tokens written in the text, e.g. by a chat template, are still matched); a whole
        prompt: `encode_prompt`."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a whole prompt under the model's rule: BOS first iff `add_bos` (a text that
        already begins with the BOS token, as a chat template writing `bos_token` does, keeps that one)."""
        return _with_bos(self, self.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


Tokenizer = Union[ByteTokenizer, HFTokenizer]  # noqa: UP007 (a runtime alias)


def _with_bos(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """`ids` with the BOS the tokenizer's rule adds: none when `add_bos` is False or `ids` already start
    with BOS (never two)."""
    if not tokenizer.add_bos or ids[:1] == [tokenizer.bos_id]:
        return ids
    return [tokenizer.bos_id, *ids]


def load_tokenizer(model_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a model directory: its `tokenizer.json` when present, else the byte tokenizer.

    `None` (or a preset name, which is not a directory) gives the byte tokenizer.
    """
    if model_dir is not None:
        path = Path(model_dir)
        if (path / TOKENIZER_FILE).is_file():
            return HFTokenizer(path)
    return ByteTokenizer()
