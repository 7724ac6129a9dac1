"""The engine's weights revision (the prefix cache's key) comes from the checkpoint's identity, not from
a pass over the tensors: a directory's files (name, size, modification time), or a preset's name. Only
a model handed over as an object is checksummed."""

import os
import warnings

import pytest
import torch

from gptoss_lite.checkpoint import load_model, save_model
from gptoss_lite.engine import LLM
from gptoss_lite.engine import llm as llm_module


@pytest.fixture
def checkpoint(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "preset with RANDOM weights"
        save_model(load_model("lite-tiny"), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_a_directory_is_named_by_its_files_without_reading_a_tensor(checkpoint, monkeypatch):
    def no_pass(model):
        raise AssertionError("the weights were read to name the checkpoint")

    monkeypatch.setattr(llm_module, "_weights_revision", no_pass)
    first = LLM(str(checkpoint), kv_blocks=64).kv.revision
    assert LLM(str(checkpoint), kv_blocks=64).kv.revision == first  # the same files: the same revision
    weights = next(p for p in checkpoint.iterdir() if p.suffix == ".safetensors")
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a rewritten checkpoint
    assert LLM(str(checkpoint), kv_blocks=64).kv.revision != first
    assert LLM(str(checkpoint), kv_blocks=64, dtype=torch.bfloat16).kv.revision != first


def test_presets_are_named_by_name_and_objects_by_their_weights():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny = LLM("lite-tiny", kv_blocks=64).kv.revision
        assert LLM("lite-tiny", kv_blocks=64).kv.revision == tiny
        assert LLM("gpt-oss-tiny", kv_blocks=64).kv.revision != tiny
        model = load_model("lite-tiny")
    before = LLM(model, kv_blocks=64).kv.revision
    with torch.no_grad():
        model.blocks[0].attn.sinks.add_(1.0)
    assert LLM(model, kv_blocks=64).kv.revision != before
    assert LLM(model, kv_blocks=64, revision="v2").kv.revision == "v2"
