"""The shared core of the drivers that train LM-shell models from scratch on generated batches.

:mod:`nested_jax.experiments.mqar` (MQAR) and :mod:`nested_jax.experiments.synthetic` (formal
languages, MAD) differ only in their batches and their scorer; everything else lives here:

* model specs: a registered mixer name, optionally ``<name>+proteus<E>`` and ``@<label>``
  (:func:`parse_model`, :func:`model_config`), validated by :func:`check_models`;
* equal parameter budgets: :func:`count_params` (abstract shapes, nothing allocated) and
  :func:`matched_d_model` / :func:`model_widths` (every model after the first gets the width whose
  parameter count is closest to the first model's);
* training: :func:`build_training` (AdamW behind global-norm clipping, linear warmup + cosine decay;
  the CMS pretrain-mode steps for Hope models) and :func:`fit` (``steps`` steps on batches drawn
  from one seeded generator, so every model sees the same batch sequence);
* scoring: :func:`make_scorer` (accuracy weighted by the scored positions, and the mean loss there,
  over a list of held-out batches);
* a stopped run's progress (:class:`Progress`); finished runs are cached by
  :mod:`nested_jax.experiments._cache`.

Settings: any object with the attributes of :class:`ShellSettings` (``MqarSettings``,
``SyntheticSettings``). A batch is ``{"inputs", "targets": int32[B, T], "loss_mask":
float32[B, T]}``; the loss is taken only where ``loss_mask`` is 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nested_jax.experiments._cache import same_key

Batch = dict[str, np.ndarray]


class ShellSettings(Protocol):
    """What the shared core reads from a driver's settings."""

    steps: int  # optimizer steps per model
    batch_size: int  # sequences per step
    d_model: int  # width of the first model (the parameter budget)
    n_layers: int  # blocks per model
    n_heads: int  # heads per mixer
    lr: float  # AdamW peak learning rate
    warmup_steps: int  # linear warmup steps
    weight_decay: float  # decoupled AdamW weight decay on matrices
    seed: int  # parameter init and training batches

    @property
    def seq_len(self) -> int: ...  # T of a training batch (Proteus context, chunk size)

    @property
    def vocab(self) -> int: ...  # model vocabulary


PROTEUS_TAG = "+proteus"
VARIANT_TAG = "@"  # <mixer>@<label>: the same mixer again, with its own --set-model options


def check_positive(s: object, names: Sequence[str]) -> None:
    """Raises ``ValueError`` naming the first field of ``names`` that is below 1."""
    for name in names:
        if getattr(s, name) < 1:
            raise ValueError(f"{name}: expected >= 1, got {getattr(s, name)}")


def check_multipliers(m: object) -> None:
    """Raises ``ValueError`` naming ``eval_multipliers`` unless ``m`` is a non-empty tuple of
    distinct positive ints."""
    if (
        not isinstance(m, tuple)
        or not m
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in m)
        or len(set(m)) != len(m)
    ):
        raise ValueError(
            f"eval_multipliers: expected a non-empty tuple of distinct positive ints, got {m!r}"
        )


def parse_model(spec: str) -> tuple[str, int]:
    """``"gdn"`` -> ``("gdn", 1)``; ``"gdn+proteus16"`` -> ``("gdn", 16)`` (Proteus blocks E).

    A spec may end in ``@<label>`` (``"hope@token"`` -> ``("hope", 1)``): a second entry of the
    same mixer under its own name, so ``--set-model hope@token:model.hope.chunk_memory=1`` can
    give it other options than ``hope`` in one comparison (its runs are cached under the label).

    Raises:
      ValueError: naming ``models`` when the Proteus suffix is not a positive int or the label is
        not a word (letters, digits, ``_``).
    """
    spec, at, label = spec.partition(VARIANT_TAG)
    if at and not label.replace("_", "").isalnum():
        raise ValueError(
            f"models: {spec}{at}{label!r}: expected <name>{VARIANT_TAG}<label> with a label of "
            f"letters, digits or _ (e.g. hope{VARIANT_TAG}token)"
        )
    if PROTEUS_TAG not in spec:
        return spec, 1
    name, _, blocks = spec.partition(PROTEUS_TAG)
    if not blocks.isdigit() or int(blocks) < 1:
        raise ValueError(
            f"models: {spec!r}: expected <name>{PROTEUS_TAG}<E> with a positive int E "
            f"(e.g. gdn{PROTEUS_TAG}16)"
        )
    return name, int(blocks)


def check_models(models: Sequence[str]) -> None:
    """Raises ``ValueError`` naming ``models`` when the list is empty, has duplicates, or names a
    mixer that is not registered (``nested_jax.models.available_mixers``)."""
    from nested_jax.models import available_mixers

    if not models:
        raise ValueError("models: expected at least one model name")
    known = available_mixers()
    unknown = [m for m in models if parse_model(m)[0] not in known]
    if unknown:
        raise ValueError(f"models: unknown {unknown}; registered: {list(known)}")
    if len(set(models)) != len(models):
        raise ValueError(f"models: duplicate names in {list(models)}")


def model_config(name: str, s: ShellSettings, d_model: int):
    """The :class:`ModelConfig` of model ``name`` (maybe ``<mixer>+proteus<E>``, see
    :func:`parse_model`) at width ``d_model`` for these settings."""
    from nested_jax.layers.options import ProteusOptions
    from nested_jax.models import ModelConfig, get_mixer

    mixer, blocks = parse_model(name)
    proteus = ProteusOptions(blocks=blocks, context_len=s.seq_len if blocks > 1 else 0)
    chunk = min(64, s.seq_len)
    # a mixer with fewer forms than the default (the LSTM: recurrent only) states them in IMPLS
    impls = getattr(get_mixer(mixer), "IMPLS", None)
    impl = "chunked" if impls is None or "chunked" in impls else impls[0]
    cfg = ModelConfig(
        name=mixer,
        vocab_size=s.vocab,
        d_model=d_model,
        n_layers=s.n_layers,
        n_heads=s.n_heads,
        chunk_size=chunk,
        impl=impl,
        proteus=proteus,
    )
    overrides = [text for model, text in getattr(s, "model_overrides", ()) if model == name]
    return apply_model_overrides(cfg, overrides) if overrides else cfg


def apply_model_overrides(cfg, overrides: Sequence[str]):
    """``cfg`` (a ``ModelConfig``) with ``model.KEY=VALUE`` overrides applied by the strict config
    machinery (``train.config``: an unknown key or a bad value raises ``ValueError`` in one line
    naming ``model.<key>``).

    Raises:
      ValueError: naming ``model_overrides`` when an override does not start with ``model.``.
    """
    from nested_jax.models import ModelConfig
    from nested_jax.train.config import apply_overrides, config_to_dict, section_from_dict

    for text in overrides:
        if not str(text).startswith("model."):
            raise ValueError(
                f"model_overrides: expected model.KEY=VALUE (e.g. model.hope.chunk_memory=1), "
                f"got {text!r}"
            )
    values = apply_overrides({"model": config_to_dict(cfg)}, overrides)
    return section_from_dict(ModelConfig, values["model"], "model")


def count_params(name: str, s: ShellSettings, d_model: int) -> int:
    """Parameters of model ``name`` at ``d_model`` (from abstract shapes; nothing allocated)."""
    from nested_jax.models import build_model

    cfg = model_config(name, s, d_model)
    abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def matched_d_model(name: str, s: ShellSettings, target: int) -> tuple[int, int]:
    """``(d_model, params)`` of ``name`` closest to ``target`` parameters (``d_model`` a multiple
    of ``2 · n_heads``, searched from ``2 · n_heads`` up to ``4 · s.d_model``)."""
    step = 2 * s.n_heads
    best = None
    for d in range(step, 4 * s.d_model + 1, step):
        try:
            n = count_params(name, s, d)
        except ValueError:  # a mixer may reject some widths (e.g. head-dim constraints)
            continue
        if best is None or abs(n - target) < abs(best[1] - target):
            best = (d, n)
        if n >= target:
            break  # counts grow with d_model: past the target the search is over
    if best is None:
        raise ValueError(f"models: no d_model gives a valid {name!r} model")
    return best


def model_widths(models: Sequence[str], s: ShellSettings, match_params: bool) -> dict[str, int]:
    """``{model: d_model}``: the first at ``s.d_model``; the others matched to its parameter count
    (:func:`matched_d_model`) when ``match_params``, else also ``s.d_model``."""
    widths = {models[0]: s.d_model}
    target = count_params(models[0], s, s.d_model)
    for name in models[1:]:
        widths[name] = matched_d_model(name, s, target)[0] if match_params else s.d_model
    return widths


def build_training(name: str, s: ShellSettings, d_model: int):
    """Model ``name`` at ``d_model`` (init seed ``s.seed``), its jitted AdamW train step and the
    initial train state: ``(graphdef, state_def, rest, step, state, n_params)``."""
    from nested_jax.models import build_model
    from nested_jax.train.config import OptimizerConfig
    from nested_jax.train.optimizer import build_optimizer
    from nested_jax.train.step import make_train_step

    cfg = model_config(name, s, d_model)
    model = build_model(cfg, rngs=nnx.Rngs(s.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state_def = jax.tree.structure(params)
    params = nnx.to_pure_dict(params)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    ocfg = OptimizerConfig(
        name="adamw",
        lr=s.lr,
        warmup_steps=min(s.warmup_steps, s.steps),
        weight_decay=s.weight_decay,
    )
    # model=cfg: CMS models (hope, hope_attention) get their pretrain-mode multi-frequency steps
    # as in the training loop; a no-op for every other model.
    tx, schedule = build_optimizer(ocfg, s.steps, model=cfg)
    step = jax.jit(make_train_step(graphdef, state_def, tx, schedule), donate_argnums=(0,))
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        "consecutive_skips": jnp.zeros((), jnp.int32),
    }
    return graphdef, state_def, rest, step, state, n_params


class Progress(NamedTuple):
    """Where :func:`train` keeps a run's progress, so a stopped run continues where it stopped.

    ``path``: an ``.npz`` file (the train state, the batch generator's state, the losses and the
    times so far), written atomically every ``every_s`` seconds of training and removed when the
    run ends. ``key``: the run's settings; a file saved under another key is not resumed.
    ``added``: settings fields newer than some files, at their defaults, as in :func:`same_key`.
    """

    path: Path
    key: dict
    every_s: float = 300.0
    added: dict | None = None


class Checks(NamedTuple):
    """Scores taken while a model trains (e.g. the formal-language protocol's scored bins after
    every epoch, as its source reports each bin's best epoch): ``fn(x)`` after every ``every``
    steps and after the last, each result kept as ``{"step": i, **fn(x)}`` in the run's
    ``curve``. :func:`fit` passes ``x`` as the :class:`Trained` model at that step, :func:`train`
    as its parameters."""

    every: int
    fn: Callable[[Any], dict]


def _save_progress(progress: Progress, state, rng, losses, clock: dict, curve: list) -> None:
    meta = {
        "key": progress.key,
        "rng": rng.bit_generator.state,
        "losses": [float(x) for x in jax.device_get(losses)],
        "curve": curve,
        **clock,
    }
    save_params(progress.path, state, meta)


def _load_progress(progress: Progress | None, state):
    """``(state, rng_state, losses, clock, curve)`` saved under ``progress``, or None (no file,
    another key, or a file that cannot be read: that run starts over, with one line saying
    why)."""
    if progress is None or not progress.path.is_file():
        return None
    try:
        meta = load_meta(progress.path)
        if not same_key(meta.get("key"), progress.key, progress.added):
            print(f"  progress at {progress.path} is for other settings: starting over", flush=True)
            return None
        state = load_params(progress.path, state)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
        print(f"  progress at {progress.path} unreadable ({err}): starting over", flush=True)
        return None
    clock = {k: meta[k] for k in ("done", "seconds", "steady_seconds", "timed_steps")}
    return state, meta["rng"], meta["losses"], clock, meta.get("curve", [])


def train(
    name: str,
    s: ShellSettings,
    step,
    state: dict,
    rest,
    next_batch: Callable[[np.random.Generator], Batch],
    log_every: int,
    progress: Progress | None = None,
    checks: Checks | None = None,
):
    """``s.steps`` steps on ``next_batch(rng)`` with one generator seeded by ``s.seed`` (the same
    batch sequence for every model). With ``progress``, the run continues from its saved progress
    (the same state, batches, losses and curve as an unbroken run) and saves it as it goes.
    ``checks``: ``checks.fn(params)`` after every ``checks.every`` steps and after the last.

    Returns:
      ``(state, losses, clock, curve)``; ``clock``: ``seconds`` (wall time of all steps,
      compilation and checks included), ``steady_seconds`` and ``timed_steps`` (the steps after
      the first of each stretch, for the throughput), summed over the stretches of a resumed run;
      ``curve``: ``[{"step": i, **checks.fn(params)}, ...]`` (empty without ``checks``).
    """
    rng = np.random.default_rng(s.seed)
    losses: list = []
    curve: list = []
    clock = {"done": 0, "seconds": 0.0, "steady_seconds": 0.0, "timed_steps": 0}
    resumed = _load_progress(progress, state)
    if resumed is not None:
        state, rng.bit_generator.state, losses, clock, curve = resumed
        print(f"  [{name}] resuming at step {clock['done']}/{s.steps}", flush=True)
    first = clock["done"] + 1
    t_start = t0 = last_save = time.perf_counter()

    def clock_now(i: int) -> dict:
        now = time.perf_counter()
        return {
            "done": i,
            "seconds": clock["seconds"] + now - t_start,
            "steady_seconds": clock["steady_seconds"] + (now - t0 if i > first else 0.0),
            "timed_steps": clock["timed_steps"] + i - first,
        }

    for i in range(first, s.steps + 1):
        state, m = step(state, rest, next_batch(rng))
        losses.append(m["loss"])
        if i == first:  # throughput excludes a stretch's first step (compilation)
            jax.block_until_ready(state["params"])
            t0 = time.perf_counter()
        if log_every and (i % log_every == 0 or i == s.steps):
            print(f"  [{name}] step {i}/{s.steps} loss {float(m['loss']):.4f}", flush=True)
        if checks is not None and (i % checks.every == 0 or i == s.steps):
            curve.append({"step": i, **checks.fn(state["params"])})
        if (
            progress is not None
            and i < s.steps
            and time.perf_counter() - last_save >= progress.every_s
        ):
            _save_progress(progress, state, rng, losses, clock_now(i), curve)
            last_save = time.perf_counter()
    jax.block_until_ready(state["params"])
    clock = clock_now(s.steps)
    if progress is not None:
        progress.path.unlink(missing_ok=True)
    return state, losses, clock, curve


class Trained(NamedTuple):
    """A trained model, split as the train step holds it."""

    graphdef: Any
    state_def: Any
    rest: Any
    params: Any


def fit(
    name: str,
    s: ShellSettings,
    d_model: int,
    next_batch: Callable[[np.random.Generator], Batch],
    log_every: int = 50,
    progress: Progress | None = None,
    checks: Checks | None = None,
) -> tuple[Trained, dict]:
    """Build model ``name`` at ``d_model`` and train it (:func:`build_training`, :func:`train`;
    ``progress``: continue a stopped run and save as it goes; ``checks``: score it as it trains).

    Returns:
      ``(trained, stats)``; ``stats``: ``params`` (count), ``final_train_loss`` (mean of the last
      10 steps), ``train_seconds`` (compilation included), ``tokens_per_s`` (steps after the
      first, ``s.batch_size · s.seq_len`` tokens each; NaN with a single step), and with
      ``checks`` its ``curve`` (:func:`train`).
    """
    graphdef, state_def, rest, step, state, n_params = build_training(name, s, d_model)
    on_params = None
    if checks is not None:
        on_params = checks._replace(fn=lambda p: checks.fn(Trained(graphdef, state_def, rest, p)))
    state, losses, clock, curve = train(
        name, s, step, state, rest, next_batch, log_every, progress, on_params
    )
    timed = clock["timed_steps"]
    tail = np.asarray(jax.device_get(losses[-10:]), np.float64)
    stats = {
        "params": n_params,
        "final_train_loss": float(tail.mean()),
        "train_seconds": clock["seconds"],
        "tokens_per_s": (
            timed * s.batch_size * s.seq_len / clock["steady_seconds"] if timed else float("nan")
        ),
    }
    if checks is not None:
        stats["curve"] = curve
    return Trained(graphdef, state_def, rest, state["params"]), stats


META_KEY = "__meta__"  # the .npz entry that holds save_params' ``meta`` as JSON


def save_params(path: Path, params, meta: dict | None = None) -> None:
    """Write a parameter tree as ``.npz`` (one array per leaf, keyed by its tree path), atomically,
    so a finished run's weights can be probed later (:func:`load_params`); ``meta``: a JSON-able
    dict kept beside them (:func:`load_meta`)."""
    import io

    from nested_jax.files import atomic_write_bytes

    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    arrays = {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}
    if meta is not None:
        arrays[META_KEY] = np.asarray(json.dumps(meta))
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def load_meta(path: Path) -> dict:
    """The ``meta`` that :func:`save_params` kept in ``path`` (``{}`` when it kept none)."""
    with np.load(path) as saved:
        return json.loads(str(saved[META_KEY])) if META_KEY in saved else {}


def load_params(path: Path, like):
    """The tree written by :func:`save_params`, in the structure of ``like``.

    Raises:
      ValueError: naming ``path`` when a leaf of ``like`` is missing or has another shape.
    """
    with np.load(path) as saved:
        leaves = []
        for key, ref in jax.tree_util.tree_flatten_with_path(like)[0]:
            name = jax.tree_util.keystr(key)
            if name not in saved or saved[name].shape != np.shape(ref):
                raise ValueError(f"path: {path} has no leaf {name} of shape {np.shape(ref)}")
            leaves.append(saved[name])
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def _model_at(trained: Trained, params):
    """``trained``'s model with the weights ``params`` (a pytree shaped like ``trained.params``)."""
    graphdef, state_def, rest, _ = trained
    return nnx.merge(graphdef, jax.tree.unflatten(state_def, jax.tree.leaves(params)), rest)


def make_logits_fn(trained: Trained) -> Callable:
    """``logits_fn(params, tokens [B, T]) -> [B, T, V]``: the jitted forward of ``trained``'s model
    (compiled once per batch shape)."""
    return jax.jit(lambda p, tokens: _model_at(trained, p)(tokens)[0])


def make_hidden_fn(trained: Trained) -> Callable:
    """``hidden_fn(params, tokens [B, T]) -> [B, T, d_model]``: the final hidden states of
    ``trained``'s model (the output head's input), jitted."""
    return jax.jit(lambda p, tokens: _model_at(trained, p).hidden(tokens)[0])


def make_scorer(trained: Trained) -> Callable[[Sequence[Batch], Callable], dict]:
    """``score(batches, accuracy_fn) -> {accuracy, eval_loss, eval_queries}`` for ``trained``.

    ``accuracy_fn(logits, batch)`` is the accuracy over the batch's scored positions
    (``score_mask`` where the batch has one, else ``loss_mask``); it is weighted by their number,
    so the result is the accuracy over all scored positions of ``batches`` (``per_row=True``:
    weighted by rows, for a string-level accuracy; ``eval_queries`` then counts rows, else scored
    positions). ``eval_loss`` is the mean loss (nats) over ``loss_mask`` (its weights). ``at``:
    score other weights of the same model instead (one scorer for a whole training curve). The
    jitted forward passes are compiled once per batch shape.
    """
    from nested_jax.train.step import make_eval_step

    graphdef, state_def, rest, params = trained
    eval_step = jax.jit(make_eval_step(graphdef, state_def))
    logits_fn = make_logits_fn(trained)

    def score(
        batches: Sequence[Batch], accuracy_fn: Callable, per_row: bool = False, at=None
    ) -> dict:
        p = params if at is None else at  # at: other weights of the same model (a curve's)
        correct, total, loss_sum, tokens = 0.0, 0, 0.0, 0.0
        for b in batches:
            n = len(b["inputs"]) if per_row else int(b.get("score_mask", b["loss_mask"]).sum())
            correct += accuracy_fn(logits_fn(p, b["inputs"]), b) * n
            total += n
            sums = eval_step(p, rest, b)
            loss_sum += float(sums["loss_sum"])
            tokens += float(sums["tokens"])
        return {"accuracy": correct / total, "eval_loss": loss_sum / tokens, "eval_queries": total}

    return score


def print_table(run: Callable[[], dict]) -> int:
    """A driver's ``main`` tail: ``run()``, then print its ``markdown`` (when it has one) and
    ``plot`` path (exit 0), or one ``error:`` line on stderr for a ``ValueError`` (exit 2)."""
    import sys

    try:
        result = run()
    except ValueError as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    print(result.get("markdown", ""), end="")
    print(f"plot: {result['plot']}")
    return 0


def _scalar_fields(cls: type, skip: Sequence[str]) -> list[tuple[str, Any]]:
    defaults = cls()
    return [
        (f.name, getattr(defaults, f.name))
        for f in dataclasses.fields(cls)
        if f.name not in skip
        and not isinstance(getattr(defaults, f.name), bool)
        and isinstance(getattr(defaults, f.name), int | float | str)
    ]


def add_scalar_flags(p: argparse.ArgumentParser, cls: type, skip: Sequence[str] = ()) -> None:
    """``--field-name`` (default None) for every int / float / str field of dataclass ``cls``."""
    for name, value in _scalar_fields(cls, skip):
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None, dest=name)


def scalar_values(args: argparse.Namespace, cls: type, skip: Sequence[str] = ()) -> dict:
    """The fields of :func:`add_scalar_flags` given on the command line (not None)."""
    return {
        name: getattr(args, name)
        for name, _ in _scalar_fields(cls, skip)
        if getattr(args, name) is not None
    }
