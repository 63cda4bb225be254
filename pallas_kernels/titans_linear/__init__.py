"""Pallas TPU kernels of the chunked Titans matrix memory (SPEC §2 with ``L_M = 1``).

``titans_linear_pallas`` (``ops.py``) is the entry; ``kernel.py`` holds the ``pallas_call`` bodies.
"""

from pallas_kernels.titans_linear.ops import titans_linear_pallas

__all__ = ["titans_linear_pallas"]
