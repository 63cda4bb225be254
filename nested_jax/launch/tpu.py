"""TPU slice shapes: what an accelerator type (``v5litepod-16``) means for each tool.

gcloud needs a runtime version that matches the chip generation; GKE schedules by an accelerator
label and a topology; a multi-host slice has one worker VM (pod) per few chips. All of it follows
from the accelerator type, so the user names only that.
"""

from __future__ import annotations

import dataclasses
import math
import re


@dataclasses.dataclass(frozen=True)
class Family:
    """One TPU generation as gcloud and GKE name it."""

    runtime_version: str  # gcloud --runtime-version of a TPU VM
    gke_accelerator: str  # node label cloud.google.com/gke-tpu-accelerator
    cores_per_chip: int  # the type's number counts TensorCores (v4, v5p) or chips (v5e, v6e)
    topology_dims: int  # 3-D torus (v4, v5p) or 2-D (v5e, v6e)
    sizes: tuple[int, ...]  # the numbers the type may carry


_POW2 = tuple(2**i for i in range(3, 14))  # v4 / v5p: 8 ... 8192 TensorCores
_SMALL = (1, 4, 8, 16, 32, 64, 128, 256)  # v5e / v6e: 1 ... 256 chips
FAMILIES = {
    "v4": Family("tpu-ubuntu2204-base", "tpu-v4-podslice", 2, 3, _POW2),
    "v5p": Family("v2-alpha-tpuv5", "tpu-v5p-slice", 2, 3, _POW2),
    "v5litepod": Family("v2-alpha-tpuv5-lite", "tpu-v5-lite-podslice", 1, 2, _SMALL),
    "v6e": Family("v2-alpha-tpuv6e", "tpu-v6e-slice", 1, 2, _SMALL),
}


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A parsed accelerator type, e.g. ``TpuSlice("v5litepod-16")`` (16 chips on 4 hosts);
    `flag` is the option the type came from, named when it is refused."""

    accelerator_type: str
    flag: str = dataclasses.field(default="--accelerator-type", compare=False)

    def __post_init__(self) -> None:
        match = re.fullmatch(r"([a-z0-9]+)-(\d+)", self.accelerator_type or "")
        family = FAMILIES.get(match.group(1)) if match else None
        if family is None or int(match.group(2)) not in family.sizes:
            known = ", ".join(f"{name}-N" for name in FAMILIES)
            raise ValueError(
                f"{self.flag}: unknown TPU type {self.accelerator_type!r} (expected one "
                f"of {known} with a slice size gcloud offers, e.g. v5litepod-16)"
            )

    @property
    def family(self) -> Family:
        return FAMILIES[self.accelerator_type.rsplit("-", 1)[0]]

    @property
    def chips(self) -> int:
        return int(self.accelerator_type.rsplit("-", 1)[1]) // self.family.cores_per_chip

    @property
    def chips_per_host(self) -> int:
        # v5e / v6e slices up to 8 chips are one VM; larger slices, and every v4 / v5p VM, hold 4.
        limit = 8 if self.family.topology_dims == 2 else 4
        return self.chips if self.chips <= limit else 4

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host

    @property
    def topology(self) -> str:
        """GKE's default topology of this many chips: e.g. ``4x4`` (v5e-16), ``2x2x2`` (v4-16).

        Built by doubling the smallest side (the last one on ties), which yields the shapes GKE
        documents: 2x2, 2x4, 4x4, 4x8, ... and 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...
        """
        sides = [1, 1] if self.family.topology_dims == 2 else [2, 2, 1]
        while math.prod(sides) < self.chips:
            smallest = min(sides)
            last = max(i for i, s in enumerate(sides) if s == smallest)
            sides[last] *= 2
        return "x".join(map(str, sides))
