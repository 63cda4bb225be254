"""nested-jax: nested-learning memory models in JAX (see README.md, SPEC in ../shared/SPEC.md)."""

__version__ = "0.1.0"
