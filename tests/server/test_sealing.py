"""Sealed reasoning (server/sealing.py): what one server seals for one tenant opens there and nowhere else."""

from __future__ import annotations

import base64
import os
import stat
import threading

import pytest

from gptoss_lite.server.sealing import KEY_FILE, Sealer, SealError, data_dir_key, read_key_file

KEY = bytes(range(32))
TEXT = "The user wants the weather. Ünïcødé too: 天气."


def _raw(token: str) -> bytes:
    return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))


def _token(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def test_round_trip_and_the_format():
    """open(seal(text)) is text; the token is unpadded base64url of version 1, a 12-byte nonce, the
    ciphertext and a 16-byte tag, with a fresh nonce each time."""
    sealer = Sealer(KEY)
    a, b = sealer.seal("alice", TEXT), sealer.seal("alice", TEXT)
    assert sealer.open("alice", a) == sealer.open("alice", b) == TEXT
    assert a != b and "=" not in a and set(a) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    raw = _raw(a)
    assert raw[0] == 1 and len(raw) == 1 + 12 + len(TEXT.encode()) + 16
    assert Sealer(KEY).open("alice", sealer.seal("alice", "")) == ""


def test_every_flipped_byte_is_refused():
    """Changing any one byte of the sealed bytes (version, nonce, ciphertext, tag) is refused."""
    sealer = Sealer(KEY)
    raw = _raw(sealer.seal("alice", TEXT))
    for i in range(len(raw)):
        changed = bytearray(raw)
        changed[i] ^= 0x01
        with pytest.raises(SealError):
            sealer.open("alice", _token(bytes(changed)))


def test_every_changed_character_is_refused():
    """Changing any one character of the token to another base64url character is refused, the last
    one's unused bits included (base64 would decode those to the same bytes)."""
    sealer = Sealer(KEY)
    token = sealer.seal("alice", "x" * 5)  # 1 + 12 + 5 + 16 = 34 bytes: the last character has 4 unused bits
    for i, c in enumerate(token):
        other = "A" if c != "A" else "B"
        with pytest.raises(SealError):
            sealer.open("alice", token[:i] + other + token[i + 1 :])


def test_another_tenant_or_key_is_refused():
    """An item sealed for one tenant does not open for another, nor under another key."""
    token = Sealer(KEY).seal("alice", TEXT)
    with pytest.raises(SealError, match="another API key"):
        Sealer(KEY).open("bob", token)
    with pytest.raises(SealError, match="another server's key"):
        Sealer(bytes(32)).open("alice", token)


@pytest.mark.parametrize(
    "token,match",
    [
        ("", "too short"),
        ("AQ", "too short"),
        ("not base64!", "not base64url"),
        ("abc=", "not base64url"),
        ("a", "not base64url"),
        (_token(bytes([2]) + bytes(40)), "version 2"),
        (_token(bytes([1]) + bytes(40)), "does not authenticate"),
    ],
)
def test_garbage_and_truncated_tokens_are_refused(token, match):
    """Empty, non-base64url, padded, impossible-length, unknown-version and forged tokens are refused."""
    with pytest.raises(SealError, match=match):
        Sealer(KEY).open("alice", token)


def test_a_truncated_token_is_refused():
    """Every prefix of a sealed item is refused."""
    sealer = Sealer(KEY)
    token = sealer.seal("alice", TEXT)
    for n in range(len(token)):
        with pytest.raises(SealError):
            sealer.open("alice", token[:n])


def test_the_key_file_is_made_once_with_mode_0600(tmp_path):
    """The data directory's key is made on first use (32 bytes, mode 0600) and read back after."""
    key = data_dir_key(tmp_path)
    path = tmp_path / KEY_FILE
    assert len(key) == 32 and path.read_bytes() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert data_dir_key(tmp_path) == key
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE]  # no temporary file left behind


def test_processes_starting_together_agree_on_the_key(tmp_path):
    """Many makers racing on one empty directory all end with the one key on disk."""

    def make(folder, start, keys):
        start.wait()
        keys.append(data_dir_key(folder))

    for round in range(5):
        folder = tmp_path / str(round)
        folder.mkdir()
        keys, start = [], threading.Barrier(8)
        threads = [threading.Thread(target=make, args=(folder, start, keys)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(keys) == 8 and set(keys) == {(folder / KEY_FILE).read_bytes()}


def test_a_bad_key_file_in_the_data_dir_is_a_clear_error(tmp_path):
    """A data directory key of the wrong size is an error naming the file, not a new key."""
    (tmp_path / KEY_FILE).write_bytes(b"short")
    with pytest.raises(ValueError, match="sealing.key: a sealing key is 32 bytes, this file has 5"):
        data_dir_key(tmp_path)


def test_secret_file_raw_or_hex(tmp_path):
    """--secret-file takes 32 raw bytes or 64 hex digits (a trailing newline is fine); anything else
    is an error that says how to make one."""
    raw = os.urandom(32)
    (tmp_path / "raw").write_bytes(raw)
    (tmp_path / "hex").write_text(raw.hex() + "\n")
    assert read_key_file(tmp_path / "raw") == read_key_file(tmp_path / "hex") == raw
    for bad in (b"", raw[:31], raw.hex()[:63].encode(), ("zz" * 32).encode(), raw + b"\n\n"):
        (tmp_path / "bad").write_bytes(bad)
        with pytest.raises(ValueError, match="expected 32 raw bytes or 64 hex digits.*head -c 32 /dev/urandom"):
            read_key_file(tmp_path / "bad")
    with pytest.raises(FileNotFoundError):
        read_key_file(tmp_path / "missing")


def test_a_key_must_be_32_bytes():
    """A Sealer refuses a key that is not 32 bytes."""
    with pytest.raises(ValueError, match="32 bytes, not 16"):
        Sealer(bytes(16))
