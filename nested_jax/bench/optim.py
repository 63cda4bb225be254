"""``nested-jax bench optim [--json]``: AdamW vs Muon vs M3 (three settings), learning-rate sweeps.

All in one process (DESIGN.md "Benchmarks"):

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
2. **Toy 2-layer regression** (the drop-in check of issue 13): a ``16 → 64 (tanh) → 8`` MLP
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
"""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nested_jax.bench.common import (
    emit,
    make_parser,
    matmul_gflops,
    progress,
    time_interleaved,
)
from nested_jax.core.associative import gated_delta_chunked
from nested_jax.core.proteus_memory import proteus_gated_delta_chunked
from nested_jax.optim.m3 import default_m3_mask, m3

OPTIMIZER_NAMES = ("adamw", "muon", "m3", "m3_rms", "m3_rms_ema")
# M3 settings of each M3 entry: (accumulate, normalize).
M3_VARIANTS = {
    "m3": ("additive", "none"),  # Algorithm 1 as printed (the default of m3())
    "m3_rms": ("additive", "rms"),  # scale-invariant, the paper's additive momenta
    "m3_rms_ema": ("ema", "rms"),  # scale-invariant, EMA momenta (neither is the paper's)
}
# Peak learning rates swept on the tiny GDN LM (the matrix lr for muon and the M3s): three per
# optimizer (factor ~3 apart; 4 for m3), chosen so that at the default sizes each optimizer's best
# rate lies inside its sweep (wider sweeps, 150 steps: 1e-3 … 1e-1 for AdamW, 6e-3 … 0.6 for Muon,
# 1e-5 … 2.56e-3 for m3, 3e-3 … 0.3 for the rms variants). m3 (Algorithm 1: step ∝ lr/|g|) needs
# far smaller rates.
DEFAULT_SWEEPS: dict[str, tuple[float, ...]] = {
    "adamw": (1e-2, 3e-2, 1e-1),
    "muon": (2e-2, 6e-2, 2e-1),
    "m3": (4e-5, 1.6e-4, 6.4e-4),
    "m3_rms": (3e-2, 1e-1, 3e-1),
    "m3_rms_ema": (3e-2, 1e-1, 3e-1),
}
# Constant learning rates of the toy regression (cheap: all runs compile as one jitted function).
TOY_SWEEPS: dict[str, tuple[float, ...]] = {
    "adamw": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    "muon": (3e-3, 1e-2, 3e-2, 1e-1),
    "m3": (1e-4, 3e-4, 1e-3, 3e-3),
    "m3_rms": (1e-3, 3e-3, 1e-2, 3e-2),
    "m3_rms_ema": (1e-3, 3e-3, 1e-2, 3e-2),
}


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def austen_byte_stream() -> np.ndarray:
    """Jane Austen's novels as one int32 byte stream (documents joined by a blank line)."""
    from nested_jax.data.corpus import austen_documents

    text = "\n\n".join(austen_documents())
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def window_batches(stream: np.ndarray, n: int, batch_size: int, seq_len: int, seed: int):
    """``n`` batches of random ``seq_len + 1`` windows of ``stream`` (loss on every token)."""
    rng = np.random.default_rng(seed)
    if stream.shape[0] < seq_len + 2:
        raise ValueError(f"stream: needs more than {seq_len + 1} tokens, got {stream.shape[0]}")
    out = []
    for _ in range(n):
        starts = rng.integers(0, stream.shape[0] - seq_len - 1, size=batch_size)
        w = np.stack([stream[s : s + seq_len + 1] for s in starts])
        out.append(
            {
                "inputs": w[:, :-1],
                "targets": w[:, 1:],
                "loss_mask": np.ones((batch_size, seq_len), np.float32),
            }
        )
    return out


def _synthetic_batches(n, batch_size, seq_len, seed):
    from nested_jax.eval.tasks import make_mqar_batch

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = make_mqar_batch(rng, batch_size, seq_len, max(1, min(8, (seq_len + 1) // 4)), 256)
        b["loss_mask"] = np.ones_like(b["loss_mask"])
        out.append(b)
    return out


# --------------------------------------------------------------------------------------------------
# Optimizers
# --------------------------------------------------------------------------------------------------


def _muon_dims(params):
    # Same routing as M3: stacked [layers, d_in, d_out] matrices are orthogonalised per layer.
    mask = default_m3_mask(params)
    return jax.tree.map(
        lambda p, m: optax.contrib.MuonDimensionNumbers(p.ndim - 2, p.ndim - 1) if m else None,
        params,
        mask,
    )


def _decay_matrices(params):
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def schedule_shape(steps: int) -> optax.Schedule:
    """The bench's lr shape with peak 1: warmup over ``max(1, steps // 10)``, cosine to 0.1."""
    from nested_jax.train.config import OptimizerConfig
    from nested_jax.train.optimizer import learning_rate_schedule

    cfg = OptimizerConfig(
        lr=1.0, warmup_steps=max(1, steps // 10), decay="cosine", min_lr_ratio=0.1
    )
    return learning_rate_schedule(cfg, steps)


def make_optimizer(
    name: str, lr: float, steps: int, adam_lr: float = 3e-3, slow_every: int = 10
) -> optax.GradientTransformation:
    """One optimizer of the LM sweep at peak rate ``lr`` (see the module docstring).

    ``clip_by_global_norm(1.0)`` then the optimizer, with the schedule ``lr · schedule_shape``.
    The rate is an ``optax.inject_hyperparams`` hyperparameter, i.e. it lives in the state: the
    ``update`` of any rate serves the states of every rate (one compiled train step per optimizer).

    Args:
      name: one of :data:`OPTIMIZER_NAMES`.
      lr: peak learning rate (AdamW: all leaves; the others: the matrices).
      steps: training steps (the schedule's length).
      adam_lr: peak AdamW rate of the non-matrix leaves of muon and the M3 runs.
      slow_every: M3's slow period.
    """
    from nested_jax.train.config import OptimizerConfig
    from nested_jax.train.optimizer import OPTIMIZERS

    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"name: expected one of {OPTIMIZER_NAMES}, got {name!r}")
    shape = schedule_shape(steps)

    def adam_sched(count):
        return adam_lr * shape(count)

    def build(learning_rate):
        def sched(count):
            return learning_rate * shape(count)

        if name == "adamw":
            inner = OPTIMIZERS["adamw"](OptimizerConfig(name="adamw", weight_decay=0.1), sched)
        elif name == "muon":
            inner = optax.contrib.muon(
                sched,
                weight_decay=0.1,
                adam_learning_rate=adam_sched,
                adam_b2=0.95,
                adam_weight_decay=0.1,
                muon_weight_dimension_numbers=_muon_dims,
            )
        else:
            accumulate, normalize = M3_VARIANTS[name]
            inner = m3(
                sched,
                slow_every=slow_every,
                accumulate=accumulate,
                weight_decay=0.1,
                weight_decay_mask=_decay_matrices,
                adam_b2=0.95,
                adam_learning_rate=adam_sched,
                normalize=normalize,
            )
        return optax.chain(optax.clip_by_global_norm(1.0), inner)

    return optax.inject_hyperparams(build)(learning_rate=lr)


def _check_sweeps(sweeps: dict, what: str) -> dict[str, tuple[float, ...]]:
    unknown = sorted(set(sweeps) - set(OPTIMIZER_NAMES))
    if unknown:
        raise ValueError(f"{what}: unknown optimizer(s) {unknown}; expected {OPTIMIZER_NAMES}")
    out = {}
    for name in OPTIMIZER_NAMES:
        if name not in sweeps:
            continue
        lrs = tuple(float(x) for x in sweeps[name])
        if not lrs or not all(math.isfinite(x) and x > 0 for x in lrs):
            raise ValueError(f"{what}: {name} needs positive learning rates, got {lrs}")
        out[name] = lrs
    if not out:
        raise ValueError(f"{what}: no optimizer to run")
    return out


def _best(lrs, losses) -> int:
    keyed = [x if math.isfinite(x) else math.inf for x in losses]
    return int(np.argmin(keyed))


def sweep_table(title: str, rows: dict[str, tuple[list, list]], extra: dict | None = None) -> str:
    """A markdown table: optimizer, rates tried, loss per rate, best rate, best loss (+ extras).

    Args:
      title: column title of the losses.
      rows: name → (rates, losses).
      extra: optional column name → {name: text}.
    """
    extra = extra or {}
    head = ["optimizer", "lrs tried", f"{title} per lr", "best lr", f"best {title}", *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, (lrs, losses) in rows.items():
        b = _best(lrs, losses)
        cells = [
            name,
            ", ".join(f"{x:g}" for x in lrs),
            ", ".join(f"{x:.3f}" for x in losses),
            f"{lrs[b]:g}",
            f"{losses[b]:.3f}",
            *(col.get(name, "") for col in extra.values()),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tiny_gdn(vocab_size: int = 256, d_model: int = 128, n_layers: int = 2, n_heads: int = 2):
    """The tiny GDN LM of the benchmark: ``(graphdef, state_def, params (pure dict), rest)``."""
    from nested_jax.models import ModelConfig, build_model

    cfg = ModelConfig(
        name="gdn", vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads
    )
    graphdef, params, rest = nnx.split(build_model(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    return graphdef, jax.tree.structure(params), nnx.to_pure_dict(params), rest


def compare_optimizers(
    steps: int = 150,
    batch_size: int = 8,
    seq_len: int = 128,
    data: str = "austen",
    sweeps: dict[str, tuple[float, ...]] | None = None,
    adam_lr: float | None = None,
    m3_slow_every: int = 10,
    eval_batches: int = 8,
    repeats: int = 5,
    seed: int = 0,
    d_model: int = 64,
    n_layers: int = 2,
) -> dict:
    """Trains the tiny GDN with every (optimizer, rate) of ``sweeps`` (module docstring).

    AdamW's runs go first (when ``adam_lr`` is None, its best rate becomes the AdamW rate of the
    non-matrix leaves of the other optimizers), then the others; inside each group the runs take
    their steps in turn. Timing afterwards: one training step of each optimizer on a fixed batch,
    interleaved (``repeats`` rounds after one warm-up), and ``tx.update`` alone likewise.

    Args:
      steps: training steps of every run (≥ 2).
      batch_size, seq_len: batch shape ``[batch_size, seq_len]``.
      data: ``"austen"`` or ``"synthetic"``.
      sweeps: optimizer name → peak rates (default :data:`DEFAULT_SWEEPS`); only these run.
      adam_lr: AdamW rate of the non-matrix leaves of muon and the M3 runs; None: the best rate
        of the AdamW sweep (then ``sweeps`` must include ``adamw``).
      m3_slow_every: M3's slow period.
      eval_batches: held-out batches.
      repeats: timed rounds.
      seed, d_model, n_layers: data seed and model size.

    Returns:
      the results dict (JSON keys of the module docstring); also prints the sweep table.
    """
    from nested_jax.train.step import make_eval_step, make_train_step

    if steps < 2:
        raise ValueError(f"steps: expected >= 2, got {steps}")
    sweeps = _check_sweeps(DEFAULT_SWEEPS if sweeps is None else sweeps, "sweeps")
    if adam_lr is None and "adamw" not in sweeps:
        raise ValueError("adam_lr: None (AdamW's best rate) needs 'adamw' in the sweeps")
    if adam_lr is not None and not adam_lr > 0:
        raise ValueError(f"adam_lr: expected a positive rate or None, got {adam_lr}")
    if data == "austen":
        stream = austen_byte_stream()
        split = int(0.95 * stream.shape[0])
        train = window_batches(stream[:split], steps, batch_size, seq_len, seed)
        held = window_batches(stream[split:], eval_batches, batch_size, seq_len, seed + 1)
    elif data == "synthetic":
        train = _synthetic_batches(steps, batch_size, seq_len, seed)
        held = _synthetic_batches(eval_batches, batch_size, seq_len, seed + 1)
    else:
        raise ValueError(f"data: expected 'austen' or 'synthetic', got {data!r}")
    graphdef, state_def, params0, rest = tiny_gdn(d_model=d_model, n_layers=n_layers)
    eval_step = jax.jit(make_eval_step(graphdef, state_def))
    results: dict = {"steps": steps, "data": data}
    txs, step_fns, final_states, rows = {}, {}, {}, {}

    def run_group(names, non_matrix_lr):
        """Trains every (name, lr) of ``names``, the runs taking their steps in turn."""
        states, losses = {}, {}
        for name in names:
            for lr in sweeps[name]:
                kw = {} if non_matrix_lr is None else {"adam_lr": non_matrix_lr}
                tx = make_optimizer(name, lr, steps, slow_every=m3_slow_every, **kw)
                # one compiled step per optimizer: the rate is in the state
                if name not in step_fns:
                    txs[name] = tx
                    step_fns[name] = jax.jit(
                        make_train_step(graphdef, state_def, tx, lambda _: 0.0)
                    )
                states[name, lr] = {
                    "step": jnp.zeros((), jnp.int32),
                    "params": params0,
                    "opt_state": tx.init(params0),
                    "consecutive_skips": jnp.zeros((), jnp.int32),
                }
                losses[name, lr] = []
        progress(
            f"[bench optim] {len(states)} runs x {steps} steps: "
            + "; ".join(f"{n} lr {', '.join(f'{x:g}' for x in sweeps[n])}" for n in names)
            + (f" (non-matrix leaves: AdamW lr {non_matrix_lr:g})" if names != ["adamw"] else "")
        )
        for batch in train:
            for run in states:
                states[run], m = step_fns[run[0]](states[run], rest, batch)
                losses[run].append(m["loss"])
        for name in names:
            evs, trs = [], []
            for lr in sweeps[name]:
                tail = np.asarray(jax.device_get(losses[name, lr][-10:]), np.float64)
                sums = [eval_step(states[name, lr]["params"], rest, b) for b in held]
                evs.append(float(sum(s["loss_sum"] for s in sums) / sum(s["tokens"] for s in sums)))
                trs.append(float(tail.mean()))
                progress(
                    f"[bench optim] {name:<10} lr {lr:<7g} train loss (last 10) {trs[-1]:.3f}, "
                    f"held-out loss {evs[-1]:.3f} nats/token"
                )
            lrs = sweeps[name]
            b = _best(lrs, evs)
            results[f"lr_{name}"] = lrs[b]
            results[f"eval_loss_{name}"] = evs[b]
            results[f"final_train_loss_{name}"] = trs[b]
            results[f"sweep_lrs_{name}"] = list(lrs)
            results[f"sweep_eval_loss_{name}"] = evs
            results[f"sweep_final_train_loss_{name}"] = trs
            rows[name] = (list(lrs), evs)
            final_states[name] = states[name, lrs[b]]

    others = [n for n in sweeps if n != "adamw"]
    if "adamw" in sweeps:
        run_group(["adamw"], None)
    results["adam_lr"] = results["lr_adamw"] if adam_lr is None else adam_lr
    if others:
        run_group(others, results["adam_lr"])

    # Timing, interleaved: one train step of each optimizer (from its best run's final state, the
    # result discarded) and the optimizer update alone on fixed gradients.
    timed = {
        name: functools.partial(step_fns[name], final_states[name], rest, train[0]) for name in txs
    }
    times = time_interleaved(timed, repeats=repeats, warmup=1)
    grads = jax.grad(lambda p: _plain_loss(graphdef, state_def, p, rest, train[0]))(params0)
    upd = {}
    for name, tx in txs.items():
        f = jax.jit(tx.update)
        upd[name] = functools.partial(f, grads, tx.init(params0), params0)
    utimes = time_interleaved(upd, repeats=repeats, warmup=1)
    for name in txs:
        results[f"step_ms_{name}"] = 1e3 * times[name]
        results[f"update_ms_{name}"] = 1e3 * utimes[name]
    if "adamw" in txs:
        for name in others:
            results[f"step_time_{name}_over_adamw"] = times[name] / times["adamw"]
            results[f"update_time_{name}_over_adamw"] = utimes[name] / utimes["adamw"]
    progress(
        "[bench optim] update only: " + ", ".join(f"{n} {1e3 * utimes[n]:.2f} ms" for n in txs)
    )
    progress(
        f"[bench optim] tiny GDN LM ({data}, d_model {d_model}, {n_layers} layers), {steps} steps "
        f"of {batch_size}x{seq_len} tokens, same init and batches; held-out loss (nats/token) per "
        f"peak lr; non-matrix leaves of muon and the M3s: AdamW lr {results['adam_lr']:g}"
        + (" (AdamW's best)" if adam_lr is None else "")
        + "\n"
        + sweep_table(
            "held-out loss",
            rows,
            {
                "train loss at best": {n: f"{results[f'final_train_loss_{n}']:.3f}" for n in rows},
                "step ms": {n: f"{results[f'step_ms_{n}']:.1f}" for n in rows},
            },
        )
    )
    return results


def _plain_loss(graphdef, state_def, params, rest, batch):
    from nested_jax.train.step import make_loss_fn

    return make_loss_fn(graphdef, state_def)(params, rest, batch)[0]


# --------------------------------------------------------------------------------------------------
# Toy 2-layer regression (drop-in check)
# --------------------------------------------------------------------------------------------------


def toy_optimizer(name: str, lr) -> optax.GradientTransformation:
    """The library defaults a user would try first: ``optax.adamw(lr)``,
    ``optax.contrib.muon(lr)``, ``m3(lr)`` (Algorithm 1), ``m3(lr, normalize="rms")`` and
    ``m3(lr, accumulate="ema", normalize="rms")``."""
    if name == "adamw":
        return optax.adamw(lr)
    if name == "muon":
        return optax.contrib.muon(lr)
    if name in M3_VARIANTS:
        accumulate, normalize = M3_VARIANTS[name]
        return m3(lr, accumulate=accumulate, normalize=normalize)
    raise ValueError(f"name: expected one of {OPTIMIZER_NAMES}, got {name!r}")


def toy_problem(seed: int = 0, n: int = 256, d_in: int = 16, d_hidden: int = 64, d_out: int = 8):
    """``(x [n, d_in], y [n, d_out], params0)`` of the toy regression (module docstring).

    Teacher ``y = tanh(x W1*) W2*`` (hidden 32), scaled to unit variance; student
    ``tanh(x w1 + b1) w2 + b2`` with ``w1 ~ N(0, 1/d_in)``, ``w2 ~ N(0, 1/d_hidden)``, zero biases.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d_in)).astype(np.float32)
    w1t = rng.normal(size=(d_in, 32)) / np.sqrt(d_in)
    w2t = rng.normal(size=(32, d_out))
    y = np.tanh(x @ w1t) @ w2t
    y = (y / y.std()).astype(np.float32)
    params = {
        "w1": (rng.normal(size=(d_in, d_hidden)) / np.sqrt(d_in)).astype(np.float32),
        "b1": np.zeros(d_hidden, np.float32),
        "w2": (rng.normal(size=(d_hidden, d_out)) / np.sqrt(d_hidden)).astype(np.float32),
        "b2": np.zeros(d_out, np.float32),
    }
    return jnp.asarray(x), jnp.asarray(y), jax.tree.map(jnp.asarray, params)


def toy_loss(params, x, y):
    """Mean squared error of the toy student."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean(jnp.square(h @ params["w2"] + params["b2"] - y))


def toy_regression(runs, steps: int = 300, seed: int = 0) -> tuple[float, list[float]]:
    """Trains the toy student for every ``(name, lr)`` of ``runs`` with ``toy_optimizer(name,
    lr)`` (all runs in one jitted function, each a ``lax.scan``; compiling one graph is much
    cheaper than one per run).

    Returns:
      ``(MSE at step 0, [MSE after `steps` steps, one per run])``.
    """
    x, y, params0 = toy_problem(seed)
    runs = [(name, float(lr)) for name, lr in runs]

    def train(name, lr):
        tx = toy_optimizer(name, lr)

        def step(carry, _):
            p, s = carry
            g = jax.grad(toy_loss)(p, x, y)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, _), _ = jax.lax.scan(step, (params0, tx.init(params0)), None, length=steps)
        return toy_loss(p, x, y)

    final = jax.jit(lambda: [train(name, lr) for name, lr in runs])()
    return float(toy_loss(params0, x, y)), [float(v) for v in final]


def toy_comparison(sweeps: dict | None = None, steps: int = 300, seed: int = 0) -> dict:
    """Every optimizer of ``sweeps`` (default :data:`TOY_SWEEPS`) on the toy regression; prints
    the table and returns the ``toy_*`` JSON keys."""
    sweeps = _check_sweeps(TOY_SWEEPS if sweeps is None else sweeps, "toy sweeps")
    results: dict = {"toy_steps": steps}
    rows = {}
    init, flat = toy_regression([(n, lr) for n, lrs in sweeps.items() for lr in lrs], steps, seed)
    results["toy_initial_loss"] = init
    for name, lrs in sweeps.items():
        final, flat = flat[: len(lrs)], flat[len(lrs) :]
        b = _best(lrs, final)
        results[f"toy_sweep_lrs_{name}"] = list(lrs)
        results[f"toy_final_loss_{name}"] = final
        results[f"toy_best_lr_{name}"] = lrs[b]
        results[f"toy_best_loss_{name}"] = final[b]
        rows[name] = (list(lrs), final)
    progress(
        f"[bench optim] toy 2-layer regression, {steps} steps, constant lr, library defaults; "
        f"MSE at step 0: {results['toy_initial_loss']:.3f}\n"
        + sweep_table(f"MSE after {steps} steps", rows)
    )
    return results


# --------------------------------------------------------------------------------------------------
# Proteus overhead
# --------------------------------------------------------------------------------------------------


def proteus_overhead(T: int = 2048, B: int = 1, H: int = 4, D: int = 64, repeats: int = 5):
    """fwd+bwd tokens/s of Proteus GDN (E=16 from a zero and from a nonzero state, E=1) and of
    plain GDN, interleaved; the gradient includes the initial state's where there is one."""
    from nested_jax.bench.core import _inputs

    q, k, v, g, beta = _inputs(T, B, H, D)
    s0 = 0.1 * jax.random.normal(jax.random.PRNGKey(1), (B, H, D, D), jnp.float32)

    def grad_of(fn, with_state=False):
        def loss(q, k, v, g, beta, s0):
            o, S = fn(q, k, v, g, beta, initial_state=s0 if with_state else None)
            return jnp.sum(o) + jnp.sum(S)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))

    e16 = functools.partial(proteus_gated_delta_chunked, context_len=T, num_blocks=16)
    fns = {
        "E16": grad_of(e16),
        "E16_S0": grad_of(e16, with_state=True),
        "E1": grad_of(functools.partial(proteus_gated_delta_chunked, context_len=T, num_blocks=1)),
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


def _parse_lrs(text: str, what: str) -> tuple[float, ...]:
    try:
        lrs = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from None
    if not lrs:
        raise ValueError(f"{what}: expected at least one learning rate, got {text!r}")
    return lrs


def parse_sweep_args(items, defaults: dict, optimizers: str | None, what: str = "--sweep") -> dict:
    """``--sweep NAME=LR,LR`` items (later ones win) over ``defaults``, restricted to
    ``optimizers`` (comma-separated names; None = all of ``defaults``)."""
    sweeps = dict(defaults)
    for item in items or ():
        name, sep, lrs = item.partition("=")
        if not sep or name not in OPTIMIZER_NAMES:
            raise ValueError(
                f"{what}: expected NAME=LR,LR,... with NAME in {OPTIMIZER_NAMES}, got {item!r}"
            )
        sweeps[name] = _parse_lrs(lrs, f"{what} {name}")
    if optimizers is not None:
        names = [n.strip() for n in optimizers.split(",") if n.strip()]
        unknown = [n for n in names if n not in OPTIMIZER_NAMES]
        if unknown or not names:
            raise ValueError(
                f"--optimizers: expected names from {OPTIMIZER_NAMES}, got {optimizers!r}"
            )
        sweeps = {n: sweeps[n] for n in OPTIMIZER_NAMES if n in names}
    return sweeps


def main(argv: list[str] | None = None) -> int:
    p = make_parser(
        "AdamW vs Muon vs M3 (Algorithm 1) vs M3 normalize='rms': learning-rate sweeps on the tiny "
        "GDN LM and a toy regression; Proteus GDN overhead"
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
