"""Tokenizers: the byte tokenizer, tokenizer.json through `tokenizers`, and load_tokenizer's choice."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gptoss_lite.tokenizer import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer, HFTokenizer, load_tokenizer


@given(st.text())
def test_byte_round_trip(text):
    """decode(encode(text)) == text for any unicode text; ids are the UTF-8 bytes."""
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_specials_and_vocab():
    """BOS=256, EOS=257, PAD=258, vocab 264; specials are skipped by decode; bos=True prepends BOS."""
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 264)
    assert (BOS_ID, EOS_ID, PAD_ID) == (256, 257, 258)
    assert tok.encode("hi", bos=True) == [256, 104, 105]
    assert tok.decode([256, 104, 257, 105, 258, 263]) == "hi"


def test_byte_decode_replaces_invalid_utf8():
    """A cut multi-byte character decodes to U+FFFD instead of raising."""
    ids = ByteTokenizer().encode("é")[:1]
    assert ByteTokenizer().decode(ids) == "\ufffd"


def test_byte_decode_rejects_out_of_range_ids():
    """Ids outside 0..263 are an error naming the range."""
    with pytest.raises(ValueError, match=r"out of range: the byte tokenizer has ids 0..263"):
        ByteTokenizer().decode([300])
    with pytest.raises(TypeError, match="encode expects a str"):
        ByteTokenizer().encode(b"bytes")


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny WordLevel tokenizer.json built locally (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>", "<pad>"])
    tok.train_from_iterator(["the passkey is hidden", "what is the passkey", "the sky is blue"], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_hf_tokenizer_round_trip(hf_dir):
    """HFTokenizer encodes known words, finds BOS/EOS/PAD by name, and decodes without specials."""
    tok = HFTokenizer(hf_dir)
    ids = tok.encode("the passkey is blue")
    assert len(ids) == 4 and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == "the passkey is blue"
    assert tok.bos_id == 1 and tok.eos_id == 2 and tok.pad_id == 3
    assert tok.encode("the", bos=True) == [1, ids[0]]
    assert tok.decode([1, *ids, 2]) == "the passkey is blue"
    assert tok.vocab_size == 4 + len({"the", "passkey", "is", "hidden", "what", "sky", "blue"})


def test_load_tokenizer_picks_tokenizer_json(hf_dir, tmp_path_factory):
    """A directory with tokenizer.json gives HFTokenizer; otherwise (or None / a preset) ByteTokenizer."""
    assert isinstance(load_tokenizer(hf_dir), HFTokenizer)
    assert isinstance(load_tokenizer(tmp_path_factory.mktemp("empty")), ByteTokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer("lite-tiny"), ByteTokenizer)


def test_hf_tokenizer_missing_file_is_an_error(tmp_path):
    """HFTokenizer on a directory without tokenizer.json says which file is missing."""
    with pytest.raises(FileNotFoundError, match="no tokenizer.json there"):
        HFTokenizer(tmp_path)
