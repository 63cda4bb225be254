"""``nested-jax bench context [--json]``: context parallelism for GDN and the Titans matrix memory.

One sequence of ``T = --seq-len`` tokens (4096) split over ``P`` devices along a ``seq`` mesh axis
(``nested_jax.core.context``), for each ``P`` in ``--devices`` (1, 2, 4, 8), on CPU
devices (the process re-runs itself with ``--xla_force_host_platform_device_count`` when it has
fewer than the largest ``P``):

- **equality**: on ``--check-devices`` (8) devices, the outputs, final state and the gradients of
  ``Σ o·w + Σ sin(S_T)`` (w fixed weights) w.r.t. every input of the context-parallel rule against
  the single-device chunked rule on the whole sequence: max relative error
  ``max|a − b| / max|b|`` per array;
- **memory per device**: the forward+backward program compiled for ``P`` devices; from
  ``memory_analysis()`` its temporaries and its peak (arguments + outputs − aliased +
  temporaries), per device. ``P = 1`` is the plain single-device rule (``plain``); every ``P``
  also has the context-parallel program (``cp``), whose local pass carries ``n`` extra value
  columns (``n = K`` for GDN, ``2K`` for Titans: the identity run of the module doc).

No time is claimed: fake CPU devices share this machine's cores. Sizes: ``B = --batch`` (1),
``H = --heads`` (4), ``K = V = --dim`` (64), GDN chunk ``--gdn-chunk`` (64), Titans chunk
``--titans-chunk`` (16), f32.

JSON keys (the last stdout line with ``--json``): ``check_max_rel_err_{rule}`` and
``check_rel_err_{rule}_{name}``; ``{rule}_{impl}_P{P}_temp_bytes`` / ``_peak_bytes`` (impl ∈
plain, cp).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nested_jax.bench.common import emit, make_parser, progress, rel_err, time_interleaved
from nested_jax.core.associative.forms import gated_delta_chunked
from nested_jax.core.context import (
    FOLDS,
    gated_delta_context_parallel,
    titans_linear_context_parallel,
)
from nested_jax.core.titans.linear import titans_linear_chunked
from nested_jax.rules import TitansRule
from nested_jax.train.aot import topology_devices

RULES = ("gdn", "titans")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _inputs(rule: str, B: int, T: int, H: int, D: int):
    """Named inputs of one rule (random, the gates in their working ranges), f32."""
    keys = iter(jax.random.split(jax.random.key(0), 8))
    normal = lambda shape: jax.random.normal(next(keys), shape)  # noqa: E731
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    uniform = lambda lo, hi: lo + (hi - lo) * jax.random.uniform(next(keys), (B, T, H))  # noqa: E731
    x = {"q": normal((B, T, H, D)), "k": unit(normal((B, T, H, D))), "v": normal((B, T, H, D))}
    if rule == "gdn":
        x["g"] = -jax.nn.softplus(normal((B, T, H)))
        x["beta"] = jax.nn.sigmoid(normal((B, T, H)))
    else:
        x.update(theta=uniform(0.05, 0.5), eta=uniform(0.5, 0.95), alpha=uniform(0.0, 0.1))
    return x


def _loss(o, final):
    weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape))
    return jnp.sum(o * weights) + sum(jnp.sum(jnp.sin(s)) for s in jax.tree.leaves(final))


def _rule(rule: str, args, split: bool, fold: str = "gather"):
    """The rule on named inputs: the plain chunked form, or the context-parallel one over 'seq'
    (its devices' maps combined by ``fold``)."""
    if rule == "gdn":
        chunk = args.gdn_chunk
        if split:
            return lambda x: gated_delta_context_parallel(
                **x, axis_name="seq", chunk_size=chunk, fold=fold
            )
        return lambda x: gated_delta_chunked(**x, chunk_size=chunk)
    titans = TitansRule(memory_chunk=args.titans_chunk)
    if split:
        return lambda x: titans_linear_context_parallel(
            **x, axis_name="seq", rule=titans, fold=fold
        )
    return lambda x: titans_linear_chunked(**x, rule=titans)


def _forward(rule: str, args, devices: int | None, fold: str = "gather"):
    """``(rule on named inputs, mesh)``: the plain rule on one device when ``devices`` is None,
    else the context-parallel rule under ``shard_map`` over a ``devices``-long 'seq' axis (of
    the TPU topology ``args.topology`` when given, else of this process's devices)."""
    if devices is None:
        return _rule(rule, args, split=False), None
    pool = topology_devices(args.topology) if args.topology else jax.devices()
    mesh = jax.make_mesh(
        (devices,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=pool[:devices],
    )  # fmt: skip
    f = jax.shard_map(
        _rule(rule, args, split=True, fold=fold),
        mesh=mesh,
        in_specs=(P(None, "seq"),),
        out_specs=(P(None, "seq"), P()),
    )
    return f, mesh


def _program(rule: str, args, devices: int | None, fold: str = "gather"):
    """``(value_and_grad of the loss, mesh)`` of :func:`_forward`."""
    f, mesh = _forward(rule, args, devices, fold)
    return jax.value_and_grad(lambda x: _loss(*f(x))), mesh


def _abstract(x: dict, mesh):
    if mesh is None:
        return {n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in x.items()}
    shard = NamedSharding(mesh, P(None, "seq"))
    return {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard) for n, a in x.items()}


def check_equal(rule: str, args, fold: str = "gather") -> dict[str, float]:
    """Max relative error of the context-parallel rule on ``--check-devices`` devices against the
    plain rule: outputs, final state(s) and every input's gradient."""
    x = _inputs(rule, args.batch, args.seq_len, args.heads, args.dim)
    plain, _ = _forward(rule, args, None)
    split, _ = _forward(rule, args, args.check_devices, fold)
    (o_ref, final_ref), (o, final) = jax.jit(plain)(x), jax.jit(split)(x)
    grads_ref = jax.jit(jax.grad(lambda x: _loss(*plain(x))))(x)
    grads = jax.jit(jax.grad(lambda x: _loss(*split(x))))(x)
    errors = {"o": rel_err(o, o_ref)}
    states = zip(jax.tree.leaves(final), jax.tree.leaves(final_ref), strict=True)
    errors.update({f"state{i}": rel_err(a, b) for i, (a, b) in enumerate(states)})
    errors.update({f"d{n}": rel_err(grads[n], grads_ref[n]) for n in x})
    return errors


def time_folds(rule: str, args) -> dict[str, float]:
    """Median fwd+bwd seconds of the context-parallel rule on ``--check-devices`` devices with
    each fold of ``--folds``, A/B interleaved (fake CPU devices share this machine's cores: a
    ratio of the two folds, not a device time)."""
    x = _inputs(rule, args.batch, args.seq_len, args.heads, args.dim)
    fns = {}
    for fold in args.folds:
        program = jax.jit(_program(rule, args, args.check_devices, fold)[0])
        fns[fold] = functools.partial(program, x)
    return time_interleaved(fns, repeats=args.repeats)


def memory_per_device(
    rule: str, args, devices: int | None, fold: str = "gather"
) -> tuple[int, int]:
    """``(temporaries, peak)`` bytes per device of the forward+backward program."""
    x = _inputs(rule, args.batch, args.seq_len, args.heads, args.dim)
    program, mesh = _program(rule, args, devices, fold)
    m = jax.jit(program).lower(_abstract(x, mesh)).compile().memory_analysis()
    temp = int(m.temp_size_in_bytes)
    peak = int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes) + temp
    return temp, peak


def markdown(results: dict, args) -> str:
    lines = [
        f"T = {args.seq_len}, B = {args.batch}, H = {args.heads}, K = V = {args.dim}, f32; "
        "forward+backward, per device (MiB)",
        "",
        "| rule | program | devices | temporaries | peak |",
        "|---|---|---|---|---|",
    ]
    for rule in args.rules:
        for impl, P_, _ in _programs_of(args):
            key = f"{rule}_{impl}_P{P_}"
            if f"{key}_temp_bytes" in results:
                t, p = results[f"{key}_temp_bytes"], results[f"{key}_peak_bytes"]
                lines.append(f"| {rule} | {impl} | {P_} | {t / 2**20:.1f} | {p / 2**20:.1f} |")
    return "\n".join(lines)


def _impl(fold: str) -> str:
    """The result-key name of the context-parallel program with ``fold``."""
    return "cp" if fold == "gather" else f"cp_{fold}"


def _programs_of(args) -> list[tuple[str, int, str]]:
    """``(impl, devices, fold)`` of every compiled program: the plain rule on one device (not for
    a TPU topology), then each fold on each device count."""
    plain = [] if args.topology else [("plain", 1, "gather")]
    return plain + [(_impl(f), d, f) for f in args.folds for d in args.devices]


def build_parser():
    p = make_parser(
        "context", "context parallelism: equality on 8 CPU devices and memory per device"
    )
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--check-devices", type=int, default=8)
    p.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--gdn-chunk", type=int, default=64)
    p.add_argument("--titans-chunk", type=int, default=16)
    p.add_argument(
        "--folds", nargs="+", choices=FOLDS, default=list(FOLDS),
        help="how the devices' state maps are combined (core.context): all-gather or prefix",
    )  # fmt: skip
    p.add_argument(
        "--topology", default="",
        help="compile for this TPU topology's chips instead (libtpu AOT, e.g. v5p:4x4x4): memory "
        "only, --devices up to its chip count",
    )  # fmt: skip
    return p


def _rerun_with_devices(argv: list[str], count: int) -> int:
    """This benchmark in a fresh process with ``count`` CPU devices (the flag must precede jax's
    start-up)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {_DEVICE_FLAG}={count}".strip()
    cmd = [sys.executable, "-m", "nested_jax.bench.context", *argv]
    return subprocess.call(cmd, env=env)


def _check_and_time(rule: str, args, results: dict) -> None:
    """Equality of every fold on ``--check-devices`` CPU devices, and the folds' time ratio."""
    for fold in args.folds:
        progress(
            f"[{rule}] equality on {args.check_devices} devices at T = {args.seq_len} ({fold})"
        )
        errors = check_equal(rule, args, fold)
        tag = "" if fold == "gather" else f"_{fold}"
        results.update({f"check_rel_err_{rule}{tag}_{n}": e for n, e in errors.items()})
        results[f"check_max_rel_err_{rule}{tag}"] = max(errors.values())
    if len(args.folds) == 2:
        t = time_folds(rule, args)
        results[f"{rule}_P{args.check_devices}_prefix_over_gather_time"] = t["prefix"] / t["gather"]
        progress(
            f"[{rule}] fwd+bwd on {args.check_devices} CPU devices: prefix fold "
            f"x{t['prefix'] / t['gather']:.2f} the all-gather fold's time"
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.topology:
        results: dict = {"seq_len": args.seq_len, "topology": args.topology}
    else:
        need = max([*args.devices, args.check_devices])
        if len(jax.devices()) < need:
            if jax.default_backend() != "cpu" or _DEVICE_FLAG in os.environ.get("XLA_FLAGS", ""):
                progress(f"bench context: needs {need} devices, found {len(jax.devices())}")
                return 2
            return _rerun_with_devices(argv, need)
        results = {"seq_len": args.seq_len, "backend": jax.default_backend()}
    for rule in args.rules:
        if not args.topology:
            _check_and_time(rule, args, results)
        for impl, devices, fold in _programs_of(args):
            progress(f"[{rule}] compile {impl} on {devices} device(s)")
            temp, peak = memory_per_device(rule, args, None if impl == "plain" else devices, fold)
            results[f"{rule}_{impl}_P{devices}_temp_bytes"] = temp
            results[f"{rule}_{impl}_P{devices}_peak_bytes"] = peak
    if not args.json:
        print(markdown(results, args), flush=True)
    emit(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
