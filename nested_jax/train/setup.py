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
    batch_shards,
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


def _abstract(tree: Any, shardings: Any) -> Any:
    """``ShapeDtypeStruct`` leaves (with their shardings) for a tree of arrays / abstract values."""
    return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings
    )


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The array-free half of a run: model structure, shardings and the jitted (uncalled) steps.

    Built without allocating a parameter (:func:`plan_train_setup`), so it serves both
    :func:`init_train_setup` (which then materialises the state) and the ahead-of-time compile of
    ``nested-jax aot`` (which lowers the steps for a TPU topology from :meth:`abstract_state`).
    The steps carry ``plan.mesh`` into their trace, so the activation constraints of the model
    (``nested_jax.parallel.mesh.constrain``) apply wherever they are called or lowered.
    """

    mesh: jax.sharding.Mesh
    graphdef: Any  # nnx GraphDef of the model
    state_def: Any  # pytree structure of the parameter nnx.State
    create_model: Callable[[], nnx.Module]  # builds the model (under nnx.use_eager_sharding(False))
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    params: dict  # abstract parameters (pure dict of ShapeDtypeStruct)
    rest: Any  # abstract non-parameter model state
    opt_state: Any  # abstract optimizer state
    state_shardings: dict
    rest_shardings: Any
    batch_shardings: dict
    train_step: Callable  # jitted (state, rest, batch) -> (state, metrics); donates `state`
    eval_step: Callable  # jitted (params, rest, batch) -> sums

    def abstract_state(self) -> dict:
        """The train state as ``ShapeDtypeStruct`` with shardings (nothing allocated)."""
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        tree = {
            "step": scalar,
            "params": self.params,
            "opt_state": self.opt_state,
            "consecutive_skips": scalar,
        }
        return _abstract(tree, self.state_shardings)

    def abstract_rest(self) -> Any:
        """The non-parameter model state as ``ShapeDtypeStruct`` with shardings."""
        return _abstract(self.rest, self.rest_shardings)

    def abstract_batch(self, batch_size: int, seq_len: int) -> dict:
        """A global ``[batch_size, seq_len]`` int32 batch as ``ShapeDtypeStruct`` with shardings."""
        shape = (batch_size, seq_len)
        return {
            k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh)
            for k, sh in self.batch_shardings.items()
        }


def plan_train_setup(
    config: Config, mesh: jax.sharding.Mesh, *, token_bytes: np.ndarray | None = None
) -> StepPlan:
    """Model structure, shardings and jitted train / eval steps on `mesh`, without any array.

    Parameters are float32 master weights sharded by their logical names
    (``nested_jax.parallel.mesh.LOGICAL_AXIS_RULES``); optimizer moments follow their parameter;
    batches are split over the batch axes; the non-parameter state is replicated.
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
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(abs_params)
    )
    rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abs_rest)

    tx, schedule = build_optimizer(config.optimizer, config.train.steps, model=config.model)
    opt_state = jax.eval_shape(tx.init, params)
    repl = replicated(mesh)
    opt_sh = shardings_like_params(opt_state, params, param_sh, mesh)
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
        loss_chunk=config.train.loss_chunk,
        mesh=mesh,
    )
    train_step = jax.jit(
        step_fn,
        in_shardings=(state_sh, rest_sh, batch_sh),
        out_shardings=(state_sh, repl),
        donate_argnums=(0,),
    )
    eval_step = jax.jit(
        make_eval_step(
            graphdef, state_def, token_bytes=tb, loss_chunk=config.train.loss_chunk, mesh=mesh
        ),
        in_shardings=(param_sh, rest_sh, batch_sh),
        out_shardings=repl,
    )
    return StepPlan(
        mesh=mesh,
        graphdef=graphdef,
        state_def=state_def,
        create_model=create,
        tx=tx,
        schedule=schedule,
        params=params,
        rest=rest,
        opt_state=opt_state,
        state_shardings=state_sh,
        rest_shardings=rest_sh,
        batch_shardings=batch_sh,
        train_step=train_step,
        eval_step=eval_step,
    )


def on_mesh(mesh: jax.sharding.Mesh, fn: Callable) -> Callable:
    """`fn` called inside ``jax.set_mesh(mesh)``, so a jitted step traces with its activation
    constraints (``nested_jax.parallel.mesh.constrain``)."""

    def call(*args):
        with jax.set_mesh(mesh):
            return fn(*args)

    return call


def init_rest(plan: StepPlan) -> Any:
    """The model's non-parameter state (replicated); deterministic from the config, never saved."""

    def rest():
        return nnx.split(plan.create_model(), nnx.Param, ...)[2]

    return jax.jit(rest, out_shardings=plan.rest_shardings)()


def setup_from_state(plan: StepPlan, state: dict, rest: Any) -> TrainSetup:
    """A :class:`TrainSetup` over an existing (fresh or restored) train `state`.

    ``state`` may lack ``opt_state`` (evaluation restores only what it reads); the steps then need
    only what they are given (``eval_step`` takes the parameters alone).
    """
    train_step, eval_step = on_mesh(plan.mesh, plan.train_step), on_mesh(plan.mesh, plan.eval_step)
    return TrainSetup(
        mesh=plan.mesh,
        graphdef=plan.graphdef,
        state_def=plan.state_def,
        rest=rest,
        state=state,
        state_shardings=plan.state_shardings,
        schedule=plan.schedule,
        train_step=lambda s, b: train_step(s, rest, b),
        eval_step=lambda p, b: eval_step(p, rest, b),
    )


def initialise(plan: StepPlan) -> TrainSetup:
    """A fresh train state for `plan`: parameters created directly with their shardings (a jitted
    initialiser with ``out_shardings``, so a model larger than one device's memory never
    materialises unsharded; f32 master weights) and the optimizer state beside them."""
    param_sh = plan.state_shardings["params"]

    def init_params():
        _, params, rest = nnx.split(plan.create_model(), nnx.Param, ...)
        return nnx.to_pure_dict(params), rest

    params, rest = jax.jit(init_params, out_shardings=(param_sh, plan.rest_shardings))()
    _check_leaf_order(plan.state_def, plan.params, params)
    opt_state = jax.jit(plan.tx.init, out_shardings=plan.state_shardings["opt_state"])(params)
    repl = replicated(plan.mesh)
    state = {
        "step": jax.device_put(jnp.zeros((), jnp.int32), repl),
        "params": params,
        "opt_state": opt_state,
        "consecutive_skips": jax.device_put(jnp.zeros((), jnp.int32), repl),
    }
    return setup_from_state(plan, state, rest)


def init_train_setup(
    config: Config, mesh: jax.sharding.Mesh, *, token_bytes: np.ndarray | None = None
) -> TrainSetup:
    """Initialises the sharded train state and jits the train / eval steps on `mesh`
    (:func:`plan_train_setup` then :func:`initialise`). Activations use ``model.dtype``."""
    return initialise(plan_train_setup(config, mesh, token_bytes=token_bytes))


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


def make_score_fn(
    setup: TrainSetup, score: Callable[[np.ndarray, dict], dict]
) -> Callable[[dict, list[dict]], dict]:
    """``score_fn(params, batches) -> {"val_<metric>": value}``: a generated task's metrics over
    process-local numpy `batches` (``nested_jax.data.task_source``).

    Each batch runs through the model on the mesh (jitted once per shape); only the argmax ids
    ``int32[B, T]`` of the global batch come back, replicated, with its inputs, targets and mask,
    so every process scores the same global rows. ``score(ids, batch)`` gives each metric as an
    average over the batch's scored positions (``loss_mask > 0``); the result weights batch ``i``
    by its count ``n_i``: ``Σ_i n_i m_i / Σ_i n_i`` (exact accuracy over all scored positions).
    """
    from nested_jax.train.step import params_to_state

    repl = replicated(setup.mesh)

    def forward(params, rest, batch):
        model = nnx.merge(setup.graphdef, params_to_state(params, setup.state_def), rest)
        logits, _ = model(batch["inputs"], segment_ids=batch["segment_ids"])
        ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return ids, batch["inputs"], batch["targets"], batch["loss_mask"]

    predict = on_mesh(setup.mesh, jax.jit(forward, out_shardings=(repl,) * 4))

    def score_fn(params: dict, batches: list[dict]) -> dict:
        sums: dict[str, float] = {}
        weight = 0.0
        for local in batches:
            batch = global_batch_from_local({k: local[k] for k in BATCH_KEYS}, setup.mesh)
            ids, inputs, targets, mask = jax.device_get(predict(params, setup.rest, batch))
            n = float((np.asarray(mask) > 0).sum())
            if not n:
                continue
            rows = {"inputs": inputs, "targets": targets, "loss_mask": mask}
            for name, value in score(ids, rows).items():
                sums[name] = sums.get(name, 0.0) + float(value) * n
            weight += n
        return {f"val_{k}": v / weight for k, v in sums.items()}

    return score_fn


def build_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """The run's mesh on `devices` (default: all), checked against ``data.batch_size``.

    Raises:
      ConfigError: the mesh sizes do not fit the devices, or the batch does not split over the
        mesh's batch shards / the JAX processes.
    """
    try:
        mesh = make_mesh(config.mesh, devices)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_mesh_batch(config, mesh)
    return mesh


def _check_mesh_batch(config: Config, mesh: jax.sharding.Mesh) -> None:
    n = batch_shards(mesh)
    if config.data.batch_size % n:
        raise ConfigError(
            f"data.batch_size: {config.data.batch_size} is not divisible by the mesh's "
            f"data × fsdp = {mesh.shape['data']}×{mesh.shape['fsdp']} = {n} batch shards"
        )
    if config.data.batch_size % jax.process_count():
        raise ConfigError(
            f"data.batch_size: {config.data.batch_size} is not divisible by the "
            f"{jax.process_count()} JAX processes"
        )


def prepare_plan(
    config: Config,
    devices: Sequence[jax.Device] | None = None,
    *,
    tokenizer: Any = None,
) -> tuple[jax.sharding.Mesh, Any, StepPlan]:
    """Mesh, data bundle (tokenizer, documents) and the array-free :class:`StepPlan` of a run.

    Args:
      config: the run's config.
      devices: restrict the mesh to those devices (default: all; the mesh sizes must
        match their number).
      tokenizer: the run's saved tokenizer (a workdir's copy); None builds it from ``config.data``.

    Raises:
      ConfigError: the mesh does not fit the devices, the batch does not fit the mesh / processes,
        or the tokenizer has more ids than ``model.vocab_size``.
      DataError: the corpus cannot be read (one line).
    """
    from nested_jax.data import pipeline

    mesh = build_mesh(config, devices)
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
    return mesh, bundle, plan_train_setup(config, mesh, token_bytes=token_bytes)


def prepare_run(
    config: Config,
    devices: Sequence[jax.Device] | None = None,
    *,
    tokenizer: Any = None,
) -> tuple[jax.sharding.Mesh, Any, TrainSetup]:
    """:func:`prepare_plan` and a freshly initialised :class:`TrainSetup` (same arguments and
    errors)."""
    mesh, bundle, plan = prepare_plan(config, devices, tokenizer=tokenizer)
    return mesh, bundle, initialise(plan)
