"""nested-jax: nested-learning memory models in JAX (README.md; the math contract: docs/SPEC.md)."""

__version__ = "0.1.0"
