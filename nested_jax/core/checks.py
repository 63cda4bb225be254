"""Argument checks shared by the public functions (one place, one message per kind of mistake)."""

from __future__ import annotations

import numpy as np

__all__ = ["check_positive_int"]


def check_positive_int(name: str, value) -> int:
    """``int(value)`` when `value` is a positive integer (Python or numpy; not a bool).

    Raises:
      ValueError: ``"<name> must be a positive int, got <value>"``.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)
