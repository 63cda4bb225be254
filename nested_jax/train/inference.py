"""Loading a trained workdir for evaluation and generation (read-only: the workdir is unchanged)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from nested_jax.train.checkpoint import Checkpointer, abstract_like
from nested_jax.train.config import Config, load_workdir_config
from nested_jax.train.loop import TrainSetup, prepare_run


@dataclasses.dataclass
class TrainedModel:
    """A restored run: its config, data bundle (tokenizer, documents), setup and parameters."""

    config: Config
    workdir: Path
    step: int  # the checkpoint's step
    bundle: Any  # nested_jax.data.pipeline.DataBundle
    setup: TrainSetup
    params: dict

    @property
    def tokenizer(self):
        return self.bundle.tokenizer

    def model(self):
        """The nnx LanguageModel carrying the restored parameters."""
        return self.setup.model(self.params)


def load_trained(workdir: str | Path, overrides: Sequence[str] = ()) -> TrainedModel:
    """Restores the newest readable checkpoint of `workdir` with its saved config (+ overrides).

    Raises:
      ConfigError: no/invalid ``config.json``; FileNotFoundError: no readable checkpoint.
    """
    workdir = Path(workdir)
    config = load_workdir_config(workdir, overrides)
    _, bundle, setup = prepare_run(config)
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        restored = ckpt.restore_latest(abstract_like(setup.state), None, quarantine=False)
    finally:
        ckpt.manager.close()
    if restored is None:
        raise FileNotFoundError(f"no readable checkpoint in {ckpt.directory}")
    step, state, _ = restored
    setup.state = state
    if jax.process_index() == 0:
        # stderr: `nested-jax generate` keeps stdout for the text alone.
        print(
            f"restored step {step} from {ckpt.directory / str(step)}", file=sys.stderr, flush=True
        )
    return TrainedModel(config, workdir, step, bundle, setup, state["params"])
