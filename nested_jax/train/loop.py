"""The training loop: ``train_and_evaluate(config, workdir) -> summary``.

One run = build the mesh → load data → initialise the sharded train state (or resume the newest good
checkpoint) → jitted steps with explicit in/out shardings → periodic validation and checkpoints →
``summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nested_jax.models.options import OPTION_SECTIONS
from nested_jax.parallel.mesh import (
    batch_sharding,
    global_batch_from_local,
    make_mesh,
    replicated,
    shardings_like_params,
    state_shardings,
)
from nested_jax.train.checkpoint import CHECKPOINT_DIR, Checkpointer, abstract_like
from nested_jax.train.config import Config, config_to_dict, save_config
from nested_jax.train.metrics import MetricsWriter
from nested_jax.train.optimizer import build_optimizer
from nested_jax.train.step import bits_per_byte, make_eval_step, make_train_step

BATCH_KEYS = ("inputs", "targets", "segment_ids", "loss_mask")


class TrainingError(RuntimeError):
    """Training stopped on purpose (NaN policy, exhausted data); ``str(err)`` is one clear line."""


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
        raise ValueError(
            f"config error: data.batch_size: {config.data.batch_size} is not divisible by the "
            "mesh's "
            f"data × fsdp = {mesh.shape['data']}×{mesh.shape['fsdp']} = {n} devices"
        )
    if config.data.batch_size % jax.process_count():
        raise ValueError(
            f"config error: data.batch_size: {config.data.batch_size} is not divisible by the "
            f"{jax.process_count()} JAX processes"
        )


# Fields a resumed run must share with the run that wrote the checkpoints (shapes, token ids).
_RESUME_FIXED = ("model.*", "optimizer.name", "data.tokenizer", "data.vocab_size", "data.corpus")


def _with_defaults(saved: Any, default: Any) -> Any:
    """``saved`` (a config dict) with the keys it lacks taken from ``default``, recursively."""
    if not isinstance(saved, dict) or not isinstance(default, dict):
        return saved
    out = dict(default)
    for k, v in saved.items():
        out[k] = _with_defaults(v, default.get(k))
    return out


def check_resume_compatible(config: Config, workdir: Path) -> None:
    """Refuses to resume a workdir whose saved run used a different model / tokenizer / corpus.

    Without this, the checkpoints would fail to restore and look corrupt. Other fields (steps,
    learning rate, eval settings, ...) may change between runs, and so may the model option
    sections the model does not read (``ModelConfig.read_option_sections``: a GDN run does not
    care about ``model.hope``).

    Raises:
      ValueError: ``config error: <field>: ...`` naming the first differing field.
    """
    saved_path = workdir / "config.json"
    ckpt_dir = workdir / CHECKPOINT_DIR
    if not saved_path.is_file() or not ckpt_dir.is_dir():
        return
    if not any(p.name.isdigit() for p in ckpt_dir.iterdir()):
        return
    new = config_to_dict(config)
    # A field missing from an older saved config did not exist then: that run used its default.
    saved = _with_defaults(json.loads(saved_path.read_text()), config_to_dict(Config()))
    inert = set(OPTION_SECTIONS) - set(config.model.read_option_sections())
    for pattern in _RESUME_FIXED:
        section, name = pattern.split(".")
        names = new[section].keys() if name == "*" else [name]
        for n in names:
            if section == "model" and n in inert:
                continue
            old_v, new_v = saved.get(section, {}).get(n), new[section][n]
            if old_v != new_v:
                raise ValueError(
                    f"config error: {section}.{n}: {new_v!r} differs from {old_v!r} used by the "
                    f"checkpoints in {workdir}; train in a new workdir or keep the saved value"
                )


def _say(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, flush=True)


class _StopSignal:
    """SIGTERM / preemption: finish the current step, save a checkpoint, stop cleanly.

    One process: a SIGTERM handler sets a flag. Several processes: orbax's
    ``reached_preemption(step)``, which agrees on the same step on every host (a per-host flag
    could make hosts stop at different steps and deadlock the collectives).
    """

    def __init__(self):
        self.signum = None
        self._previous = None
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum

    def requested(self, ckpt: Checkpointer, step: int) -> bool:
        if jax.process_count() > 1:
            return bool(ckpt.manager.reached_preemption(step))
        return self.signum is not None

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def prepare_run(
    config: Config, devices: Sequence[jax.Device] | None = None
) -> tuple[jax.sharding.Mesh, Any, TrainSetup]:
    """Mesh, data bundle (tokenizer, documents) and a freshly initialised :class:`TrainSetup`.

    `devices` restricts the mesh to those devices (default: all; ``mesh.data × mesh.fsdp`` must
    match their number).

    Raises:
      ValueError: ``config error: ...`` when the batch does not fit the mesh / processes or the
        tokenizer has more ids than ``model.vocab_size``.
    """
    from nested_jax.data import pipeline

    mesh = make_mesh(config.mesh, devices)
    _check_mesh_batch(config, mesh)
    bundle = pipeline.prepare_data(config.data)
    tok = bundle.tokenizer
    if tok.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"config error: model.vocab_size: {config.model.vocab_size} is smaller than the "
            f"tokenizer's vocabulary ({tok.vocab_size} ids)"
        )
    token_bytes = np.asarray(tok.token_bytes)
    if token_bytes.shape[0] < config.model.vocab_size:  # ids the tokenizer never produces: 0 bytes
        token_bytes = np.pad(token_bytes, (0, config.model.vocab_size - token_bytes.shape[0]))
    return mesh, bundle, init_train_setup(config, mesh, token_bytes=token_bytes)


def _apply_nan_policy(m: dict, step: int, tc: Any, ckpt_dir: Path) -> None:
    """After a non-finite step (already not applied): report it, or raise per train.nan_policy."""
    if tc.nan_policy == "stop":
        raise TrainingError(
            f"non-finite loss/gradient at step {step} (loss={m['loss']}, grad_norm="
            f"{m['grad_norm']}); train.nan_policy=stop: stopping, the last saved checkpoint in "
            f"{ckpt_dir} is intact"
        )
    _say(
        f"step {step}: non-finite loss/gradient (loss={m['loss']}); update skipped "
        f"({int(m['consecutive_skips'])} in a row, limit {tc.max_consecutive_skips})"
    )
    if m["consecutive_skips"] > tc.max_consecutive_skips:
        raise TrainingError(
            f"{int(m['consecutive_skips'])} consecutive non-finite steps (up to step {step}) "
            f"exceed train.max_consecutive_skips={tc.max_consecutive_skips}; stopping, the last "
            f"saved checkpoint in {ckpt_dir} is intact"
        )


def train_and_evaluate(
    config: Config, workdir: str | Path, *, devices: Sequence[jax.Device] | None = None
) -> dict:
    """Trains `config` in `workdir` (resuming the newest good checkpoint there); returns a summary.

    Writes ``config.json``/``config.yaml``, ``checkpoints/``, ``metrics.jsonl``, ``tensorboard/``
    and ``summary.json`` into `workdir`. `devices` restricts the mesh to those devices (default:
    all of ``jax.devices()``; notebooks and tests use a subset).

    Returns:
      summary dict: final_train_loss, val_loss, val_bits_per_byte, val_perplexity,
      unigram_entropy_bits_per_byte, tokens_per_s, steps, start_step, skipped_steps, preempted,
      wall_time_s, workdir. On SIGTERM (or a multi-host preemption notice) the current step
      finishes, a checkpoint is saved and the summary has ``preempted: True`` (no final validation).

    Raises:
      TrainingError: NaN/Inf policy stop, too many consecutive skipped steps, or exhausted data.
    """
    from nested_jax.data import pipeline

    t_start = time.time()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    check_resume_compatible(config, workdir)
    tc = config.train
    mesh, bundle, setup = prepare_run(config, devices)
    tok = bundle.tokenizer
    entropy = pipeline.unigram_byte_entropy(list(bundle.train_docs) + list(bundle.val_docs))

    def make_iterator():
        return pipeline.make_train_iterator(
            config.data,
            tok,
            bundle.train_docs,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )

    ckpt = Checkpointer(workdir, keep=tc.keep_checkpoints, async_save=tc.async_checkpointing)
    restored = ckpt.restore_latest(abstract_like(setup.state), make_iterator)
    if restored is None:
        start, state, iterator = 0, setup.state, make_iterator()
        _say(f"starting from scratch in {workdir} (no checkpoint found)")
    else:
        start, state, iterator = restored
        _say(f"resuming from step {start} (checkpoint {ckpt.directory / str(start)})")
    if jax.process_index() == 0:
        save_config(config, workdir)
    config_dict = config_to_dict(config)
    eval_batches = pipeline.make_eval_batches(
        config.data,
        tok,
        bundle.val_docs,
        max_batches=config.eval.eval_batches or None,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    writer = MetricsWriter(workdir)
    if start:
        writer.write(start, "event", {"event": "resume"})

    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    _say(
        f"model {config.model.name}: {n_params / 1e6:.2f}M params; mesh {dict(mesh.shape)}; "
        f"{tc.steps - start} steps to go; unigram byte entropy {entropy:.3f} bits/byte"
    )
    bar = None
    if tc.progress_bar and jax.process_index() == 0 and start < tc.steps:
        from tqdm import tqdm

        bar = tqdm(
            total=tc.steps,
            initial=start,
            file=sys.stderr,
            dynamic_ncols=True,
            unit="step",
            mininterval=1.0,  # few redraws when stderr is a log file
        )

    last_loss = float("nan")
    val: dict = {}
    skipped = 0
    preempted = False
    stop_signal = _StopSignal()
    timed_tokens, timed_s = 0.0, 0.0
    try:
        for step in range(start + 1, tc.steps + 1):
            t0 = time.perf_counter()
            try:
                local = next(iterator)
            except StopIteration:
                raise TrainingError(f"training data exhausted at step {step}") from None
            batch = global_batch_from_local({k: local[k] for k in BATCH_KEYS}, mesh)
            state, metrics = setup.train_step(state, batch)
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            dt = time.perf_counter() - t0
            if step > start + 1:  # the first step of a run includes compilation
                timed_tokens += m["tokens"]
                timed_s += dt
            tok_s = timed_tokens / timed_s if timed_s else float("nan")
            if not m["finite"]:
                skipped += 1
                _apply_nan_policy(m, step, tc, ckpt.directory)
            else:
                last_loss = m["loss"]
            bpb = bits_per_byte(m["loss_sum"], m["bytes"])
            if step % tc.log_every == 0 or step == tc.steps or not m["finite"]:
                writer.write(
                    step,
                    "train",
                    {
                        "loss": m["loss"],
                        "bits_per_byte": bpb,
                        "grad_norm": m["grad_norm"],
                        "lr": m["lr"],
                        "tokens_per_s": tok_s,
                        "skipped": 1 - int(m["finite"]),
                    },
                )
            if bar is not None:
                bar.set_postfix(loss=f"{m['loss']:.3f}", bpb=f"{bpb:.3f}", tok_s=f"{tok_s:.0f}")
                bar.update(1)
            if (tc.eval_every and step % tc.eval_every == 0) or step == tc.steps:
                val = evaluate(setup, state["params"], eval_batches)
                writer.write(step, "eval", val)
                line = (
                    f"step {step}: val loss {val['val_loss']:.4f}, "
                    f"val bits/byte {val['val_bits_per_byte']:.4f}"
                )
                bar.write(line) if bar is not None else _say(line)
            saved = step % tc.checkpoint_every == 0 or step == tc.steps
            if saved:
                ckpt.save(step, state, iterator, config_dict)
            if stop_signal.requested(ckpt, step):
                if not saved:
                    ckpt.save(step, state, iterator, config_dict)
                preempted = True
                msg = (
                    f"preempted at step {step}: checkpoint saved; run the same command again to "
                    "resume"
                )
                bar.write(msg) if bar is not None else _say(msg)
                break
        ckpt.wait()
    finally:
        stop_signal.restore()
        if bar is not None:
            bar.close()
        writer.close()
        try:
            ckpt.close()
        except (
            Exception
        ) as err:  # a failed background save: report it, do not mask the original error
            _say(f"checkpoint: the last save did not complete ({type(err).__name__}: {err})")
            if sys.exc_info()[0] is None:
                raise

    if not val and not preempted:  # resumed a finished run: evaluate what was restored
        val = evaluate(setup, state["params"], eval_batches)
    summary = {
        "final_train_loss": last_loss,
        **val,
        "unigram_entropy_bits_per_byte": entropy,
        "tokens_per_s": timed_tokens / timed_s if timed_s else float("nan"),
        "steps": int(jax.device_get(state["step"])),
        "start_step": start,
        "skipped_steps": skipped,
        "preempted": preempted,
        "wall_time_s": time.time() - t_start,
        "workdir": str(workdir),
    }
    if jax.process_index() == 0:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _say(format_summary(summary))
    return summary


def format_summary(summary: dict) -> str:
    """Human-readable multi-line summary of a run."""
    gap = summary["unigram_entropy_bits_per_byte"] - summary.get("val_bits_per_byte", float("nan"))
    return "\n".join(
        [
            "== summary ==",
            f"steps                      {summary['steps']} "
            f"(this run started at {summary['start_step']})",
            f"final train loss           {summary['final_train_loss']:.4f} nats/token",
            f"validation loss            {summary.get('val_loss', float('nan')):.4f} nats/token",
            f"validation bits/byte       {summary.get('val_bits_per_byte', float('nan')):.4f}",
            f"corpus unigram entropy     {summary['unigram_entropy_bits_per_byte']:.4f} bits/byte "
            f"(model is {gap:.3f} below)",
            f"throughput                 {summary['tokens_per_s']:.0f} tokens/s",
            f"wall time                  {summary['wall_time_s']:.1f} s",
        ]
    )
