"""Loading a trained workdir for evaluation and generation (read-only: the workdir is unchanged)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from nested_jax.train.checkpoint import Checkpointer, abstract_like
from nested_jax.train.config import Config
from nested_jax.train.setup import TrainSetup, prepare_run
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


def _note(msg: str) -> None:
    if jax.process_index() == 0:
        # stderr: `nested-jax generate` keeps stdout for the text alone.
        print(msg, file=sys.stderr, flush=True)


def load_trained(workdir: str | Path, overrides: Sequence[str] = ()) -> TrainedModel:
    """Restores the newest readable checkpoint of `workdir` with its saved config (+ overrides).

    The tokenizer is the one saved in the workdir (never rebuilt from the corpus); a corpus that
    changed since training is reported on stderr and in :attr:`TrainedModel.corpus_change`.

    Raises:
      ConfigError: no run in `workdir` / invalid config; FileNotFoundError: no readable checkpoint;
      DataError: the saved tokenizer is unreadable.
    """
    workdir = Path(workdir)
    config, _ = resolve_config(workdir, [], list(overrides))
    saved = saved_data(workdir)
    _, bundle, setup = prepare_run(config, tokenizer=None if saved is None else saved.tokenizer)
    change = None if saved is None else corpus_change_message(saved.spec, bundle.corpus)
    if change is not None:
        _note(f"warning: {change}; using the tokenizer saved with the run ({saved.where})")
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        restored = ckpt.restore_latest(abstract_like(setup.state), None, quarantine=False)
    finally:
        ckpt.manager.close()
    if restored is None:
        raise FileNotFoundError(f"no readable checkpoint in {ckpt.directory}")
    step, state, _ = restored
    setup.state = state
    _note(f"restored step {step} from {ckpt.directory / str(step)}")
    return TrainedModel(config, workdir, step, bundle, setup, state["params"], change)
