"""Pure, jittable training and evaluation steps over an explicit train state.

The train state is a plain dict of arrays (so orbax saves and restores it exactly)::

    {"step": int32[],                # optimizer steps taken so far, skipped ones included
     "params": {...},                # nnx.Param values as a pure nested dict (f32 master weights)
     "opt_state": optax state,
     "consecutive_skips": int32[]}   # non-finite steps in a row (NaN policy)

NaN/Inf policy: when the loss or the gradient norm is not finite the update is not applied — params
and optimizer state are selected unchanged with ``jnp.where`` inside the jitted step, so a skipped
step is exact — and ``consecutive_skips`` counts up; a finite step resets it. The host loop turns
the count into "skip" or "stop".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nested_jax.ops import chunked_cross_entropy
from nested_jax.parallel.mesh import traced_on

TrainState = dict[str, Any]
Batch = dict[str, jax.Array]


def masked_cross_entropy(
    logits: jax.Array, targets: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Summed token cross-entropy ``Σ_t m_t (logsumexp(z_t) − z_t[y_t])`` (nats) and ``Σ_t m_t``.

    Args:
      logits: ``[B, T, V]`` (any float dtype; computed in f32).
      targets: ``[B, T]`` int token ids.
      mask: ``[B, T]`` weights (1 = count the token, 0 = padding / ignored).
    Returns:
      ``(loss_sum, weight_sum)`` f32 scalars.
    """
    if logits.ndim != 3 or targets.shape != logits.shape[:2] or mask.shape != targets.shape:
        raise ValueError(
            f"logits/targets/mask: expected [B, T, V] / [B, T] / [B, T], got {logits.shape} / "
            f"{targets.shape} / {mask.shape}"
        )
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    # where(): padding positions may hold inf/NaN logits and must not leak into the sum.
    return jnp.sum(jnp.where(mask > 0, nll, 0.0) * mask), jnp.sum(mask)


def target_bytes(targets: jax.Array, mask: jax.Array, token_bytes: jax.Array | None) -> jax.Array:
    """UTF-8 bytes covered by the counted targets: ``Σ m_t · token_bytes[y_t]`` (tokens if None)."""
    if token_bytes is None:
        return jnp.sum(mask.astype(jnp.float32))
    return jnp.sum(jnp.take(token_bytes, targets, mode="clip").astype(jnp.float32) * mask)


def params_to_state(params: dict, state_def: Any) -> nnx.State:
    """Rebuilds the nnx ``State`` of the parameters from its pure dict (same leaf order)."""
    return jax.tree.unflatten(state_def, jax.tree.leaves(params))


def make_loss_fn(graphdef: Any, state_def: Any, *, loss_chunk: int = 0) -> Callable:
    """``loss_fn(params, rest, batch) -> (mean_loss, (loss_sum, weight_sum))`` for an nnx LM.

    The model gives its final hidden states (``model.hidden(inputs, segment_ids=...)``) and output
    projection (``model.output_weight()``); the loss is :func:`masked_cross_entropy` of the f32
    logits, computed ``loss_chunk`` positions at a time (``ops.chunked_cross_entropy``: equal
    values and gradients, no ``[B, T, V]`` logits of the whole batch; 0 = all at once).
    """

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params_to_state(params, state_def), rest)
        hidden, _ = model.hidden(batch["inputs"], segment_ids=batch.get("segment_ids"))
        weight_matrix, layout = model.output_weight()
        loss_sum, weight = chunked_cross_entropy(
            hidden,
            weight_matrix,
            batch["targets"],
            batch["loss_mask"],
            chunk_tokens=loss_chunk,
            weight_layout=layout,
        )
        return loss_sum / jnp.maximum(weight, 1.0), (loss_sum, weight)

    return loss_fn


def make_train_step(
    graphdef: Any,
    state_def: Any,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    token_bytes: jax.Array | None = None,
    debug_nan_at_steps: Sequence[int] = (),
    loss_chunk: int = 0,
    mesh: jax.sharding.Mesh | None = None,
) -> Callable[[TrainState, Any, Batch], tuple[TrainState, dict]]:
    """Builds the pure ``train_step(state, rest, batch) -> (state, metrics)``.

    ``rest`` is the model's non-parameter state (passed through, never updated). Metrics (f32
    scalars): loss (mean nats/token), loss_sum, tokens, bytes, grad_norm, lr (of this step), finite
    (1/0), consecutive_skips. ``debug_nan_at_steps`` (tests only) multiplies the loss by NaN at
    those 1-based steps, so loss and gradients are NaN exactly as in a real blow-up.
    ``loss_chunk``: see :func:`make_loss_fn`. ``mesh``: the mesh the parameters and batches are
    sharded on; the step traces its body on it (``nested_jax.parallel.mesh.traced_on``), so the
    model's activation constraints hold in any ``jax.jit`` of the step, inside ``jax.set_mesh`` or
    not (None: only inside the caller's mesh).
    """
    loss_fn = make_loss_fn(graphdef, state_def, loss_chunk=loss_chunk)
    nan_steps = jnp.asarray(tuple(debug_nan_at_steps) or (-1,), jnp.int32)

    def train_step(state: TrainState, rest: Any, batch: Batch):
        step = state["step"] + 1

        def objective(params):
            loss, aux = loss_fn(params, rest, batch)
            if debug_nan_at_steps:
                poison = jnp.where(jnp.any(nan_steps == step), jnp.nan, 1.0)
                loss = loss * poison
                aux = (aux[0] * poison, aux[1])
            return loss, aux

        (loss, (loss_sum, weight)), grads = jax.value_and_grad(objective, has_aux=True)(
            state["params"]
        )
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = tx.update(grads, state["opt_state"], state["params"])
        new_params = optax.apply_updates(state["params"], updates)

        def keep(new, old):
            return jnp.where(finite, new, old)

        skips = jnp.where(finite, 0, state["consecutive_skips"] + 1).astype(jnp.int32)
        new_state = {
            "step": step,
            "params": jax.tree.map(keep, new_params, state["params"]),
            "opt_state": jax.tree.map(keep, new_opt, state["opt_state"]),
            "consecutive_skips": skips,
        }
        metrics = {
            "loss": loss,
            "loss_sum": loss_sum,
            "tokens": weight,
            "bytes": target_bytes(batch["targets"], batch["loss_mask"], token_bytes),
            "grad_norm": grad_norm,
            # optax schedules count from 0; this step used the lr at count = step - 1.
            "lr": jnp.asarray(schedule(state["step"]), jnp.float32),
            "finite": finite.astype(jnp.float32),
            "consecutive_skips": skips,
        }
        return new_state, metrics

    return traced_on(mesh, train_step)


def make_eval_step(
    graphdef: Any,
    state_def: Any,
    *,
    token_bytes: jax.Array | None = None,
    loss_chunk: int = 0,
    mesh: jax.sharding.Mesh | None = None,
) -> Callable[[dict, Any, Batch], dict]:
    """Builds ``eval_step(params, rest, batch) -> {"loss_sum", "tokens", "bytes"}`` (sums);
    ``mesh`` as in :func:`make_train_step`."""
    loss_fn = make_loss_fn(graphdef, state_def, loss_chunk=loss_chunk)

    def eval_step(params, rest, batch):
        _, (loss_sum, weight) = loss_fn(params, rest, batch)
        return {
            "loss_sum": loss_sum,
            "tokens": weight,
            "bytes": target_bytes(batch["targets"], batch["loss_mask"], token_bytes),
        }

    return traced_on(mesh, eval_step)


def bits_per_byte(loss_sum_nats: float, n_bytes: float) -> float:
    """``nats / ln 2 / bytes`` (NaN when no bytes were counted)."""
    return loss_sum_nats / math.log(2.0) / n_bytes if n_bytes > 0 else float("nan")
