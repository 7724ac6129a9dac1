"""The real gpt-oss tokenizer, built offline, and a random-weight gpt-oss-tiny checkpoint that uses it.

The route (test and dev extras only, never the runtime path):
1. quicktok-v1 ships the o200k vocabulary; re-serialised as `base64(token) rank` lines it is tiktoken's
   `o200k_base.tiktoken`, which must hash to the value openai-harmony checks;
2. transformers' TikTokenConverter turns those ranks, the o200k split pattern and the harmony special
   tokens (ids 199,998..201,087) into a `tokenizer.json`.

Both are built once per machine under ~/.cache/gptoss-lite/test-o200k (about 40 s) and reused.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import os
import shutil
import tempfile
from collections import deque
from pathlib import Path

import pytest
import torch

from gptoss_lite.engine import LLM, PreparedRequest
from gptoss_lite.harmony.vocabulary import O200K_BASE_SHA256, O200K_BASE_SIZE

# The o200k split pattern, as the released gpt-oss tokenizer.json spells it.
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
VOCAB_SIZE = 201_088
NAMED_SPECIALS = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}


def cache_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "gptoss-lite" / "test-o200k"


def o200k_ranks() -> bytes:
    """o200k_base.tiktoken from quicktok-v1's bundled vocabulary (checked against harmony's hash)."""
    quicktok = pytest.importorskip("quicktok", reason="the offline o200k vocabulary comes from quicktok-v1")
    enc = quicktok.get_encoding("o200k_base")
    lines = [base64.b64encode(enc.decode_single_token_bytes(rank)) + b" %d\n" % rank for rank in range(O200K_BASE_SIZE)]
    data = b"".join(lines)
    digest = hashlib.sha256(data).hexdigest()
    assert digest == O200K_BASE_SHA256, f"quicktok's o200k vocabulary hashes to {digest}, not o200k_base"
    return data


def _specials() -> list[str]:
    return [NAMED_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(O200K_BASE_SIZE, VOCAB_SIZE)]


def build_tokenizer_json(target: Path) -> Path:
    """Write the o200k_harmony tokenizer.json to `target` (a file path)."""
    converters = pytest.importorskip("transformers.convert_slow_tokenizer", reason="needs transformers")
    data = o200k_ranks()

    class Converter(converters.TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:  # the ranks in hand, not a download
            return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in data.splitlines())}

    tok = Converter(vocab_file="o200k_base.tiktoken", pattern=O200K_PATTERN, extra_special_tokens=_specials())
    tokenizer = tok.converted()
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert tokenizer.token_to_id("<|channel|>") == 200005
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tokenizer-")
    os.close(fd)
    tokenizer.save(tmp)
    os.replace(tmp, target)
    return target


def tokenizer_json() -> Path:
    """The cached o200k_harmony tokenizer.json (built on first use)."""
    target = cache_root() / "tokenizer.json"
    if not target.is_file():
        build_tokenizer_json(target)
    return target


def write_gptoss_tiny(directory: Path, seed: int = 0) -> Path:
    """A random-weight gpt-oss-tiny with the real vocabulary (201,088 ids), in the released HF layout,
    with the o200k_harmony tokenizer.json beside it."""
    from conftest import make_model
    from gptoss_lite.checkpoint import save_hf

    model = make_model("gpt-oss-tiny", seed=seed, vocab_size=VOCAB_SIZE, d_model=32, n_heads=2, n_kv_heads=1)
    save_hf(model, directory)
    shutil.copyfile(tokenizer_json(), directory / "tokenizer.json")
    return directory


def gptoss_tiny_dir() -> Path:
    """The cached harmony test checkpoint (built on first use)."""
    target = cache_root() / "gpt-oss-tiny-harmony"
    if not (target / "tokenizer.json").is_file():
        cache_root().mkdir(parents=True, exist_ok=True)  # a fresh machine has no cache folder yet
        tmp = Path(tempfile.mkdtemp(dir=cache_root(), prefix=".tiny-"))
        write_gptoss_tiny(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    return target


def forced_tokens(tokens: list[int], then=None):
    """A logits processor that makes a request emit `tokens` in order, then hands over to `then` (the
    request's own processor, if any): the scripted streams the parse tests drive through the real
    engine, and the scripted prefixes of the structured-output tests."""

    def processor(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        step = len(output_ids)
        if step >= len(tokens):
            return logits if then is None else then(output_ids, logits)
        forced = torch.full_like(logits, float("-inf"))
        forced[..., tokens[step]] = 0.0
        return forced

    return processor


class ScriptedLLM(LLM):
    """The real engine, whose next requests emit scripted token streams (`script(tokens)` queues one):
    each added request takes the oldest script as its logits processor; without one it runs freely.
    `prompts` records every added request's prompt token ids, in order (what the server rendered)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scripts: deque[list[int]] = deque()
        self.prompts: list[list[int]] = []

    def script(self, *streams: list[int]) -> None:
        self.scripts.extend(list(s) for s in streams)

    def add_request(self, prompt, sampling=None, **kwargs):
        self.prompts.append(list(prompt.token_ids if isinstance(prompt, PreparedRequest) else prompt))
        if self.scripts:
            if not isinstance(prompt, PreparedRequest):  # the server prepares; tests may not
                prompt = self.prepare(prompt, sampling)
            script = forced_tokens(self.scripts.popleft(), then=prompt.sampling.logits_processor)
            prompt = PreparedRequest(prompt.token_ids, dataclasses.replace(prompt.sampling, logits_processor=script))
            sampling = None
        return super().add_request(prompt, sampling, **kwargs)


@contextlib.contextmanager
def harmony_server(max_running: int = 8, **app_kwargs):
    """(the ScriptedLLM, the app's ServerState, the live server) on the harmony test model."""
    from gptoss_lite.server import create_app
    from gptoss_lite.server.background import BackgroundServer

    llm = ScriptedLLM(str(gptoss_tiny_dir()), max_model_len=4096, max_running=max_running)
    app = create_app(llm, **app_kwargs)
    with BackgroundServer(app) as live:
        yield llm, app.state.server, live


def tokens_of(encoding, text: str) -> list[int]:
    """Token ids of text with harmony control tokens spelt inline (`<|channel|>analysis<|message|>…`)."""
    return encoding.encode(text, allowed_special="all")


__all__ = [
    "ScriptedLLM",
    "harmony_server",
    "build_tokenizer_json",
    "tokenizer_json",
    "gptoss_tiny_dir",
    "forced_tokens",
    "tokens_of",
]


if __name__ == "__main__":  # python tests/harmony/harmony_fixture.py DIR: the harmony test model, to try by hand
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' conftest (make_model)
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/harmony/harmony_fixture.py DIR")
    out = write_gptoss_tiny(Path(sys.argv[1]))
    print(f"wrote a random-weight gpt-oss-tiny with the o200k_harmony tokenizer to {out}")


# A weather conversation the /v1/responses tests script: the tool, a call to it with its chain of
# thought, and an answer (text in harmony, turned into tokens by `tokens_of`).
WEATHER_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
WEATHER_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)
WEATHER_ANSWER = (
    "<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
)
