"""The generated tasks of :mod:`nested_jax.experiments.synthetic`: the task names, the settings of
one comparison (:class:`SyntheticSettings`) and its batches (training, held-out, validation; the
fixed string sets of the next-character protocol)."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import numpy as np

from nested_jax.eval.formal_languages import (
    FORMAL_TASKS,
    FormalVocab,
    formal_chance,
    make_formal_batch,
)
from nested_jax.eval.formal_protocol import PROTOCOL_TASKS, make_protocol_batch, protocol_strings
from nested_jax.eval.mad import MAD_TASKS, mad_chance, make_mad_batch
from nested_jax.eval.recall import (
    HAYSTACKS,
    RECALL_SIZES,
    RECALL_TASKS,
    RecallVocab,
    make_recall_batch,
    recall_chance,
)
from nested_jax.experiments._training import check_multipliers, check_positive

FAMILIES = {
    "formal": FORMAL_TASKS,
    "mad": MAD_TASKS,
    "protocol": PROTOCOL_TASKS,
    "recall": RECALL_TASKS,
}
EVAL_SEED_OFFSET = 10_000  # held-out batches: seed + this (training batches use the seed itself)
VAL_SEED_OFFSET = 20_000  # validation batches (learning-rate choice) of formal / MAD tasks
PROTOCOL_DATA_SEED = 30_000  # protocol: the fixed test, validation and training strings
MAD_DATA_SEED = 40_000  # MAD with a fixed data set: its training, validation and test instances
# MAD's own config keys for a fixed data set (mad-lab ``MADConfig``), read beside the task sizes:
# num_train_examples > 0 trains epochs over that many instances instead of fresh batches.
MAD_DATASET_KEYS = ("num_train_examples", "num_test_examples")
MAD_TEST_EXAMPLES = 1_280  # MAD's num_test_examples
EVAL_ROWS = 250  # protocol: strings per scoring batch


def parse_task(task: str) -> tuple[str, str]:
    """``"formal:parity"`` -> ``("formal", "parity")``.

    Raises:
      ValueError: naming ``task`` when the family or the name is unknown.
    """
    family, sep, name = str(task).partition(":")
    if not sep or family not in FAMILIES or name not in FAMILIES[family]:
        raise ValueError(
            f"task: expected formal:<name>, protocol:<name>, mad:<name> or recall:<name>, got "
            f"{task!r}; formal: {sorted(FORMAL_TASKS)}; protocol: {sorted(PROTOCOL_TASKS)}; "
            f"mad: {sorted(MAD_TASKS)}; recall: {sorted(RECALL_TASKS)}"
        )
    return family, name


@dataclasses.dataclass(frozen=True)
class SyntheticSettings:
    """One comparison on one generated task (the same for every model)."""

    task: str = "formal:parity"  # formal:<name> or mad:<name>
    steps: int = 300  # optimizer steps per model and seed
    batch_size: int = 32  # sequences per step (and per held-out batch)
    d_model: int = 64  # width of the first model (the parameter budget)
    n_layers: int = 2  # blocks per model
    n_heads: int = 2  # heads per mixer
    lr: float = 2e-3  # AdamW peak learning rate
    warmup_steps: int = 20  # linear warmup steps
    weight_decay: float = 0.1  # decoupled AdamW weight decay on matrices
    eval_batches: int = 8  # held-out batches per length bin (formal) or in all (MAD)
    seed: int = 0  # init and training batches of one run (run_synthetic sets it per seed)
    match_params: bool = True  # adjust d_model of models 2.. to the first model's parameter count
    train_lengths: tuple[int, int] = (1, 16)  # formal: training string lengths [lo, hi]
    eval_multipliers: tuple[int, ...] = (1, 2, 4, 8)  # formal: score at lengths up to m × hi
    # MAD: overrides of the task's baseline sizes; num_train_examples / num_test_examples set a
    # fixed data set (MAD's protocol) instead of fresh batches
    mad_sizes: tuple[tuple[str, int | float], ...] = ()
    train_size: int = 10_000  # protocol: training strings (batches drawn from them)
    test_size: int = 2_000  # protocol: scored strings per bin
    val_size: int = 500  # protocol: validation strings (Bin0 window, disjoint from the test)
    bins: tuple[tuple[int, int], ...] = ()  # protocol: (Bin0, Bin1) windows; () = the task's
    # recall: overrides of the generator's sizes (seq_len, pairs, queries, keys, values, filler)
    recall_sizes: tuple[tuple[str, int], ...] = ()
    depth_bins: int = 5  # recall: scored depth bands of the haystack per length multiplier
    model_overrides: tuple[tuple[str, str], ...] = ()  # (model, "model.KEY=VALUE") pairs
    # > 0: also score the held-out sets and the validation split every this many steps (the
    # formal-language protocol's source reports each bin's best epoch); 0: at the end only
    score_every: int = 0

    def __post_init__(self) -> None:
        family, name = parse_task(self.task)
        check_positive(self, ("steps", "batch_size", "d_model", "n_layers", "n_heads"))
        check_positive(self, ("eval_batches", "train_size", "test_size", "val_size"))
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: {self.d_model} is not divisible by n_heads={self.n_heads}")
        if not (isinstance(self.score_every, int) and self.score_every >= 0):
            raise ValueError(f"score_every: expected an int >= 0, got {self.score_every!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        for pair in self.model_overrides:
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise ValueError(
                    f"model_overrides: expected (model, KEY=VALUE) pairs, got {pair!r}"
                )
        if self.recall_sizes and family != "recall":
            raise ValueError(f"recall_sizes: only for recall:<name> tasks, not {self.task!r}")
        if family == "recall":
            self._check_recall()
            return
        if family == "protocol":
            if self.mad_sizes:
                raise ValueError(f"mad_sizes: only for mad:<name> tasks, not {self.task!r}")
            bins = self.protocol_bins
            if len(bins) != 2:
                raise ValueError(f"bins: expected (Bin0, Bin1) windows, got {self.bins!r}")
            for window in bins:
                try:
                    protocol_strings(name, 1, window, 0)
                except ValueError as err:
                    raise ValueError(f"bins: {err}") from None
            return
        if self.bins:
            raise ValueError(f"bins: only for protocol:<name> tasks, not {self.task!r}")
        # the generators validate the sizes; fail before any training, naming our own field
        if family == "mad":
            sizes = self.sizes
            try:
                make_mad_batch(name, 1, 0, **sizes)
            except (TypeError, ValueError) as err:
                raise ValueError(f"mad_sizes: {err}") from None
            self._check_mad_dataset()
            return
        if self.mad_sizes:
            raise ValueError(f"mad_sizes: only for mad:<name> tasks, not {self.task!r}")
        try:
            make_formal_batch(name, 1, self.train_lengths, 0)
        except ValueError as err:
            raise ValueError(f"train_lengths: {err}") from None
        check_multipliers(self.eval_multipliers)
        for m in self.eval_multipliers:
            try:
                make_formal_batch(name, 1, self.eval_lengths(m), 0)
            except ValueError as err:
                raise ValueError(f"eval_multipliers: {m}×: {err}") from None

    def _check_recall(self) -> None:
        if self.mad_sizes or self.bins:
            raise ValueError(f"mad_sizes, bins: not for recall:<name> tasks ({self.task!r})")
        check_positive(self, ("depth_bins",))
        check_multipliers(self.eval_multipliers)
        try:
            sizes = dict(self.recall_sizes)
            unknown = sorted(set(sizes) - set(RECALL_SIZES))
            if unknown:
                raise ValueError(f"unknown sizes {unknown}; expected {sorted(RECALL_SIZES)}")
            for m, band in self.recall_cells():
                cell = self.recall_batch_sizes(m)
                make_recall_batch(1, 0, **cell, depth=band, haystack=HAYSTACKS[self.name])
        except (TypeError, ValueError) as err:
            raise ValueError(f"recall_sizes: {str(err).splitlines()[0]}") from None

    def recall_batch_sizes(self, multiplier: int = 1) -> dict[str, int]:
        """Recall: the generator's sizes for rows ``multiplier`` times the training length."""
        sizes = {**RECALL_SIZES, **dict(self.recall_sizes)}
        return {**sizes, "seq_len": multiplier * sizes["seq_len"]}

    def recall_cells(self) -> list[tuple[int, tuple[float, float]]]:
        """Recall: the scored ``(multiplier, depth band)`` grid, ``depth_bins`` bands per length."""
        n = self.depth_bins
        bands = [(i / n, (i + 1) / n) for i in range(n)]
        return [(m, band) for m in self.eval_multipliers for band in bands]

    @property
    def family(self) -> str:
        return parse_task(self.task)[0]

    @property
    def name(self) -> str:
        return parse_task(self.task)[1]

    @property
    def _mad_items(self) -> dict[str, int | float]:
        try:
            return dict(self.mad_sizes)
        except (TypeError, ValueError):
            raise ValueError(
                f"mad_sizes: expected (key, number) pairs, got {self.mad_sizes!r}"
            ) from None

    @property
    def sizes(self) -> dict[str, int | float]:
        """The MAD generator's size overrides as keyword arguments (without the data-set keys)."""
        return {k: v for k, v in self._mad_items.items() if k not in MAD_DATASET_KEYS}

    @property
    def mad_dataset(self) -> tuple[int, int] | None:
        """MAD: ``(num_train_examples, num_test_examples)`` of a fixed data set, or None (fresh
        batches every step, held-out batches from ``seed + EVAL_SEED_OFFSET``)."""
        items = self._mad_items
        if "num_train_examples" not in items:
            return None
        return items["num_train_examples"], items.get("num_test_examples", MAD_TEST_EXAMPLES)

    def _check_mad_dataset(self) -> None:
        items = self._mad_items
        if "num_test_examples" in items and "num_train_examples" not in items:
            raise ValueError("mad_sizes: num_test_examples needs num_train_examples")
        for key in MAD_DATASET_KEYS:
            value = items.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mad_sizes: {key}: expected an int >= 1, got {value!r}")

    @property
    def protocol_bins(self) -> tuple[tuple[int, int], ...]:
        """Protocol: the (Bin0, Bin1) windows (``bins``, else the task's own)."""
        if self.bins:
            return tuple(tuple(w) for w in self.bins)
        return PROTOCOL_TASKS[self.name].bins

    def protocol_seq_len(self, window: tuple[int, int]) -> int:
        """Protocol: T of a row of the window (BOS + the longest string)."""
        return PROTOCOL_TASKS[self.name].max_length(window) + 1

    @property
    def vocab(self) -> int:
        """Model vocabulary: the 17 formal-language ids, or the MAD task's ``vocab_size``."""
        if self.family in ("formal", "protocol"):
            return FormalVocab().size
        if self.family == "recall":
            sizes = self.recall_batch_sizes()
            return RecallVocab(sizes["keys"], sizes["values"], sizes["filler"]).size
        make = MAD_TASKS[self.name].make
        return self.sizes.get(
            "vocab_size", inspect.signature(make).parameters["vocab_size"].default
        )

    @property
    def seq_len(self) -> int:
        """T of a training batch."""
        if self.family == "formal":
            return self.train_lengths[1] + 2  # BOS, string, QUERY
        if self.family == "protocol":
            return self.protocol_seq_len(self.protocol_bins[0])
        if self.family == "recall":
            return self.recall_batch_sizes()["seq_len"]
        return make_mad_batch(self.name, 1, 0, **self.sizes)["inputs"].shape[1]

    @property
    def chance(self) -> float:
        if self.family == "protocol":
            return 0.0  # every prediction of a string must be right: guessing scores ~0
        if self.family == "formal":
            return formal_chance(self.name)
        if self.family == "recall":
            return recall_chance(**self.recall_batch_sizes())
        return mad_chance(self.name, **self.sizes)

    def eval_lengths(self, m: int) -> tuple[int, int]:
        """String lengths of the ``m×`` bin: the training range at 1, else ``(m·hi/2, m·hi]``."""
        lo, hi = self.train_lengths
        return (lo, hi) if m == 1 else (m * hi // 2 + 1, m * hi)


@functools.lru_cache(maxsize=8)
def _protocol_data(name: str, bins, train_size: int, test_size: int, val_size: int) -> dict:
    rng = np.random.default_rng(PROTOCOL_DATA_SEED)
    bin0, bin1 = bins
    test0 = protocol_strings(name, test_size, bin0, rng)
    test1 = protocol_strings(name, test_size, bin1, rng)
    val = protocol_strings(name, val_size, bin0, rng, exclude=set(test0))
    train = protocol_strings(name, train_size, bin0, rng, exclude=set(test0) | set(val))
    return {"train": tuple(train), "val": tuple(val), "bin0": tuple(test0), "bin1": tuple(test1)}


def protocol_data(s: SyntheticSettings) -> dict:
    """Protocol: the fixed string sets ``{train, val, bin0, bin1}`` (the same for every model and
    seed; drawn from ``PROTOCOL_DATA_SEED``). ``val`` and ``train`` avoid the Bin0 test strings
    and each other, unless the language has one string per length (``enumerable``)."""
    return _protocol_data(s.name, s.protocol_bins, s.train_size, s.test_size, s.val_size)


def _protocol_batches(s: SyntheticSettings, strings, window) -> list[dict]:
    t = s.protocol_seq_len(window)
    return [
        make_protocol_batch(s.name, list(strings[i : i + EVAL_ROWS]), t)
        for i in range(0, len(strings), EVAL_ROWS)
    ]


@functools.lru_cache(maxsize=4)
def _mad_data(name: str, sizes: tuple, n_train: int, n_val: int, n_test: int) -> dict:
    rng = np.random.default_rng(MAD_DATA_SEED)
    make = functools.partial(make_mad_batch, name, rng_or_seed=rng, **dict(sizes))
    return {"train": make(n_train), "val": make(n_val), "test": make(n_test)}


def mad_data(s: SyntheticSettings) -> dict:
    """MAD with a fixed data set (:attr:`SyntheticSettings.mad_dataset`): ``{train, val, test}``
    batches of ``num_train_examples``, ``val_size`` and ``num_test_examples`` instances, drawn in
    that order from ``MAD_DATA_SEED`` (the same for every model and seed, as MAD's stored data
    sets; the memorization task's key-value map is fixed by its own seed)."""
    n_train, n_test = s.mad_dataset
    return _mad_data(s.name, tuple(sorted(s.sizes.items())), n_train, s.val_size, n_test)


def _row_batches(rows: dict, batch_size: int) -> list[dict]:
    """``rows`` (arrays ``[N, ...]``) cut into batches of ``batch_size`` rows (the last may be
    shorter)."""
    n = len(rows["inputs"])
    return [{k: v[i : i + batch_size] for k, v in rows.items()} for i in range(0, n, batch_size)]


def recall_batch(s: SyntheticSettings, rng, multiplier: int = 1, depth=(0.0, 1.0)) -> dict:
    """A recall batch of ``s`` (its sizes and haystack, ``batch_size`` rows ``multiplier`` times
    the training length) without its ``depth`` annotation (the batches the models see)."""
    sizes = s.recall_batch_sizes(multiplier)
    haystack = HAYSTACKS[s.name]
    batch = make_recall_batch(s.batch_size, rng, **sizes, depth=depth, haystack=haystack)
    return {k: v for k, v in batch.items() if k != "depth"}


def train_batch(s: SyntheticSettings, rng: np.random.Generator) -> dict:
    """One training batch of ``s.task`` drawn from ``rng`` (protocol: ``batch_size`` of the fixed
    training strings, drawn with replacement)."""
    if s.family == "protocol":
        pool = protocol_data(s)["train"]
        rows = [pool[i] for i in rng.integers(0, len(pool), size=s.batch_size)]
        return make_protocol_batch(s.name, rows, s.seq_len)
    if s.family == "formal":
        return make_formal_batch(s.name, s.batch_size, s.train_lengths, rng)
    if s.family == "recall":
        return recall_batch(s, rng)
    if s.mad_dataset is not None:
        pool = mad_data(s)["train"]
        rows = rng.integers(0, len(pool["inputs"]), size=s.batch_size)
        return {k: v[rows] for k, v in pool.items()}
    return make_mad_batch(s.name, s.batch_size, rng, **s.sizes)


def eval_sets(s: SyntheticSettings) -> list[tuple[str, dict, list[dict]]]:
    """``(key, info, batches)`` per held-out set: one per multiplier for a formal task (``key =
    str(m)``, ``info``: ``multiplier, min_len, max_len, seq_len``), one (``"heldout"``) for MAD,
    one per (multiplier, depth band) for recall (``key = "<m>x@<lo>"``, ``info``: ``multiplier,
    depth, seq_len``)."""
    if s.family == "protocol":
        data, sets = protocol_data(s), []
        for key, window in zip(("bin0", "bin1"), s.protocol_bins, strict=True):
            lengths = [len(x) for x in data[key]]
            info = {
                "bin": key,
                "window": list(window),
                "min_len": min(lengths),
                "max_len": max(lengths),
                "seq_len": s.protocol_seq_len(window),
            }
            sets.append((key, info, _protocol_batches(s, data[key], window)))
        return sets
    seed = s.seed + EVAL_SEED_OFFSET
    if s.family == "recall":
        sets = []
        for m, band in s.recall_cells():
            rng = np.random.default_rng(seed)  # the same source in every cell
            batches = [recall_batch(s, rng, m, band) for _ in range(s.eval_batches)]
            info = {"multiplier": m, "depth": list(band), "seq_len": m * s.seq_len}
            sets.append((f"{m}x@{band[0]:.2f}", info, batches))
        return sets
    if s.mad_dataset is not None:
        test = mad_data(s)["test"]
        info = {"seq_len": s.seq_len, "examples": len(test["inputs"])}
        return [("heldout", info, _row_batches(test, s.batch_size))]
    if s.family == "mad":
        rng = np.random.default_rng(seed)
        batches = [
            make_mad_batch(s.name, s.batch_size, rng, **s.sizes) for _ in range(s.eval_batches)
        ]
        return [("heldout", {"seq_len": s.seq_len}, batches)]
    sets = []
    for m in s.eval_multipliers:
        lo, hi = s.eval_lengths(m)
        rng = np.random.default_rng(seed)  # the same source at every length
        batches = [
            make_formal_batch(s.name, s.batch_size, (lo, hi), rng, seq_len=m * s.seq_len)
            for _ in range(s.eval_batches)
        ]
        info = {"multiplier": m, "min_len": lo, "max_len": hi, "seq_len": m * s.seq_len}
        sets.append((str(m), info, batches))
    return sets


def val_batches(s: SyntheticSettings) -> list[dict]:
    """The validation set of the learning-rate choice: protocol: the ``val`` strings (Bin0 window,
    disjoint from the scored test strings); formal: ``eval_batches`` batches of the training range
    from ``seed + VAL_SEED_OFFSET`` (a stream apart from the scored one); MAD: likewise."""
    if s.family == "protocol":
        return _protocol_batches(s, protocol_data(s)["val"], s.protocol_bins[0])
    if s.mad_dataset is not None:
        return _row_batches(mad_data(s)["val"], s.batch_size)
    rng = np.random.default_rng(s.seed + VAL_SEED_OFFSET)
    if s.family == "recall":
        return [recall_batch(s, rng) for _ in range(s.eval_batches)]
    if s.family == "mad":
        return [make_mad_batch(s.name, s.batch_size, rng, **s.sizes) for _ in range(s.eval_batches)]
    return [
        make_formal_batch(s.name, s.batch_size, s.train_lengths, rng, seq_len=s.seq_len)
        for _ in range(s.eval_batches)
    ]
