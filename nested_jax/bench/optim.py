"""``nested-jax bench optim [--json]``: AdamW vs Muon vs M3 (three settings), learning-rate sweeps.

All in one process (the rule of :mod:`nested_jax.bench.common`):

1. **Optimizers, fair comparison** (SPEC §3.5). The tiny GDN language model (``--d-model`` 64,
   ``--layers`` 2, 2 heads, byte vocabulary) is trained from the same initialisation on the same
   batches (``--batch-size`` 8 random windows of ``--seq-len`` 128 + 1 bytes of Jane Austen's
   novels, 95 % / 5 % train / held-out split of the stream; ``--data synthetic`` uses MQAR batches
   with the loss on every token) for the same ``--steps`` (150), by five optimizers, each at every
   learning rate of its sweep (``--sweep NAME=LR,LR,...``; defaults :data:`DEFAULT_SWEEPS`;
   ``--optimizers`` picks a subset). The runs are deterministic, so a later invocation with other
   rates extends the same table. Every run has
   ``clip_by_global_norm(1.0)``, the same warmup (10 % of the steps) + cosine (to 0.1 ×) schedule
   shape, decoupled weight decay 0.1 on matrices, AdamW ``b2 = 0.95``:

   - ``adamw``: the training registry's AdamW (``optimizer.name=adamw``) at the swept lr;
   - ``muon``: ``optax.contrib.muon`` at the swept lr on matrices (``default_m3_mask``: ``ndim ≥
     2``, not the embedding; leading axes of stacked layers are batch axes);
   - ``m3``: :func:`nested_jax.optim.m3.m3`, Algorithm 1 as printed (``normalize="none"``), at the
     swept lr on the same matrices, ``slow_every = --m3-slow-every``;
   - ``m3_rms``: the same with ``normalize="rms"`` (the scale-invariant variant: per-matrix update
     RMS 0.2, see the ``m3`` module docstring), still with the paper's additive momenta;
   - ``m3_rms_ema``: ``normalize="rms"`` with ``accumulate="ema"`` (EMA momenta, Adam-style ``V``;
     neither is the paper's), which separates the effect of the scaling from that of momenta that
     never decay (additive ``M1 = β1 Σ g``).

   The non-matrix leaves of ``muon`` and the M3 runs (embedding, norms, biases) all take AdamW
   (same schedule shape) at one rate: AdamW's best rate of its sweep (AdamW's runs go first), or
   ``--adam-lr``; so the sweep compares the matrix optimizers alone. (``optimizer.name=m3`` in a
   training config shares one lr between the two branches.) The learning rate lives in the
   optimizer state (``optax.inject_hyperparams``), so all rates of one optimizer share one
   compiled train step.

   Per run: mean training loss of the last 10 steps and the held-out loss on ``--eval-batches``
   fixed batches (nats/token). Per optimizer the best run is the one with the lowest held-out loss
   (non-finite counts as +inf); a table (optimizer, rates tried, held-out loss per rate, best rate,
   best loss) is printed. Timing, after training: one train step of each optimizer on a fixed
   batch, and the optimizer update alone (``tx.update`` on fixed gradients), each interleaved
   (median of ``--repeats`` after a warm-up), with ratios to AdamW.
2. **Toy 2-layer regression** (the drop-in check): a ``16 → 64 (tanh) → 8`` MLP
   regressing a random ``16 → 32 (tanh) → 8`` teacher (targets scaled to unit variance, 256
   samples, full batch, MSE), 300 steps at a constant rate, with the library defaults
   ``optax.adamw(lr)``, ``optax.contrib.muon(lr)``, ``m3(lr)``, ``m3(lr, normalize="rms")`` and
   ``m3(lr, accumulate="ema", normalize="rms")`` (their AdamW branches at the same lr), every
   rate of :data:`TOY_SWEEPS` (``--toy-sweep``). ``--toy-only`` runs just this part.
3. **Proteus overhead** (SPEC §4): fwd+bwd tokens/s of ``proteus_gated_delta_chunked`` with
   ``E = 16`` from a zero state, ``E = 16`` from a nonzero ``initial_state`` (15 blocks re-enter
   through injection tokens), ``E = 1`` (which dispatches to the backbone) and plain
   ``gated_delta_chunked`` at ``T = --proteus-seq-len`` (context ``N = T``, so all 16 blocks open
   during the sequence), H=4, K=V=64, interleaved. ``--proteus-only`` runs just this part.

JSON keys (last stdout line with ``--json``): ``matmul_gflops``, ``steps``, ``data``, ``adam_lr``
(the non-matrix AdamW rate used);
per optimizer ``o`` ∈ {adamw, muon, m3, m3_rms, m3_rms_ema} (those swept): ``lr_{o}`` (best rate),
``eval_loss_{o}`` (its held-out loss), ``final_train_loss_{o}`` (its last-10 training loss),
``sweep_lrs_{o}``, ``sweep_eval_loss_{o}``, ``sweep_final_train_loss_{o}`` (lists, one entry per
rate), ``step_ms_{o}``, ``update_ms_{o}``; ``step_time_{o}_over_adamw``,
``update_time_{o}_over_adamw`` (``o`` ≠ adamw, when adamw is swept); toy regression:
``toy_steps``, ``toy_initial_loss``, ``toy_sweep_lrs_{o}``, ``toy_final_loss_{o}`` (lists),
``toy_best_lr_{o}``, ``toy_best_loss_{o}``; ``proteus_tokens_per_s_{E16,E16_S0,E1,gdn}``,
``proteus_E16_over_E1_time``, ``proteus_E16_S0_over_E1_time``, ``proteus_E1_over_gdn_time``;
``wall_s``. ``--proteus-only`` / ``--toy-only`` emit only their part's keys (and
``matmul_gflops``, ``wall_s``).

Code: part 1 is :mod:`nested_jax.bench.optim_lm`, part 2 :mod:`nested_jax.bench.optim_toy`, the
optimizer names and sweeps :mod:`nested_jax.bench.optim_sweeps`; this module holds part 3 and the
command line, and re-exports the public names of the others.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

from nested_jax.bench.common import emit, make_parser, matmul_gflops, progress, time_interleaved
from nested_jax.bench.optim_lm import (  # noqa: F401  (re-exported: the benchmark's public names)
    austen_byte_stream,
    compare_optimizers,
    lm_batches,
    make_optimizer,
    schedule_shape,
    tiny_gdn,
    window_batches,
)
from nested_jax.bench.optim_sweeps import (  # noqa: F401  (re-exported)
    DEFAULT_SWEEPS,
    M3_VARIANTS,
    OPTIMIZER_NAMES,
    TOY_SWEEPS,
    parse_sweep_args,
    sweep_table,
)
from nested_jax.bench.optim_toy import (  # noqa: F401  (re-exported)
    toy_comparison,
    toy_loss,
    toy_optimizer,
    toy_problem,
    toy_regression,
)
from nested_jax.core.associative.forms import gated_delta_chunked
from nested_jax.core.associative.proteus import proteus_gated_delta_chunked
from nested_jax.rules import ProteusRule

# --------------------------------------------------------------------------------------------------
# Proteus overhead
# --------------------------------------------------------------------------------------------------


def proteus_overhead(T: int = 2048, B: int = 1, H: int = 4, D: int = 64, repeats: int = 5):
    """fwd+bwd tokens/s of Proteus GDN (E=16 from a zero and from a nonzero state, E=1) and of
    plain GDN, interleaved; the gradient includes the initial state's where there is one."""
    from nested_jax.bench.core import gdn_inputs

    q, k, v, g, beta = gdn_inputs(T, B, H, D)
    s0 = 0.1 * jax.random.normal(jax.random.PRNGKey(1), (B, H, D, D), jnp.float32)

    def grad_of(fn, with_state=False):
        def loss(q, k, v, g, beta, s0):
            o, S = fn(q, k, v, g, beta, initial_state=s0 if with_state else None)
            return jnp.sum(o) + jnp.sum(S)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))

    e16 = functools.partial(proteus_gated_delta_chunked, schedule=ProteusRule(16, context_len=T))
    e1 = functools.partial(proteus_gated_delta_chunked, schedule=ProteusRule(1, context_len=T))
    fns = {
        "E16": grad_of(e16),
        "E16_S0": grad_of(e16, with_state=True),
        "E1": grad_of(e1),
        "gdn": grad_of(gated_delta_chunked),
    }
    times = time_interleaved(
        {n: functools.partial(f, q, k, v, g, beta, s0) for n, f in fns.items()},
        repeats=repeats,
        warmup=1,
    )
    results = {f"proteus_tokens_per_s_{n}": B * T / t for n, t in times.items()}
    results["proteus_T"] = T
    results["proteus_E16_over_E1_time"] = times["E16"] / times["E1"]
    results["proteus_E16_S0_over_E1_time"] = times["E16_S0"] / times["E1"]
    results["proteus_E1_over_gdn_time"] = times["E1"] / times["gdn"]
    progress(
        f"[bench optim] Proteus GDN fwd+bwd T={T}: E=16 {B * T / times['E16']:.0f} tok/s "
        f"(from a state {B * T / times['E16_S0']:.0f}), E=1 {B * T / times['E1']:.0f} tok/s, "
        f"plain GDN {B * T / times['gdn']:.0f} tok/s "
        f"(E16/E1 time x{results['proteus_E16_over_E1_time']:.2f})"
    )
    return results


def main(argv: list[str] | None = None) -> int:
    p = make_parser(
        "optim",
        "AdamW vs Muon vs M3 (Algorithm 1) vs M3 normalize='rms': learning-rate sweeps on the tiny "
        "GDN LM and a toy regression; Proteus GDN overhead",
    )
    p.add_argument("--steps", type=int, default=150, help="training steps of every LM run")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=64, help="width of the tiny GDN LM")
    p.add_argument("--layers", type=int, default=2, help="layers of the tiny GDN LM")
    p.add_argument("--data", choices=("austen", "synthetic"), default="austen")
    p.add_argument(
        "--sweep",
        action="append",
        metavar="NAME=LR,LR,...",
        help=f"peak learning rates of one optimizer ({', '.join(OPTIMIZER_NAMES)}) on the LM; "
        "repeat per optimizer; default: "
        + "; ".join(f"{n}={','.join(f'{x:g}' for x in v)}" for n, v in DEFAULT_SWEEPS.items()),
    )
    p.add_argument(
        "--optimizers", default=None, help="comma-separated subset to run (default: all)"
    )
    p.add_argument(
        "--adam-lr",
        type=float,
        default=None,
        help="AdamW lr of the non-matrix leaves of muon and the M3s (default: AdamW's best rate)",
    )
    p.add_argument("--m3-slow-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--toy-steps", type=int, default=300, help="steps of the toy regression")
    p.add_argument(
        "--toy-sweep",
        action="append",
        metavar="NAME=LR,LR,...",
        help="constant learning rates of the toy regression, per optimizer; default: "
        + "; ".join(f"{n}={','.join(f'{x:g}' for x in v)}" for n, v in TOY_SWEEPS.items()),
    )
    p.add_argument("--proteus-seq-len", type=int, default=2048)
    only = p.add_mutually_exclusive_group()
    only.add_argument(
        "--proteus-only", action="store_true", help="only the Proteus overhead (skip optimizers)"
    )
    only.add_argument("--toy-only", action="store_true", help="only the toy regression")
    args = p.parse_args([] if argv is None else argv)
    try:
        sweeps = parse_sweep_args(args.sweep, DEFAULT_SWEEPS, args.optimizers)
        toy_sweeps = parse_sweep_args(args.toy_sweep, TOY_SWEEPS, args.optimizers, "--toy-sweep")
    except ValueError as err:
        p.error(str(err))
    t0 = time.perf_counter()
    results: dict = {"matmul_gflops": matmul_gflops()}
    progress(f"[bench optim] f32 matmul: {results['matmul_gflops']:.1f} GFLOP/s")
    if not args.proteus_only:
        results.update(toy_comparison(toy_sweeps, steps=args.toy_steps))
    if not (args.proteus_only or args.toy_only):
        results.update(
            compare_optimizers(
                steps=args.steps,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                data=args.data,
                sweeps=sweeps,
                adam_lr=args.adam_lr,
                m3_slow_every=args.m3_slow_every,
                eval_batches=args.eval_batches,
                repeats=args.repeats,
                d_model=args.d_model,
                n_layers=args.layers,
            )
        )
    if not args.toy_only:
        results.update(proteus_overhead(T=args.proteus_seq_len, repeats=args.repeats))
    results["wall_s"] = time.perf_counter() - t0
    emit(results, args.json)
    return 0
