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
