"""``nested-jax bench kernels [--json]``: the Pallas gated delta kernel vs the XLA chunked rule.

The two implementations of the same op (SPEC §1):

- ``pallas``: ``pallas_kernels.gated_delta.gated_delta_pallas`` (Mosaic TPU kernels, forward and
  reverse-chunk backward, the ``[K, V]`` state kept in VMEM across chunks),
- ``xla``: ``nested_jax.core.associative.forms.gated_delta_chunked`` (WY/UT chunk form in XLA ops).

What runs depends on the backend (``--mode auto`` picks it):

- **TPU / GPU** (``device``): for each ``T`` in ``--seq-lens`` (2048, 8192, 32768) and head dim
  ``D`` in ``--dims`` (64, 128), ``H = --heads`` (16), ``B = --batch`` (1), q, k, v in ``--dtype``
  (bf16), g, β f32: the forward and the forward+backward (``jax.grad`` of ``sum(o) + sum(S_T)``
  w.r.t. q, k, v, g, β) of both, timed A/B interleaved (median of ``--repeats``), with the achieved
  TF/s and GB/s as a percentage of the chip's peak (:data:`DEVICE_PEAKS`). The Pallas kernel is a
  Mosaic *TPU* kernel: on a GPU it does not compile; the reason is printed and only XLA is timed.
- **CPU** (``cpu``): no speed claim. (a) Correctness: the kernel in Pallas interpret mode against
  the XLA chunked rule at a small size, in float32 and bfloat16: max relative error
  ``max|a − b| / max|b|`` of the outputs ``o, S_T`` and of the gradients w.r.t. q, k, v, g, β.
  (b) Memory on a TPU, without one: both paths' forward and forward+backward compiled ahead of time
  for ``--topology`` (libtpu's abstract devices, the batch split over the chips by ``shard_map``)
  at ``T = --aot-seq-len`` (8192), ``--aot-batch-per-chip`` sequences per chip, ``--aot-heads``,
  ``--aot-dim``; per program ``memory_analysis()`` (temporaries, arguments, outputs, peak =
  arguments + outputs − aliased + temporaries) and, for the Pallas kernels, the scoped VMEM the TPU
  compiler assigned to each ``tpu_custom_call`` (``used_scoped_memory_configs`` with memory space
  1 in the compiled HLO). ``compiled.as_text()`` can raise after a successful compile (seen on
  v5p / v6e); the VMEM figure is then reported as unavailable. Without libtpu this part is skipped
  with one line.

FLOPs (the same count for both implementations, from the chunk algorithm; per chunk and head,
chunk ``C``; multiply-add = 2 FLOPs; elementwise work not counted; ``N = ceil(T / C)`` chunks)::

    forward   4C²K + (2/3)C³ + 2C²(K+V) + 6CKV + 2C²V
    backward  4C²V + 12CKV + 4C²(K+V) + 8C²K          (``bench core``'s ``chunked_gdn_flops``)

Bytes: the compulsory HBM traffic, every operand read once and every result written once per pass
(forward: q, k, v, g, β in, o and S_T out; backward: the same inputs and dO in, the five gradients
out), a lower bound that states how far a pass is from the bandwidth roofline.

JSON keys (the last stdout line with ``--json``): ``mode``, ``backend``; device mode per
``T{T}_D{D}``: ``time_ms_{impl}_{pass}_…``, ``tflops_…``, ``pct_peak_flops_…``, ``gbps_…``,
``pct_peak_bw_…`` (impl ∈ pallas, xla; pass ∈ fwd, fwdbwd), ``pallas_over_xla_speedup_{pass}_…``;
CPU mode ``check_rel_err_{dtype}_{name}``, ``check_max_rel_err_{dtype}``, ``aot_status`` and per
``{impl}_{program}`` ``aot_temp_bytes_…``, ``aot_peak_bytes_…`` (…), ``aot_vmem_bytes_pallas_…``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from nested_jax.bench.common import emit, make_parser, progress, rel_err, time_interleaved
from nested_jax.bench.core import chunked_gdn_flops
from nested_jax.core.associative.forms import gated_delta_chunked
from nested_jax.train.chips import CHIPS
from pallas_kernels.gated_delta import BlockSizes, gated_delta_pallas

# Peak dense bf16 FLOP/s and HBM bytes/s per chip, the vendors' published figures: the TPUs from
# the chip table of ``nested-jax aot`` (``train.chips``), H100 / H200 ≈ 989 TF/s, 3.35 / 4.8 TB/s.
# Keys are matched against ``device.device_kind`` (lower case; "v5 lite" is how v5e names itself).
_TPU_KINDS = {"v5e": "v5e", "v5 lite": "v5e", "v5p": "v5p", "v6e": "v6e", "v6 lite": "v6e"}
DEVICE_PEAKS = {
    **{
        kind: (CHIPS[chip].peak_tflops * 1e12, CHIPS[chip].hbm_gbps * 1e9)
        for kind, chip in _TPU_KINDS.items()
    },
    "h100": (989e12, 3.35e12),
    "h200": (989e12, 4.8e12),
}
DEFAULT_SEQ_LENS = (2048, 8192, 32768)
DEFAULT_DIMS = (64, 128)
IMPLS = ("pallas", "xla")
PASSES = ("fwd", "fwdbwd")
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")
_POSITIVE_FLAGS = ("heads", "batch", "chunk", "check_seq_len", "check_heads", "check_dim")
_POSITIVE_FLAGS += ("aot_seq_len", "aot_batch_per_chip", "aot_heads", "aot_dim")
_VMEM_SPACE = "1"  # memory space colour of VMEM in the TPU compiler's scoped memory configs
_USED_VMEM_RE = re.compile(r'"used_scoped_memory_configs":\[([^\]]*)\]')
_SIZE_RE = re.compile(r'"memory_space":"(\d+)","offset":"\d+","size":"(\d+)"')


def device_peak(device_kind: str) -> tuple[float, float] | None:
    """``(peak FLOP/s, peak HBM bytes/s)`` of a chip from its ``device_kind``; None if unknown."""
    kind = device_kind.lower()
    for name, peak in DEVICE_PEAKS.items():
        if name in kind:
            return peak
    return None


def gdn_bytes(T: int, B: int, H: int, K: int, V: int, itemsize: int, backward: bool) -> float:
    """Compulsory HBM bytes of one pass (module docstring): q, k, v and o in ``itemsize`` bytes,
    g, β and the state ``[B, H, K, V]`` in f32; the backward re-reads the inputs, reads dO and
    writes one gradient per input."""
    inputs = B * T * H * ((2 * K + V) * itemsize + 2 * 4)
    out = B * T * H * V * itemsize + B * H * K * V * 4
    fwd = inputs + out
    return float(fwd + ((inputs + B * T * H * V * itemsize + inputs) if backward else 0))


def make_inputs(T: int, B: int, H: int, D: int, dtype, seed: int = 0):
    """GDN-layer-like operands: L2-normalised q, k and normal v in ``dtype`` ``[B, T, H, D]``,
    log decay ``g ∈ [−0.1, 0)`` and ``β ∈ (0, 1)`` f32 ``[B, T, H]``."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = jax.random.normal(ks[0], (B, T, H, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, H, D), jnp.float32)
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, H, D), jnp.float32)
    g = -0.1 * jax.random.uniform(ks[3], (B, T, H), jnp.float32, 1e-3, 1.0)
    beta = jax.random.uniform(ks[4], (B, T, H), jnp.float32, 0.05, 0.95)
    return (*(x.astype(dtype) for x in (q, k, v)), g, beta)


def gdn_fn(impl: str, chunk: int, interpret: bool = False):
    """``(q, k, v, g, β) → (o, S_T)`` of ``impl`` ("pallas" | "xla") with chunk ``chunk``."""
    if impl == "pallas":
        bs = BlockSizes(chunk=chunk)
        return lambda *a: gated_delta_pallas(*a, block_sizes=bs, interpret=interpret)
    if impl == "xla":
        return lambda *a: gated_delta_chunked(*a, chunk_size=chunk)
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def fwdbwd(fn):
    """``jax.grad`` of ``sum(o) + sum(S_T)`` w.r.t. q, k, v, g, β (f32 sums)."""

    def loss(*args):
        o, s = fn(*args)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


# --------------------------------------------------------------------------------------------------
# TPU / GPU: timing against the roofline
# --------------------------------------------------------------------------------------------------


def run_device(seq_lens, dims, *, B, H, chunk, dtype, repeats) -> dict:
    """Times both implementations (module docstring, device mode); returns the results dict."""
    dev = jax.devices()[0]
    peak = device_peak(dev.device_kind)
    results: dict = {"mode": "device", "backend": jax.default_backend(), "device": dev.device_kind}
    if peak is None:
        progress(f"[bench kernels] no peak numbers for {dev.device_kind!r}: no % of roofline")
    else:
        results["peak_tflops"], results["peak_gbps"] = peak[0] / 1e12, peak[1] / 1e9
    itemsize = jnp.dtype(dtype).itemsize
    for T in seq_lens:
        for D in dims:
            args = make_inputs(T, B, H, D, dtype)
            tag = f"T{T}_D{D}"
            for pas in PASSES:
                fns, skipped = {}, {}
                for impl in IMPLS:
                    f = gdn_fn(impl, chunk)
                    f = jax.jit(f if pas == "fwd" else fwdbwd(f))
                    try:
                        fns[impl] = _bound(f.lower(*args).compile(), args)
                    except Exception as err:  # the Mosaic TPU kernel on a GPU
                        skipped[impl] = str(err).strip().splitlines()[0][:200]
                        results[f"unavailable_{impl}_{pas}_{tag}"] = skipped[impl]
                        progress(
                            f"[bench kernels] {tag} {pas}: {impl} does not compile: {skipped[impl]}"
                        )
                if not fns:
                    continue
                times = time_interleaved(fns, repeats=repeats, warmup=1)
                flops = chunked_gdn_flops(T, B, H, D, D, chunk, backward=pas == "fwdbwd")
                nbytes = gdn_bytes(T, B, H, D, D, itemsize, backward=pas == "fwdbwd")
                line = []
                for impl, t in times.items():
                    key = f"{impl}_{pas}_{tag}"
                    tf, gbs = flops / t / 1e12, nbytes / t / 1e9
                    results[f"time_ms_{key}"] = 1e3 * t
                    results[f"tflops_{key}"] = tf
                    results[f"gbps_{key}"] = gbs
                    text = f"{impl} {1e3 * t:.3f} ms {tf:.3g} TF/s {gbs:.3g} GB/s"
                    if peak is not None:
                        pf, pb = 100 * tf * 1e12 / peak[0], 100 * gbs * 1e9 / peak[1]
                        results[f"pct_peak_flops_{key}"] = pf
                        results[f"pct_peak_bw_{key}"] = pb
                        text += f" ({pf:.1f}% / {pb:.1f}% of peak)"
                    line.append(text)
                if len(times) == 2:
                    results[f"pallas_over_xla_speedup_{pas}_{tag}"] = times["xla"] / times["pallas"]
                progress(f"[bench kernels] {tag} {pas}: " + "; ".join(line))
    return results


def _bound(compiled, args):
    return lambda: compiled(*args)


# --------------------------------------------------------------------------------------------------
# CPU: interpret-mode correctness and TPU memory by ahead-of-time compiles
# --------------------------------------------------------------------------------------------------


def check_interpret(T: int, B: int, H: int, D: int, chunk: int, dtype) -> dict[str, float]:
    """Pallas (interpret mode) vs XLA chunked at one small size: relative errors of ``o``,
    ``state`` and the gradients ``dq, dk, dv, dg, dbeta`` (loss ``sum(o) + sum(S_T)``)."""
    args = make_inputs(T, B, H, D, dtype, seed=1)
    out = {}
    for impl in IMPLS:
        f = gdn_fn(impl, chunk, interpret=True)
        out[impl] = (jax.jit(f)(*args), jax.jit(fwdbwd(f))(*args))
    names = ("o", "state", *GRAD_NAMES)
    leaves = {impl: jax.tree.leaves(v) for impl, v in out.items()}
    return {
        n: rel_err(a, b) for n, a, b in zip(names, leaves["pallas"], leaves["xla"], strict=True)
    }


def scoped_vmem(hlo_text: str, kernel: str) -> int | None:
    """Scoped VMEM bytes the TPU compiler gave the custom call(s) named ``kernel`` in an optimized
    HLO text (``used_scoped_memory_configs``, memory space 1); the largest over the call sites, or
    None when no such call or no VMEM entry is found."""
    sizes = []
    for line in hlo_text.splitlines():
        if f"%{kernel}" not in line.split("=", 1)[0] or "tpu_custom_call" not in line:
            continue
        for match in _USED_VMEM_RE.finditer(line):
            for space, size in _SIZE_RE.findall(match.group(1)):
                if space == _VMEM_SPACE:
                    sizes.append(int(size))
    return max(sizes) if sizes else None


def aot_compile(impl, program, devices, *, B_per_chip, T, H, D, chunk, dtype):
    """Lowers and compiles ``impl``'s ``program`` ("fwd" | "fwdbwd") for the abstract TPU
    ``devices``, batch ``B_per_chip × len(devices)`` split over the chips by ``shard_map``.

    ``check_vma=False``: the XLA chunked rule's ``fori_loop`` carries and the kernel's zero initial
    state are not marked as varying over the mesh axis (a type check only; the per-chip program is
    the same). Returns ``(lowered text, compiled executable, compile seconds)``.
    """
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("batch",))
    B = B_per_chip * len(devices)
    sharding = NamedSharding(mesh, P("batch"))
    f32 = jnp.float32
    specs = (
        *(jax.ShapeDtypeStruct((B, T, H, D), dtype, sharding=sharding) for _ in range(3)),
        *(jax.ShapeDtypeStruct((B, T, H), f32, sharding=sharding) for _ in range(2)),
    )
    fn = jax.shard_map(
        gdn_fn(impl, chunk),
        mesh=mesh,
        in_specs=(P("batch"),) * 5,
        out_specs=P("batch"),
        check_vma=False,
    )
    fn = fn if program == "fwd" else fwdbwd(fn)
    start = time.perf_counter()
    lowered = jax.jit(fn).lower(*specs)
    compiled = lowered.compile()
    return lowered.as_text(), compiled, time.perf_counter() - start


def run_aot(topology: str, *, B_per_chip, T, H, D, chunk, dtype) -> dict:
    """Both implementations' forward and forward+backward compiled for ``topology``; per program
    the memory of ``memory_analysis()`` and the Pallas kernels' scoped VMEM (module docstring)."""
    from nested_jax.train.aot import AotError, topology_devices

    results: dict = {"aot_topology": topology}
    if importlib.util.find_spec("libtpu") is None:
        results["aot_status"] = "skipped: libtpu not installed"
        progress("[bench kernels] AOT skipped: libtpu is not installed (pip install -e '.[tpu]')")
        return results
    try:
        devices = topology_devices(topology)
    except AotError as err:
        results["aot_status"] = f"skipped: {err}"
        progress(f"[bench kernels] AOT skipped: {err}")
        return results
    shape = dict(B_per_chip=B_per_chip, T=T, H=H, D=D, chunk=chunk, dtype=dtype)
    results.update(
        aot_chips=len(devices),
        aot_batch_per_chip=B_per_chip,
        aot_seq_len=T,
        aot_heads=H,
        aot_dim=D,
        aot_chunk=chunk,
        aot_dtype=jnp.dtype(dtype).name,
    )
    for program in PASSES:
        for impl in IMPLS:
            text, compiled, seconds = aot_compile(impl, program, devices, **shape)
            mem = compiled.memory_analysis()
            key = f"{impl}_{program}"
            nums = {
                "temp": int(mem.temp_size_in_bytes),
                "argument": int(mem.argument_size_in_bytes),
                "output": int(mem.output_size_in_bytes),
                "alias": int(mem.alias_size_in_bytes),
            }
            nums["peak"] = nums["argument"] + nums["output"] - nums["alias"] + nums["temp"]
            for name, n in nums.items():
                results[f"aot_{name}_bytes_{key}"] = n
            line = (
                f"[bench kernels] {topology} {key}: temp {nums['temp'] / 2**20:.1f} MiB, peak "
                f"{nums['peak'] / 2**20:.1f} MiB per chip (compiled in {seconds:.1f} s)"
            )
            if impl == "pallas":
                kernels = ["gated_delta_fwd"] + (["gated_delta_bwd"] if program != "fwd" else [])
                results[f"aot_tpu_custom_call_{key}"] = all(
                    "tpu_custom_call" in text and k in text for k in kernels
                )
                line += "; " + _vmem_report(compiled, kernels, key, results)
            progress(line)
    for program in PASSES:
        p, x = (results[f"aot_temp_bytes_{i}_{program}"] for i in IMPLS)
        results[f"aot_temp_xla_over_pallas_{program}"] = x / p if p else float("nan")
    results["aot_status"] = "ok"
    return results


def _vmem_report(compiled, kernels, key, results) -> str:
    try:  # can fail on programs that compiled fine (RET_CHECK on async-update arity, v5p / v6e)
        hlo = compiled.as_text()
    except Exception as err:
        reason = str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__
        results[f"aot_vmem_note_{key}"] = f"unavailable: compiled.as_text() failed: {reason}"
        return "VMEM unavailable (compiled.as_text() failed)"
    parts = []
    for k in kernels:
        vmem = scoped_vmem(hlo, k)
        if vmem is None:
            results[f"aot_vmem_note_{key}_{k}"] = "unavailable: no used_scoped_memory_configs"
            parts.append(f"{k} VMEM unavailable")
        else:
            results[f"aot_vmem_bytes_{key}_{k}"] = vmem
            parts.append(f"{k} scoped VMEM {vmem / 2**10:.0f} KiB")
    return ", ".join(parts)


def run_cpu(args) -> dict:
    """CPU mode: interpret-mode errors (f32 and bf16) and the AOT memory table."""
    results: dict = {"mode": "cpu", "backend": jax.default_backend()}
    for dtype in (jnp.float32, jnp.bfloat16):
        name = jnp.dtype(dtype).name
        t0 = time.perf_counter()
        errs = check_interpret(
            args.check_seq_len, 1, args.check_heads, args.check_dim, args.chunk, dtype
        )
        for n, e in errs.items():
            results[f"check_rel_err_{name}_{n}"] = e
        results[f"check_max_rel_err_{name}"] = max(errs.values())
        progress(
            f"[bench kernels] interpret check {name} T={args.check_seq_len}: max rel err "
            + ", ".join(f"{n} {e:.2e}" for n, e in errs.items())
            + f" ({time.perf_counter() - t0:.1f} s)"
        )
    if args.no_aot:
        results["aot_status"] = "skipped: --no-aot"
        return results
    results.update(
        run_aot(
            args.topology,
            B_per_chip=args.aot_batch_per_chip,
            T=args.aot_seq_len,
            H=args.aot_heads,
            D=args.aot_dim,
            chunk=args.chunk,
            dtype=jnp.dtype(args.dtype),
        )
    )
    return results


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise ValueError(f"{flag}: expected comma-separated positive integers, got {text!r}")
    return values


def build_parser():
    p = make_parser(
        "kernels", "Pallas gated delta kernel vs the XLA chunked rule (time / memory / errors)"
    )
    p.add_argument(
        "--mode",
        choices=("auto", "device", "cpu"),
        default="auto",
        help="auto: device on TPU / GPU, cpu on CPU",
    )
    p.add_argument(
        "--seq-lens",
        default=",".join(map(str, DEFAULT_SEQ_LENS)),
        help="device mode: comma-separated T",
    )
    p.add_argument(
        "--dims",
        default=",".join(map(str, DEFAULT_DIMS)),
        help="device mode: comma-separated head dims D (K = V)",
    )
    p.add_argument("--heads", type=int, default=16, help="device mode: heads H")
    p.add_argument("--batch", type=int, default=1, help="device mode: batch B")
    p.add_argument("--chunk", type=int, default=64, help="chunk C of both paths (BlockSizes)")
    p.add_argument("--dtype", default="bfloat16", help="q, k, v dtype (device and AOT)")
    p.add_argument("--check-seq-len", type=int, default=128, help="cpu mode: T of the check")
    p.add_argument("--check-heads", type=int, default=2)
    p.add_argument("--check-dim", type=int, default=32)
    p.add_argument("--topology", default="v5e:2x2", help="cpu mode: TPU topology of the AOT part")
    p.add_argument("--aot-seq-len", type=int, default=8192)
    p.add_argument(
        "--aot-batch-per-chip",
        type=int,
        default=4,
        help="sequences per chip (4 × 8192 = pod_gdn_1.3b's 16 × 2048 tokens/chip)",
    )
    p.add_argument("--aot-heads", type=int, default=16)
    p.add_argument("--aot-dim", type=int, default=128)
    p.add_argument("--no-aot", action="store_true", help="cpu mode: skip the AOT compiles")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args([] if argv is None else argv)
    seq_lens = _ints(args.seq_lens, "--seq-lens")
    dims = _ints(args.dims, "--dims")
    for flag in _POSITIVE_FLAGS:
        if getattr(args, flag) <= 0:
            raise ValueError(
                f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}"
            )
    mode = args.mode
    if mode == "auto":
        mode = "cpu" if jax.default_backend() == "cpu" else "device"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # see nested_jax.train.aot
    t0 = time.perf_counter()
    if mode == "device":
        results = run_device(
            seq_lens,
            dims,
            B=args.batch,
            H=args.heads,
            chunk=args.chunk,
            dtype=jnp.dtype(args.dtype),
            repeats=args.repeats,
        )
    else:
        results = run_cpu(args)
    results["chunk"] = args.chunk
    results["wall_s"] = time.perf_counter() - t0
    emit(results, args.json)
    return 0
