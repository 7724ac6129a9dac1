"""Argument checks shared by the pure-Python modules (no torch): one wording for every caller mistake."""

from __future__ import annotations

from typing import Any


def check_int(name: str, value: Any, minimum: int) -> int:
    """An int >= minimum; booleans are rejected (True is not a size)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r}: must be an int (not bool or float)")
    if value < minimum:
        raise ValueError(f"{name}={value}: must be >= {minimum}")
    return value
