"""The TPU chips ``nested-jax aot`` compiles for: memory, peak compute and bandwidths per chip.

Every number is Google Cloud's published figure for the chip (the page in ``source``, read
2026-12); ``None`` where the page gives none. They feed the roofline estimate of
:mod:`nested_jax.train.aot_estimate`, which labels what it derives from them an estimate.

* ``hbm_gib``: HBM per chip the compiler may fill (the capacity ``aot`` checks against);
* ``peak_tflops``: dense bf16 peak per chip;
* ``hbm_gbps``: HBM bandwidth per chip (GB/s);
* ``ici_gbps``: bidirectional inter-chip interconnect bandwidth per chip (GB/s);
* ``dcn_gbps``: data-centre network bandwidth per chip (GB/s; between slices).
"""

from __future__ import annotations

import dataclasses

__all__ = ["Chip", "CHIPS", "chip_of"]


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation's per-chip figures (module docstring)."""

    name: str
    hbm_gib: float
    peak_tflops: float
    hbm_gbps: float
    ici_gbps: float | None
    dcn_gbps: float | None
    source: str


CHIPS: dict[str, Chip] = {
    chip.name: chip
    for chip in (
        Chip("v4", 32.0, 275.0, 1200.0, None, None, "https://cloud.google.com/tpu/docs/v4"),
        # v5e: 2 x 100 Gbps NICs per host of 8 chips = 25 Gbps = 3.125 GB/s per chip
        Chip("v5e", 16.0, 197.0, 819.0, 400.0, 3.125, "https://cloud.google.com/tpu/docs/v5e"),
        # v5p: DCN 50 Gbps per chip = 6.25 GB/s
        Chip("v5p", 95.0, 459.0, 2765.0, 1200.0, 6.25, "https://cloud.google.com/tpu/docs/v5p"),
        Chip("v6e", 32.0, 918.0, 1638.0, 800.0, None, "https://cloud.google.com/tpu/docs/v6e"),
    )
}


def chip_of(topology: str) -> Chip:
    """The chip of a topology name such as ``v5e:4x4``.

    Raises:
      ValueError: naming ``topology`` when its generation is not in :data:`CHIPS`.
    """
    generation = topology.split(":")[0].split("-")[0].lower()
    if generation not in CHIPS:
        raise ValueError(
            f"topology: unknown TPU generation {generation!r} (known: {', '.join(CHIPS)})"
        )
    return CHIPS[generation]
