"""Test-wide setup: 8 fake CPU devices (must happen before JAX initialises) and f32 matmuls."""

import os

# The two LLVM flags cut the suite's CPU time by about a quarter: the tests are dominated by XLA
# compiles of tiny programs, whose run time the LLVM optimisation passes barely change. They change
# no semantics (HLO passes still run); benchmarks and `nested-jax aot` never read this file.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_llvm_disable_expensive_passes=true",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop JAX's compiled programs.

    A worker that keeps every program of its ~600 tests alive grows without bound: XLA:CPU maps
    each compiled kernel's code and data as separate anonymous regions (a 105-test subset reached
    15 640 mappings of the kernel's default vm.max_map_count of 65 530), and the default suite's
    peak worker RSS was 6.9 GB. Cleared per module: peak 2.6 GB RSS and under 15 000 mappings
    per worker, and the suite is no slower (programs are rarely shared across modules). (A CI
    worker once died with a segfault inside backend_compile after ~800 tests, not reproduced
    here; XLA:CPU out of section memory aborts rather than segfaults, so this is headroom, not a
    proven fix for it.)
    """
    yield
    jax.clear_caches()
    gc.collect()
