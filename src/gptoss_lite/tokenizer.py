"""Tokenizers: a byte-level tokenizer for the demo models, and `tokenizer.json` via `tokenizers`.

Both expose the same small API: `encode(text, bos=False) -> list[int]`, `decode(ids) -> str`,
`vocab_size`, and the special ids `bos_id` / `eos_id` / `pad_id` (None where a tokenizer has none).
Nothing is downloaded at run time (docs/checkpoints.md).
"""

from __future__ import annotations

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


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, plus BOS=256, EOS=257, PAD=258 (259..263 reserved)."""

    vocab_size: int = BYTE_TOKENIZER_VOCAB_SIZE
    bos_id: int = BOS_ID
    eos_id: int = EOS_ID
    pad_id: int = PAD_ID

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """Token ids of `text` (one per UTF-8 byte), optionally preceded by BOS."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if bos else ids

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
        self.bos_id = self._first_token_id(("<|startoftext|>", "<|begin_of_text|>", "<s>", "[BOS]", "<bos>"))
        self.eos_id = self._first_token_id(("<|endoftext|>", "<|end_of_text|>", "<|return|>", "</s>", "[EOS]", "<eos>"))
        self.pad_id = self._first_token_id(("<|pad|>", "<pad>", "[PAD]"))

    def token_to_id(self, name: str) -> int | None:
        """The id of a token by its text (a special token such as "<|channel|>"), or None."""
        return self._tok.token_to_id(name)

    def _first_token_id(self, names: tuple[str, ...]) -> int | None:
        for name in names:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                return tid
        return None

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """Token ids of `text` without the tokenizer's own post-processing; BOS prepended on request."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if bos:
            if self.bos_id is None:
                raise ValueError(f"{self.path}: this tokenizer has no BOS token; call encode(text, bos=False)")
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


Tokenizer = Union[ByteTokenizer, HFTokenizer]  # noqa: UP007 (a runtime alias)


def load_tokenizer(model_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a model directory: its `tokenizer.json` when present, else the byte tokenizer.

    `None` (or a preset name, which is not a directory) gives the byte tokenizer.
    """
    if model_dir is not None:
        path = Path(model_dir)
        if (path / TOKENIZER_FILE).is_file():
            return HFTokenizer(path)
    return ByteTokenizer()
