"""The sharded train state and jitted steps of a run (``prepare_run``, ``init_train_setup``).

Shared by training (:mod:`nested_jax.train.loop`), evaluation and generation
(:mod:`nested_jax.train.inference`), the Hope-Attention conversion and the experiment drivers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nested_jax.parallel.mesh import (
    batch_sharding,
    global_batch_from_local,
    make_mesh,
    replicated,
    shardings_like_params,
    state_shardings,
)
from nested_jax.train.config import Config, ConfigError
from nested_jax.train.optimizer import build_optimizer
from nested_jax.train.step import bits_per_byte, make_eval_step, make_train_step

BATCH_KEYS = ("inputs", "targets", "segment_ids", "loss_mask")


def _build_model(model_cfg, rngs: nnx.Rngs):
    # Indirection (and a lazy import) so tests can substitute a stand-in model.
    from nested_jax.models import build_model

    return build_model(model_cfg, rngs=rngs)


@dataclasses.dataclass
class TrainSetup:
    """Everything the loop needs besides data: model structure, shardings and jitted steps."""

    mesh: jax.sharding.Mesh
    graphdef: Any  # nnx GraphDef of the model
    state_def: Any  # pytree structure of the parameter nnx.State (to rebuild it from the pure dict)
    rest: Any  # non-parameter model state (replicated, never trained)
    state: dict  # the train state (see nested_jax.train.step)
    state_shardings: dict
    schedule: optax.Schedule
    train_step: Callable  # (state, batch) -> (state, metrics), jitted; donates `state`
    eval_step: Callable  # (params, batch) -> sums, jitted

    def model(self, params: dict | None = None) -> nnx.Module:
        """The nnx model with the given (default: current) parameters, for generation / analysis."""
        from nested_jax.train.step import params_to_state

        params = self.state["params"] if params is None else params
        return nnx.merge(self.graphdef, params_to_state(params, self.state_def), self.rest)


def _check_leaf_order(state_def: Any, abstract_state: Any, pure: dict) -> None:
    # params_to_state() relies on the pure dict flattening in the same order as the nnx.State.
    a = [x.shape for x in jax.tree.leaves(abstract_state)]
    b = [x.shape for x in jax.tree.leaves(pure)]
    if a != b or state_def.num_leaves != len(b):
        raise RuntimeError("internal: nnx.State and its pure dict flatten in different orders")


def init_train_setup(
    config: Config, mesh: jax.sharding.Mesh, *, token_bytes: np.ndarray | None = None
) -> TrainSetup:
    """Initialises the sharded train state and jits the train / eval steps on `mesh`.

    Parameters are created directly with their shardings (a jitted initialiser with
    ``out_shardings``), so a model larger than one device's memory never materialises unsharded.
    Parameters stay float32 (master weights); activations use ``model.dtype``.
    """

    def create():
        with nnx.use_eager_sharding(False):
            return _build_model(config.model, nnx.Rngs(config.train.seed))

    with nnx.use_eager_sharding(False):
        abstract_model = nnx.eval_shape(create)
    graphdef, abs_params, abs_rest = nnx.split(abstract_model, nnx.Param, ...)
    state_def = jax.tree.structure(abs_params)
    param_sh = nnx.to_pure_dict(state_shardings(abs_params, mesh))
    rest_sh = jax.tree.map(lambda _: replicated(mesh), abs_rest)

    def init_params():
        _, params, rest = nnx.split(create(), nnx.Param, ...)
        return nnx.to_pure_dict(params), rest

    params, rest = jax.jit(init_params, out_shardings=(param_sh, rest_sh))()
    _check_leaf_order(state_def, abs_params, params)

    tx, schedule = build_optimizer(config.optimizer, config.train.steps, model=config.model)
    abs_opt = jax.eval_shape(tx.init, params)
    repl = replicated(mesh)
    opt_sh = shardings_like_params(abs_opt, params, param_sh, mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    state = {
        "step": jax.device_put(jnp.zeros((), jnp.int32), repl),
        "params": params,
        "opt_state": opt_state,
        "consecutive_skips": jax.device_put(jnp.zeros((), jnp.int32), repl),
    }
    state_sh = {"step": repl, "params": param_sh, "opt_state": opt_sh, "consecutive_skips": repl}
    batch_sh = {k: batch_sharding(mesh, 2) for k in BATCH_KEYS}
    tb = None if token_bytes is None else jnp.asarray(token_bytes, jnp.int32)

    step_fn = make_train_step(
        graphdef,
        state_def,
        tx,
        schedule,
        token_bytes=tb,
        debug_nan_at_steps=config.train.debug_nan_at_steps,
    )
    jit_step = jax.jit(
        step_fn,
        in_shardings=(state_sh, rest_sh, batch_sh),
        out_shardings=(state_sh, repl),
        donate_argnums=(0,),
    )
    jit_eval = jax.jit(
        make_eval_step(graphdef, state_def, token_bytes=tb),
        in_shardings=(param_sh, rest_sh, batch_sh),
        out_shardings=repl,
    )
    return TrainSetup(
        mesh=mesh,
        graphdef=graphdef,
        state_def=state_def,
        rest=rest,
        state=state,
        state_shardings=state_sh,
        schedule=schedule,
        train_step=lambda s, b: jit_step(s, rest, b),
        eval_step=lambda p, b: jit_eval(p, rest, b),
    )


def evaluate(setup: TrainSetup, params: dict, batches: list[dict]) -> dict:
    """Validation over process-local numpy `batches`: loss, perplexity, bits/byte, counts."""
    totals = {"loss_sum": 0.0, "tokens": 0.0, "bytes": 0.0}
    for local in batches:
        out = jax.device_get(setup.eval_step(params, global_batch_from_local(local, setup.mesh)))
        for k in totals:
            totals[k] += float(out[k])
    tokens = totals["tokens"]
    loss = totals["loss_sum"] / tokens if tokens else float("nan")
    return {
        "val_loss": loss,
        "val_perplexity": math.exp(loss) if math.isfinite(loss) and loss < 700 else float("inf"),
        "val_bits_per_byte": bits_per_byte(totals["loss_sum"], totals["bytes"]),
        "val_tokens": tokens,
        "val_bytes": totals["bytes"],
    }


def _check_mesh_batch(config: Config, mesh: jax.sharding.Mesh) -> None:
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    if config.data.batch_size % n:
        raise ConfigError(
            f"data.batch_size: {config.data.batch_size} is not divisible by the mesh's "
            f"data × fsdp = {mesh.shape['data']}×{mesh.shape['fsdp']} = {n} devices"
        )
    if config.data.batch_size % jax.process_count():
        raise ConfigError(
            f"data.batch_size: {config.data.batch_size} is not divisible by the "
            f"{jax.process_count()} JAX processes"
        )


def prepare_run(
    config: Config,
    devices: Sequence[jax.Device] | None = None,
    *,
    tokenizer: Any = None,
) -> tuple[jax.sharding.Mesh, Any, TrainSetup]:
    """Mesh, data bundle (tokenizer, documents) and a freshly initialised :class:`TrainSetup`.

    Args:
      config: the run's config.
      devices: restrict the mesh to those devices (default: all; ``mesh.data × mesh.fsdp`` must
        match their number).
      tokenizer: the run's saved tokenizer (a workdir's copy); None builds it from ``config.data``.

    Raises:
      ConfigError: the mesh does not fit the devices, the batch does not fit the mesh / processes,
        or the tokenizer has more ids than ``model.vocab_size``.
      DataError: the corpus cannot be read (one line).
    """
    from nested_jax.data import pipeline

    try:
        mesh = make_mesh(config.mesh, devices)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_mesh_batch(config, mesh)
    bundle = pipeline.prepare_data(config.data, tokenizer=tokenizer)
    tok = bundle.tokenizer
    if tok.vocab_size > config.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size: {config.model.vocab_size} is smaller than the "
            f"tokenizer's vocabulary ({tok.vocab_size} ids)"
        )
    token_bytes = np.asarray(tok.token_bytes)
    if token_bytes.shape[0] < config.model.vocab_size:  # ids the tokenizer never produces: 0 bytes
        token_bytes = np.pad(token_bytes, (0, config.model.vocab_size - token_bytes.shape[0]))
    return mesh, bundle, init_train_setup(config, mesh, token_bytes=token_bytes)
