"""Multi-process JAX start-up from environment variables (before any JAX computation).

- ``NESTED_JAX_COORDINATOR=host:port``, ``NESTED_JAX_NUM_PROCESSES=N``, ``NESTED_JAX_PROCESS_ID=i``:
  explicit start (e.g. N processes on one machine or a cluster without auto-detection). On CPU the
  cross-process collectives use gloo.
- ``NESTED_JAX_DISTRIBUTED=auto``: ``jax.distributed.initialize()`` with JAX's own cluster
  auto-detection (TPU pod slices, SLURM, ...).
- neither: a single process; nothing to do.
"""

from __future__ import annotations

import os

import jax

_initialized = False


def maybe_initialize() -> bool:
    """Initialises ``jax.distributed`` when the environment asks for it; True when it did.

    Raises:
      ValueError: naming the environment variable that is missing or not an integer.
    """
    global _initialized
    if _initialized:
        return True
    coordinator = os.environ.get("NESTED_JAX_COORDINATOR", "")
    if coordinator:
        values = {}
        for name in ("NESTED_JAX_NUM_PROCESSES", "NESTED_JAX_PROCESS_ID"):
            raw = os.environ.get(name, "")
            if not raw.isdigit():
                raise ValueError(
                    f"{name}: expected an integer with NESTED_JAX_COORDINATOR, got {raw!r}"
                )
            values[name] = int(raw)
        if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=values["NESTED_JAX_NUM_PROCESSES"],
            process_id=values["NESTED_JAX_PROCESS_ID"],
        )
    elif os.environ.get("NESTED_JAX_DISTRIBUTED", "") == "auto":
        jax.distributed.initialize()
    else:
        return False
    _initialized = True
    return True


def say(msg: str) -> None:
    """Prints `msg` (flushed) on process 0 only: one copy of each status line per run."""
    if jax.process_index() == 0:
        print(msg, flush=True)
