"""Long-context evaluations: passkey retrieval by context length and depth (docs/passkey.md)."""

from gptoss_lite.evals.passkey import (
    DEFAULT_DEPTHS,
    DEFAULT_LENGTHS,
    PasskeyEvaluator,
    PasskeyResult,
    build_passkey_prompt,
    extract_passkey,
    passkey_keys,
)

__all__ = [
    "PasskeyEvaluator",
    "PasskeyResult",
    "build_passkey_prompt",
    "extract_passkey",
    "passkey_keys",
    "DEFAULT_LENGTHS",
    "DEFAULT_DEPTHS",
]
