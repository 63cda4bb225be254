"""Argument checks shared by the public functions (one place, one message per kind of mistake)."""

from __future__ import annotations

import numpy as np

__all__ = ["check_positive_int", "require_initial_state"]


def check_positive_int(name: str, value) -> int:
    """``int(value)`` when `value` is a positive integer (Python or numpy; not a bool).

    Raises:
      ValueError: ``"<name> must be a positive int, got <value>"``.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def require_initial_state(fn: str, initial_state, constructor: str):
    """``initial_state`` when it is given; memories whose start is learned have no zero state.

    The sequence forms of the MLP memories (Titans ``L_M ≥ 1`` weights, Hope's memories) take
    ``initial_state=`` as a keyword like every rule (SPEC §0), but its default ``None`` cannot mean
    "zeros": the initial weights are outer parameters. This turns the missing argument into a
    message that names the constructor.

    Raises:
      ValueError: ``"<fn>: initial_state: required ... pass initial_state=<constructor>"``.
    """
    if initial_state is None:
        raise ValueError(
            f"{fn}: initial_state: required (this memory has no zero state: its initial weights "
            f"are learned); pass initial_state={constructor}"
        )
    return initial_state
