"""Native checkpoints: save_model / load_model, strict validation, the default demo model (docs/checkpoints.md).

Native layout: `config.json` = {"format_version": 1, "model": ModelConfig.to_dict(), ...extras} and
safetensors weights named exactly as `GPTOSS.state_dict()` (a tied head is stored once, as
`embed.weight`).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gptoss_lite.checkpoint.hf import config_from_hf, load_hf_state_dict
from gptoss_lite.checkpoint.io import (
    CONFIG_NAME,
    DEFAULT_MAX_SHARD_BYTES,
    read_json,
    read_tensors,
    write_checkpoint_dir,
)
from gptoss_lite.checkpoint.state_dict import check_state_dict
from gptoss_lite.config import CONFIG_FORMAT_VERSION, PRESETS, ModelConfig
from gptoss_lite.fixtures import FIXTURES, resolve_config, valid_names
from gptoss_lite.model import GPTOSS, RotaryEmbedding
from gptoss_lite.model.moe import MXFP4Experts

# Where the trained demo model lives once it has been trained and copied in (package data).
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo"
# Config used when the demo model is not there (a test fixture; random weights, announced on stderr).
FALLBACK_PRESET = "lite-tiny"
_RESERVED_KEYS = ("format_version", "model")


def default_model_source() -> Path | str:
    """The demo model directory if it holds a config.json, else the test fixture name "lite-tiny".

    In the second case a one-line notice goes to stderr: the model will have random weights.
    """
    if (DEFAULT_MODEL / CONFIG_NAME).is_file():
        return DEFAULT_MODEL
    print(
        f"gptoss-lite: no trained demo model at {DEFAULT_MODEL}; using test config {FALLBACK_PRESET!r} "
        "with RANDOM weights",
        file=sys.stderr,
    )
    return FALLBACK_PRESET


def save_model(
    model: GPTOSS,
    directory: str | Path,
    extra_config: Mapping[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write `model` to `directory` in the native layout, atomically; returns the directory.

    extra_config: extra top-level config.json keys (e.g. {"tokenizer": "byte"}); "format_version"
    and "model" are reserved. Weights above `max_shard_bytes` are sharded with an index json.
    The model is not modified.
    """
    if not isinstance(model, GPTOSS):
        raise TypeError(f"save_model: expected a GPTOSS model, got {type(model).__name__}")
    extra = dict(extra_config or {})
    clash = [k for k in _RESERVED_KEYS if k in extra]
    if clash:
        raise ValueError(f"extra_config keys {clash} are reserved for the native config layout")
    config = {"format_version": CONFIG_FORMAT_VERSION, "model": model.config.to_dict(), **extra}
    return write_checkpoint_dir(directory, config, dict(model.state_dict()), max_shard_bytes)


def read_native_config(directory: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, the whole config.json dict) of a native checkpoint directory."""
    path = Path(directory) / CONFIG_NAME
    data = read_json(path)
    version = data.get("format_version")
    if version != CONFIG_FORMAT_VERSION:
        raise ValueError(f"{path}: format_version={version!r}; this version reads {CONFIG_FORMAT_VERSION}")
    if not isinstance(data.get("model"), dict):
        raise ValueError(f"{path}: missing the 'model' section (a dict of ModelConfig fields)")
    try:
        cfg = ModelConfig.from_dict(data["model"])
    except (TypeError, ValueError) as e:
        raise type(e)(f"{path}: bad model config: {e}") from e
    return cfg, data


def _resolve_dtype(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype={dtype!r}: must be a floating torch.dtype")
        return dtype
    stored = {t.dtype for t in state.values() if t.is_floating_point()}  # not the uint8 MXFP4 codes
    return stored.pop() if len(stored) == 1 else torch.float32


def model_from_state_dict(
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    source: str,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> GPTOSS:
    """A fresh GPTOSS holding `state` (native names), validated strictly before use, and prepared for
    inference (`GPTOSS.prepare_for_inference`: eval mode, decode-packed weights).

    dtype None keeps the stored dtype when all tensors share one, else float32.
    """
    with torch.device("meta"):
        model = GPTOSS(cfg)  # no memory, no random init: every parameter comes from `state`
        if any(k.endswith("experts.gate_up_blocks") for k in state):
            model.use_mxfp4_experts()
    expected = model.state_dict()
    codes = [k for k, v in expected.items() if v.dtype == torch.uint8]
    check_state_dict({k: tuple(v.shape) for k, v in expected.items()}, state, source, codes)
    dtype = _resolve_dtype(state, dtype)
    device = torch.device(device) if device is not None else torch.device("cpu")
    # Tensors already in the asked device and dtype are taken as they are (memory-mapped from the file).
    state = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (rotary inverse frequencies) are not in the checkpoint: rebuild them.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = RotaryEmbedding(cfg, pruned_pairs=module.pruned_pairs).inv_freq.to(device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not left, f"tensors left unmaterialised after loading: {left}"
    return model.prepare_for_inference()


MXFP4_MODES = ("auto", "packed", "dequantize")
MXFP4_ACTIVATIONS = MXFP4Experts.ACTIVATIONS


def load_model(
    source: str | Path,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    mxfp4: str = "auto",
    rope_factor: float | None = None,
    mxfp4_activations: str = "exact",
) -> GPTOSS:
    """Load a GPTOSS from a directory or a preset name, prepared for inference (eval mode, on
    `device`, in `dtype`, decode-packed weights: `GPTOSS.prepare_for_inference`).

    - a directory with our config.json ("format_version") -> native layout;
    - a directory with an HF gpt-oss config.json (model_type "gpt_oss") -> HF layout. MXFP4 experts
      stay packed (`mxfp4="packed"`: `MXFP4Experts`, 4.25 bits per weight, read by the kernels in
      `gptoss_lite.kernels.mxfp4`) or are dequantised to the dense dtype (`"dequantize"`); `"auto"`
      packs them on a CPU and dequantises elsewhere. `dtype` applies to the dense weights and biases;
    - a preset or test-fixture name (`fixtures.resolve_config`) -> RANDOM weights seeded by `seed`
      (announced with a warning).
    `rope_factor` overrides the checkpoint's YaRN factor (`ModelConfig.with_rope_factor`): the same
    weights at a longer (or shorter) rotary context. `mxfp4_activations="int8"` opts the packed experts
    into int8-rounded activations (`GPTOSS.set_mxfp4_activations`; changes results). Loading is strict
    (see check_state_dict) and never unpickles.
    """
    if mxfp4 not in MXFP4_MODES:
        raise ValueError(f"mxfp4={mxfp4!r}: must be one of {MXFP4_MODES}")
    if mxfp4_activations not in MXFP4_ACTIVATIONS:
        raise ValueError(f"mxfp4_activations={mxfp4_activations!r}: must be one of {MXFP4_ACTIVATIONS}")
    if mxfp4_activations != "exact" and mxfp4 == "dequantize":
        raise ValueError(f"mxfp4_activations={mxfp4_activations!r} needs packed experts; mxfp4='dequantize' has none")
    if mxfp4 == "auto":
        mxfp4 = "packed" if device is None or torch.device(device).type == "cpu" else "dequantize"
    cfg, layout = read_model_config(source)
    if rope_factor is not None:
        cfg = cfg.with_rope_factor(rope_factor)
    if layout == "preset":
        warnings.warn(
            f"load_model({source!r}): preset with RANDOM weights (seed={seed}), not a trained model", stacklevel=2
        )
        model = GPTOSS(cfg)
        model.reset_parameters(seed)
        model.prepare_for_inference(device, dtype)
    else:
        directory = Path(source)
        state = load_hf_state_dict(directory, cfg, mxfp4) if layout == "hf" else read_tensors(directory)
        model = model_from_state_dict(cfg, state, str(directory), device, dtype)
    return model.set_mxfp4_activations(mxfp4_activations) if mxfp4_activations != "exact" else model


def read_model_config(source: str | Path) -> tuple[ModelConfig, str]:
    """(the ModelConfig `load_model(source)` builds, its layout: "native", "hf" or "preset"), read
    without touching any weight; raises the errors load_model would, naming the file."""
    path = Path(source)
    if path.is_dir():
        config_path = path / CONFIG_NAME
        if not config_path.is_file():
            raise ValueError(f"{path}: no {CONFIG_NAME}; not a model directory")
        data = read_json(config_path)
        if data.get("model_type") == "gpt_oss":
            try:
                return config_from_hf(data), "hf"
            except ValueError as e:
                raise ValueError(f"{config_path}: {e}") from None
        if "format_version" in data:
            return read_native_config(path)[0], "native"
        raise ValueError(
            f"{config_path}: neither a gptoss-lite config (format_version) nor an HF gpt-oss "
            f"config (model_type 'gpt_oss'; got model_type={data.get('model_type')!r})"
        )
    if isinstance(source, str) and (source in PRESETS or source in FIXTURES):
        return resolve_config(source), "preset"
    if path.exists():
        raise ValueError(f"load_model: {path} is a file; pass the model directory that holds {CONFIG_NAME}")
    raise ValueError(f"load_model: {str(source)!r} is neither a model directory nor a preset; {valid_names()}")


# The fields a deliberate change of context may alter between a checkpoint and the model it starts
# (`read_weights_for(..., allow=ROPE_CHANGE_FIELDS)`): the rotary scaling and the lengths it implies. No
# tensor depends on them, so the weights load unchanged and training learns the new positions.
ROPE_CHANGE_FIELDS = frozenset(
    {"rope_factor", "rope_original_context", "max_position_embeddings", "train_context_length"}
)


def read_weights_for(
    model: GPTOSS, directory: str | Path, allow: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """A native checkpoint's tensors, checked against `model` (config, names, shapes, finiteness).

    `allow` names config fields that may differ (ROPE_CHANGE_FIELDS for a change of context); every
    other field must be equal. Nothing is changed; every problem is a ValueError naming the directory
    or file.
    """
    directory = Path(directory)
    cfg, _ = read_native_config(directory)
    ours, theirs = model.config.to_dict(), cfg.to_dict()
    diff = {k: (v, theirs[k]) for k, v in ours.items() if theirs[k] != v and k not in allow}
    if diff:
        raise ValueError(f"{directory}: config differs from the model's (field: (model, checkpoint)): {diff}")
    state = read_tensors(directory)
    check_state_dict({k: tuple(v.shape) for k, v in model.state_dict().items()}, state, str(directory))
    return state


def load_weights_into(model: GPTOSS, directory: str | Path, allow: frozenset[str] = frozenset()) -> GPTOSS:
    """Copy a native checkpoint's weights into an existing model (e.g. to resume training).

    Everything is validated first (config equal to model.config but for the fields in `allow`, names,
    shapes, finiteness); on any error the model is left exactly as it was.
    """
    state = read_weights_for(model, directory, allow)
    with torch.no_grad():
        for name, target in model.state_dict().items():
            target.copy_(state[name])
    return model
