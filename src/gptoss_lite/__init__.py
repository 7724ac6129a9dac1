"""GPT-OSS-Lite: a small, honest, fast inference stack for gpt-oss-style long-context models."""

from gptoss_lite.config import PRESETS, ModelConfig, count_active_parameters, count_parameters, get_preset

__version__ = "0.1.0"

__all__ = ["ModelConfig", "PRESETS", "get_preset", "count_parameters", "count_active_parameters",
           "__version__"]
