"""Pallas TPU kernels of HOLA's cache read (SPEC §5).

``hola_cache_read_pallas`` (``ops.py``) is the entry, with the contract of
``nested_jax.core.hola.cache.read_blocks``; ``kernel.py`` holds the ``pallas_call`` bodies.
"""

from pallas_kernels.hola_cache.ops import BlockSizes, hola_cache_read_pallas

__all__ = ["BlockSizes", "hola_cache_read_pallas"]
