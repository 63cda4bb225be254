"""One way to take a seed for the generated tasks (``formal_languages``, ``mad``)."""

from __future__ import annotations

import numpy as np


def as_rng(rng_or_seed) -> np.random.Generator:
    """A numpy ``Generator`` from an int seed (a fresh, deterministic stream) or a ``Generator``
    (used as is, so a caller can draw several batches from one stream).

    Raises:
      ValueError: naming ``rng_or_seed`` for anything else (a bool included).
    """
    if isinstance(rng_or_seed, np.random.Generator):
        return rng_or_seed
    if isinstance(rng_or_seed, bool) or not isinstance(rng_or_seed, int | np.integer):
        raise ValueError(
            f"rng_or_seed: expected an int seed or a numpy Generator, got {rng_or_seed!r}"
        )
    return np.random.default_rng(rng_or_seed)
