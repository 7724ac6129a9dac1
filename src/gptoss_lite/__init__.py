"""GPT-OSS-Lite: a small, honest, fast inference stack for gpt-oss-style long-context models.

Torch-backed names (`GPTOSS`, `load_model`, `save_model`, `generate`) are imported on first use so
that pure-Python parts (`gptoss_lite.plan`, `gptoss-lite plan`) never load torch.
"""

from importlib import import_module

from gptoss_lite.config import PRESETS, ModelConfig, count_active_parameters, count_parameters, get_preset

__version__ = "0.1.0"

_LAZY = {
    "GPTOSS": "gptoss_lite.model",
    "load_model": "gptoss_lite.checkpoint",
    "save_model": "gptoss_lite.checkpoint",
    "generate": "gptoss_lite.generation",
    "stream_generate": "gptoss_lite.generation",
    "generate_reference": "gptoss_lite.generation",
    "KVCache": "gptoss_lite.kv.base",
    "MixedKVCache": "gptoss_lite.kv.mixed",
}

__all__ = ["ModelConfig", "PRESETS", "get_preset", "count_parameters", "count_active_parameters", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gptoss_lite' has no attribute {name!r}")
