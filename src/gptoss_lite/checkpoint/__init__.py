"""Checkpoints: safetensors only, native and Hugging Face gpt-oss layouts, MXFP4 (docs/checkpoints.md).

native.py  save_model / load_model / default_model_source, strict validation
hf.py      GptOssForCausalLM layout: config mapping, key mapping, save_hf
io.py      safetensors directory reading/writing (sharding, atomic replace)
state_dict.py  check_state_dict: the strict names/shapes/finiteness check both readers run
"""

from gptoss_lite.checkpoint.hf import (
    config_from_hf,
    config_to_hf,
    hf_to_native,
    load_hf_state_dict,
    native_to_hf,
    save_hf,
)
from gptoss_lite.checkpoint.io import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, read_tensors
from gptoss_lite.checkpoint.native import (
    DEFAULT_MODEL,
    FALLBACK_PRESET,
    default_model_source,
    load_model,
    load_weights_into,
    model_from_state_dict,
    read_native_config,
    save_model,
)
from gptoss_lite.checkpoint.state_dict import check_state_dict
from gptoss_lite.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4

__all__ = [
    "save_model",
    "load_model",
    "load_weights_into",
    "default_model_source",
    "DEFAULT_MODEL",
    "FALLBACK_PRESET",
    "check_state_dict",
    "model_from_state_dict",
    "read_native_config",
    "read_tensors",
    "config_from_hf",
    "config_to_hf",
    "load_hf_state_dict",
    "save_hf",
    "hf_to_native",
    "native_to_hf",
    "dequantize_mxfp4",
    "quantize_mxfp4",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "INDEX_NAME",
]
