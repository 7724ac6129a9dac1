"""Sealed reasoning: a chain of thought the client holds and sends back, readable only by this server
(docs/server.md#encrypted-reasoning).

A `reasoning` output item asked for with `include: ["reasoning.encrypted_content"]` carries its text
sealed with AES-256-GCM: `base64url(version || nonce || ciphertext and tag)`, unpadded, where the
version is one byte (1), the nonce 12 random bytes, and the associated data names the purpose and the
tenant. So a client can drop `store` and still continue a chain of thought, and an item is refused
(`SealError`) if one bit of it changed, if another tenant sends it, or if another key sealed it.

The key is 32 bytes: `--secret-file` (raw or 64 hex digits), or made on first start and kept in the
data directory, where every server process on that directory reads the same one.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import tempfile
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # GCM's 96-bit nonce; random per item (2^32 items per key keep collisions below 2^-32)
TAG_BYTES = 16
VERSION = 1  # the first byte of every sealed item; a new format gets a new number
PURPOSE = b"gptoss-lite reasoning v1"  # in the associated data: a sealed item is good for this and nothing else
KEY_FILE = "sealing.key"  # in the data directory: the 32 raw bytes, mode 0600
BASE64URL = re.compile(r"[A-Za-z0-9_-]*")


class SealError(ValueError):
    """A sealed item that this server did not seal for this tenant, or that changed since."""


class Sealer:
    """Seals and opens reasoning text for one tenant at a time, under one 32-byte key."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a sealing key is {KEY_BYTES} bytes, not {len(key)}")
        self._aead = AESGCM(key)

    def seal(self, tenant: str, text: str) -> str:
        """`text` sealed for `tenant`: an unpadded base64url string."""
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, text.encode("utf-8"), _associated(tenant))
        return base64.urlsafe_b64encode(bytes([VERSION]) + nonce + sealed).rstrip(b"=").decode("ascii")

    def open(self, tenant: str, token: str) -> str:
        """The text `seal(tenant, text)` sealed in `token`; SealError for anything else."""
        if not BASE64URL.fullmatch(token):
            raise SealError("not base64url")
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except (binascii.Error, ValueError):
            raise SealError("not base64url") from None
        # NOTE: base64 ignores the unused low bits of a last character; re-encoding refuses a token
        # that differs from the sealed one only there, so every change to the string is refused.
        if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != token:
            raise SealError("not canonical base64url")
        if len(raw) < 1 + NONCE_BYTES + TAG_BYTES:
            raise SealError(f"{len(raw)} bytes: too short to be a sealed item")
        if raw[0] != VERSION:
            raise SealError(f"format version {raw[0]}; this server reads version {VERSION}")
        nonce, sealed = raw[1 : 1 + NONCE_BYTES], raw[1 + NONCE_BYTES :]
        try:
            plain = self._aead.decrypt(nonce, sealed, _associated(tenant))
        except InvalidTag:
            raise SealError(
                "it does not authenticate: changed, sealed by another server's key, or for another API key"
            ) from None
        return plain.decode("utf-8")


def _associated(tenant: str) -> bytes:
    return PURPOSE + b"\0" + tenant.encode("utf-8")


def read_key_file(path: str | Path) -> bytes:
    """A key from `--secret-file`: 32 raw bytes, or 64 hex digits (surrounding whitespace allowed)."""
    data = Path(path).read_bytes()
    if len(data) == KEY_BYTES:
        return data
    text = data.strip()
    if len(text) == 2 * KEY_BYTES and re.fullmatch(rb"[0-9a-fA-F]+", text):
        return bytes.fromhex(text.decode("ascii"))
    raise ValueError(
        f"--secret-file {path}: expected {KEY_BYTES} raw bytes or {2 * KEY_BYTES} hex digits, found {len(data)} "
        f"bytes (make one with: head -c {KEY_BYTES} /dev/urandom > {path})"
    )


def data_dir_key(data_dir: str | Path) -> bytes:
    """The key kept in `data_dir/sealing.key`, made (32 random bytes, mode 0600) if there is none.

    Written to a temporary file and hard-linked into place, which fails if the name exists: of two
    processes starting at once, one link wins and both read the winner's key."""
    path = Path(data_dir) / KEY_FILE
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=".sealing-")  # mkstemp: mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process made it first: use theirs
        finally:
            os.unlink(tmp)
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise ValueError(
            f"{path}: a sealing key is {KEY_BYTES} bytes, this file has {len(key)}; remove it to make a new key "
            "(reasoning items sealed with the old one can then no longer be read)"
        )
    return key


__all__ = ["Sealer", "SealError", "read_key_file", "data_dir_key", "KEY_FILE"]
