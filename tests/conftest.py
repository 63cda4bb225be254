"""Test-wide setup: 8 fake CPU devices (must happen before JAX initialises) and f32 matmuls."""

import getpass
import os
import tempfile

# The two LLVM flags cut the suite's CPU time by about a quarter: the tests are dominated by XLA
# compiles of tiny programs, whose run time the LLVM optimisation passes barely change. They change
# no semantics (HLO passes still run); benchmarks and `nested-jax aot` never read this file.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_llvm_disable_expensive_passes=true",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the session, its xdist workers and the training runs the
# tests start as subprocesses (they inherit the environment): the same tiny train steps and layers
# compile in many places, and a cache hit skips XLA (keyed by the program, the flags above and the
# jax version, so a stale entry is never a wrong one). Programs under 0.2 s are not worth a write.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"nested-jax-test-xla-cache-{getpass.getuser()}"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))  # LRU-evicted beyond 2 GiB

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import gc  # noqa: E402

import pytest  # noqa: E402

# vm.max_map_count is 65 530 by default: XLA:CPU maps every compiled kernel's code and data as
# separate anonymous regions and keeps them while the program is cached, and a process that reaches
# the limit dies inside backend_compile_and_load (measured: `-m slow tests/pallas_kernels/
# test_pallas_wiring.py` in one process climbed to 65 279 mappings after 70 tests and aborted
# there, as the CI worker that segfaulted in the same call after ~800 tests had). Dropping the
# compiled programs returns the mappings; the checks below keep every worker far from the limit.
_MAPPINGS_HIGH = 20_000


def _mappings() -> int:
    """This process's memory mappings (0 where /proc is absent)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _release() -> None:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _bound_mappings():
    """After a test that leaves more than ``_MAPPINGS_HIGH`` mappings, drop the compiled programs
    (a module of many compile-heavy tests would otherwise reach the kernel's limit)."""
    yield
    if _mappings() > _MAPPINGS_HIGH:
        _release()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop JAX's compiled programs.

    A worker that keeps every program of its ~600 tests alive grows without bound (mappings, see
    above; the default suite's peak worker RSS was 6.9 GB). Cleared per module: peak 2.6 GB RSS,
    and the suite is no slower (programs are rarely shared across modules).
    """
    yield
    _release()
