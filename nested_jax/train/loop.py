"""The training loop: ``train_and_evaluate(config, workdir) -> summary``.

One run, as named steps (each a function below):

1. :func:`~nested_jax.train.workdir.plan_resume` reads what `workdir` already holds (the saved
   config and data record) and decides which changed settings a resume may apply. Nothing is
   written yet, so a refused resume, a bad mesh or an unreadable corpus leaves no trace.
2. :func:`prepare_data` builds the mesh, loads the data with the workdir's own tokenizer,
   initialises the sharded state and jits the steps
   (:func:`~nested_jax.train.setup.prepare_run`); the corpus is checked against the saved
   fingerprint. With ``data.task`` the data is a generated task
   (:mod:`nested_jax.data.task_source`) and every validation also reports its score
   (``val_accuracy``).
3. :func:`restore_or_start` restores the newest good checkpoint (params, optimizer, data
   iterator, step) or starts from scratch; :func:`~nested_jax.train.workdir.record_run` writes the
   config, the data record and the config history.
4. :func:`open_run` opens the metrics and the progress bar; :func:`run_and_close` runs
   :func:`run_steps` (jitted steps, NaN policy, validation, checkpoints, and a clean stop on
   SIGTERM / Ctrl-C: checkpoint saved, ``preempted: True``) and closes them all.
5. :func:`~nested_jax.train.summary.build_summary`, then
   :func:`~nested_jax.train.summary.write_summary` writes ``summary.json`` (strict JSON) and prints
   the summary.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nested_jax.files import as_path
from nested_jax.parallel.distributed import say
from nested_jax.train.checkpoint import (
    Checkpointer,
    abstract_like,
    checkpoint_bytes,
    free_bytes,
    is_disk_full,
)
from nested_jax.train.config import Config, config_to_dict
from nested_jax.train.lock import acquire, stale_notice
from nested_jax.train.metrics import MetricsWriter
from nested_jax.train.optimizer import with_fresh_hyperparams
from nested_jax.train.progress import Progress
from nested_jax.train.setup import (  # noqa: F401  (re-exported: the loop's public names)
    BATCH_KEYS,
    TrainSetup,
    evaluate,
    init_train_setup,
    make_score_fn,
    prepare_run,
)
from nested_jax.train.signals import StopSignal
from nested_jax.train.step import bits_per_byte
from nested_jax.train.summary import StepStats, build_summary, write_summary
from nested_jax.train.workdir import (
    ResumePlan,
    check_corpus,
    plan_resume,
    record_run,
)


class TrainingError(RuntimeError):
    """Training stopped on purpose (NaN policy, exhausted data); ``str(err)`` is one clear line."""


# -- 2. mesh, data and steps ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """The mesh, data and jitted steps of a run (step 2), and the data facts its records need."""

    data: Any  # the config's data section
    mesh: Any
    setup: TrainSetup
    bundle: Any  # the loaded corpus: tokenizer, train_docs, val_docs, corpus record
    spec: dict  # the data record written to data_spec.json and saved with every checkpoint
    entropy: float  # unigram byte entropy of the whole corpus (bits/byte; NaN for a task)
    eval_batches: list[dict]  # this process's validation batches
    # (params, eval batches) -> {"val_accuracy": ...} of a generated task (None: a text corpus)
    score_fn: Callable[[dict, list[dict]], dict] | None = None

    def make_iterator(self) -> Any:
        """A fresh training-data iterator (this process's share); a checkpoint restores its
        position."""
        from nested_jax.data import pipeline

        return pipeline.make_train_iterator(
            self.data,
            self.bundle.tokenizer,
            self.bundle.train_docs,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )


def prepare_data(
    config: Config, workdir: Path, plan: ResumePlan, devices: Sequence[jax.Device] | None
) -> PreparedRun:
    """Builds the mesh, loads the data with the workdir's own tokenizer (when it has one), sets up
    the state and steps (:func:`~nested_jax.train.setup.prepare_run`), then checks the corpus
    against the saved fingerprint; nothing is written.

    Raises:
      DataError: the corpus cannot be read. ResumeRefused: the corpus changed.
    """
    from nested_jax.data import pipeline
    from nested_jax.data.identity import data_spec

    tokenizer = None if plan.data is None else plan.data.tokenizer
    mesh, bundle, setup = prepare_run(config, devices, tokenizer=tokenizer)
    check_corpus(plan, bundle, workdir)
    tok = bundle.tokenizer
    spec = data_spec(config.data, tok, bundle.corpus)
    if bundle.task is None:
        entropy = pipeline.unigram_byte_entropy(list(bundle.train_docs) + list(bundle.val_docs))
        score_fn = None
    else:  # no text: no byte entropy; the task scores its own predictions
        entropy, score_fn = float("nan"), make_score_fn(setup, bundle.task.score)
    eval_batches = pipeline.make_eval_batches(
        config.data,
        tok,
        bundle.val_docs,
        max_batches=config.eval.eval_batches or None,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    return PreparedRun(config.data, mesh, setup, bundle, spec, entropy, eval_batches, score_fn)


# -- 3. restore -----------------------------------------------------------------------------------


def restore_or_start(
    config: Config,
    workdir: Path,
    setup: TrainSetup,
    make_iterator: Callable[[], Any],
    plan: ResumePlan,
) -> tuple[Checkpointer, int, dict, Any]:
    """``(checkpointer, start step, state, data iterator)`` from the newest good checkpoint.

    Raises:
      CheckpointMismatch: the newest readable checkpoint holds other arrays than `config`
        builds (nothing is moved).
    """
    tc = config.train
    ckpt = Checkpointer(workdir, keep=tc.keep_checkpoints, async_save=tc.async_checkpointing)
    try:
        restored = ckpt.restore_latest(
            abstract_like(setup.state), make_iterator, reset_optimizer=plan.reset_optimizer
        )
    except BaseException:
        ckpt.manager.close()
        raise
    if restored is None:
        say(f"starting from scratch in {workdir} (no checkpoint found)")
        return ckpt, 0, setup.state, make_iterator()
    start, state, iterator = restored
    if plan.reset_optimizer or "opt_state" not in state:
        why = "--reset-optimizer" if plan.reset_optimizer else "the checkpoint holds none"
        state = {**setup.state, **state}  # the restored weights, a fresh optimizer state
        say(f"resuming from step {start} with a fresh optimizer state ({why})")
    else:
        if any(c.field.startswith("optimizer.") for c in plan.changes):  # a new schedule
            fresh = setup.state["opt_state"]
            state = {**state, "opt_state": with_fresh_hyperparams(state["opt_state"], fresh)}
        say(f"resuming from step {start} (checkpoint {ckpt.directory / str(start)})")
    return ckpt, start, state, iterator


def _apply_nan_policy(m: dict, step: int, tc: Any, ckpt_dir: Path) -> None:
    """After a non-finite step (already not applied): report it, or raise per train.nan_policy."""
    if tc.nan_policy == "stop":
        raise TrainingError(
            f"non-finite loss/gradient at step {step} (loss={m['loss']}, grad_norm="
            f"{m['grad_norm']}); train.nan_policy=stop: stopping, the last saved checkpoint in "
            f"{ckpt_dir} is intact"
        )
    say(
        f"step {step}: non-finite loss/gradient (loss={m['loss']}); update skipped "
        f"({int(m['consecutive_skips'])} in a row, limit {tc.max_consecutive_skips})"
    )
    if m["consecutive_skips"] > tc.max_consecutive_skips:
        raise TrainingError(
            f"{int(m['consecutive_skips'])} consecutive non-finite steps (up to step {step}) "
            f"exceed train.max_consecutive_skips={tc.max_consecutive_skips}; stopping, the last "
            f"saved checkpoint in {ckpt_dir} is intact"
        )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def space_needed(workdir: Path, state: dict) -> int:
    """Bytes a checkpoint needs: the newest complete one's size, else the state's array bytes."""
    size = checkpoint_bytes(workdir)
    if size is None:
        size = sum(
            int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)
        )
    return size


def check_free_space(workdir: Path, state: dict) -> None:
    """Refuses to train when the disk cannot hold one more checkpoint (local workdirs only).

    Raises:
      TrainingError: one line with the bytes a checkpoint needs and the bytes free.
    """
    free = free_bytes(workdir)
    needed = space_needed(workdir, state)
    if free is not None and free < needed:
        raise TrainingError(
            f"not enough free space for a checkpoint in {workdir}: one needs about "
            f"{_size(needed)}, {_size(free)} free; free some space and run the same command "
            "again (nothing was trained, the checkpoints there are intact)"
        )


def disk_full_error(step: int, directory: Path, state: dict) -> TrainingError:
    """The one-line error of a checkpoint that the full disk could not take."""
    free = free_bytes(directory)
    free_text = "" if free is None else f", {_size(free)} free"
    return TrainingError(
        f"checkpoint {step} could not be written: no space left on device (a checkpoint needs "
        f"about {_size(space_needed(directory.parent, state))}{free_text}); the checkpoints saved "
        f"before in {directory} are intact; free some space and run the same command to resume"
    )


# -- 4. the steps ----------------------------------------------------------------------------------


@dataclasses.dataclass
class RunContext:
    """Everything :func:`run_steps` uses besides the train state."""

    config: Config
    setup: TrainSetup
    ckpt: Checkpointer
    iterator: Any  # the grain training iterator (checkpointed with the state)
    eval_batches: list[dict]
    writer: MetricsWriter
    progress: Progress
    save_extras: dict  # config dict, data spec and tokenizer bytes saved with every checkpoint
    score_fn: Callable[[dict, list[dict]], dict] | None = None  # a generated task's scores

    def wait(self, step: int, state: dict) -> None:
        """Waits for the pending saves (up to `step`); a full disk stops training in one line."""
        try:
            self.ckpt.wait()
        except Exception as err:
            if is_disk_full(err):
                raise disk_full_error(step, self.ckpt.directory, state) from err
            raise

    def save(self, step: int, state: dict) -> None:
        """Starts saving checkpoint `step`; a write error (disk full) stops training in one line."""
        try:
            self.ckpt.save(step, state, self.iterator, **self.save_extras)
        except Exception as err:  # orbax leaves only its temporary directory behind
            if is_disk_full(err):
                raise disk_full_error(step, self.ckpt.directory, state) from err
            if not isinstance(err, OSError):
                raise
            raise TrainingError(
                f"checkpoint {step} could not be written ({err.strerror or err}); the checkpoints "
                f"saved before in {self.ckpt.directory} are intact"
            ) from err


def _train_step(run: RunContext, state: dict, step: int, stats: StepStats) -> dict:
    from nested_jax.parallel.mesh import global_batch_from_local

    tc = run.config.train
    t0 = time.perf_counter()
    try:
        local = next(run.iterator)
    except StopIteration:
        raise TrainingError(f"training data exhausted at step {step}") from None
    batch = global_batch_from_local({k: local[k] for k in BATCH_KEYS}, run.setup.mesh)
    state, metrics = run.setup.train_step(state, batch)
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if stats.steps_run:  # the first step of an invocation includes compilation
        stats.timed_tokens += m["tokens"]
        stats.timed_s += time.perf_counter() - t0
    stats.steps_run += 1
    if not m["finite"]:
        stats.skipped += 1
        _apply_nan_policy(m, step, tc, run.ckpt.directory)
    else:
        stats.last_loss = m["loss"]
    bpb = bits_per_byte(m["loss_sum"], m["bytes"])
    if step % tc.log_every == 0 or step == tc.steps or not m["finite"]:
        scalars = {"loss": m["loss"], "bits_per_byte": bpb, "grad_norm": m["grad_norm"]}
        scalars.update(lr=m["lr"], tokens_per_s=stats.tokens_per_s, skipped=1 - int(m["finite"]))
        run.writer.write(step, "train", scalars)
    run.progress.update(1, loss=m["loss"], bpb=bpb, tok_s=stats.tokens_per_s)
    return state


def _validate(run: RunContext, state: dict, step: int) -> dict:
    val = evaluate(run.setup, state["params"], run.eval_batches)
    scores = run.score_fn(state["params"], run.eval_batches) if run.score_fn else {}
    val.update(scores)
    run.writer.write(step, "eval", val)
    run.progress.write(
        f"step {step}: val loss {val['val_loss']:.4f}, val bits/byte {val['val_bits_per_byte']:.4f}"
        + "".join(f", {k.replace('_', ' ')} {v:.4f}" for k, v in scores.items())
    )
    return val


def run_steps(run: RunContext, state: dict, start: int) -> tuple[dict, StepStats]:
    """Trains from `start` to ``train.steps``; stops early (after saving) on SIGTERM / Ctrl-C.

    Returns:
      the final state and :class:`StepStats`.
    Raises:
      TrainingError: NaN policy stop, too many skipped steps, exhausted data.
      KeyboardInterrupt: a second Ctrl-C (abort without saving).
    """
    tc = run.config.train
    stats = StepStats()
    step = start
    with StopSignal() as stop:
        for step in range(start + 1, tc.steps + 1):
            state = _train_step(run, state, step, stats)
            if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                stats.val = _validate(run, state, step)
            saved = step % tc.checkpoint_every == 0 or step == tc.steps
            if saved:
                run.save(step, state)
            if stop.requested(run.ckpt.manager, step):
                with stop.shielded():  # a second Ctrl-C now would only interrupt a good save
                    if not saved:
                        run.save(step, state)
                    run.wait(step, state)
                stats.stopped_by = stop.name
                run.progress.write(
                    f"preempted at step {step}: checkpoint saved ({stop.name}); run the same "
                    "command again to resume"
                )
                break
        run.wait(step, state)
    return state, stats


def open_run(
    config: Config, workdir: Path, prep: PreparedRun, ckpt: Checkpointer, iterator: Any,
    state: dict, start: int,
) -> RunContext:  # fmt: skip
    """Opens the metrics (a resume event when continuing), prints the run's first line and
    starts the progress bar: the :class:`RunContext` of :func:`run_steps`."""
    from nested_jax.data.identity import tokenizer_payload

    writer = MetricsWriter(workdir)
    if start:
        writer.write(start, "event", {"event": "resume"})
    tc = config.train
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    data = (
        f"task {config.data.task} ({prep.bundle.tokenizer.vocab_size} ids)"
        if config.data.task
        else f"unigram byte entropy {prep.entropy:.3f} bits/byte"
    )
    say(
        f"model {config.model.name}: {n_params / 1e6:.2f}M params; mesh {dict(prep.mesh.shape)}; "
        f"{max(tc.steps - start, 0)} steps to go; {data}"
    )
    progress = Progress(
        tc.steps,
        initial=start,
        desc="train",
        unit="step",
        enabled=tc.progress_bar and jax.process_index() == 0 and start < tc.steps,
        echo=jax.process_index() == 0,
    )
    save_extras = {
        "config": config_to_dict(config),
        "data_spec": prep.spec,
        "tokenizer_file": tokenizer_payload(prep.bundle.tokenizer)[1],
    }
    return RunContext(
        config,
        prep.setup,
        ckpt,
        iterator,
        prep.eval_batches,
        writer,
        progress,
        save_extras,
        prep.score_fn,
    )


def run_and_close(run: RunContext, state: dict, start: int) -> tuple[dict, StepStats]:
    """:func:`run_steps`, then closes the progress bar, the metrics and the checkpointer whatever
    happened (a failed background save is reported, not allowed to mask the original error)."""
    steps_failed = True
    try:
        result = run_steps(run, state, start)
        steps_failed = False
        return result
    finally:
        run.progress.close()
        run.writer.close()
        try:
            run.ckpt.close()
        except Exception as err:  # a failed background save: report it, do not mask the original
            say(f"checkpoint: the last save did not complete ({type(err).__name__}: {err})")
            # Inside this handler sys.exc_info() is `err` itself, so it cannot tell whether the
            # steps failed; the flag can. Without an earlier error the failed save is the error.
            if not steps_failed:
                raise


# -- the whole run ---------------------------------------------------------------------------------


def train_and_evaluate(
    config: Config,
    workdir: str | Path,
    *,
    devices: Sequence[jax.Device] | None = None,
    reset_optimizer: bool = False,
    config_source: str | None = None,
) -> dict:
    """Trains `config` in `workdir` (resuming the newest good checkpoint there); returns a summary.

    Writes ``config.json``/``config.yaml``, ``data_spec.json`` (+ the tokenizer file),
    ``checkpoints/``, ``metrics.jsonl``, ``tensorboard/`` and ``summary.json`` into `workdir`, but
    only once the config, the resume and the data are known to be good. `devices` restricts the
    mesh to those devices (default: all of ``jax.devices()``; notebooks and tests use a subset).
    `reset_optimizer` resumes the weights and data position with a fresh optimizer state (and
    lets ``optimizer.*`` settings change). `config_source` (e.g. "saved in W/config.json") is
    printed as the config the run uses once the resume and the data are accepted.

    Returns:
      summary dict: final_train_loss, val_loss, val_bits_per_byte, val_perplexity,
      unigram_entropy_bits_per_byte, tokens_per_s, steps, start_step, steps_this_run,
      skipped_steps, preempted, stopped_by, wall_time_s, workdir. On SIGTERM / Ctrl-C (or a
      multi-host preemption notice) the current step finishes, a checkpoint is saved and the
      summary has ``preempted: True`` (no final validation).

    Raises:
      WorkdirBusy: another live run holds `workdir` (:mod:`nested_jax.train.lock`); nothing was
        written.
      ConfigError (ResumeRefused, CheckpointMismatch): a refused resume; nothing was written.
      DataError: the corpus cannot be read; nothing was written.
      TrainingError: NaN/Inf policy stop, too many consecutive skipped steps, exhausted data, or
        a full disk (before training when it cannot hold one more checkpoint).
    """
    t_start = time.time()
    workdir = as_path(workdir)
    # One run per workdir, held before anything is written (process 0 writes the run's files).
    lock = acquire(workdir) if jax.process_index() == 0 else None
    try:
        notice = stale_notice(lock)
        if notice:
            say(notice)
        return _train_locked(config, workdir, devices, reset_optimizer, config_source, t_start)
    finally:
        if lock is not None:
            lock.release()


def _train_locked(
    config: Config,
    workdir: Path,
    devices: Sequence[jax.Device] | None,
    reset_optimizer: bool,
    config_source: str | None,
    t_start: float,
) -> dict:
    plan = plan_resume(config, workdir, reset_optimizer=reset_optimizer)
    prep = prepare_data(config, workdir, plan, devices)
    ckpt, start, state, iterator = restore_or_start(
        config, workdir, prep.setup, prep.make_iterator, plan
    )
    if start < config.train.steps:
        try:
            check_free_space(workdir, state)
        except TrainingError:
            ckpt.manager.close()
            raise
    if config_source:
        say(f"this run uses the config {config_source}")
    record_run(config, workdir, plan, prep.spec, prep.bundle.tokenizer, start)
    run = open_run(config, workdir, prep, ckpt, iterator, state, start)
    state, stats = run_and_close(run, state, start)
    if not stats.val and stats.stopped_by is None:  # nothing trained: evaluate what was restored
        stats.val = evaluate(prep.setup, state["params"], prep.eval_batches)
        if prep.score_fn is not None:
            stats.val.update(prep.score_fn(state["params"], prep.eval_batches))
    summary = build_summary(workdir, stats, state, start, prep.entropy, t_start)
    write_summary(workdir, summary)
    return summary
