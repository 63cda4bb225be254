"""A training workdir describes itself: its config, its data, and what may change on resume.

Files (besides ``checkpoints/``, ``metrics.jsonl``, ``summary.json``)::

    config.json / config.yaml   the config of the latest run (each checkpoint also keeps its own)
    data_spec.json              tokenizer identity + corpus fingerprint (nested_jax.data.identity)
    tokenizer.model | .json     the exact tokenizer file (SentencePiece / Hugging Face runs)
    config_history.jsonl        one line per setting changed on resume: step, field, old, new

Rules (enforced before anything is written):

- ``train --workdir W`` without ``--config`` continues W with its saved config. A W without a run
  (missing, empty, a typo) is refused with a hint instead of starting a default run. When
  ``config.json`` is gone, the config saved in the newest checkpoint is used.
- Resuming with a changed setting: settings that are safe to change on resume
  (:data:`SAFE_ON_RESUME`: the learning-rate schedule (``train.steps``, ``optimizer.lr``, warmup
  and decay, :data:`SCHEDULE_FIELDS`), eval / checkpoint / log cadence, evaluation settings, the
  device mesh, cache paths) are applied and printed as a notice; the optimizer state is kept.
  Other optimizer settings need ``--reset-optimizer`` (weights and data position kept, optimizer
  state fresh). Anything else (model, tokenizer, sequence length, batch, seeds) is refused with one
  line naming each field, and nothing in W is touched.
- The tokenizer used for training is the one saved in W; eval, generate and a resumed run read
  that copy. A corpus whose fingerprint differs from the saved one is refused for training (the
  data order would silently change) and reported by eval / generate.

A training run (:mod:`nested_jax.train.loop`) starts with :func:`plan_resume` (reads W, writes
nothing) and, once the data and the checkpoint are accepted, :func:`record_run` writes the files.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from pathlib import Path
from typing import Any

import jax
from etils import epath

from nested_jax.data.corpus import DataError
from nested_jax.data.identity import (
    TOKENIZER_FILES,
    corpus_changed,
    describe_corpus,
    tokenizer_from_payload,
    tokenizer_payload,
)
from nested_jax.files import append_text, as_path, atomic_write_bytes, strict_json, write_json
from nested_jax.layers.options import OPTION_SECTIONS
from nested_jax.parallel.distributed import say
from nested_jax.train.checkpoint import Checkpointer, checkpoint_steps
from nested_jax.train.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    flatten_fields,
    load_config,
    load_workdir_config,
    save_config,
)
from nested_jax.train.optimizer import learning_rate_schedule

CONFIG_JSON = "config.json"
DATA_SPEC_JSON = "data_spec.json"
CONFIG_HISTORY = "config_history.jsonl"

# Optimizer settings that only shape the learning-rate schedule. Every registered optimizer takes
# the schedule as a function of its step count, so its state (count, moments) holds the same arrays
# whatever these are: a resume keeps the saved moments and the new schedule applies from the next
# step (a rate held in the state by optax.inject_hyperparams is refreshed on restore).
SCHEDULE_FIELDS = (
    "optimizer.lr",
    "optimizer.warmup_steps",
    "optimizer.decay",
    "optimizer.min_lr_ratio",
)
# Settings a resumed run may change (fnmatch patterns over dotted field paths): they change neither
# the arrays in a checkpoint nor the data the model sees. `data.corpus` names where the text is;
# whether the text itself changed is judged by its fingerprint (check_corpus).
SAFE_ON_RESUME = (
    "train.steps",
    "train.log_every",
    "train.eval_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.async_checkpointing",
    "train.progress_bar",
    "train.nan_policy",
    "train.max_consecutive_skips",
    "train.debug_nan_at_steps",
    "train.loss_chunk",
    "model.attention_block",
    "model.attention_impl",
    "eval.*",
    "mesh.*",
    "data.corpus",
    "data.data_dir",
    # Where the tokens come from: a prepared folder is checked against the tokenizer, split and
    # train text (nested_jax.data.prepared.check_manifest), so one that loads gives the same
    # token stream as tokenising in-process, and the iterator state is the same for both.
    "data.prepared_dir",
    # Read-ahead threads: the same batches in the same order, the same iterator state.
    "data.prefetch",
    # Hope compute knobs: how the same math is scheduled (values equal up to rounding)
    "model.hope.chunk_updates",
    "model.hope.remat*",
    # the learning-rate schedule: the optimizer state is kept as saved
    *SCHEDULE_FIELDS,
)
# Fields added with a default that changes the math: a saved config without the field ran with
# the value here (the behaviour before the field existed), not with today's default.
BEFORE_THE_FIELD = {
    "model.hope.grad_clip": 0.0,  # saved before the inner-gradient softclamp: it ran without
}
# Settings that --reset-optimizer makes changeable (the optimizer state is rebuilt from them).
OPTIMIZER_FIELDS = ("optimizer.*",)


class ResumeRefused(ConfigError):
    """A resume that would change what the checkpoints mean; ``str`` is one line with the fix."""


@dataclasses.dataclass(frozen=True)
class ConfigChange:
    """One setting that differs between the saved run and the current config."""

    field: str  # dotted path, e.g. "optimizer.grad_clip"
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.field} ({self.old!r} -> {self.new!r})"


def has_run(workdir: str | os.PathLike) -> bool:
    """Whether `workdir` holds a run to continue (a saved config or a complete checkpoint)."""
    workdir = as_path(workdir)
    return (workdir / CONFIG_JSON).is_file() or bool(checkpoint_steps(workdir))


def saved_config_dict(workdir: str | os.PathLike) -> tuple[dict, str] | None:
    """``(config dict, where it came from)`` of the run in `workdir`, or None without one.

    The newest checkpoint's own config comes first (it is what the arrays were saved with), then
    ``config.json``.
    """
    workdir = as_path(workdir)
    steps = checkpoint_steps(workdir)
    if steps:
        ckpt = Checkpointer(workdir, read_only=True)
        try:
            for step in reversed(steps):
                try:
                    return dict(ckpt.restore_config(step)), f"checkpoint {step}"
                except Exception:  # an unreadable checkpoint: the restore reports it later
                    continue
        finally:
            ckpt.manager.close()
    path = workdir / CONFIG_JSON
    if path.is_file():
        try:
            return json.loads(path.read_text()), str(path)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: unreadable JSON ({err})") from None
    return None


def resolve_config(
    workdir: str | os.PathLike, config_paths: list[str], overrides: list[str]
) -> tuple[Config, str]:
    """The config ``nested-jax train`` runs with, and a note saying where it came from.

    With `config_paths`: those YAML files (+ overrides). Without: the run saved in `workdir`
    (``config.json``, else the newest checkpoint's config), + overrides.

    Raises:
      ConfigError: no ``--config`` and no run in `workdir` (one line with the hint).
    """
    if config_paths:
        return load_config(config_paths, overrides), "from " + ", ".join(config_paths)
    workdir = as_path(workdir)
    path = workdir / CONFIG_JSON
    if path.is_file():
        return load_workdir_config(workdir, overrides), f"saved in {path}"
    saved = saved_config_dict(workdir)
    if saved is None:
        state = "does not exist" if not workdir.exists() else "holds no run"
        raise ConfigError(
            f"--workdir {workdir} {state}: give --config FILE to start a new run there "
            "(or check the path)"
        )
    values, where = saved
    config = config_from_dict(apply_overrides(values, overrides))
    return config, f"recovered from {where} ({CONFIG_JSON} was missing)"


def _with_defaults(saved: Any, default: Any) -> Any:
    """``saved`` (a config dict) with the keys it lacks taken from ``default``, recursively."""
    if not isinstance(saved, dict) or not isinstance(default, dict):
        return saved
    out = dict(default)
    for k, v in saved.items():
        out[k] = _with_defaults(v, default.get(k))
    return out


def _normalise(v: Any) -> Any:
    # JSON turns tuples into lists; compare values, not container types.
    return json.loads(strict_json(v))


def config_changes(saved: dict, config: Config) -> list[ConfigChange]:
    """Fields whose value in `config` differs from the saved config dict, in field order.

    A field missing from an older saved config did not exist then: that run used its default, or
    the value in :data:`BEFORE_THE_FIELD` where a new field's default changed the math.
    Option sections the model does not read (``model.hope`` of a GDN run) are not compared.
    """
    new = flatten_fields(config_to_dict(config))
    old = flatten_fields(_with_defaults(saved, config_to_dict(Config())))
    had = flatten_fields(saved)
    old.update({p: v for p, v in BEFORE_THE_FIELD.items() if p not in had})
    inert = set(OPTION_SECTIONS) - set(config.model.read_option_sections())
    changes = []
    for path, value in new.items():
        if any(path.startswith(f"model.{s}.") for s in inert):
            continue
        before = old.get(path)
        if _normalise(before) != _normalise(value):
            changes.append(ConfigChange(path, before, value))
    return changes


def _matches(path: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(path, p) for p in patterns)


def check_resume(
    saved: dict, config: Config, workdir: str | os.PathLike, *, reset_optimizer: bool = False
) -> list[ConfigChange]:
    """The changes a resume of `workdir` with `config` may apply; raises for the others.

    Returns:
      the allowed changes (safe ones, and optimizer ones under `reset_optimizer`), for notices.
    Raises:
      ResumeRefused: one line naming every refused field and how to proceed.
    """
    allowed = SAFE_ON_RESUME + (OPTIMIZER_FIELDS if reset_optimizer else ())
    changes = config_changes(saved, config)
    refused = [c for c in changes if not _matches(c.field, allowed)]
    if not refused:
        return changes
    if all(_matches(c.field, OPTIMIZER_FIELDS) for c in refused):
        how = (
            "revert it, pass --reset-optimizer (keeps the weights and the data position, starts "
            "a fresh optimizer state), or train in a new workdir"
        )
    else:
        how = "revert it or train in a new workdir"
    raise ResumeRefused(
        f"cannot resume {workdir} with a changed "
        + ", ".join(str(c) for c in refused)
        + ": its checkpoints were trained with the old value; nothing was changed. To proceed, "
        + how
    )


def describe_change(change: ConfigChange, config: Config, start: int, reset_optimizer: bool) -> str:
    """The notice printed for a change applied on resume at step `start` (one line).

    A schedule change (``train.steps`` or :data:`SCHEDULE_FIELDS`) shows the learning rate of step
    `start` before and after it.
    """
    line = f"notice: {change} applied on resume"
    opt = config.optimizer
    if change.field == "train.steps":
        old = learning_rate_schedule(opt, int(change.old))(start)
        line += f"; the learning-rate schedule now ends at step {change.new}"
    elif change.field in SCHEDULE_FIELDS and not reset_optimizer:
        before = dataclasses.replace(opt, **{change.field.split(".", 1)[1]: change.old})
        old = learning_rate_schedule(before, config.train.steps)(start)
        line += "; the optimizer state is kept"
    elif change.field.startswith("optimizer."):
        return line + " with a fresh optimizer state"
    else:
        return line
    new = learning_rate_schedule(opt, config.train.steps)(start)
    return line + f" (lr at step {start}: {float(old):.3g} -> {float(new):.3g})"


def record_config_changes(
    workdir: str | os.PathLike, step: int, changes: list[ConfigChange]
) -> None:
    """Appends the changes applied on resume to ``config_history.jsonl`` (the run's record)."""
    if not changes:
        return
    records = [
        {"resumed_at_step": step, "field": c.field, "old": c.old, "new": c.new} for c in changes
    ]
    append_text(as_path(workdir) / CONFIG_HISTORY, "".join(strict_json(r) + "\n" for r in records))


# -- the data a run was trained on -----------------------------------------------------------------


def _read_saved_data(workdir: epath.Path) -> tuple[dict, bytes | None, str] | None:
    path = workdir / DATA_SPEC_JSON
    if path.is_file():
        try:
            spec = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: unreadable JSON ({err})") from None
        name = spec["tokenizer"].get("file")
        payload = (workdir / name).read_bytes() if name and (workdir / name).is_file() else None
        if name is None or payload is not None:
            return spec, payload, str(workdir / (name or DATA_SPEC_JSON))
    steps = checkpoint_steps(workdir)
    if not steps:
        return None
    ckpt = Checkpointer(workdir, read_only=True)
    try:
        for step in reversed(steps):
            found = ckpt.restore_data_spec(step)
            if found is not None:
                spec, payload = found
                return spec, payload, f"checkpoint {step} of {workdir}"
    finally:
        ckpt.manager.close()
    return None


@dataclasses.dataclass(frozen=True)
class SavedData:
    """A workdir's data record, its tokenizer rebuilt from the saved file."""

    spec: dict  # nested_jax.data.identity.data_spec()
    tokenizer: Any  # nested_jax.data.tokenizers.Tokenizer
    where: str  # where the tokenizer came from (for messages)


def saved_data(workdir: str | os.PathLike) -> SavedData | None:
    """The tokenizer and corpus record saved in `workdir` (files, else the newest checkpoint).

    Returns None for a workdir that has none (a new run, or one written before data records).

    Raises:
      DataError: a saved tokenizer that cannot be rebuilt (one line naming the file).
    """
    found = _read_saved_data(as_path(workdir))
    if found is None:
        return None
    spec, payload, where = found
    return SavedData(spec, tokenizer_from_payload(spec["tokenizer"], payload, where), where)


def write_data_spec(workdir: str | os.PathLike, spec: dict, tokenizer: Any) -> None:
    """Writes ``data_spec.json`` and the tokenizer file into `workdir` (atomically).

    Called only when the run's data is established: for a new run, or to restore missing files
    of a resumed one from its checkpoint.
    """
    workdir = as_path(workdir)
    kind, payload = tokenizer_payload(tokenizer)
    if payload is not None:
        atomic_write_bytes(workdir / TOKENIZER_FILES[kind], payload)
    write_json(workdir / DATA_SPEC_JSON, spec)


def corpus_change_message(saved_spec: dict, current: dict) -> str | None:
    """One line describing how the corpus differs from the saved one, or None if it does not."""
    old = saved_spec["corpus"]
    if not corpus_changed(old, current):
        return None
    return (
        f"the corpus changed since this workdir was trained: {describe_corpus(old)} then, "
        f"{describe_corpus(current)} now"
    )


# -- the run's plan and records (steps 1 and 3 of nested_jax.train.loop) --------------------------


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a run continues from (``saved_config is None``: a new run)."""

    saved_config: dict | None  # the config the newest checkpoint was trained with
    changes: list[ConfigChange]  # settings that differ and may change (printed as notices)
    data: SavedData | None  # the saved tokenizer and corpus record (None: new or older run)
    reset_optimizer: bool  # restore weights and data position, start a fresh optimizer state


def plan_resume(config: Config, workdir: Path, *, reset_optimizer: bool = False) -> ResumePlan:
    """Reads `workdir` (never writes) and checks that `config` may continue it.

    Raises:
      ResumeRefused: a setting changed that the checkpoints depend on (one line, with the fix).
    """
    saved = saved_config_dict(workdir) if checkpoint_steps(workdir) else None
    if saved is None:
        if reset_optimizer:
            say(f"notice: --reset-optimizer ignored: {workdir} has no checkpoint to resume")
        return ResumePlan(None, [], None, False)
    changes = check_resume(saved[0], config, workdir, reset_optimizer=reset_optimizer)
    return ResumePlan(saved[0], changes, saved_data(workdir), reset_optimizer)


def check_corpus(plan: ResumePlan, bundle: Any, workdir: Path) -> None:
    """Refuses to resume on a corpus whose fingerprint differs from the saved one."""
    if plan.data is None:
        return
    change = corpus_change_message(plan.data.spec, bundle.corpus)
    if change is not None:
        raise ResumeRefused(
            f"cannot resume {workdir}: {change}; the checkpoints' data position and validation "
            "split refer to the old text. Restore the corpus, or train on the new one in a new "
            "workdir; nothing was changed"
        )


def _notice_lines(config: Config, plan: ResumePlan, start: int) -> list[str]:
    return [describe_change(c, config, start, plan.reset_optimizer) for c in plan.changes]


def record_run(
    config: Config, workdir: Path, plan: ResumePlan, spec: dict, tokenizer: Any, start: int
) -> None:
    """Process 0 writes the config, the data record (when new or missing) and the changes."""
    for line in _notice_lines(config, plan, start):
        say(line)
    if jax.process_index() != 0:
        return
    save_config(config, workdir)
    if plan.data is None and plan.saved_config is not None:
        say(f"notice: {workdir} predates saved tokenizers; recording the one in use now")
    if plan.data is None or not (workdir / DATA_SPEC_JSON).is_file():
        write_data_spec(workdir, spec, tokenizer)  # a new run, or files restored from a checkpoint
    record_config_changes(workdir, start, plan.changes)
