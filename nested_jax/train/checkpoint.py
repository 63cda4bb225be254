"""Orbax checkpoints of the train state, the data iterator and the config, with safe resume.

Layout: ``workdir/checkpoints/<step>/{state,data,config}`` written by one ``ocp.CheckpointManager``
(async by default, keeps the newest N). Guarantees:

- **Atomic saves.** Orbax writes into ``<step>.orbax-checkpoint-tmp-*`` and renames when complete,
  so a process killed mid-save (or a writer that raises) leaves only a temporary directory, never a
  half checkpoint under a step name. The next start reports the incomplete save in one line and
  resumes from the newest complete step.
- **Corruption.** A complete-looking checkpoint whose files are truncated or garbled fails to
  restore; that is reported in one line, the directory is moved (never deleted) to
  ``workdir/corrupt_checkpoints/``, and the next older checkpoint is tried.
- **Exactness.** Arrays are restored onto the shardings of a freshly initialised state
  (``ShapeDtypeStruct`` with ``sharding``), the grain iterator state restores the exact next batch.
"""

from __future__ import annotations

import datetime as _dt
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"


def abstract_like(tree: Any) -> Any:
    """``ShapeDtypeStruct`` (with sharding) for every array of `tree`: the restore target."""

    def one(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def _tmp_dirs(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and "tmp" in p.name)


def _say(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


class Checkpointer:
    """Saves and restores ``{"state", "data", "config"}`` checkpoints under ``workdir/checkpoints``.

    Args:
      workdir: the run's directory.
      keep: how many newest checkpoints to keep (train.keep_checkpoints).
      async_save: write in a background thread (train.async_checkpointing).
      read_only: never write, move or delete anything (eval / generate).
    """

    def __init__(
        self,
        workdir: str | Path,
        *,
        keep: int = 3,
        async_save: bool = True,
        read_only: bool = False,
    ):
        self.workdir = Path(workdir)
        self.directory = self.workdir / CHECKPOINT_DIR
        if read_only and not self.directory.is_dir():
            raise FileNotFoundError(f"no checkpoints in {self.workdir} (expected {self.directory})")
        self.directory.mkdir(parents=True, exist_ok=True)
        # Reported before the manager exists: orbax may tidy these temporary directories away.
        self.incomplete = _tmp_dirs(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            enable_async_checkpointing=async_save,
            create=not read_only,
            # Incomplete saves are ours to tidy when training; read-only users (eval) touch nothing.
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
        )
        self.manager = ocp.CheckpointManager(self.directory.resolve(), options=options)

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int, state: Any, iterator: Any, config: dict) -> None:
        """Starts saving checkpoint `step` (returns once arrays are copied to host when async)."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(iterator),
            config=ocp.args.JsonSave(config),
        )
        self.manager.save(step, args=args, force=True)

    def wait(self) -> None:
        """Blocks until pending saves are on disk (re-raises a failed background save)."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self.manager.wait_until_finished()
        self.manager.close()

    # -- restoring -----------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(
        self,
        abstract_state: Any,
        make_iterator: Callable[[], Any] | None,
        *,
        quarantine: bool = True,
    ) -> tuple[int, Any, Any] | None:
        """Restores the newest readable checkpoint, skipping (and quarantining) unreadable ones.

        Args:
          abstract_state: restore target (:func:`abstract_like` of a freshly initialised state).
          make_iterator: returns a fresh data iterator to restore into (a new one per attempt, so a
            failed attempt never leaves a half-restored iterator); None to skip the data item.
        Returns:
          ``(step, state, iterator)`` or None when there is no usable checkpoint.
        """
        for tmp in self.incomplete:
            _say(
                f"checkpoint: ignoring incomplete save {tmp.name} in {self.directory} "
                "(the process stopped while writing it)"
            )
        for step in reversed(self.all_steps()):
            iterator = make_iterator() if make_iterator is not None else None
            items = {"state": ocp.args.StandardRestore(abstract_state)}
            if iterator is not None:
                items["data"] = grain.checkpoint.CheckpointRestore(iterator)
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(**items))
                state = restored["state"]
                jax.block_until_ready(state)
            except Exception as err:  # any failure to read a step means that step is unusable
                reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[
                    :300
                ]
                where = f"moved it to {self._quarantine(step)} and " if quarantine else ""
                _say(
                    f"checkpoint: step {step} in {self.directory} is unreadable ({reason}); "
                    f"{where}trying the previous checkpoint"
                )
                continue
            return step, state, iterator
        return None

    def restore_config(self, step: int | None = None) -> dict:
        """The config dict saved with checkpoint `step` (default: latest)."""
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))[
            "config"
        ]

    def _quarantine(self, step: int) -> Path:
        src = self.directory / str(step)
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
        dst = self.workdir / CORRUPT_DIR / f"step_{step}_{stamp}"
        if jax.process_index() == 0 and src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(src), str(dst))
        self.manager.reload()
        return dst
