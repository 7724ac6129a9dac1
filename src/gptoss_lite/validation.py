"""Argument checks shared by the pure-Python modules (no torch): one wording for every caller mistake."""

from __future__ import annotations

import numbers
from typing import Any


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as a plain int, if it is an integer in [minimum, maximum] (either bound optional).

    Any `numbers.Integral` is accepted (numpy integers included); booleans are rejected (True is not
    a size), and so are floats, even whole ones. Errors name the argument, its value and the limit:
    TypeError for the wrong type, ValueError for a value out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r}: must be an int (not {type(value).__name__})")
    value = int(value)
    low = minimum is not None and value < minimum
    high = maximum is not None and value > maximum
    if (low or high) and minimum is not None and maximum is not None:
        raise ValueError(f"{name}={value}: must be in [{minimum}, {maximum}]")
    if low:
        raise ValueError(f"{name}={value}: must be >= {minimum}")
    if high:
        raise ValueError(f"{name}={value}: must be <= {maximum}")
    return value
