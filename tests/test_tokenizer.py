"""Tokenizers: the byte tokenizer, tokenizer.json through `tokenizers`, load_tokenizer's choice, and
the BOS rule (`add_bos`, `encode_prompt`) that only the tokenizer decides."""

from __future__ import annotations

import ast
import json
from pathlib import Path

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
    """BOS=256, EOS=257, PAD=258, vocab 264; specials are skipped by decode."""
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 264)
    assert (BOS_ID, EOS_ID, PAD_ID) == (256, 257, 258)
    assert tok.decode([256, 104, 257, 105, 258, 263]) == "hi"


def test_byte_prompt_has_bos_and_fragment_has_none():
    """The byte models' rule is BOS first: encode_prompt prepends it, encode (a fragment) never does
    and has no way to ask for it."""
    tok = ByteTokenizer()
    assert tok.add_bos is True and tok.bos_token is None
    assert tok.encode_prompt("hi") == [256, 104, 105]
    assert tok.encode_prompt("") == [256]
    assert tok.encode("hi") == [104, 105]
    with pytest.raises(TypeError, match="bos"):
        tok.encode("hi", bos=True)


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
    assert tok.bos_id == 1 and tok.eos_id == 2 and tok.pad_id == 3 and tok.bos_token == "<s>"
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


def _config(directory: Path, **fields) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps(fields))


def test_hf_without_config_adds_no_bos(hf_dir):
    """A tokenizer.json alone (gpt-oss's case: harmony has no BOS) means add_bos False: a prompt is its text's ids."""
    tok = HFTokenizer(hf_dir)
    assert tok.add_bos is False
    assert tok.encode_prompt("the sky") == tok.encode("the sky") and tok.bos_id not in tok.encode_prompt("the sky")


def test_hf_add_bos_token_from_config(hf_dir):
    """tokenizer_config.json's add_bos_token is the rule: true puts BOS first (once, also when the text
    already begins with it, as a chat template writing bos_token does); false leaves it out."""
    _config(hf_dir, add_bos_token=True, chat_template="{{ bos_token }}")
    tok = HFTokenizer(hf_dir)
    ids = tok.encode("the sky")
    assert tok.add_bos is True and tok.encode_prompt("the sky") == [1, *ids]
    assert tok.encode_prompt("<s>the sky") == [1, *ids]
    assert tok.encode("the sky") == ids and 1 not in ids
    _config(hf_dir, add_bos_token=False)
    assert HFTokenizer(hf_dir).encode_prompt("the sky") == ids


def test_hf_add_bos_token_errors(hf_dir, tmp_path_factory):
    """add_bos_token true without a BOS token, a non-boolean, or a config that is not a JSON object fail at load."""
    _config(hf_dir, add_bos_token="yes")
    with pytest.raises(ValueError, match=r"add_bos_token='yes': must be true or false"):
        HFTokenizer(hf_dir)
    (hf_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        HFTokenizer(hf_dir)
    (hf_dir / "tokenizer_config.json").write_text("[true]")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        HFTokenizer(hf_dir)
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bare = tmp_path_factory.mktemp("no_bos")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the sky is blue"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(bare / "tokenizer.json"))
    _config(bare, add_bos_token=True)
    with pytest.raises(ValueError, match="add_bos_token is true but .* has no BOS token"):
        HFTokenizer(bare)
    _config(bare, add_bos_token=False)
    assert HFTokenizer(bare).encode_prompt("the sky") == HFTokenizer(bare).encode("the sky")


# ---- the rule has one owner ----------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
OWNER = ROOT / "src" / "gptoss_lite" / "tokenizer.py"


def _mentions(node: ast.AST, name: str) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name)
        for n in ast.walk(node)
    )


def _is_bos_id(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "bos_id") or (
        isinstance(node, ast.Name) and node.id in ("bos_id", "BOS_ID")
    )


def bos_decisions(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each place that decides BOS itself: `encode(..., bos=...)`, a list that starts
    with `bos_id` (unless it is the branch of an `... if <add_bos> else ...`), or the old heuristic
    `bos_id is (not) None` ("the tokenizer has a BOS, so add it")."""
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.IfExp) and _mentions(node.test, "add_bos"):
            guarded |= {id(node.body), id(node.orelse)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and any(k.arg == "bos" for k in node.keywords):
            found.append((node.lineno, "passes bos= to a call"))
        elif isinstance(node, ast.List) and node.elts and _is_bos_id(node.elts[0]) and id(node) not in guarded:
            found.append((node.lineno, "builds a list starting with bos_id"))
        elif isinstance(node, ast.Compare) and any(map(_is_bos_id, [node.left, *node.comparators])):
            if any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators):
                found.append((node.lineno, "tests bos_id against None"))
    return found


def test_bos_decisions_are_found():
    """The check below finds each way a caller used to decide BOS, and lets the add_bos form pass."""
    source = (
        "ids = tok.encode(text, bos=True)\n"
        "body = [tok.bos_id, *head]\n"
        "n = 1 if tokenizer.bos_id is not None else 0\n"
        "ok = [tok.bos_id] if tok.add_bos else []\n"
    )
    assert [line for line, _ in bos_decisions(ast.parse(source))] == [1, 2, 3]


def test_only_the_tokenizer_decides_bos():
    """No file under src/ or benchmarks/ but tokenizer.py decides BOS: prompts go through
    encode_prompt, and a BOS placed by hand (training documents) follows add_bos."""
    files = sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    assert OWNER in files and len(files) > 50
    found = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in files
        if path != OWNER
        for line, what in bos_decisions(ast.parse(path.read_text(), str(path)))
    ]
    assert not found, "\n".join(found)
