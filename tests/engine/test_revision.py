"""The engine's weights revision (the prefix cache's key) comes from the checkpoint's identity, not from
a pass over the tensors: a directory's files (name, size, modification time), a preset's name, or for a
model handed over as an object its parameters' storage and version counters."""

import os
import warnings

import pytest
import torch

from gptoss_lite.checkpoint import load_model, save_model
from gptoss_lite.engine import LLM, sources


@pytest.fixture
def checkpoint(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "preset with RANDOM weights"
        save_model(load_model("lite-tiny"), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_a_directory_is_named_by_its_files_without_reading_a_tensor(checkpoint, monkeypatch):
    def no_pass(model):
        raise AssertionError("the weights were read to name the checkpoint")

    monkeypatch.setattr(sources, "weights_revision", no_pass)
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


def test_an_object_is_named_without_reading_a_tensor(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model("lite-tiny")

    def no_read(*args, **kwargs):
        raise AssertionError("the revision read a tensor")

    monkeypatch.setattr(torch, "sum", no_read)
    monkeypatch.setattr(torch.Tensor, "sum", no_read)
    monkeypatch.setattr(torch.Tensor, "tolist", no_read)
    revision = sources.weights_revision(model)
    assert sources.weights_revision(model) == revision
    monkeypatch.undo()
    with torch.no_grad():
        model.blocks[1].moe.router.weight.mul_(1.0)  # in place, even to the same values: a new version
    assert sources.weights_revision(model) != revision
