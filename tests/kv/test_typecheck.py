"""A type checker sees the model<->cache contract: the caches and their callers conform to KVCache."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = [
    "kv/base.py",
    "kv/mixed.py",
    "kv/paged_cache.py",
    "model/attention/__init__.py",
    "model/attention/reference.py",
    "model/attention/plan.py",
    "model/attention/blocks.py",
    "model/attention/decode.py",
    "model/attention/layer.py",
    "engine/paged_batch.py",
    "model/transformer.py",
    "generation.py",
]
BROKEN = """
import torch
from gptoss_lite.kv.base import KVCache

class WrongUpdate(KVCache):
    @property
    def batch_size(self) -> int:
        return 1
    @property
    def num_tokens(self) -> int:
        return 0
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        return k, v, 0

class NoUpdate:
    batch_size = 1
    num_tokens = 0

def run(cache: KVCache) -> None: ...
run(NoUpdate())
"""

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is a dev/test extra")


def _mypy(*paths: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--no-incremental",
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"MYPYPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )


def test_caches_model_and_generation_type_check():
    """mypy finds no error in the protocol, both caches, the attention layer, the model and generate()."""
    out = _mypy(*(ROOT / "src" / "gptoss_lite" / f for f in CONTRACT))
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_cache_that_breaks_the_protocol_is_caught(tmp_path):
    """A subclass with the wrong update() signature, or a class without update(), fails the check."""
    bad = tmp_path / "bad_cache.py"
    bad.write_text(BROKEN)
    out = _mypy(bad)
    assert out.returncode == 1
    assert re.search(
        r'bad_cache.py:\d+: error: Signature of "update" incompatible with supertype "[\w.]*KVCache"', out.stdout
    ), out.stdout
    assert re.search(r'"NoUpdate" is missing following "[\w.]*KVCache" protocol member', out.stdout), out.stdout
