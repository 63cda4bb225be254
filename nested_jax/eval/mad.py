"""MAD synthetic tasks (Mechanistic Architecture Design, Poli et al. 2024), generated locally.

Six token-manipulation tasks with MAD's baseline sizes as defaults. Every generator returns the
batch format of :func:`nested_jax.eval.tasks.make_mqar_batch` (so the same training step trains on
it)::

    {"inputs": int32[B, T], "targets": int32[B, T], "loss_mask": float32[B, T]}

``loss_mask`` is 1 exactly at the positions MAD scores (its test-split targets); the scorer
:func:`mad_accuracy` is the accuracy of the argmax there (``average="micro"``: over positions;
``"macro"``: mean over target classes of the per-class accuracy, the default of the torchmetrics
metric MAD logs). Targets outside the mask are valid ids (the next input token, or the blank /
pad token) and are never scored. MAD trains the recall tasks on the full next-token loss; here the
loss is on the scored positions unless a caller sets the mask to ones.

Tasks (``V`` = ``vocab_size``; ids of each role; chance = a uniform guess among the ids a scored
position can hold):

``in_context_recall`` (V=16, seq_len=128). A sequence of ``seq_len / 2`` key-value pairs ``k v``
  (keys ``[0, V/2)``, values ``[V/2, V)``; each key keeps one value within a sequence, values may
  repeat across keys); the last pair's key appeared before. Multi-query: every value whose key
  appeared earlier is scored. Next-token form: ``inputs = s[:-1]``, ``targets = s[1:]``, so
  ``T = seq_len - 1``; the mask sits on the key positions (whose target is the value).
  Chance ``1 / (V/2) = 1/8``.
``noisy_in_context_recall`` (V=32, noise_vocab_size=16, frac_noise=0.2). As above with keys and
  values in the first ``V - 16`` ids (keys ``[0, 8)``, values ``[8, 16)``); each pair but one
  (and the probe) is replaced by two noise tokens ``[16, 32)`` with probability 0.2. Chance 1/8.
``fuzzy_in_context_recall`` (V=16, k_motif_size=3, v_motif_size=3). Keys and values are motifs of
  1..3 distinct tokens (keys ``[0, 7)``, values ``[7, 15)``, pad ``15``); sequences are
  left-padded to ``seq_len + 1`` tokens (``T = seq_len``). Every token of a value whose key motif
  appeared earlier is scored. ``fixed_key_size=True`` gives MAD's test split (every key has
  ``k_motif_size`` tokens). Chance ``1/8``.
``selective_copying`` (V=16, seq_len=256, num_tokens_to_copy=16). ``16`` content tokens
  ``[0, V-2)`` scattered among blanks (``V - 2``), then COPY (``V - 1``) and 16 blanks; at the
  i-th blank after COPY the target is the i-th content token (no teacher forcing: the inputs there
  are blanks). ``T = seq_len``. Chance ``1 / (V-2) = 1/14``.
``compression`` (V=16, seq_len=32). MAD: ``seq_len - 1`` tokens ``[0, V-1)`` and a compression
  token ``V - 1``; an MLP decoder reconstructs the sequence from the compression token's embedding
  alone. LM form (no decoder head in the LM shell): the tokens, then the compression token
  repeated ``seq_len - 1`` times; at its i-th occurrence the target is token i. ``T = 2
  (seq_len - 1)``. With attention the bottleneck is not enforced (the model may look back); for
  recurrent models the state is the bottleneck. Chance ``1 / (V-1) = 1/15``.
``memorization`` (V=256, seq_len=32). A fixed key -> value map (keys ``[0, 127)``, distinct
  values from ``[127, 255)``, seeded by ``kv_map_seed``, the same in every batch: it must be
  learned into the weights); rows are ``seq_len / 2`` pairs ``k INSERT`` (INSERT = ``V - 1``),
  the target at INSERT is ``value(k)``. ``T = seq_len``. Chance ``1 / 128`` (uniform over the
  value ids; the best constant answer scores ``1 / 127``, the chance of its key).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nested_jax.eval.seeds import as_rng
from nested_jax.eval.tasks import predicted_ids

Batch = dict[str, np.ndarray]


def _check_int(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
    return int(value)


def _batch(inputs, targets, mask) -> Batch:
    return {
        "inputs": np.asarray(inputs, np.int32),
        "targets": np.asarray(targets, np.int32),
        "loss_mask": np.asarray(mask, np.float32),
    }


# ---- in-context recall (plain and noisy) ------------------------------------------------------


def in_context_recall(
    rng_or_seed: int | np.random.Generator,
    batch_size: int,
    vocab_size: int = 16,
    seq_len: int = 128,
    noise_vocab_size: int = 0,
    frac_noise: float = 0.0,
) -> Batch:
    """Multi-query in-context recall (module docstring); ``T = seq_len - 1``.

    Args:
      rng_or_seed: a seed or a ``numpy.random.Generator``.
      batch_size: B.
      vocab_size: V; keys ``[0, n/2)``, values ``[n/2, n)`` with ``n = V - noise_vocab_size``,
        noise ``[n, V)``.
      seq_len: tokens per instance (even, >= 4): ``seq_len / 2`` pairs.
      noise_vocab_size: ids reserved for noise (> 0 when ``frac_noise > 0``).
      frac_noise: probability that a pair is two noise tokens, in ``[0, 1)``.

    Returns:
      The batch dict; ``loss_mask`` marks the key positions of pairs whose key appeared before.
    """
    batch_size = _check_int("batch_size", batch_size, 1)
    seq_len = _check_int("seq_len", seq_len, 4)
    if seq_len % 2:
        raise ValueError(f"seq_len: expected an even number (pairs), got {seq_len}")
    noise_vocab_size = _check_int("noise_vocab_size", noise_vocab_size, 0)
    vocab_size = _check_int("vocab_size", vocab_size, 2)
    n = vocab_size - noise_vocab_size
    if n < 2:
        raise ValueError(
            f"vocab_size: {vocab_size} leaves {n} ids for keys and values after "
            f"noise_vocab_size={noise_vocab_size} (need >= 2)"
        )
    if not 0.0 <= frac_noise < 1.0:
        raise ValueError(f"frac_noise: expected a fraction in [0, 1), got {frac_noise}")
    if frac_noise > 0 and noise_vocab_size == 0:
        raise ValueError("noise_vocab_size: must be > 0 when frac_noise > 0")
    rng = as_rng(rng_or_seed)
    n_keys, n_pairs = n // 2, seq_len // 2
    stream = np.zeros((batch_size, seq_len), np.int64)
    mask = np.zeros((batch_size, seq_len - 1), np.float32)
    for b in range(batch_size):
        value_of = rng.integers(n_keys, n, size=n_keys)
        keys = rng.integers(0, n_keys, size=n_pairs)
        noise = rng.random(n_pairs - 1) < frac_noise
        noise[rng.integers(n_pairs - 1)] = False  # at least one real pair before the probe
        body = np.flatnonzero(~noise)
        keys[-1] = keys[body[rng.integers(body.size)]]  # the probe: a key shown before
        row = stream[b]
        row[0::2], row[1::2] = keys, value_of[keys]
        for i in np.flatnonzero(noise):
            row[2 * i : 2 * i + 2] = rng.integers(n, vocab_size, size=2)
        seen: set[int] = set()
        for i in range(n_pairs):
            if i < n_pairs - 1 and noise[i]:
                continue
            if keys[i] in seen:
                mask[b, 2 * i] = 1.0
            seen.add(int(keys[i]))
    return _batch(stream[:, :-1], stream[:, 1:], mask)


def noisy_in_context_recall(
    rng_or_seed: int | np.random.Generator,
    batch_size: int,
    vocab_size: int = 32,
    seq_len: int = 128,
    noise_vocab_size: int = 16,
    frac_noise: float = 0.2,
) -> Batch:
    """In-context recall with noise pairs (MAD's noisy baseline sizes); see
    :func:`in_context_recall`."""
    return in_context_recall(
        rng_or_seed, batch_size, vocab_size, seq_len, noise_vocab_size, frac_noise
    )


# ---- fuzzy in-context recall ------------------------------------------------------------------


def fuzzy_in_context_recall(
    rng_or_seed: int | np.random.Generator,
    batch_size: int,
    vocab_size: int = 16,
    seq_len: int = 128,
    k_motif_size: int = 3,
    v_motif_size: int = 3,
    fixed_key_size: bool = False,
) -> Batch:
    """Recall with keys and values of 1..motif-size tokens (module docstring); ``T = seq_len``.

    Args:
      rng_or_seed: a seed or a ``numpy.random.Generator``.
      batch_size: B.
      vocab_size: V; pad ``V - 1``, keys ``[0, (V-1)//2)``, values ``[(V-1)//2, V-1)``.
      seq_len: T; the instance (``seq_len + 1`` tokens before the shift) is left-padded.
      k_motif_size: largest key motif (distinct tokens within a motif).
      v_motif_size: largest value motif.
      fixed_key_size: every key has ``k_motif_size`` tokens (MAD's test split).

    Returns:
      The batch dict; ``loss_mask`` is 1 where the target is a token of a value whose key motif
      appeared earlier in the row (always including the final probe's value).
    """
    batch_size = _check_int("batch_size", batch_size, 1)
    vocab_size = _check_int("vocab_size", vocab_size, 3)
    k_max = _check_int("k_motif_size", k_motif_size, 1)
    v_max = _check_int("v_motif_size", v_motif_size, 1)
    pad, n = vocab_size - 1, vocab_size - 1
    key_tokens, value_tokens = list(range(n // 2)), list(range(n // 2, n))
    if k_max > len(key_tokens) or v_max > len(value_tokens):
        raise ValueError(
            f"vocab_size: {vocab_size} gives {len(key_tokens)} key and {len(value_tokens)} value "
            f"ids, fewer than k_motif_size={k_max} / v_motif_size={v_max} distinct tokens"
        )
    seq_len = _check_int("seq_len", seq_len, 1)
    if seq_len + 1 < 2 * (k_max + v_max):
        raise ValueError(
            f"seq_len: needs seq_len + 1 >= 2 * (k_motif_size + v_motif_size) = "
            f"{2 * (k_max + v_max)} (the probe twice), got {seq_len}"
        )
    rng = as_rng(rng_or_seed)
    k_sizes = [k_max] if fixed_key_size else list(range(1, k_max + 1))

    def motif(tokens, sizes):
        return tuple(row_rng.sample(tokens, row_rng.choice(sizes)))

    stream = np.full((batch_size, seq_len + 1), pad, np.int64)
    mask = np.zeros((batch_size, seq_len + 1), np.float32)  # over stream positions of targets
    v_sizes = list(range(1, v_max + 1))
    for b in range(batch_size):
        # one seeded stdlib generator per row: its many tiny draws cost ~1 µs instead of ~20 µs
        row_rng = random.Random(int(rng.integers(2**63)))
        k_probe, v_probe = motif(key_tokens, k_sizes), motif(value_tokens, v_sizes)
        value_of = {k_probe: v_probe}
        budget = seq_len + 1 - len(k_probe) - len(v_probe)  # room before the final probe
        used = len(k_probe) + len(v_probe)  # the probe's first occurrence in the body
        pairs = []
        while used + k_max + v_max <= budget:
            k = motif(key_tokens, k_sizes)
            if k not in value_of:
                value_of[k] = motif(value_tokens, v_sizes)
            pairs.append(k)
            used += len(k) + len(value_of[k])
        pairs.insert(int(rng.integers(len(pairs) + 1)), k_probe)
        pairs.append(k_probe)
        pos = seq_len + 1 - used - len(k_probe) - len(v_probe)  # left padding
        seen = set()
        for k in pairs:
            v = value_of[k]
            stream[b, pos : pos + len(k)] = k
            stream[b, pos + len(k) : pos + len(k) + len(v)] = v
            if k in seen:
                mask[b, pos + len(k) : pos + len(k) + len(v)] = 1.0
            seen.add(k)
            pos += len(k) + len(v)
        assert pos == seq_len + 1
    return _batch(stream[:, :-1], stream[:, 1:], mask[:, 1:])


# ---- selective copying ------------------------------------------------------------------------


def selective_copying(
    rng_or_seed: int | np.random.Generator,
    batch_size: int,
    vocab_size: int = 16,
    seq_len: int = 256,
    num_tokens_to_copy: int = 16,
) -> Batch:
    """Selective copying (module docstring); ``T = seq_len``.

    Args:
      rng_or_seed: a seed or a ``numpy.random.Generator``.
      batch_size: B.
      vocab_size: V; content ``[0, V-2)``, blank ``V - 2``, COPY ``V - 1``.
      seq_len: T; needs ``seq_len > 2 * num_tokens_to_copy + 1``.
      num_tokens_to_copy: N content tokens (drawn with replacement).

    Returns:
      The batch dict; ``loss_mask`` is 1 on the last N positions (targets: the content in order).
    """
    batch_size = _check_int("batch_size", batch_size, 1)
    vocab_size = _check_int("vocab_size", vocab_size, 3)
    n = _check_int("num_tokens_to_copy", num_tokens_to_copy, 1)
    seq_len = _check_int("seq_len", seq_len, 1)
    if seq_len <= 2 * n + 1:
        raise ValueError(
            f"seq_len: needs > 2 * num_tokens_to_copy + 1 = {2 * n + 1}, got {seq_len}"
        )
    rng = as_rng(rng_or_seed)
    blank, copy = vocab_size - 2, vocab_size - 1
    slots = seq_len - n - 1  # content + blanks before COPY
    inputs = np.full((batch_size, seq_len), blank, np.int64)
    targets = np.full((batch_size, seq_len), blank, np.int64)
    mask = np.zeros((batch_size, seq_len), np.float32)
    for b in range(batch_size):
        content = rng.integers(0, blank, size=n)
        where = np.sort(rng.choice(slots, size=n, replace=False))
        inputs[b, where] = content
        targets[b, slots + 1 :] = content
    inputs[:, slots] = copy
    mask[:, slots + 1 :] = 1.0
    return _batch(inputs, targets, mask)


# ---- compression ------------------------------------------------------------------------------


def compression(
    rng_or_seed: int | np.random.Generator,
    batch_size: int,
    vocab_size: int = 16,
    seq_len: int = 32,
) -> Batch:
    """Compression in LM form (module docstring); ``T = 2 (seq_len - 1)``.

    Args:
      rng_or_seed: a seed or a ``numpy.random.Generator``.
      batch_size: B.
      vocab_size: V; content ``[0, V-1)``, compression token ``V - 1``.
      seq_len: MAD's instance length: ``seq_len - 1`` content tokens and one compression token.

    Returns:
      The batch dict; ``loss_mask`` is 1 on the ``seq_len - 1`` reconstruction positions.
    """
    batch_size = _check_int("batch_size", batch_size, 1)
    vocab_size = _check_int("vocab_size", vocab_size, 2)
    seq_len = _check_int("seq_len", seq_len, 2)
    rng = as_rng(rng_or_seed)
    n, token = seq_len - 1, vocab_size - 1
    content = rng.integers(0, token, size=(batch_size, n))
    inputs = np.concatenate([content, np.full((batch_size, n), token)], axis=1)
    # before the compression token the target is the next input (plain next-token prediction)
    targets = np.concatenate([inputs[:, 1 : n + 1], content], axis=1)
    mask = np.zeros((batch_size, 2 * n), np.float32)
    mask[:, n:] = 1.0
    return _batch(inputs, targets, mask)


# ---- memorization -----------------------------------------------------------------------------


def memorization_kv_map(vocab_size: int = 256, kv_map_seed: int = 12345) -> np.ndarray:
    """The fixed map of :func:`memorization`: ``value_of[k]`` for keys ``k < (V - 1) // 2``.

    Values are distinct ids from ``[(V - 1) // 2, V - 1)``, a function of the two arguments only.
    """
    vocab_size = _check_int("vocab_size", vocab_size, 3)
    n = vocab_size - 1
    values = np.random.default_rng(kv_map_seed).permutation(np.arange(n // 2, n))
    return values[: n // 2]


def memorization(
    rng_or_seed: int | np.random.Generator,
    batch_size: int,
    vocab_size: int = 256,
    seq_len: int = 32,
    kv_map_seed: int = 12345,
) -> Batch:
    """Memorization of a fixed key -> value map (module docstring); ``T = seq_len``.

    Args:
      rng_or_seed: a seed or a ``numpy.random.Generator`` (draws the keys of each row).
      batch_size: B.
      vocab_size: V; keys ``[0, (V-1)//2)``, values ``[(V-1)//2, V-1)``, INSERT ``V - 1``.
      seq_len: T, even: ``seq_len / 2`` pairs ``k INSERT``.
      kv_map_seed: seeds the map (:func:`memorization_kv_map`); keep it fixed across batches.

    Returns:
      The batch dict; ``loss_mask`` is 1 at every INSERT position (target: the key's value).
    """
    batch_size = _check_int("batch_size", batch_size, 1)
    seq_len = _check_int("seq_len", seq_len, 2)
    if seq_len % 2:
        raise ValueError(f"seq_len: expected an even number (pairs), got {seq_len}")
    value_of = memorization_kv_map(vocab_size, kv_map_seed)
    rng = as_rng(rng_or_seed)
    insert = vocab_size - 1
    keys = rng.integers(0, value_of.size, size=(batch_size, seq_len // 2))
    inputs = np.full((batch_size, seq_len), insert, np.int64)
    targets = np.full((batch_size, seq_len), insert, np.int64)
    inputs[:, 0::2] = keys
    targets[:, 1::2] = value_of[keys]
    mask = np.zeros((batch_size, seq_len), np.float32)
    mask[:, 1::2] = 1.0
    return _batch(inputs, targets, mask)


# ---- registry and scoring ---------------------------------------------------------------------


@dataclass(frozen=True)
class MadTask:
    """A MAD task: its batch generator and its chance level as a function of the sizes.

    Attributes:
      make: ``make(rng_or_seed, batch_size, **sizes) -> batch``.
      chance: ``chance(**sizes) -> float`` (sizes default to MAD's baseline).
    """

    make: Callable[..., Batch]
    chance: Callable[..., float]


def _recall_chance(vocab_size=16, noise_vocab_size=0, **_) -> float:
    n = vocab_size - noise_vocab_size
    return 1.0 / (n - n // 2)


def _fuzzy_chance(vocab_size=16, **_) -> float:
    n = vocab_size - 1
    return 1.0 / (n - n // 2)


MAD_TASKS: dict[str, MadTask] = {
    "in_context_recall": MadTask(in_context_recall, _recall_chance),
    "noisy_in_context_recall": MadTask(
        noisy_in_context_recall,
        lambda vocab_size=32, noise_vocab_size=16, **_: _recall_chance(
            vocab_size, noise_vocab_size
        ),
    ),
    "fuzzy_in_context_recall": MadTask(fuzzy_in_context_recall, _fuzzy_chance),
    "selective_copying": MadTask(
        selective_copying, lambda vocab_size=16, **_: 1 / (vocab_size - 2)
    ),
    "compression": MadTask(compression, lambda vocab_size=16, **_: 1 / (vocab_size - 1)),
    "memorization": MadTask(
        memorization, lambda vocab_size=256, **_: 1 / ((vocab_size - 1) - (vocab_size - 1) // 2)
    ),
}


def _task(name: str) -> MadTask:
    if name not in MAD_TASKS:
        raise ValueError(f"name: unknown MAD task {name!r}; known: {sorted(MAD_TASKS)}")
    return MAD_TASKS[name]


def make_mad_batch(
    name: str, batch_size: int, rng_or_seed: int | np.random.Generator, **sizes
) -> Batch:
    """One batch of MAD task ``name``; ``sizes`` override its MAD baseline keyword arguments."""
    make = _task(name).make
    known = list(inspect.signature(make).parameters)[2:]
    unknown = sorted(set(sizes) - set(known))
    if unknown:
        raise ValueError(f"sizes: {name!r} takes {known}, got unknown {unknown}")
    return make(rng_or_seed, batch_size, **sizes)


def mad_chance(name: str, **sizes) -> float:
    """Accuracy of a uniform guess among the ids a scored position can hold (module docstring)."""
    return float(_task(name).chance(**sizes))


def mad_accuracy(logits, batch: dict, average: str = "micro") -> float:
    """Accuracy of the argmax at the masked positions.

    Args:
      logits: float[B, T, V], or the argmax ids int[B, T].
      batch: a MAD batch (uses ``targets`` and ``loss_mask``).
      average: ``"micro"`` (fraction of scored positions) or ``"macro"`` (mean over the target
        classes present of each class's accuracy).

    Returns:
      Accuracy in [0, 1].
    """
    targets, mask = np.asarray(batch["targets"]), np.asarray(batch["loss_mask"])
    ids = predicted_ids(logits, targets.shape)
    if average not in ("micro", "macro"):
        raise ValueError(f"average: expected 'micro' or 'macro', got {average!r}")
    sel = mask > 0
    if not sel.any():
        raise ValueError("batch: loss_mask selects no scored positions")
    pred = ids[sel]
    want = targets[sel]
    if average == "micro":
        return float((pred == want).mean())
    return float(np.mean([(pred[want == c] == c).mean() for c in np.unique(want)]))
