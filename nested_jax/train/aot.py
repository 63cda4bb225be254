"""``nested-jax aot``: compile a config's real train / eval steps for a TPU slice on this CPU.

    nested-jax aot --config configs/experiments/pod_gdn_1.3b.yaml [--topology v5e:4x4]
                   [--per-device-batch 16] [--eval] [--set key=value ...] [--json]
    nested-jax aot --table configs/experiments/pod_*.yaml [--markdown FILE]

With ``libtpu`` installed (``pip install -e '.[tpu]'``) JAX can describe a TPU topology without
owning one (``jax.experimental.topologies``): the steps are lowered from abstract inputs (no array
is allocated, :class:`~nested_jax.train.setup.StepPlan`) with the run's shardings on that
topology's mesh, and XLA's TPU compiler builds the real executable. Its ``memory_analysis()`` gives
the bytes per chip; a program that does not fit fails to compile (``CompileTimeHbmOom``), which is
reported as "does not fit". The exit code is 0 when every compiled step fits, 1 otherwise, 2 for a
bad config or a missing libtpu.

Per-chip peak is estimated as ``arguments + outputs − aliased + temporaries``: donated state
aliases its output, so a train step's peak is about state + batch + temporaries.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from nested_jax.train.aot_estimate import (
    COLLECTIVES,
    StepEstimate,
    collective_bytes,
    describe_estimate,
    estimate_step,
)
from nested_jax.train.chips import CHIPS, chip_of
from nested_jax.train.config import Config, ConfigError, add_override_argument, load_config

GIB = 1024**3
_COLLECTIVE_RE = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


class AotError(RuntimeError):
    """One line for the user: libtpu missing, unknown topology."""


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What one compiled step needs per chip (bytes) and whether it fits the chip's HBM."""

    step: str  # "train" or "eval"
    fits: bool
    argument: int = 0
    output: int = 0
    alias: int = 0
    temp: int = 0
    capacity: int = 0
    collectives: dict = dataclasses.field(default_factory=dict)
    compile_s: float = 0.0
    error: str = ""  # the compiler's one-line reason when it did not fit
    hlo: str = dataclasses.field(default="", repr=False)  # optimized HLO (keep_text=True)
    estimate: StepEstimate | None = None  # the roofline estimate (train step, --estimate)
    estimate_error: str = ""  # why the estimate's programs did not compile

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp


def chip_capacity(topology: str) -> int:
    """HBM bytes of one chip of `topology` (e.g. ``"v5e:4x4"``).

    Raises:
      AotError: for a TPU generation this table does not know.
    """
    try:
        return int(chip_of(topology).hbm_gib * GIB)
    except ValueError:
        raise AotError(
            f"--topology: unknown TPU generation {topology.split(':')[0]!r} in {topology!r}; "
            f"expected one of {sorted(CHIPS)} (e.g. v5e:4x4)"
        ) from None


def topology_devices(topology: str, slices: int = 1) -> list:
    """The (abstract) devices of a TPU `topology` × `slices`, from libtpu's topology description.

    Raises:
      AotError: libtpu is not installed, or the topology name is refused.
    """
    if importlib.util.find_spec("libtpu") is None:
        raise AotError(
            "libtpu is not installed: `pip install -e '.[tpu]'` (a 140 MB wheel; it lets XLA "
            "compile for TPU on this CPU)"
        )
    from jax.experimental import topologies

    chip_capacity(topology)
    # A topology description opens no chip; without this, a second compiling process (a parallel
    # test worker, an aot beside a run) fails on libtpu's single-process lock file.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        desc = topologies.get_topology_desc(
            platform="tpu", topology_name=topology, num_slices=slices
        )
    except Exception as err:  # libtpu's own message names what it accepts
        reason = str(err).splitlines()[0]
        raise AotError(f"--topology: libtpu refused {topology!r}: {reason}") from None
    return list(desc.devices)


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each cross-chip collective the optimized HLO issues (async pairs once)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for match in _COLLECTIVE_RE.finditer(hlo_text):
        counts[match.group(1)] += 1
    return counts


def with_per_device_batch(config: Config, per_device_batch: int, n_devices: int) -> Config:
    """The config with ``data.batch_size`` set to ``per_device_batch`` per batch shard."""
    from nested_jax.parallel.mesh import resolve_mesh_shape

    m = config.mesh
    data, fsdp, _, _ = resolve_mesh_shape(m.data, m.fsdp, n_devices // m.slices, m.tensor, m.seq)
    batch = per_device_batch * data * fsdp * m.slices
    return dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=batch))


def _oom_reason(err: Exception) -> str | None:
    text = str(err)
    if not any(m in text for m in ("RESOURCE_EXHAUSTED", "HbmOom", "Ran out of memory")):
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    useful = [ln for ln in lines if "exceeds" in ln or "Ran out of memory" in ln]
    return (useful or lines)[0][:300]


def compile_with_text(lowered):
    """``(compiled, optimized per-chip HLO text)`` of a lowered step.

    The text is XLA's own dump of the optimized module, not ``compiled.as_text()``: for v5p and
    v6e programs with asynchronous collectives the latter fails to rebuild the module from its
    proto after a successful compile ("async-update instruction should have 1 operands but sees
    3", libtpu 0.0.52), while the compiler's text dump is complete."""
    with tempfile.TemporaryDirectory() as dump:
        compiled = lowered.compile(
            compiler_options={"xla_dump_to": dump, "xla_dump_hlo_as_text": True}
        )
        found = sorted(Path(dump).glob("*.after_optimizations.txt"))
        if len(found) != 1:
            raise AotError(f"expected one optimized HLO dump from XLA, found {len(found)}")
        return compiled, found[0].read_text()


def compile_step(lowered, step: str, capacity: int, keep_text: bool = False) -> StepMemory:
    """Compiles one lowered step and reads its per-chip memory and collectives.

    ``keep_text``: also keep the optimized per-chip HLO (``StepMemory.hlo``) for inspection.
    """
    start = time.perf_counter()
    try:
        compiled, text = compile_with_text(lowered)
    except Exception as err:  # XLA raises a plain runtime error for an HBM OOM
        reason = _oom_reason(err)
        if reason is None:
            raise
        return StepMemory(step, False, capacity=capacity, error=reason)
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    out = StepMemory(
        step,
        True,
        argument=int(mem.argument_size_in_bytes),
        output=int(mem.output_size_in_bytes),
        alias=int(mem.alias_size_in_bytes),
        temp=int(mem.temp_size_in_bytes),
        capacity=capacity,
        collectives=count_collectives(text) if text else {},
        compile_s=seconds,
        hlo=text if keep_text else "",
    )
    return dataclasses.replace(out, fits=out.peak <= capacity)


def compile_for_topology(
    config: Config,
    topology: str,
    *,
    per_device_batch: int = 0,
    eval_step: bool = False,
    keep_text: bool = False,
    estimate: bool = False,
) -> tuple[Config, dict, list[StepMemory]]:
    """Lowers and compiles the train (and eval) step of `config` for `topology`.

    ``estimate``: also the train step's roofline estimate (:func:`estimate_train_step`; one more
    compile, with the layers unrolled).

    Returns:
      ``(config actually compiled, mesh shape, [StepMemory per step])``.
    Raises:
      ConfigError: the mesh or the batch does not fit the topology's chips.
      AotError: libtpu missing or the topology refused.
    """
    import jax

    from nested_jax.train.setup import build_mesh, plan_train_setup

    devices = topology_devices(topology, config.mesh.slices)
    if per_device_batch:
        config = with_per_device_batch(config, per_device_batch, len(devices))
    mesh = build_mesh(config, devices)
    capacity = chip_capacity(topology)
    plan = plan_train_setup(config, mesh)
    batch = plan.abstract_batch(config.data.batch_size, config.data.seq_len)
    results = []
    with jax.set_mesh(mesh):
        lowered = plan.train_step.lower(plan.abstract_state(), plan.abstract_rest(), batch)
        results.append(compile_step(lowered, "train", capacity, keep_text))
        if eval_step:
            params = plan.abstract_state()["params"]
            lowered = plan.eval_step.lower(params, plan.abstract_rest(), batch)
            results.append(compile_step(lowered, "eval", capacity, keep_text))
    if estimate and results[0].fits:
        try:
            guess = {"estimate": estimate_train_step(config, mesh, topology, plan)}
        except Exception as err:  # an estimate that fails must not hide the fit just measured
            guess = {"estimate_error": (_oom_reason(err) or str(err).splitlines()[0])[:300]}
        results[0] = dataclasses.replace(results[0], **guess)
    return config, dict(mesh.shape), results


def _layer_cost(config: Config, mesh, layers: int) -> tuple[dict, str]:
    """``(cost_analysis, optimized HLO)`` of the train step with ``layers`` unrolled layers."""
    import jax

    from nested_jax.train.setup import plan_train_setup

    model = dataclasses.replace(config.model, n_layers=layers, scan_layers=False)
    plan = plan_train_setup(dataclasses.replace(config, model=model), mesh)
    batch = plan.abstract_batch(config.data.batch_size, config.data.seq_len)
    with jax.set_mesh(mesh):
        lowered = plan.train_step.lower(plan.abstract_state(), plan.abstract_rest(), batch)
        compiled, text = compile_with_text(lowered)
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list | tuple) else cost), text


def estimate_train_step(config: Config, mesh, topology: str, plan) -> StepEstimate:
    """The roofline estimate (:mod:`nested_jax.train.aot_estimate`) of ``config``'s train step on
    ``mesh`` (``plan``: its ``plan_train_setup``, for the parameter count).

    XLA counts a loop body once, so the layers cannot stay scanned, and unrolling all of them
    changes the program's memory (a 1.3B model's unrolled step does not fit where its scanned one
    does). The step is compiled with 1 and 2 unrolled layers instead, and every count extended
    linearly to ``L`` layers, ``c(L) = c(1) + (L − 1) (c(2) − c(1))`` (the layers of a preset are
    alike).
    """
    import jax
    import numpy as np

    n_layers = config.model.n_layers
    cost1, text1 = _layer_cost(config, mesh, 1)
    cost2, text2 = (cost1, text1) if n_layers == 1 else _layer_cost(config, mesh, 2)

    def extend(one: float, two: float) -> float:
        return one + (n_layers - 1) * (two - one)

    total = {k: extend(cost1[k], cost2[k]) for k in ("flops", "bytes accessed")}
    moved1, moved2 = collective_bytes(text1), collective_bytes(text2)
    moved = {k: extend(moved1[k], moved2[k]) for k in moved1}
    params = jax.tree.leaves(plan.abstract_state()["params"])
    n_params = sum(int(np.prod(x.shape)) for x in params)
    tokens = config.data.batch_size * config.data.seq_len
    return estimate_step(total, moved, chip_of(topology), mesh.size, n_params, tokens)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def describe(config: Config, topology: str, mesh_shape: dict, results: list[StepMemory]) -> str:
    """Human-readable report: per step, per-chip HBM against the chip, collectives, verdict."""
    d = config.data
    lines = [
        f"{config.model.name} on {topology} (mesh {mesh_shape}): global batch {d.batch_size} × "
        f"{d.seq_len} tokens"
    ]
    for r in results:
        if not r.fits and r.error:
            lines.append(f"  {r.step}: DOES NOT FIT ({r.error})")
            continue
        verdict = "fits" if r.fits else "DOES NOT FIT"
        lines.append(
            f"  {r.step}: peak {_gib(r.peak)} GiB of {_gib(r.capacity)} GiB per chip ({verdict}); "
            f"arguments {_gib(r.argument)}, outputs {_gib(r.output)}, aliased {_gib(r.alias)}, "
            f"temporaries {_gib(r.temp)} GiB; compiled in {r.compile_s:.0f} s"
        )
        if r.collectives:
            counts = ", ".join(f"{k} {v}" for k, v in r.collectives.items() if v)
            lines.append(f"    collectives: {counts or 'none'}")
        if r.estimate is not None:
            lines.append(describe_estimate(r.estimate, chip_of(topology)))
        if r.estimate_error:
            lines.append(f"    estimate: not made ({r.estimate_error})")
    return "\n".join(lines)


def table_row(
    path: str, config: Config, topology: str, mesh_shape: dict, results: list[StepMemory]
) -> str:
    """One Markdown row: preset, topology, batch, per-chip peak of train / eval, fits, and the
    train step's estimate (step time, tokens/s/chip, MFU; ``–`` without ``--estimate``)."""
    per_chip = {r.step: (_gib(r.peak) if not r.error else "OOM") for r in results}
    per_device = config.data.batch_size // (mesh_shape["data"] * mesh_shape["fsdp"])
    fits = "yes" if all(r.fits for r in results) else "**no**"
    e = results[0].estimate
    guess = "– | – | –"
    if e is not None:
        mfu = e.mfu(chip_of(topology).peak_tflops)
        guess = f"{e.step_s:.3f} | {e.tokens_per_s_per_chip:,.0f} | {mfu:.0%}"
    return (
        f"| `{Path(path).stem}` | {topology} | {config.data.batch_size} ({per_device}/chip) | "
        f"{per_chip.get('train', '')} | {per_chip.get('eval', '')} | "
        f"{_gib(results[0].capacity)} | {fits} | {guess} |"
    )


TABLE_HEADER = (
    "| preset | topology | global batch | train peak GiB/chip | eval peak GiB/chip | "
    "HBM GiB/chip | fits | est. step s | est. tokens/s/chip | est. MFU |\n"
    "|---|---|---|---:|---:|---:|---|---:|---:|---:|"
)


def _estimate_record(r: StepMemory, topology: str) -> dict:
    if r.estimate is None:
        return {}
    e = r.estimate
    derived = {
        "step_s": e.step_s,
        "tokens_per_s_per_chip": e.tokens_per_s_per_chip,
        "mfu": e.mfu(chip_of(topology).peak_tflops),
        "bound": e.bound,
    }
    return {"estimate": dataclasses.asdict(e) | derived}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nested-jax aot", description=__doc__.split("\n\n")[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", help="an experiment YAML")
    what.add_argument(
        "--table", nargs="+", metavar="CONFIG", help="compile each config for its mesh.topology"
    )
    p.add_argument("--topology", help="TPU topology, e.g. v5e:4x4 (default: mesh.topology)")
    p.add_argument(
        "--per-device-batch", type=int, default=0, help="set data.batch_size to N per batch shard"
    )
    p.add_argument("--eval", action="store_true", help="also compile the eval step")
    p.add_argument(
        "--estimate",
        action="store_true",
        help="also estimate the train step's time, tokens/s/chip and MFU from the compiled program",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--markdown", help="with --table: also write the Markdown table to this file")
    add_override_argument(p)
    return p


def _one(path: str, args) -> tuple[Config, str, dict, list[StepMemory]]:
    config = load_config([path], args.overrides)
    topology = args.topology or config.mesh.topology
    if not topology:
        raise ConfigError(f"mesh.topology: {path} names no TPU topology; pass --topology")
    config, mesh_shape, results = compile_for_topology(
        config,
        topology,
        per_device_batch=args.per_device_batch,
        eval_step=args.eval,
        estimate=args.estimate,
    )
    return config, topology, mesh_shape, results


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    paths = args.table or [args.config]
    rows, all_fit, records = [], True, []
    try:
        for path in paths:
            config, topology, mesh_shape, results = _one(path, args)
            all_fit &= all(r.fits for r in results)
            records.append(
                {
                    "config": path,
                    "topology": topology,
                    "mesh": mesh_shape,
                    "batch_size": config.data.batch_size,
                    "seq_len": config.data.seq_len,
                    "steps": [
                        {k: v for k, v in dataclasses.asdict(r).items() if k != "hlo"}
                        | {"peak": r.peak}
                        | _estimate_record(r, topology)
                        for r in results
                    ],
                }
            )
            if not args.json:
                print(describe(config, topology, mesh_shape, results), flush=True)
            rows.append(table_row(path, config, topology, mesh_shape, results))
    except (ConfigError, AotError) as err:
        prefix = "config error" if isinstance(err, ConfigError) else "aot"
        print(f"{prefix}: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(records, indent=2))
    if args.table:
        table = TABLE_HEADER + "\n" + "\n".join(rows) + "\n"
        print("\n" + table, end="")
        if args.markdown:
            Path(args.markdown).write_text(table)
    if not all_fit:
        print("aot: does not fit the named TPU chips (see above)", file=sys.stderr)
    return 0 if all_fit else 1
