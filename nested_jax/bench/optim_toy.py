"""Part 2 of ``nested-jax bench optim``: the toy 2-layer regression (the drop-in check).

A ``16 → 64 (tanh) → 8`` MLP regresses a random ``16 → 32 (tanh) → 8`` teacher (targets scaled to
unit variance, 256 samples, full batch, MSE) for a number of steps at a constant rate, with the
library defaults a user would try first (:func:`toy_optimizer`), every rate of
:data:`~nested_jax.bench.optim_sweeps.TOY_SWEEPS`. The module docstring of
:mod:`nested_jax.bench.optim` lists the JSON keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from nested_jax.bench.common import progress
from nested_jax.bench.optim_sweeps import (
    M3_VARIANTS,
    OPTIMIZER_NAMES,
    TOY_SWEEPS,
    _best,
    _check_sweeps,
    sweep_table,
)
from nested_jax.optim.m3 import m3


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
