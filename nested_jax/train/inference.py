"""Loading a trained workdir for evaluation and generation (read-only: the workdir is unchanged)."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nested_jax.files import as_path
from nested_jax.parallel.mesh import batch_sharding, batch_shards, replicated
from nested_jax.train.checkpoint import Checkpointer
from nested_jax.train.config import Config
from nested_jax.train.setup import TrainSetup, init_rest, prepare_plan, setup_from_state
from nested_jax.train.step import params_to_state
from nested_jax.train.workdir import corpus_change_message, resolve_config, saved_data


@dataclasses.dataclass
class TrainedModel:
    """A restored run: its config, data bundle (tokenizer, documents), setup and parameters."""

    config: Config
    workdir: Path
    step: int  # the checkpoint's step
    bundle: Any  # nested_jax.data.pipeline.DataBundle
    setup: TrainSetup
    params: dict
    corpus_change: str | None = None  # how the corpus differs from the training one (None: same)

    @property
    def tokenizer(self):
        return self.bundle.tokenizer

    def model(self):
        """The nnx LanguageModel carrying the restored parameters."""
        return self.setup.model(self.params)


def host_batch_to_mesh(tokens: np.ndarray, mesh: jax.sharding.Mesh) -> tuple[jax.Array, int]:
    """A global ``[B', L]`` array split over the batch axes from the SAME numpy ``[B, L]`` on every
    process (rows padded with copies of row 0 up to a multiple of the batch shards).

    Returns: ``(array, B)``; rows ``B:`` are padding.
    """
    rows = tokens.shape[0]
    pad = -rows % batch_shards(mesh)
    padded = np.concatenate([tokens, np.repeat(tokens[:1], pad, axis=0)]) if pad else tokens
    sharding = batch_sharding(mesh, padded.ndim)
    return jax.make_array_from_callback(padded.shape, sharding, lambda idx: padded[idx]), rows


def sharded_argmax_fn(trained: TrainedModel) -> Callable[[np.ndarray], np.ndarray]:
    """``tokens int32[B, L] -> argmax ids int32[B, L]`` (numpy) of the restored model, jitted on
    the run's mesh: the batch split over the data axes, parameters sharded as trained, only the
    ids (replicated, small) come back to every process — never the ``[B, L, V]`` logits.

    Every process must call it with the same tokens (evaluation data is deterministic).
    """
    setup = trained.setup

    @functools.partial(jax.jit, out_shardings=replicated(setup.mesh))
    def forward(params, rest, tokens):
        model = nnx.merge(setup.graphdef, params_to_state(params, setup.state_def), rest)
        return jnp.argmax(model(tokens)[0], axis=-1).astype(jnp.int32)

    def call(tokens: np.ndarray) -> np.ndarray:
        batch, rows = host_batch_to_mesh(np.asarray(tokens, np.int32), setup.mesh)
        with jax.set_mesh(setup.mesh):
            ids = forward(trained.params, setup.rest, batch)
        return np.asarray(ids)[:rows]

    return call


def _note(msg: str) -> None:
    if jax.process_index() == 0:
        # stderr: `nested-jax generate` keeps stdout for the text alone.
        print(msg, file=sys.stderr, flush=True)


def load_trained(
    workdir: str | Path,
    overrides: Sequence[str] = (),
    devices: Sequence[jax.Device] | None = None,
) -> TrainedModel:
    """Restores the newest readable checkpoint of `workdir` with its saved config (+ overrides).

    The tokenizer is the one saved in the workdir (never rebuilt from the corpus); a corpus that
    changed since training is reported on stderr and in :attr:`TrainedModel.corpus_change`.
    The parameters land on the mesh of `devices` (default: all) whatever mesh trained them.

    Raises:
      ConfigError: no run in `workdir` / invalid config; FileNotFoundError: no readable checkpoint;
      DataError: the saved tokenizer is unreadable.
    """
    workdir = as_path(workdir)
    config, _ = resolve_config(workdir, [], list(overrides))
    saved = saved_data(workdir)
    # Array-free plan on THIS run's mesh: orbax reshards the saved arrays onto it, so a checkpoint
    # trained on any mesh shape / device count restores here; the optimizer state is not read.
    tokenizer = None if saved is None else saved.tokenizer
    _, bundle, plan = prepare_plan(config, devices, tokenizer=tokenizer)
    change = None if saved is None else corpus_change_message(saved.spec, bundle.corpus)
    if change is not None:
        _note(f"warning: {change}; using the tokenizer saved with the run ({saved.where})")
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        restored = ckpt.restore_latest(
            plan.abstract_state(), None, quarantine=False, reset_optimizer=True
        )
    finally:
        ckpt.manager.close()
    if restored is None:
        raise FileNotFoundError(f"no readable checkpoint in {ckpt.directory}")
    step, state, _ = restored
    setup = setup_from_state(plan, state, init_rest(plan))
    _note(f"restored step {step} from {ckpt.directory / str(step)}")
    return TrainedModel(config, workdir, step, bundle, setup, state["params"], change)
