"""Long-context evaluations: passkey retrieval by context length and depth (docs/passkey.md) and a
RULER-style suite by task x length x haystack (docs/ruler.md)."""

from gptoss_lite.evals.passkey import (
    DEFAULT_DEPTHS,
    DEFAULT_LENGTHS,
    PasskeyEvaluator,
    PasskeyResult,
    build_passkey_prompt,
    extract_passkey,
    passkey_keys,
)
from gptoss_lite.evals.ruler import RulerEvaluator, RulerResult, RulerSuite

__all__ = [
    "PasskeyEvaluator",
    "PasskeyResult",
    "build_passkey_prompt",
    "extract_passkey",
    "passkey_keys",
    "DEFAULT_LENGTHS",
    "DEFAULT_DEPTHS",
    "RulerEvaluator",
    "RulerResult",
    "RulerSuite",
]
