"""``nested-jax aot --estimate``: a roofline step time, tokens/s/chip and MFU from the compiled
TPU program (every number an *estimate*; no TPU ran it).

From one compiled train step per chip (``compiled.cost_analysis()`` and the optimized HLO):

* ``flops``: XLA's FLOP count of the per-chip program; ``hbm_bytes``: its bytes accessed;
* ``collective_bytes``: per kind (all-gather, all-reduce, reduce-scatter, all-to-all,
  collective-permute), the bytes of each collective's result (:func:`collective_bytes`);

and the chip's published peaks (:mod:`nested_jax.train.chips`)::

    compute_s    = max(flops, model_flops / chips) / peak
    memory_s     = hbm_bytes / HBM bandwidth
    collective_s = (2 · all-reduce bytes + the other kinds' bytes) / ICI bandwidth
    step_s       = max(compute_s, memory_s) + collective_s
    tokens/s/chip = tokens per step / chips / step_s
    MFU          = model_flops / step_s / (peak · chips),   model_flops = 6 · N · tokens per step

(``N``: every parameter; 6·N·tokens is the usual dense-training count and ignores attention's
``T²`` term and the memories' inner work, so it is a floor on the real work.) It assumes perfect
overlap of compute and HBM traffic, none of collectives with either, and a ring's cost for each
collective; a real step is slower.

What XLA's counts miss: the body of a ``while`` loop is counted once. The estimate therefore
compiles the step with 1 and 2 unrolled layers and extends the counts linearly to the preset's
depth (``aot.estimate_train_step``); the recurrences *inside* a layer (the scan over chunks of the
gated delta rule, Titans, Hope) are still counted for one chunk, and ``compute_s`` then rests on
``model_flops``, the floor above. Multi-slice runs:
collectives are all priced at ICI bandwidth (the data-centre network between slices is slower;
``Chip.dcn_gbps`` is listed, not modelled).
"""

from __future__ import annotations

import dataclasses
import math
import re

from nested_jax.train.chips import Chip

__all__ = ["COLLECTIVES", "StepEstimate", "collective_bytes", "estimate_step", "describe_estimate"]

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2}
DTYPE_BYTES |= {"s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")


def _array_bytes(dtype: str, dims: str) -> int:
    size = DTYPE_BYTES.get(dtype, 4)
    return size * math.prod(int(d) for d in dims.split(",") if d)


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes of each cross-chip collective's result in the optimized HLO, summed by kind.

    A synchronous op counts its result (all arrays of a combined op); an asynchronous ``-start``
    op, whose result tuple also holds its operands, counts its largest array. Collectives inside a
    loop body are counted once (the module docstring).
    """
    out = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if not match:
            continue
        arrays = [_array_bytes(t, d) for t, d in _ARRAY.findall(match.group(1))]
        if arrays:
            out[match.group(2)] += max(arrays) if match.group(3) else sum(arrays)
    return out


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """The roofline estimate of one train step per chip (module docstring)."""

    chip: str
    chips: int
    flops: float  # XLA's count for the per-chip program
    hbm_bytes: float
    collective_bytes: dict
    model_flops: float  # 6 · N · tokens, whole step (all chips)
    params: int
    tokens: int  # per step, all chips
    compute_s: float
    memory_s: float
    collective_s: float  # NaN when the chip's ICI bandwidth is not published

    @property
    def step_s(self) -> float:
        collectives = 0.0 if math.isnan(self.collective_s) else self.collective_s
        return max(self.compute_s, self.memory_s) + collectives

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "HBM"

    @property
    def tokens_per_s_per_chip(self) -> float:
        return self.tokens / self.chips / self.step_s

    def mfu(self, peak_tflops: float) -> float:
        return self.model_flops / self.step_s / (peak_tflops * 1e12 * self.chips)


def estimate_step(
    cost: dict, moved: dict, chip: Chip, chips: int, params: int, tokens: int
) -> StepEstimate:
    """The :class:`StepEstimate` of a compiled step (``cost``: its ``cost_analysis()``; ``moved``:
    its collective bytes by kind, :func:`collective_bytes`).

    Raises:
      ValueError: naming ``cost`` when it has no ``flops`` or ``bytes accessed``.
    """
    if "flops" not in cost or "bytes accessed" not in cost:
        raise ValueError(f"cost: expected XLA's 'flops' and 'bytes accessed', got {sorted(cost)}")
    if chips < 1 or params < 1 or tokens < 1:
        raise ValueError(f"chips, params, tokens: expected >= 1, got {chips}, {params}, {tokens}")
    moved = dict(moved)
    model_flops = 6.0 * params * tokens
    peak = chip.peak_tflops * 1e12
    wire = 2 * moved["all-reduce"] + sum(v for k, v in moved.items() if k != "all-reduce")
    return StepEstimate(
        chip=chip.name,
        chips=chips,
        flops=float(cost["flops"]),
        hbm_bytes=float(cost["bytes accessed"]),
        collective_bytes=moved,
        model_flops=model_flops,
        params=params,
        tokens=tokens,
        compute_s=max(float(cost["flops"]), model_flops / chips) / peak,
        memory_s=float(cost["bytes accessed"]) / (chip.hbm_gbps * 1e9),
        collective_s=(wire / (chip.ici_gbps * 1e9)) if chip.ici_gbps else float("nan"),
    )


def _duration(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def describe_estimate(e: StepEstimate, chip: Chip) -> str:
    """Lines for the ``aot`` report, every figure labelled an estimate."""
    moved = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in e.collective_bytes.items() if v)
    if math.isnan(e.collective_s):
        coll = "n/a (no published ICI bandwidth)"
    else:
        coll = _duration(e.collective_s)
    peaks = (
        f"{chip.peak_tflops:g} TFLOP/s bf16, {chip.hbm_gbps:g} GB/s HBM, "
        f"ICI {chip.ici_gbps or 'n/a'} GB/s per chip; {chip.source}"
    )
    model = e.model_flops / e.chips / 1e12
    return "\n".join(
        [
            f"    estimate ({chip.name}: {peaks}):",
            f"      per chip: {e.flops / 1e12:.3f} TFLOP compiled (model 6·N·tokens: {model:.3f},"
            f" N = {e.params:,}), {e.hbm_bytes / 2**30:.2f} GiB HBM traffic, collectives "
            f"{moved or 'none'}",
            f"      step ≈ {_duration(e.step_s)} (compute {_duration(e.compute_s)}, HBM "
            f"{_duration(e.memory_s)}, collectives {coll}; {e.bound}-bound), "
            f"≈ {e.tokens_per_s_per_chip:,.0f} tokens/s/chip, MFU ≈ {e.mfu(chip.peak_tflops):.0%}",
        ]
    )
