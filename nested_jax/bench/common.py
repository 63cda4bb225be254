"""Helpers every benchmark reuses (docs/status.md "Benchmarks and comparisons").

Benchmarks report ratios measured in one process (A vs B interleaved, median of ≥ 5 after warm-up)
plus an in-run normaliser (the measured f32 matmul GFLOP/s), never a bare absolute time as a claim.

Pattern for a benchmark module ``nested_jax/bench/<name>.py``::

    def main(argv):
        args = make_parser("<name>", "what it measures").parse_args(argv)
        gf = matmul_gflops()
        t = time_interleaved({"a": fa, "b": fb}, repeats=args.repeats)
        results = {"matmul_gflops": gf, "a_over_b": t["b"] / t["a"]}
        emit(results, args.json)  # with --json the LAST stdout line is one JSON object
        return 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from nested_jax.files import strict_json

__all__ = [
    "make_parser",
    "progress",
    "matmul_gflops",
    "time_interleaved",
    "temp_bytes",
    "rel_err",
    "emit",
]


def make_parser(name: str, description: str) -> argparse.ArgumentParser:
    """An ``argparse`` parser for ``nested-jax bench <name>`` with the shared ``--json`` and
    ``--repeats`` options (its usage line names the command a user types)."""
    p = argparse.ArgumentParser(prog=f"nested-jax bench {name}", description=description)
    p.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line of stdout"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per function (>= 5)")
    return p


def progress(msg: str) -> None:
    """One progress line (stdout, flushed) so long benchmarks show where they are."""
    print(msg, flush=True)


def _block(x):
    return jax.block_until_ready(x)


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Measured f32 ``n×n @ n×n`` throughput in GFLOP/s (median of ``repeats``): the normaliser."""
    key = jax.random.PRNGKey(0)
    a = jax.random.normal(key, (n, n), jnp.float32)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    _block(f(a, b))
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        _block(f(a, b))
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / statistics.median(times) / 1e9


def time_interleaved(
    fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1
) -> dict[str, float]:
    """Median wall time in seconds of each zero-argument callable, measured A/B interleaved.

    Every round runs each function once (in dict order), so slow drifts of the machine load hit
    all of them alike. Each call's result is blocked on before the clock stops.

    Args:
      fns: name → callable returning JAX arrays (e.g. a jitted function with bound arguments).
      repeats: timed rounds (≥ 1; benchmarks use ≥ 5).
      warmup: untimed rounds first (compilation, caches).

    Returns:
      name → median seconds.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        for f in fns.values():
            _block(f())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            _block(f())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def rel_err(a, b) -> float:
    """``max|a − b| / max|b|`` in float64 (the agreement benchmarks print beside their timings)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def max_err(a, b) -> float:
    """The largest :func:`rel_err` over the matching leaves of two pytrees (``b`` the reference)."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(rel_err(x, y) for x, y in pairs)


def temp_bytes(jitted_fn, *args, **kwargs) -> int:
    """Peak temporary buffer bytes of ``jitted_fn(*args)`` as compiled by XLA.

    ``jitted_fn`` may also be an already compiled executable (``jax.jit(f).lower(...).compile()``),
    so a benchmark can time and measure the same compilation.

    ``jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes`` (arguments and
    outputs are not counted).
    """
    if hasattr(jitted_fn, "memory_analysis"):  # already a compiled executable
        return int(jitted_fn.memory_analysis().temp_size_in_bytes)
    if not hasattr(jitted_fn, "lower"):
        jitted_fn = jax.jit(jitted_fn)
    analysis = jitted_fn.lower(*args, **kwargs).compile().memory_analysis()
    return int(analysis.temp_size_in_bytes)


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    return x


def emit(results: dict, as_json: bool, file=None) -> None:
    """Print ``results`` as aligned ``key  value`` lines, or as one JSON line (last line)."""
    file = sys.stdout if file is None else file
    if as_json:
        print(strict_json(results), file=file, flush=True)  # NaN -> null: valid JSON
        return
    width = max((len(k) for k in results), default=0)
    for k, v in results.items():
        v = _jsonable(v)
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        print(f"{k:<{width}}  {text}", file=file, flush=True)
