"""Part 1 of ``nested-jax bench optim``: the optimizers' learning-rate sweeps on the tiny GDN LM.

Data (Jane Austen byte windows or MQAR batches), the optimizers at a swept peak rate
(:func:`make_optimizer`, SPEC §3.5 for M3), and :func:`compare_optimizers`, which trains every
(optimizer, rate) from the same initialisation on the same batches, picks each optimizer's best
rate by held-out loss, then times one train step and one optimizer update of each. The protocol
and the JSON keys are in the module docstring of :mod:`nested_jax.bench.optim`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nested_jax.bench.common import progress, time_interleaved
from nested_jax.bench.optim_sweeps import (
    DEFAULT_SWEEPS,
    M3_VARIANTS,
    OPTIMIZER_NAMES,
    _best,
    _check_sweeps,
    sweep_table,
)
from nested_jax.optim.m3 import default_m3_mask, m3

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


def lm_batches(data: str, steps: int, eval_batches: int, batch_size: int, seq_len: int, seed: int):
    """``(train, held)``: ``steps`` training and ``eval_batches`` held-out batches.

    ``"austen"``: random windows of the first 95 % / the last 5 % of the byte stream;
    ``"synthetic"``: MQAR batches with the loss on every token (held-out from ``seed + 1``).
    """
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
    return train, held


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


# --------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------


def tiny_gdn(vocab_size: int = 256, d_model: int = 128, n_layers: int = 2, n_heads: int = 2):
    """The tiny GDN LM of the benchmark: ``(graphdef, state_def, params (pure dict), rest)``."""
    from nested_jax.models import ModelConfig, build_model

    cfg = ModelConfig(
        name="gdn", vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads
    )
    graphdef, params, rest = nnx.split(build_model(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    return graphdef, jax.tree.structure(params), nnx.to_pure_dict(params), rest


@dataclasses.dataclass
class _LMSweep:
    """The fixed pieces of one LM sweep, and what its runs have produced so far."""

    graphdef: object
    state_def: object
    params0: dict  # the common initialisation (pure dict)
    rest: object  # the model's non-parameter state
    sweeps: dict[str, tuple[float, ...]]
    steps: int
    m3_slow_every: int
    train: list[dict]  # one batch per step, the same for every run
    held: list[dict]  # held-out batches
    eval_step: object  # jitted: (params, rest, batch) -> {"loss_sum", "tokens", ...}
    results: dict  # the JSON keys, filled as the groups finish
    txs: dict = dataclasses.field(default_factory=dict)  # name -> the optimizer compiled
    step_fns: dict = dataclasses.field(default_factory=dict)  # name -> jitted train step
    final_states: dict = dataclasses.field(default_factory=dict)  # name -> state of its best run
    rows: dict = dataclasses.field(default_factory=dict)  # name -> (rates, held-out losses)


def _check_lm_args(steps: int, sweeps, adam_lr) -> dict[str, tuple[float, ...]]:
    """The validated sweeps (default :data:`DEFAULT_SWEEPS`); ``ValueError`` naming the argument."""
    if steps < 2:
        raise ValueError(f"steps: expected >= 2, got {steps}")
    sweeps = _check_sweeps(DEFAULT_SWEEPS if sweeps is None else sweeps, "sweeps")
    if adam_lr is None and "adamw" not in sweeps:
        raise ValueError("adam_lr: None (AdamW's best rate) needs 'adamw' in the sweeps")
    if adam_lr is not None and not adam_lr > 0:
        raise ValueError(f"adam_lr: expected a positive rate or None, got {adam_lr}")
    return sweeps


def _init_runs(sw: _LMSweep, names, non_matrix_lr) -> dict:
    """A fresh train state per (name, lr) of ``names``; compiles one train step per optimizer
    (the rate is in the optimizer state, so every rate of an optimizer shares it)."""
    from nested_jax.train.step import make_train_step

    states = {}
    for name in names:
        for lr in sw.sweeps[name]:
            kw = {} if non_matrix_lr is None else {"adam_lr": non_matrix_lr}
            tx = make_optimizer(name, lr, sw.steps, slow_every=sw.m3_slow_every, **kw)
            if name not in sw.step_fns:
                sw.txs[name] = tx
                sw.step_fns[name] = jax.jit(
                    make_train_step(sw.graphdef, sw.state_def, tx, lambda _: 0.0)
                )
            states[name, lr] = {
                "step": jnp.zeros((), jnp.int32),
                "params": sw.params0,
                "opt_state": tx.init(sw.params0),
                "consecutive_skips": jnp.zeros((), jnp.int32),
            }
    return states


def _score_group(sw: _LMSweep, names, states: dict, losses: dict) -> None:
    """Held-out loss and last-10 training loss of every run; the best rate per optimizer goes
    into ``sw.results`` / ``sw.rows`` / ``sw.final_states``."""
    for name in names:
        evs, trs = [], []
        for lr in sw.sweeps[name]:
            tail = np.asarray(jax.device_get(losses[name, lr][-10:]), np.float64)
            sums = [sw.eval_step(states[name, lr]["params"], sw.rest, b) for b in sw.held]
            evs.append(float(sum(s["loss_sum"] for s in sums) / sum(s["tokens"] for s in sums)))
            trs.append(float(tail.mean()))
            progress(
                f"[bench optim] {name:<10} lr {lr:<7g} train loss (last 10) {trs[-1]:.3f}, "
                f"held-out loss {evs[-1]:.3f} nats/token"
            )
        lrs = sw.sweeps[name]
        b = _best(lrs, evs)
        sw.results[f"lr_{name}"] = lrs[b]
        sw.results[f"eval_loss_{name}"] = evs[b]
        sw.results[f"final_train_loss_{name}"] = trs[b]
        sw.results[f"sweep_lrs_{name}"] = list(lrs)
        sw.results[f"sweep_eval_loss_{name}"] = evs
        sw.results[f"sweep_final_train_loss_{name}"] = trs
        sw.rows[name] = (list(lrs), evs)
        sw.final_states[name] = states[name, lrs[b]]


def _run_group(sw: _LMSweep, names, non_matrix_lr) -> None:
    """Trains every (name, lr) of ``names``, the runs taking their steps in turn, then scores."""
    states = _init_runs(sw, names, non_matrix_lr)
    losses = {run: [] for run in states}
    progress(
        f"[bench optim] {len(states)} runs x {sw.steps} steps: "
        + "; ".join(f"{n} lr {', '.join(f'{x:g}' for x in sw.sweeps[n])}" for n in names)
        + (f" (non-matrix leaves: AdamW lr {non_matrix_lr:g})" if names != ["adamw"] else "")
    )
    for batch in sw.train:
        for run in states:
            states[run], m = sw.step_fns[run[0]](states[run], sw.rest, batch)
            losses[run].append(m["loss"])
    _score_group(sw, names, states, losses)


def _plain_loss(graphdef, state_def, params, rest, batch):
    from nested_jax.train.step import make_loss_fn

    return make_loss_fn(graphdef, state_def)(params, rest, batch)[0]


def _time_optimizers(sw: _LMSweep, others, repeats: int) -> None:
    """Interleaved timing: one train step of each optimizer (from its best run's final state, the
    result discarded) and the optimizer update alone on fixed gradients; fills ``sw.results``."""
    timed = {
        name: functools.partial(sw.step_fns[name], sw.final_states[name], sw.rest, sw.train[0])
        for name in sw.txs
    }
    times = time_interleaved(timed, repeats=repeats, warmup=1)
    grads = jax.grad(lambda p: _plain_loss(sw.graphdef, sw.state_def, p, sw.rest, sw.train[0]))(
        sw.params0
    )
    upd = {}
    for name, tx in sw.txs.items():
        f = jax.jit(tx.update)
        upd[name] = functools.partial(f, grads, tx.init(sw.params0), sw.params0)
    utimes = time_interleaved(upd, repeats=repeats, warmup=1)
    for name in sw.txs:
        sw.results[f"step_ms_{name}"] = 1e3 * times[name]
        sw.results[f"update_ms_{name}"] = 1e3 * utimes[name]
    if "adamw" in sw.txs:
        for name in others:
            sw.results[f"step_time_{name}_over_adamw"] = times[name] / times["adamw"]
            sw.results[f"update_time_{name}_over_adamw"] = utimes[name] / utimes["adamw"]
    progress(
        "[bench optim] update only: " + ", ".join(f"{n} {1e3 * utimes[n]:.2f} ms" for n in sw.txs)
    )


def _sweep_report(sw: _LMSweep, data, batch_size, seq_len, d_model, n_layers, adam_lr) -> str:
    """The printed summary: the settings line and the sweep table."""
    results, rows = sw.results, sw.rows
    return (
        f"[bench optim] tiny GDN LM ({data}, d_model {d_model}, {n_layers} layers), {sw.steps} "
        f"steps of {batch_size}x{seq_len} tokens, same init and batches; held-out loss "
        f"(nats/token) per peak lr; non-matrix leaves of muon and the M3s: AdamW lr "
        f"{results['adam_lr']:g}"
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
    from nested_jax.train.step import make_eval_step

    sweeps = _check_lm_args(steps, sweeps, adam_lr)
    train, held = lm_batches(data, steps, eval_batches, batch_size, seq_len, seed)
    graphdef, state_def, params0, rest = tiny_gdn(d_model=d_model, n_layers=n_layers)
    eval_step = jax.jit(make_eval_step(graphdef, state_def))
    results: dict = {"steps": steps, "data": data}
    sw = _LMSweep(
        graphdef, state_def, params0, rest, sweeps, steps, m3_slow_every, train, held, eval_step,
        results,
    )  # fmt: skip
    others = [n for n in sweeps if n != "adamw"]
    if "adamw" in sweeps:
        _run_group(sw, ["adamw"], None)
    results["adam_lr"] = results["lr_adamw"] if adam_lr is None else adam_lr
    if others:
        _run_group(sw, others, results["adam_lr"])
    _time_optimizers(sw, others, repeats)
    progress(_sweep_report(sw, data, batch_size, seq_len, d_model, n_layers, adam_lr))
    return results
