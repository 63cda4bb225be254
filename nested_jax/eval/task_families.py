"""The generated-task families ``formal`` and ``mad``, registered for ``data.task`` training.

Importing this module registers them in :mod:`nested_jax.data.task_source` (the data layer cannot
import the generators, which live here in ``eval``); ``nested-jax train`` / ``eval`` / ``generate``
import it before they run, so ``nested-jax train --task formal:parity`` trains on parity strings
with the ordinary loop, checkpoints and progress bar.

``formal:<name>`` (:data:`~nested_jax.eval.formal_languages.FORMAL_TASKS`): one string per row,
``BOS w QUERY`` then padding, the class of ``w`` predicted at the QUERY position (layout in
:mod:`nested_jax.eval.formal_languages`; 17 ids). Options (``data.task_options``):

* ``train_lengths: [lo, hi]`` string lengths of the training batches (default ``[1, T - 2]``,
  the longest strings a row of ``T = data.seq_len`` holds);
* ``eval_lengths: [lo, hi]`` string lengths of the held-out batches (default ``train_lengths``;
  e.g. ``[hi + 1, 2 hi]`` to measure length generalisation; ``hi <= T - 2``).

Score: ``accuracy``, the fraction of rows whose answer-position argmax is the right class
(:func:`~nested_jax.eval.formal_languages.formal_accuracy`; chance 1 / classes).

``mad:<name>`` (:data:`~nested_jax.eval.mad.MAD_TASKS`): MAD's generator at its baseline sizes,
which ``data.task_options`` overrides (its keyword arguments: ``seq_len``, ``vocab_size``, ...);
rows (``T_task`` tokens, e.g. ``seq_len - 1`` for in-context recall) are right-padded to
``data.seq_len`` with id 0, target 0 and ``loss_mask`` 0 (a causal model never sees the padding
from a scored position). The model's vocabulary must hold the task's ``vocab_size``. Score:
``accuracy`` at the scored positions (:func:`~nested_jax.eval.mad.mad_accuracy`, micro).

Train and validation batches of both families come from disjoint seed streams
(:func:`nested_jax.data.task_source.batch_rng`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np

from nested_jax.data.task_source import register_task_family
from nested_jax.eval.formal_languages import (
    FORMAL_TASKS,
    FormalVocab,
    formal_accuracy,
    make_formal_batch,
)
from nested_jax.eval.mad import MAD_TASKS, mad_accuracy, make_mad_batch

FORMAL_OPTIONS = ("train_lengths", "eval_lengths")


def _lengths(options: Mapping[str, Any], key: str, default: tuple[int, int]) -> tuple[int, int]:
    value = options.get(key, default)
    ok = (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )
    if not ok:
        raise ValueError(f"data.task_options.{key}: expected [lo, hi] ints, got {value!r}")
    return int(value[0]), int(value[1])


@dataclasses.dataclass(frozen=True)
class FormalTaskData:
    """A formal-language task as training data (module docstring)."""

    name: str  # key of FORMAL_TASKS
    train_lengths: tuple[int, int]
    eval_lengths: tuple[int, int]
    seq_len: int  # T, the padded row length
    vocab_size: int = FormalVocab().size

    def batch(self, rng_or_seed: Any, batch_size: int, split: str) -> dict[str, np.ndarray]:
        """``batch_size`` rows of strings with lengths in the split's range, padded to T."""
        lengths = self.train_lengths if split == "train" else self.eval_lengths
        return make_formal_batch(self.name, batch_size, lengths, rng_or_seed, seq_len=self.seq_len)

    def score(self, logits: Any, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        """``{"accuracy"}``: sequence accuracy (one scored position per row)."""
        return {"accuracy": formal_accuracy(logits, batch)}


def formal_family(name: str, options: Mapping[str, Any], seq_len: int, seed: int) -> FormalTaskData:
    """Factory of ``formal:<name>`` (options in the module docstring; `seed` unused: batches are
    drawn from the stream the source gives).

    Raises:
      ValueError: one line naming ``data.task``, ``data.task_options.<key>`` or ``data.seq_len``.
    """
    del seed
    if name not in FORMAL_TASKS:
        raise ValueError(
            f"data.task: unknown formal task {name!r}; known: {', '.join(sorted(FORMAL_TASKS))}"
        )
    unknown = sorted(set(options) - set(FORMAL_OPTIONS))
    if unknown:
        raise ValueError(
            f"data.task_options: formal tasks take {', '.join(FORMAL_OPTIONS)}; got {unknown}"
        )
    if seq_len < 3:
        raise ValueError(f"data.seq_len: a formal task row needs >= 3 tokens, got {seq_len}")
    train = _lengths(options, "train_lengths", (1, seq_len - 2))
    held_out = _lengths(options, "eval_lengths", train)
    for key, lengths in (("train_lengths", train), ("eval_lengths", held_out)):
        if lengths[1] > seq_len - 2:
            raise ValueError(
                f"data.task_options.{key}: strings up to {lengths[1]} need rows of "
                f"{lengths[1] + 2} tokens (BOS, string, QUERY), more than data.seq_len={seq_len}"
            )
        try:  # the generator's own checks (range order, lengths its language allows)
            make_formal_batch(name, 1, lengths, 0, seq_len=seq_len)
        except ValueError as err:
            raise ValueError(f"data.task_options.{key}: {err}") from None
    return FormalTaskData(name, train, held_out, seq_len)


@dataclasses.dataclass(frozen=True)
class MadTaskData:
    """A MAD task as training data (module docstring)."""

    name: str  # key of MAD_TASKS
    sizes: tuple[tuple[str, Any], ...]  # overrides of the generator's keyword arguments
    seq_len: int  # T, the padded row length
    vocab_size: int

    def batch(self, rng_or_seed: Any, batch_size: int, split: str) -> dict[str, np.ndarray]:
        """``batch_size`` rows of the task (same generator for both splits), right-padded to T."""
        del split
        raw = make_mad_batch(self.name, batch_size, rng_or_seed, **dict(self.sizes))
        pad = self.seq_len - raw["inputs"].shape[1]
        return {k: np.pad(v, ((0, 0), (0, pad))) for k, v in raw.items()}

    def score(self, logits: Any, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        """``{"accuracy"}`` at the scored positions (micro average)."""
        return {"accuracy": mad_accuracy(logits, batch)}


def mad_family(name: str, options: Mapping[str, Any], seq_len: int, seed: int) -> MadTaskData:
    """Factory of ``mad:<name>``: `options` are the generator's size arguments (`seed` unused).

    Raises:
      ValueError: one line naming ``data.task``, ``data.task_options`` or ``data.seq_len``.
    """
    del seed
    if name not in MAD_TASKS:
        raise ValueError(
            f"data.task: unknown MAD task {name!r}; known: {', '.join(sorted(MAD_TASKS))}"
        )
    sizes = dict(options)
    try:
        probe = make_mad_batch(name, 1, 0, **sizes)
    except (TypeError, ValueError) as err:
        raise ValueError(f"data.task_options: {str(err).splitlines()[0]}") from None
    width = probe["inputs"].shape[1]
    if width > seq_len:
        raise ValueError(
            f"data.seq_len: mad:{name} rows hold {width} tokens, more than data.seq_len={seq_len}; "
            "raise data.seq_len or shorten the task (data.task_options, e.g. its seq_len)"
        )
    defaults = inspect.signature(MAD_TASKS[name].make).parameters
    vocab = int(sizes.get("vocab_size", defaults["vocab_size"].default))
    return MadTaskData(name, tuple(sorted(sizes.items())), seq_len, vocab)


register_task_family("formal", formal_family)
register_task_family("mad", mad_family)
