"""``nested-jax bench peers [--json]``: our gated delta rule against the JAX LLM stacks' own.

A user who needs a gated delta rule in JAX could take one from Levanter or MaxText instead; this
command times ours beside theirs in one process (A/B interleaved, medians of ``--repeats``), with
the peak temporaries of each compiled program (``memory_analysis().temp_size_in_bytes``), the
largest difference of outputs and gradients, the chunked form's achieved GFLOP/s and the in-run f32
matmul GFLOP/s. Shapes: ``B = 2``, ``H = 4``, chunk 64, f32, ``T`` in ``--seq-lens`` (default
2048 8192), ``K = V = D`` in ``--dims`` (default 64 128), unit-norm q and k (every peer then
computes the same function; Levanter's in-kernel normalisation is off), ``g = −softplus(·)``,
``β = σ(·)``. Gradients are those of ``sum(o ⊙ w) + sum(S_T ⊙ w_S)`` w.r.t. q, k, v, g, β (fixed
random weights, so no gradient is trivially zero).

Rows per shape (ratio = ours ÷ peer: < 1 means ours is faster or smaller):

- ``forward``: ``gated_delta_chunked`` vs the peer's chunked form, forward only;
- ``fwd+bwd``: the same with gradients;
- ``temps``: fwd+bwd temporaries;
- ``recurrent``: ``gated_delta_recurrent`` vs the peer's per-token scan, fwd+bwd, time and
  temporaries (the first ``T`` of ``--seq-lens`` only: the scan is slow on a CPU).

Peers (none is a dependency; they are loaded from ``--peers-dir``, default ``.bench-peers``):

- **Levanter** (``marin-levanter``; ``levanter/layers/gated_deltanet.py``:
  ``chunk_gated_delta_rule``, ``recurrent_gated_delta_rule``). Its wheel pins ``optax<0.2.7``
  and ``transformers<5``, which our ``train`` extra does not admit, so it cannot be a project
  extra; ``bash scripts/bench_peers_setup`` installs it and the few modules its GDN file needs
  (``--no-deps``, pinned, from PyPI) into ``.bench-peers``, and this command loads that one file
  by path (its package ``__init__`` imports the whole training stack). PyPI's newest wheel is
  older than Levanter's main branch (whose non-Pallas path is
  ``_chunk_gated_delta_rule_fused_reference``): ``--levanter-file`` loads another copy of the file,
  e.g. from a checkout of ``marin-community/marin`` (``lib/levanter/src/levanter/layers/``).
- **MaxText** (``maxtext/models/qwen3.py``: ``jax_chunk_gated_delta_rule``): could not be had
  here. ``maxtext`` 0.2.5 on PyPI needs Python >= 3.12 and a newer JAX than ours
  (``jax.experimental.xla_metadata.must_fuse_call``), and its GDN module imports the whole model
  stack. The command says so in its output.

JSON keys (last stdout line with ``--json``): ``matmul_gflops``, ``peers`` (name → ``"ok"`` or why
not), and per peer and shape ``<peer>_<row>_T{T}_D{D}`` (ratios), ``ours_gflops_T{T}_D{D}``,
``chunk_matmul_gflops_T{T}_D{D}`` (the chunk form's matmul shapes timed alone, batched over all
chunks·heads at once: ``bench.core.chunk_matmul_gflops``), ``<peer>_max_err_T{T}_D{D}`` (outputs
and gradients).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from nested_jax.bench.common import (
    emit,
    make_parser,
    matmul_gflops,
    max_err,
    progress,
    temp_bytes,
    time_interleaved,
)
from nested_jax.bench.core import chunk_matmul_gflops, chunked_gdn_flops
from nested_jax.core.associative.forms import gated_delta_chunked, gated_delta_recurrent

B, H, CHUNK = 2, 4, 64
LEVANTER_FILE = "levanter/layers/gated_deltanet.py"
MAXTEXT_MISSING = (
    "not installable here: maxtext 0.2.5 on PyPI needs Python >= 3.12 and a JAX newer than "
    "0.10.2 (jax.experimental.xla_metadata.must_fuse_call)"
)

GDN = Callable[..., tuple[jax.Array, jax.Array]]  # (q, k, v, g, beta) -> (o, final state)


def _xla_path(fn) -> dict:
    """``{"use_flash": False}`` when ``fn`` takes ``use_flash`` and no TPU is attached: newer
    Levanter files default to their Pallas TPU kernels, which run nowhere else; their pure-XLA
    path (``_chunk_gated_delta_rule_fused_reference`` on main) is the peer of ours off TPU."""
    import inspect

    takes = "use_flash" in inspect.signature(fn).parameters
    return {"use_flash": False} if takes and jax.default_backend() != "tpu" else {}


def load_levanter(peers_dir: Path, path: Path | None = None) -> tuple[dict[str, GDN] | None, str]:
    """``({"chunked", "recurrent"}, "ok")`` from Levanter's GDN file (``path``, default
    ``<peers_dir>/levanter/layers/gated_deltanet.py``; its imports come from ``peers_dir``), or
    ``(None, why)`` when it is not there or does not load."""
    path = Path(peers_dir) / LEVANTER_FILE if path is None else Path(path)
    if not path.is_file():
        return None, f"not installed in {peers_dir} (run: bash scripts/bench_peers_setup)"
    sys.path.insert(0, str(Path(peers_dir).resolve()))
    try:
        spec = importlib.util.spec_from_file_location("_levanter_gated_deltanet", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        import haliax as hax
    except Exception as err:  # a peer that does not load is reported, not fatal
        return None, f"failed to load {path}: {type(err).__name__}: {err}"

    def named(q, k, v, g, beta):
        names = ("batch", "position", "heads")
        axes = [hax.Axis(n, s) for n, s in zip(names, q.shape[:3], strict=True)]
        dk, dv = hax.Axis("k_head_dim", q.shape[-1]), hax.Axis("v_head_dim", v.shape[-1])
        return (
            hax.named(q, (*axes, dk)),
            hax.named(k, (*axes, dk)),
            hax.named(v, (*axes, dv)),
            hax.named(g, tuple(axes)),
            hax.named(beta, tuple(axes)),
        )

    chunk_options = _xla_path(module.chunk_gated_delta_rule)
    step_options = _xla_path(module.recurrent_gated_delta_rule)

    def chunked(q, k, v, g, beta):
        o, s = module.chunk_gated_delta_rule(
            *named(q, k, v, g, beta),
            chunk_size=CHUNK,
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
            **chunk_options,
        )
        return o.array, s

    def recurrent(q, k, v, g, beta):
        o, s = module.recurrent_gated_delta_rule(
            *named(q, k, v, g, beta),
            output_final_state=True,
            use_qk_l2norm_in_kernel=False,
            **step_options,
        )
        return o.array, s

    return {"chunked": chunked, "recurrent": recurrent}, "ok"


def _ours() -> dict[str, GDN]:
    return {
        "chunked": functools.partial(gated_delta_chunked, chunk_size=CHUNK),
        "recurrent": gated_delta_recurrent,
    }


def inputs(T: int, D: int, seed: int = 0) -> tuple:
    """``(q, k, v, g, beta)`` of the module docstring's distribution, and the loss weights."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)

    def unit(x):
        return x / jnp.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(jax.random.normal(ks[0], (B, T, H, D)))
    k = unit(jax.random.normal(ks[1], (B, T, H, D)))
    v = jax.random.normal(ks[2], (B, T, H, D))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, H)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    w_o = jax.random.normal(ks[5], (B, T, H, D))
    w_s = jax.random.normal(ks[6], (B, H, D, D))
    return (q, k, v, g, beta), (w_o, w_s)


def forward_and_grad(fn: GDN, weights) -> tuple[Callable, Callable]:
    """Jitted ``forward(*xs) -> (o, S)`` and ``grads(*xs) -> (o, S, dq, dk, dv, dg, dβ)``."""
    w_o, w_s = weights

    def loss(*xs):
        o, s = fn(*xs)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)

    def grads(*xs):
        (_, (o, s)), dxs = jax.value_and_grad(loss, argnums=range(5), has_aux=True)(*xs)
        return (o, s, *dxs)

    return jax.jit(fn), jax.jit(grads)


def compare_shape(peer: str, theirs: dict[str, GDN], T: int, D: int, repeats: int, recurrent: bool):
    """The rows of the module docstring for one peer at one shape: ``{key: value}``."""
    xs, weights = inputs(T, D)
    ours = _ours()
    fwd_a, grad_a = forward_and_grad(ours["chunked"], weights)
    fwd_b, grad_b = forward_and_grad(theirs["chunked"], weights)
    tag = f"T{T}_D{D}"
    out = {f"{peer}_max_err_{tag}": max_err(grad_a(*xs), grad_b(*xs))}
    t = time_interleaved({"fa": lambda: fwd_a(*xs), "fb": lambda: fwd_b(*xs)}, repeats=repeats)
    out[f"{peer}_forward_{tag}"] = t["fa"] / t["fb"]
    t = time_interleaved({"ga": lambda: grad_a(*xs), "gb": lambda: grad_b(*xs)}, repeats=repeats)
    out[f"{peer}_fwd+bwd_{tag}"] = t["ga"] / t["gb"]
    out[f"ours_gflops_{tag}"] = chunked_gdn_flops(T, B, H, D, D, CHUNK) / t["ga"] / 1e9
    n_chunks = -(-T // CHUNK) * B * H
    out[f"chunk_matmul_gflops_{tag}"] = chunk_matmul_gflops(n_chunks, CHUNK, D, D, repeats)
    ours_temp, their_temp = temp_bytes(grad_a, *xs), temp_bytes(grad_b, *xs)
    out[f"{peer}_temps_{tag}"] = ours_temp / their_temp
    out[f"ours_temp_mib_{tag}"] = ours_temp / 2**20
    out[f"{peer}_temp_mib_{tag}"] = their_temp / 2**20
    if recurrent:
        _, rec_a = forward_and_grad(ours["recurrent"], weights)
        _, rec_b = forward_and_grad(theirs["recurrent"], weights)
        out[f"{peer}_recurrent_max_err_{tag}"] = max_err(rec_a(*xs), rec_b(*xs))
        t = time_interleaved({"ra": lambda: rec_a(*xs), "rb": lambda: rec_b(*xs)}, repeats=repeats)
        out[f"{peer}_recurrent_fwd+bwd_{tag}"] = t["ra"] / t["rb"]
        out[f"{peer}_recurrent_temps_{tag}"] = temp_bytes(rec_a, *xs) / temp_bytes(rec_b, *xs)
    return out


def report(results: dict, seq_lens, dims, peers: dict[str, str]) -> str:
    """The Markdown table of the ratios (ours ÷ peer), one row per peer and shape."""
    lines = [
        "| peer | T | D | forward | fwd+bwd | temps (MiB ours / peer) | recurrent fwd+bwd | "
        "recurrent temps | ours GFLOP/s | its matmuls alone GFLOP/s | max err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for peer, status in peers.items():
        if status != "ok":
            lines.append(f"| {peer} | – | – | {status} | | | | | | | |")
            continue
        for T in seq_lens:
            for D in dims:
                tag = f"T{T}_D{D}"

                def cell(key, fmt="{:.2f}", tag=tag, peer=peer):
                    value = results.get(f"{peer}_{key}_{tag}", results.get(f"{key}_{tag}"))
                    return "–" if value is None else fmt.format(value)

                lines.append(
                    f"| {peer} | {T} | {D} | {cell('forward')} | {cell('fwd+bwd')} | "
                    f"{cell('temps')} ({cell('ours_temp_mib', '{:.0f}')} / "
                    f"{cell('temp_mib', '{:.0f}')}) | {cell('recurrent_fwd+bwd')} | "
                    f"{cell('recurrent_temps')} | {cell('ours_gflops', '{:.1f}')} | "
                    f"{cell('chunk_matmul_gflops', '{:.1f}')} | {cell('max_err', '{:.1e}')} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = make_parser("peers", "our gated delta rule vs Levanter's and MaxText's, in one process")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--peers-dir", default=".bench-peers", help="where the peers are installed")
    p.add_argument(
        "--levanter-file",
        default=None,
        help="another gated_deltanet.py of Levanter (e.g. from a newer checkout than PyPI's); "
        "its imports still come from --peers-dir",
    )
    p.add_argument("--no-recurrent", action="store_true", help="skip the per-token scan rows")
    args = p.parse_args(argv)
    if args.repeats < 1 or min(args.seq_lens) < 1 or min(args.dims) < 1:
        print("error: --repeats, --seq-lens and --dims must be >= 1", file=sys.stderr)
        return 2
    results = {"matmul_gflops": matmul_gflops()}
    progress(f"matmul f32: {results['matmul_gflops']:.1f} GFLOP/s")
    levanter, status = load_levanter(Path(args.peers_dir), args.levanter_file)
    peers = {"levanter": status, "maxtext": MAXTEXT_MISSING}
    results["peers"] = peers
    for name, why in peers.items():
        if why != "ok":
            progress(f"{name}: {why}")
    if levanter is not None:
        for i, T in enumerate(args.seq_lens):
            for D in args.dims:
                progress(f"levanter: T={T} D={D} ...")
                results |= compare_shape(
                    "levanter",
                    levanter,
                    T,
                    D,
                    args.repeats,
                    recurrent=i == 0 and not args.no_recurrent,
                )
    print(report(results, args.seq_lens, args.dims, peers), end="")
    emit(results, args.json)
    return 0 if levanter is not None else 2


if __name__ == "__main__":
    sys.exit(main())
