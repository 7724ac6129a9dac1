"""Safetensors directory I/O shared by the native and HF layouts (docs/checkpoints.md).

A model directory holds `config.json` and either `model.safetensors` or, above a size threshold,
shards `model-0000k-of-0000n.safetensors` listed by `model.safetensors.index.json` (the same index
format as Hugging Face: {"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}).

NOTE: weights are only ever read with safetensors. Pickle files (pytorch_model.bin, *.pt) are
refused by name and never unpickled: torch.load on an untrusted file runs arbitrary code.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gptoss_lite.validation import check_int

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3  # 2 GiB per shard, like HF's default "2GB"-ish shards
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _is_checkpoint_file(name: str) -> bool:
    """Files a save owns: replaced as a set so stale shards never mix with new ones."""
    return name in (CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME) or (
        name.startswith("model-") and name.endswith(".safetensors")
    )


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object from `path`; a missing file or bad JSON is a ValueError naming the file."""
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model directory on CPU, each exactly once (single file or sharded index)."""
    index, single = directory / INDEX_NAME, directory / WEIGHTS_NAME
    if index.is_file() and single.is_file():
        raise ValueError(
            f"{directory}: holds both {WEIGHTS_NAME} and {INDEX_NAME}; "
            "remove the stale one so the weights are unambiguous"
        )
    if single.is_file():
        return _load_safetensors(single)
    if not index.is_file():
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(
                f"{directory}: weights {pickles} are pickle files, which are never loaded "
                f"(unpickling runs arbitrary code); convert them to {WEIGHTS_NAME}"
            )
        raise ValueError(f"{directory}: no {WEIGHTS_NAME} or {INDEX_NAME}")
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
    out: dict[str, torch.Tensor] = {}
    for fname in sorted(set(weight_map.values())):
        if Path(fname).name != fname:
            raise ValueError(f"{index}: shard {fname!r} must be a file name inside {directory}")
        shard = directory / fname
        if not shard.is_file():
            raise ValueError(f"{index}: shard {fname} is missing")
        tensors = _load_safetensors(shard)
        listed = {k for k, v in weight_map.items() if v == fname}
        if set(tensors) != listed:
            extra, missing = sorted(set(tensors) - listed), sorted(listed - set(tensors))
            raise ValueError(
                f"{shard}: tensors disagree with {INDEX_NAME}: "
                f"in the file but not the index {extra}, in the index but not the file {missing}"
            )
        out.update(tensors)
    return out


def _shard(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in key order; a tensor bigger than the limit gets a shard of its own."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def write_checkpoint_dir(
    directory: str | Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Atomically (re)write `directory` with config.json and safetensors weights.

    Everything is written into a temporary directory beside the target, which is then renamed into
    place, so a crash never leaves a half-written checkpoint. Files in an existing target that are
    not checkpoint files (e.g. tokenizer.json, training state) are carried over; old weight files
    are replaced as a set.
    """
    max_shard_bytes = check_int("max_shard_bytes", max_shard_bytes, minimum=1)
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target}: exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        shards = _shard(tensors, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        else:
            n = len(shards)
            weight_map = {}
            for i, shard in enumerate(shards, start=1):
                fname = f"model-{i:05d}-of-{n:05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX_NAME).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2))
        _swap_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _swap_into_place(tmp: Path, target: Path) -> None:
    """Rename tmp to target; an existing target is moved aside first and its extra files kept."""
    if not target.exists():
        os.rename(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    old.rmdir()
    os.rename(target, old)
    try:
        for entry in old.iterdir():
            if not _is_checkpoint_file(entry.name):
                os.rename(entry, tmp / entry.name)
        os.rename(tmp, target)
    except BaseException:
        # Put the previous checkpoint back exactly as it was.
        for entry in list(tmp.iterdir()):
            if not _is_checkpoint_file(entry.name):
                os.rename(entry, old / entry.name)
        if not target.exists():
            os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
