"""The arms of the class-incremental experiment: their models, training and scoring per task.

The arms (``transformer``, ``hope_attention``, ``hope_attention_online``, ``hope``) are
described in the docstring of :mod:`nested_jax.experiments.class_incremental`. Here: each arm's
model configuration (:func:`model_config`), one jitted program per (configuration, phase) with the
phase's optimizer (pretraining, fine-tuning, or the online CMS rule of SPEC §3.3), what the arms
of one seed share (split, test passages, pretrained backbones) and :func:`run_arm`: one arm on one
seed, scored after every task.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from nested_jax.experiments.class_incremental_data import (
    VOCAB,
    ClassIncrementalSettings,
    ClassSplit,
    class_order,
    classification_batch,
    lm_batch,
    sample_passages,
    split_classes,
    task_classes,
)
from nested_jax.experiments.class_incremental_report import (
    accuracy_rows,
    average_accuracy,
    forgetting,
)

__all__ = ["ARMS", "SeedData", "model_config", "run_arm"]

ARMS = ("transformer", "hope_attention", "hope_attention_online", "hope")


def model_config(arm: str, s: ClassIncrementalSettings):
    """The :class:`~nested_jax.models.config.ModelConfig` of an arm (``"transformer"`` for the
    pretrained backbone of arms 1-3)."""
    from nested_jax.layers.options import CMSOptions
    from nested_jax.models import ModelConfig

    base = dict(
        vocab_size=VOCAB,
        d_model=s.d_model,
        n_layers=s.n_layers,
        n_heads=s.n_heads,
        chunk_size=min(64, s.passage_len),
    )
    if arm == "transformer":
        return ModelConfig(name="transformer", **base)
    if arm == "hope":
        return ModelConfig(name="hope", cms=CMSOptions(periods=s.cms_periods), **base)
    online = arm == "hope_attention_online"
    cms = CMSOptions(
        periods=s.cms_periods,
        variant="independent",
        mode="online" if online else "pretrain",
        online_lr=s.online_lr,
    )
    return ModelConfig(name="hope_attention", cms=cms, **base)


class _Program:
    """One model configuration's jitted train step and last-position logits (built once, reused
    by every seed: the jit caches key on these function objects)."""

    def __init__(self, cfg, phase: str, s: ClassIncrementalSettings):
        import jax
        import optax
        from flax import nnx

        from nested_jax.models import build_model
        from nested_jax.optim.multifreq import multi_frequency
        from nested_jax.train.config import OptimizerConfig
        from nested_jax.train.optimizer import build_optimizer, cms_level_of
        from nested_jax.train.step import make_train_step, params_to_state

        self.cfg = cfg
        abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
        graphdef, params, _ = nnx.split(abstract, nnx.Param, ...)
        state_def = jax.tree.structure(params)
        if phase == "pretrain":
            ocfg = OptimizerConfig(
                lr=s.pretrain_lr, warmup_steps=max(1, s.pretrain_steps // 10), weight_decay=0.1
            )
            tx, schedule = build_optimizer(ocfg, max(1, s.pretrain_steps), model=cfg)
        elif phase == "online":  # only the CMS levels learn, by SGD at their periods
            frozen = lambda p: jax.tree.map(  # noqa: E731
                lambda lab: lab is None, cms_level_of(p), is_leaf=lambda x: x is None
            )
            sgd = optax.sgd(s.online_lr)
            tx = optax.chain(
                optax.masked(optax.set_to_zero(), frozen),
                multi_frequency(
                    sgd,
                    level_of=cms_level_of,
                    periods=s.cms_periods,
                    accumulate=s.online_accumulate,
                ),
            )
            schedule = optax.constant_schedule(s.online_lr)
        else:
            ocfg = OptimizerConfig(
                lr=s.lr, warmup_steps=s.warmup_steps, decay="constant", weight_decay=s.weight_decay
            )
            tx, schedule = build_optimizer(ocfg, s.n_tasks * s.steps_per_task, model=cfg)
        self.tx = tx
        self.step = jax.jit(make_train_step(graphdef, state_def, tx, schedule), donate_argnums=0)

        def last_logits(p, rest, tokens):
            model = nnx.merge(graphdef, params_to_state(p, state_def), rest)
            return model(tokens)[0][:, -1, :]

        self.last_logits = jax.jit(last_logits)

    def init(self, seed: int):
        """``(params, rest, n_params)`` of a fresh model initialised with ``seed``."""
        import jax
        from flax import nnx

        from nested_jax.models import build_model

        _, params, rest = nnx.split(build_model(self.cfg, rngs=nnx.Rngs(seed)), nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        return params, rest, sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))

    def train(self, params, rest, batches, state=None):
        """Steps on ``batches`` (an iterable) from a copy of ``params`` (or a carried ``state``).

        Returns:
          ``(state, losses)``.
        """
        import jax
        import jax.numpy as jnp

        if state is None:
            params = jax.tree.map(jnp.array, params)  # a copy: the step donates its input
            state = {
                "step": jnp.zeros((), jnp.int32),
                "params": params,
                "opt_state": self.tx.init(params),
                "consecutive_skips": jnp.zeros((), jnp.int32),
            }
        losses = []
        for b in batches:
            state, m = self.step(state, rest, b)
            losses.append(m["loss"])
        return state, [float(x) for x in jax.device_get(losses)]

    def predictor(self, params, rest, eval_batch: int) -> Callable[[np.ndarray], np.ndarray]:
        """``inputs [N, P] -> logits [N, V]`` at the last position, ``eval_batch`` rows at a time
        (the last batch padded, so one compiled shape)."""

        def predict(x):
            out = []
            for i in range(0, len(x), eval_batch):
                chunk = x[i : i + eval_batch]
                pad = np.concatenate([chunk, np.repeat(chunk[-1:], eval_batch - len(chunk), 0)])
                out.append(np.asarray(self.last_logits(params, rest, pad))[: len(chunk)])
            return np.concatenate(out)

        return predict


def _task_batches(split: list[ClassSplit], classes: Sequence[int], s, rng, steps: int):
    """``steps`` classification batches of a task: classes balanced within each batch."""
    for _ in range(steps):
        labels = rng.permutation(np.resize(np.asarray(classes), s.batch_size))
        x = np.stack([sample_passages(split[c].train, 1, s.passage_len, rng)[0] for c in labels])
        yield classification_batch(x, labels)


class SeedData:
    """What every arm of one seed shares: split, test passages, pretrained backbones (lazy)."""

    def __init__(self, s: ClassIncrementalSettings, seed: int, novels: dict, programs: dict):
        self.s, self.seed, self.programs = s, seed, programs
        self.order = class_order(seed, s.permute)
        self.split = split_classes(novels, self.order, s.test_fraction, seed)
        rng = np.random.default_rng([seed, 1])
        self.test_sets = [sample_passages(c.test, s.n_test, s.passage_len, rng) for c in self.split]
        self.backbones: dict[str, dict] = {}

    def program(self, arm: str, phase: str) -> _Program:
        key = (arm, phase)
        if key not in self.programs:
            self.programs[key] = _Program(model_config(arm, self.s), phase, self.s)
        return self.programs[key]

    def backbone(self, name: str) -> dict:
        """The pretrained ``"transformer"`` or ``"hope"`` of this seed (trained on first use)."""
        if name not in self.backbones:
            s, prog = self.s, self.program(name, "pretrain")
            params, rest, n = prog.init(self.seed)
            text = [ch for c in self.split for ch in c.train]
            rng = np.random.default_rng([self.seed, 2])
            batches = (
                lm_batch(text, s.batch_size, s.passage_len, rng) for _ in range(s.pretrain_steps)
            )
            t0 = time.perf_counter()
            state, losses = prog.train(params, rest, batches)
            secs = time.perf_counter() - t0
            tail = float(np.mean(losses[-20:])) if losses else math.nan
            print(
                f"  pretrained {name} seed {self.seed}: loss {tail:.3f} ({secs:.0f} s)", flush=True
            )
            self.backbones[name] = {
                "params": state["params"],
                "rest": rest,
                "loss": tail,
                "seconds": secs,
            }
        return self.backbones[name]


def run_arm(arm: str, data: SeedData) -> dict:
    """Pretrained backbone → (conversion) → the task sequence, scored after every task.

    Returns:
      a row: ``arm, seed, order, A, A_task`` (``[N, N]``, NaN above the diagonal), ``avg_acc``
      (``[N]``), ``final_avg_acc``, ``forgetting``, ``forgetting_task``, ``task_loss`` (mean
      label loss of the last 10 steps of each task), ``params``, ``pretrain_loss``,
      ``pretrain_seconds``, ``conversion_max_abs`` (converted arms), ``seconds``.
    """
    from nested_jax.train.convert import check_convertible, convert_ffn_to_cms

    s = data.s
    t0 = time.perf_counter()
    bb = data.backbone("hope" if arm == "hope" else "transformer")
    phase = "online" if arm == "hope_attention_online" else "finetune"
    prog = data.program(arm, phase)
    params, rest, n_params = prog.init(data.seed)
    row = {"arm": arm, "seed": data.seed, "order": list(data.order), "params": n_params}
    if arm.startswith("hope_attention"):
        src = data.program("transformer", "pretrain")
        check_convertible(src.cfg, prog.cfg)
        params = convert_ffn_to_cms(bb["params"], params)
        x = data.test_sets[0][: s.eval_batch]
        before = src.predictor(bb["params"], bb["rest"], s.eval_batch)(x)
        after = prog.predictor(params, rest, s.eval_batch)(x)
        row["conversion_max_abs"] = float(np.max(np.abs(before - after)))
    else:
        params = bb["params"]
    rest = bb["rest"] if arm in ("transformer", "hope") else rest
    n = s.n_tasks
    a, a_task = np.full((n, n), np.nan), np.full((n, n), np.nan)
    rng = np.random.default_rng([data.seed, 3])
    state, task_loss = None, []
    for i, classes in enumerate(task_classes(len(data.split), s.classes_per_task)):
        batches = _task_batches(data.split, classes, s, rng, s.steps_per_task)
        state, losses = prog.train(params, rest, batches, state)
        task_loss.append(float(np.mean(losses[-10:])))
        predict = prog.predictor(state["params"], rest, s.eval_batch)
        a[i], a_task[i] = accuracy_rows(predict, data.test_sets, i, s.classes_per_task)
        print(
            f"  [{arm} seed {data.seed}] after task {i + 1}: "
            + " ".join(f"{v:.2f}" for v in a[i, : i + 1])
            + f" (label loss {task_loss[-1]:.3f})",
            flush=True,
        )
    return {
        **row,
        "A": a.tolist(),
        "A_task": a_task.tolist(),
        "avg_acc": average_accuracy(a).tolist(),
        "final_avg_acc": float(average_accuracy(a)[-1]),
        "forgetting": forgetting(a),
        "forgetting_task": forgetting(a_task),
        "task_loss": task_loss,
        "pretrain_loss": bb["loss"],
        "pretrain_seconds": bb["seconds"],
        "seconds": time.perf_counter() - t0,
    }
