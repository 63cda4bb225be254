"""Orbax checkpoints of the train state, the data iterator, the config and the data spec.

Layout: ``workdir/checkpoints/<step>/{state,data,config,data_spec}`` written by one
``ocp.CheckpointManager`` (async by default, keeps the newest N). ``data_spec`` holds the tokenizer
file (base64) and the corpus fingerprint (:mod:`nested_jax.data.identity`), so a checkpoint alone
says what it was trained on. Guarantees:

- **Atomic saves.** Orbax writes into ``<step>.orbax-checkpoint-tmp-*`` and renames when complete,
  so a process killed mid-save (or a writer that raises, or a full disk) leaves only a temporary
  directory, never a half checkpoint under a step name. The next start reports the incomplete save
  in one line and resumes from the newest complete step.
- **Mismatch is not corruption.** Before restoring, the checkpoint's array metadata (paths, shapes,
  dtypes) is compared with what the current config builds. A difference (another optimizer, another
  model, a new library version) raises :class:`CheckpointMismatch`, one line saying what differs;
  nothing is moved.
- **Corruption.** A checkpoint whose bytes fail to restore although its structure matches (or
  whose metadata is unreadable too: truncated or garbled files) is reported in one line, moved
  (never deleted) to ``workdir/corrupt_checkpoints/``, and the next older checkpoint is tried.
  Unreadable metadata alone is no verdict (the restore decides), and running out of memory while
  restoring is re-raised, not blamed on the checkpoint.
- **Remote workdirs.** A ``gs://`` workdir is written there by orbax and tensorstore directly
  (``nested_jax.files.as_path``); quarantining there copies the checkpoint's objects.
- **Exactness.** Arrays are restored onto the shardings of a freshly initialised state
  (``ShapeDtypeStruct`` with ``sharding``), the grain iterator state restores the exact next batch.
"""

from __future__ import annotations

import base64
import datetime as _dt
import errno
import logging
import math
import os
import shutil
from collections.abc import Callable
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from nested_jax.files import as_path, move, resolve_path
from nested_jax.parallel.distributed import say
from nested_jax.train.config import ConfigError

CHECKPOINT_DIR = "checkpoints"
CORRUPT_DIR = "corrupt_checkpoints"
# Parts of the train state kept by --reset-optimizer (everything but the optimizer state).
KEPT_ON_OPTIMIZER_RESET = ("step", "params", "consecutive_skips")


class CheckpointMismatch(ConfigError):
    """A readable checkpoint holds another state than the config builds; ``str`` is one line."""


def checkpoint_steps(workdir: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints in ``workdir/checkpoints`` (read from the folder names)."""
    directory = as_path(workdir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def checkpoint_bytes(workdir: str | os.PathLike) -> int | None:
    """Bytes on disk of the newest complete checkpoint in a local `workdir` (None: none, or a
    URL: listing every object of a remote checkpoint costs more than the estimate it gives)."""
    steps = checkpoint_steps(workdir) if "://" not in os.fspath(workdir) else []
    if not steps:
        return None
    total = 0
    for root, _, files in os.walk(os.path.join(os.fspath(workdir), CHECKPOINT_DIR, str(steps[-1]))):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def free_bytes(workdir: str | os.PathLike) -> int | None:
    """Free bytes on the file system of a local `workdir` (None for a URL)."""
    if "://" in os.fspath(workdir):
        return None
    path = os.fspath(workdir)
    while not os.path.exists(path):  # a new workdir: the folder it will be created in
        path = os.path.dirname(os.path.abspath(path))
    return shutil.disk_usage(path).free


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` (an OSError, or tensorstore's error text) says the disk is full."""
    return getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in str(err)


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey / FlattenedIndexKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_table(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{"opt_state.1.0.mu.w": (shape, dtype)}`` for every array of `tree`.

    Paths are joined like orbax names the arrays it saves, so the table of an abstract state and the
    table of a checkpoint's metadata (:meth:`Checkpointer.saved_leaves`) can be compared.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
    )
    return {
        ".".join(_key_name(k) for k in path): (tuple(x.shape), str(np.dtype(x.dtype)))
        for path, x in flat
    }


def describe_mismatch(saved: dict, wanted: dict, *, partial: bool = False) -> str | None:
    """What differs between two :func:`leaf_table` s, in a few words (None when they agree).

    With ``partial=True`` arrays the checkpoint has beyond `wanted` are fine (a partial restore).
    """

    def example(names):
        names = sorted(names)
        return f"{len(names)} (e.g. {names[0]})"

    missing = [k for k in wanted if k not in saved]
    extra = [] if partial else [k for k in saved if k not in wanted]
    reshaped = [k for k in wanted if k in saved and saved[k] != wanted[k]]
    parts = []
    if missing:
        parts.append(f"arrays this config needs but the checkpoint lacks: {example(missing)}")
    if extra:
        parts.append(f"arrays the checkpoint has but this config does not build: {example(extra)}")
    if reshaped:
        k = sorted(reshaped)[0]
        parts.append(
            f"arrays of another shape/dtype: {len(reshaped)} (e.g. {k}: {saved[k][0]} "
            f"{saved[k][1]} saved, {wanted[k][0]} {wanted[k][1]} now)"
        )
    return "; ".join(parts) or None


def _is_resource_error(err: BaseException) -> bool:
    # Running out of memory says nothing about the checkpoint: never quarantine for it.
    return isinstance(err, MemoryError) or "RESOURCE_EXHAUSTED" in str(err)


def _one_line(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}"[:300]


def abstract_like(tree: Any) -> Any:
    """``ShapeDtypeStruct`` (with sharding) for every array of `tree`: the restore target."""

    def one(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def _tmp_dirs(directory: epath.Path) -> list[epath.Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and "tmp" in p.name)


# Orbax warns whenever a manager is opened read-only, which eval, generate and every resume check do
# on purpose; the two warnings say only what was asked for, so they are dropped (nothing else is).
_READ_ONLY_NOTES = ("CheckpointManagerOptions.read_only=True", "Given directory is read only")


def _not_a_read_only_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_READ_ONLY_NOTES)


logging.getLogger("absl").addFilter(_not_a_read_only_note)


def save_limit_gb(state: Any) -> int:
    """The smallest ``save_concurrent_gb`` that writes `state` (arrays or ``ShapeDtypeStruct``):
    whole GB above its largest array shard (orbax refuses a write as large as the limit)."""
    largest = 0
    for x in jax.tree.leaves(state):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):  # a Python scalar
            x = np.asarray(x)
        sharding = getattr(x, "sharding", None)
        shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
        largest = max(largest, math.prod(shape) * np.dtype(x.dtype).itemsize)
    return largest // 10**9 + 1


class Checkpointer:
    """Saves and restores ``{"state", "data", "config"}`` checkpoints under ``workdir/checkpoints``.

    Args:
      workdir: the run's directory (a local path or a URL such as ``gs://bucket/runs/x``).
      keep: how many newest checkpoints to keep (train.keep_checkpoints).
      async_save: write in a background thread (train.async_checkpointing).
      read_only: never write, move or delete anything (eval / generate).
      save_concurrent_gb: at most this many GB (10**9 bytes) of the train state in tensorstore
        writes at once (each array is encoded into a buffer of its size before it reaches the
        disk, so without a limit a save holds a second copy of the state); None: orbax's default.
        Must exceed the largest array shard: :func:`save_limit_gb`.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        keep: int = 3,
        async_save: bool = True,
        read_only: bool = False,
        save_concurrent_gb: int | None = None,
    ):
        self.workdir = as_path(workdir)
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
        bounded = {}  # orbax's own handlers unless the save's in-flight bytes are bounded
        if save_concurrent_gb is not None:
            registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
            standard = ocp.StandardCheckpointHandler(save_concurrent_gb=save_concurrent_gb)
            registry.add("state", ocp.args.StandardSave, standard)
            registry.add("state", ocp.args.StandardRestore, standard)
            bounded = {"handler_registry": registry}
        self.manager = ocp.CheckpointManager(
            resolve_path(self.directory), options=options, **bounded
        )

    # -- saving --------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        iterator: Any,
        config: dict,
        data_spec: dict | None = None,
        tokenizer_file: bytes | None = None,
    ) -> None:
        """Starts saving checkpoint `step` (returns once arrays are copied to host when async).

        Args:
          step, state, iterator, config: the train state, data iterator and config dict.
          data_spec: :func:`nested_jax.data.identity.data_spec` of the run (None: not saved).
          tokenizer_file: the tokenizer file's bytes (kept in the checkpoint, base64).
        """
        items = {
            "state": ocp.args.StandardSave(state),
            "data": grain.checkpoint.CheckpointSave(iterator),
            "config": ocp.args.JsonSave(config),
        }
        if data_spec is not None:
            payload = None if tokenizer_file is None else base64.b64encode(tokenizer_file)
            record = {**data_spec, "tokenizer_file_b64": payload and payload.decode("ascii")}
            items["data_spec"] = ocp.args.JsonSave(record)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

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

    def saved_leaves(self, step: int) -> dict:
        """:func:`leaf_table` of checkpoint `step`'s train state, from its metadata (no array read).

        Raises:
          Exception: the metadata is unreadable.
        """
        meta = ocp.StandardCheckpointHandler().metadata(self._state_path(step))
        return leaf_table(getattr(meta, "tree", meta))

    def restore_latest(
        self,
        abstract_state: Any,
        make_iterator: Callable[[], Any] | None,
        *,
        quarantine: bool = True,
        reset_optimizer: bool = False,
    ) -> tuple[int, Any, Any] | None:
        """Restores the newest readable checkpoint, skipping (and quarantining) unreadable ones.

        Args:
          abstract_state: restore target (:func:`abstract_like` of a freshly initialised state).
          make_iterator: returns a fresh data iterator to restore into (a new one per attempt, so a
            failed attempt never leaves a half-restored iterator); None to skip the data item.
          quarantine: move unreadable checkpoints to ``corrupt_checkpoints/`` (training); False
            leaves them where they are (eval, generate).
          reset_optimizer: restore only :data:`KEPT_ON_OPTIMIZER_RESET` (the returned state lacks
            ``opt_state``); the saved optimizer state may then have any structure. A checkpoint
            saved without an optimizer state (``nested-jax import-hf``) restores so too.
        Returns:
          ``(step, state, iterator)`` or None when there is no usable checkpoint.
        Raises:
          CheckpointMismatch: the newest readable checkpoint holds other arrays than
            `abstract_state` (nothing is moved).
        """
        for tmp in self.incomplete:
            say(
                f"checkpoint: ignoring incomplete save {tmp.name} in {self.directory} "
                "(the process stopped while writing it)"
            )
        kept = {k: abstract_state[k] for k in KEPT_ON_OPTIMIZER_RESET}
        for step in reversed(self.all_steps()):
            partial, target = reset_optimizer, kept if reset_optimizer else abstract_state
            try:
                saved = self.saved_leaves(step)
                if not any(name.startswith("opt_state") for name in saved):
                    # Saved without an optimizer state (an imported step 0): a fresh one.
                    partial, target = True, kept
                problem = describe_mismatch(saved, leaf_table(target), partial=partial)
            except Exception as err:
                if _is_resource_error(err):
                    raise
                # Not a verdict yet: only a failed restore below marks the checkpoint unreadable.
                problem = None
            if problem is not None:
                raise CheckpointMismatch(
                    f"checkpoint {step} in {self.directory} does not match this config "
                    f"({problem}); nothing was moved"
                )
            iterator = make_iterator() if make_iterator is not None else None
            try:
                state = self._restore_state(step, target, partial=partial)
                if iterator is not None:
                    data = grain.checkpoint.CheckpointRestore(iterator)
                    self.manager.restore(step, args=ocp.args.Composite(data=data))
            except Exception as err:
                if _is_resource_error(err):
                    raise
                self._skip_unreadable(step, err, quarantine)
                continue
            return step, state, iterator
        return None

    def _restore_state(self, step: int, abstract_state: Any, *, partial: bool) -> Any:
        if partial:  # a subset of the saved tree: orbax's PyTree handler can restore that
            args = ocp.args.PyTreeRestore(
                item=abstract_state,
                restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
                partial_restore=True,
            )
            with ocp.PyTreeCheckpointer() as reader:
                state = reader.restore(self._state_path(step), args=args)
        else:
            args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            state = self.manager.restore(step, args=args)["state"]
        jax.block_until_ready(state)
        return state

    def _state_path(self, step: int) -> epath.Path:
        return resolve_path(self.directory / str(step) / "state")

    def _skip_unreadable(self, step: int, err: BaseException, quarantine: bool) -> None:
        where = f"moved it to {self._quarantine(step)} and " if quarantine else ""
        say(
            f"checkpoint: step {step} in {self.directory} is unreadable ({_one_line(err)}); "
            f"{where}trying the previous checkpoint"
        )

    def restore_data_spec(self, step: int) -> tuple[dict, bytes | None] | None:
        """``(data spec, tokenizer file bytes)`` saved with checkpoint `step`; None if absent."""
        try:
            args = ocp.args.Composite(data_spec=ocp.args.JsonRestore())
            record = dict(self.manager.restore(step, args=args)["data_spec"])
        except Exception:  # checkpoints written before data specs were saved, or unreadable
            return None
        payload = record.pop("tokenizer_file_b64", None)
        return record, None if payload is None else base64.b64decode(payload)

    def restore_config(self, step: int | None = None) -> dict:
        """The config dict saved with checkpoint `step` (default: latest)."""
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))[
            "config"
        ]

    def _quarantine(self, step: int) -> epath.Path:
        src = self.directory / str(step)
        stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S")
        dst = self.workdir / CORRUPT_DIR / f"step_{step}_{stamp}"
        if jax.process_index() == 0 and src.exists():
            move(src, dst)
        self.manager.reload()
        return dst
