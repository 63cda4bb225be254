"""Pallas TPU kernels of the chunked gated delta rule (SPEC §1).

``gated_delta_pallas`` (``ops.py``) is the entry; ``kernel.py`` holds the ``pallas_call`` bodies.
"""

from pallas_kernels.gated_delta.ops import BlockSizes, gated_delta_pallas

__all__ = ["BlockSizes", "gated_delta_pallas"]
