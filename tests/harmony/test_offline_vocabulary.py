"""openai-harmony's loader is Rust: it would download past the Python socket guard of conftest. So the
vocabulary is loaded here in a process with no network at all (a fresh network namespace, loopback
down), from an empty cache: it must come from the checkpoint's tokenizer.json alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from harmony_fixture import tokenizer_json

from gptoss_lite.harmony.vocabulary import (
    O200K_BASE_SHA256,
    HarmonyUnavailable,
    load_encoding,
    tiktoken_ranks,
)


def _no_network_available() -> bool:
    unshare = shutil.which("unshare")
    return unshare is None or subprocess.run([unshare, "-n", "true"], capture_output=True).returncode != 0


@pytest.mark.skipif(_no_network_available(), reason="needs unshare -n (a network namespace) to cut the network")
def test_the_vocabulary_loads_with_no_network_and_an_empty_cache(tmp_path):
    script = textwrap.dedent(
        f"""
        import os
        assert not os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        from gptoss_lite.harmony.vocabulary import load_encoding
        enc = load_encoding({str(tokenizer_json())!r})
        print(enc.name, enc.encode("hello world"), sorted(os.listdir({str(tmp_path / "cache")!r})))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TIKTOKEN_ENCODINGS_BASE", "TIKTOKEN_RS_CACHE_DIR")}
    env.update(GPTOSS_LITE_HARMONY_DIR=str(tmp_path / "cache"), TIKTOKEN_RS_CACHE_DIR=str(tmp_path / "rs-cache"))
    done = subprocess.run(["unshare", "-n", sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("[", 1)[0].strip() == "HarmonyGptOss"
    assert "o200k_base.tiktoken" in done.stdout
    assert not (tmp_path / "rs-cache").exists()  # openai-harmony's download cache was never touched


def test_the_ranks_are_o200k_base():
    import hashlib
    import json

    ranks = tiktoken_ranks(json.loads(tokenizer_json().read_text()))
    assert hashlib.sha256(ranks).hexdigest() == O200K_BASE_SHA256


def test_a_different_vocabulary_is_refused_with_its_reason(tmp_path):
    import json

    data = json.loads(tokenizer_json().read_text())
    vocab = data["model"]["vocab"]
    a, b = next(k for k, v in vocab.items() if v == 1000), next(k for k, v in vocab.items() if v == 1001)
    vocab[a], vocab[b] = 1001, 1000  # two ranks swapped: the same tokens, another vocabulary
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(HarmonyUnavailable, match="not o200k_base"):
        load_encoding(tmp_path / "tokenizer.json")
    (tmp_path / "other").mkdir()
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<|channel|>"]
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(HarmonyUnavailable, match="no harmony control tokens"):
        load_encoding(tmp_path / "other")
