"""Strict, typed experiment configuration: dataclass defaults ← YAML file(s) ← ``--set a.b=value``.

Every section is a frozen dataclass with one comment per field. Loading is strict: an unknown key, a
value of the wrong type (int / float / str / bool are not interchangeable, except that an int is
accepted where a float is expected, and so is a number written with an exponent such as ``1e-3``,
which YAML 1.2 reads as a float but PyYAML's YAML 1.1 as a string) or an impossible combination
fails at load time with ONE line naming the full field path, e.g. ``config error: train.steps:
expected int, got str 'abc'`` (raised as :class:`ConfigError`).

Cross-field rules checked at load:
- ``data.batch_size`` must be divisible by ``mesh.data × mesh.fsdp × mesh.slices`` when explicit;
  with ``mesh.fsdp = -1`` the product is only known once the devices are, so the same check runs
  again when the mesh is built.
- **Decision:** a chunked mixer needs ``data.seq_len`` to be a multiple of the chunk size it
  really reads, and the registry asks the mixer which one (``mixer_seq_len_multiples``):
  ``model.chunk_size`` for DeltaNet / GDN / HOLA with ``model.impl = "chunked"``,
  ``model.titans.memory_chunk`` for the Titans mixers with ``memory_impl`` chunked or pallas, both
  ``model.hope.chunk_memory`` and ``chunk_other`` for Hope with ``model.impl = "chunked"``. The
  chunked kernels would pad the tail chunk, but that pads every training sequence and silently
  wastes compute, and Pallas kernels need whole chunks; a config that asks for it is almost always
  a typo. Recurrent forms and attention have no such constraint.
- ``model.vocab_size`` must cover the tokenizer (257 ids for "byte", ``data.vocab_size`` for
  "sentencepiece"; a ``tokenizer.json`` is checked when it is loaded, at the start of training).
- ``optimizer.name`` must be registered in :data:`nested_jax.train.optimizer.OPTIMIZERS`.

YAML files may name other presets with ``include:`` (alias ``base:``): a path or a list of paths
relative to the including file, merged first, so the including file overrides them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from nested_jax.data.config import DataConfig
from nested_jax.files import as_path, atomic_write_text
from nested_jax.models.config import ModelConfig
from nested_jax.models.registry import mixer_seq_len_multiples
from nested_jax.train.optimizer import OPTIMIZERS, OptimizerConfig


class ConfigError(ValueError):
    """A configuration problem; ``str(err)`` is one line that names the field path."""


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh with axes ("data", "fsdp", "seq", "tensor") (see nested_jax.parallel.mesh).

    Sizes are per slice; at most one of data / fsdp / seq / tensor may be -1 (all remaining).
    """

    data: int = 1  # size of the pure data-parallel axis (parameters replicated across it)
    fsdp: int = -1  # size of the fully-sharded data-parallel axis; -1 = all remaining devices
    # context-parallel axis: each sequence's tokens split over this many devices (GDN / delta
    # rule fold their states across it, nested_jax.core.context); 1 = none
    seq: int = 1
    # model-parallel axis over heads, MLP width and vocabulary (1 = none)
    tensor: int = 1
    # TPU slices joined over DCN (multi-slice); the data axis spans them (data × slices in all)
    slices: int = 1
    # the TPU slice this config is sized for, e.g. "v5e:4x4" (nested-jax aot compiles for it; a
    # run itself uses whatever devices it finds)
    topology: str = ""


@dataclass(frozen=True)
class TrainConfig:
    """Training-loop settings."""

    steps: int = 1000  # total optimizer steps (a resumed run continues up to this number)
    seed: int = 0  # seed of parameter initialisation
    log_every: int = 10  # write train metrics (JSONL, TensorBoard) every this many steps
    # run validation every this many steps (and always at the last step); 0 = only at the end
    eval_every: int = 200
    # save a checkpoint every this many steps (and always at the last step and on SIGTERM)
    checkpoint_every: int = 200
    keep_checkpoints: int = 3  # how many of the most recent checkpoints to keep on disk
    async_checkpointing: bool = True  # write checkpoints in a background thread (orbax async)
    # on a non-finite loss or gradient: "skip" the update (exactly: state unchanged) or "stop"
    nan_policy: Literal["skip", "stop"] = "skip"
    # with nan_policy=skip: stop with an error after more than this many skipped steps in a row
    max_consecutive_skips: int = 10
    progress_bar: bool = True  # show a tqdm progress bar (loss, bits/byte, tokens/s) on stderr
    # the loss walks the sequence this many positions at a time, so the f32 logits [B, T, V] of
    # the whole batch never exist at once (ops.chunked_cross_entropy; equal values); 0 = at once
    loss_chunk: int = 512
    # DEBUG ONLY (tests of the NaN policy): steps (1-based) whose loss is replaced by NaN inside the
    # jitted step.
    debug_nan_at_steps: tuple[int, ...] = ()


@dataclass(frozen=True)
class EvalConfig:
    """Validation during training and the `nested-jax eval` report."""

    eval_batches: int = 8  # validation batches per evaluation (0 = the whole validation split)
    niah_lengths: tuple[int, ...] = (128, 256)  # NIAH haystack lengths in tokens
    # NIAH needle depths as fractions of the haystack (0 = start, 1 = end)
    niah_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    niah_per_cell: int = 4  # NIAH examples per (length, depth) cell
    niah_seed: int = 0  # seed of every generated eval task (needle values, haystack offsets)
    # `nested-jax eval --suite ruler` (nested_jax.eval.ruler): kinds, lengths (× niah_depths),
    # examples per (length, depth) cell, haystack "text" (validation text) or "noise"
    ruler_kinds: tuple[str, ...] = (
        "single",
        "multikey",
        "multivalue",
        "multiquery",
        "variable_tracking",
    )
    ruler_lengths: tuple[int, ...] = (512, 1024)
    ruler_per_cell: int = 2
    ruler_haystack: str = "text"
    # `nested-jax eval --suite babilong` (nested_jax.eval.babilong): tasks, lengths, examples each
    babilong_tasks: tuple[str, ...] = ("qa1", "qa2", "qa3", "qa4", "qa5")
    babilong_lengths: tuple[int, ...] = (512, 1024)
    babilong_per_length: int = 4


@dataclass(frozen=True)
class Config:
    """A whole experiment: model, data, optimizer, mesh, training loop and evaluation."""

    # LM shell and mixer (nested_jax.models); 257 ids = the default byte tokenizer's vocabulary.
    model: ModelConfig = field(default_factory=lambda: ModelConfig(vocab_size=257))
    # corpus, tokenizer, packing, global batch (nested_jax.data)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # optimizer and schedule
    mesh: MeshConfig = field(default_factory=MeshConfig)  # device mesh
    train: TrainConfig = field(default_factory=TrainConfig)  # training loop
    eval: EvalConfig = field(default_factory=EvalConfig)  # evaluation


# ------------------------------------------------------------------------------------------------
# Strict conversion dict -> dataclass
# ------------------------------------------------------------------------------------------------


# A number with an exponent, as YAML 1.2 writes floats (`1e-3`, `-2e5`, `1.5E4`). PyYAML follows
# YAML 1.1, whose float needs a dot and a signed exponent, so it loads these as strings; a float
# field reads them as the number they are. Parsing here, where the field's type is known, keeps a
# str field's `1e-3` the string it is (a YAML float resolver would turn it into 0.001 first).
_EXPONENT_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+")


def _type_name(t: Any) -> str:
    if isinstance(t, type):
        return t.__name__
    return str(t).replace("typing.", "")


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _convert(value: Any, t: Any, path: str, base: Any = None) -> Any:
    """Checks `value` against annotation `t` (strict) and returns the converted value.

    `base` is the default instance a nested dataclass section is built on (None: the class
    defaults).
    """
    origin = typing.get_origin(t)
    args = typing.get_args(t)
    if dataclasses.is_dataclass(t):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping of fields, got {_describe(value)}")
        return _build_dataclass(t, value, path, base)
    if origin is Literal:
        if not any(type(value) is type(a) and value == a for a in args):
            raise ConfigError(f"{path}: expected one of {list(args)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{path}: expected {_type_name(t)}, got {_describe(value)}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {_describe(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{path}: expected a list of {len(args)} items, got {len(value)}")
        pairs = enumerate(zip(args, value, strict=True))
        return tuple(_convert(v, a, f"{path}[{i}]") for i, (a, v) in pairs)
    if t is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {_describe(value)}")
        for k in value:
            if not isinstance(k, str):
                raise ConfigError(f"{path}: keys must be strings, got {_describe(k)}")
        return dict(value)
    if t is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected bool, got {_describe(value)}")
        return value
    if t is int:
        # bool is a subclass of int: a YAML `true` must not become steps=1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected int, got {_describe(value)}")
        return value
    if t is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected float, got {_describe(value)}")
        return float(value)
    if t is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected str, got {_describe(value)}")
        return value
    if t is Any:
        return value
    raise ConfigError(f"{path}: unsupported field type {_type_name(t)}")  # a bug in a dataclass


def _field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _build_dataclass(cls: type, values: Mapping[str, Any], path: str, base: Any = None) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    names = list(fields)
    unknown = [k for k in values if k not in names]
    if unknown:
        where = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise ConfigError(f"{where}: unknown key (known keys: {', '.join(names)})")
    # Start from the base instance's values so a section default set by the parent (e.g. Config's
    # model.vocab_size=257) survives a YAML that only sets other fields of the section.
    kwargs = {} if base is None else {n: getattr(base, n) for n in names}
    for name in names:
        if name in values:
            sub = f"{path}.{name}" if path else name
            sub_base = kwargs.get(name) if base is not None else _field_default(fields[name])
            if not dataclasses.is_dataclass(sub_base):
                sub_base = None
            kwargs[name] = _convert(values[name], hints[name], sub, sub_base)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        # Section classes validate themselves; their messages start with "<Class>.<field>:" or
        # "<section>.<field>:" - normalise to the full path.
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        prefix = f"{cls.__name__}."
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
        section = path.rsplit(".", 1)[-1] if path else ""
        if section and msg.startswith(section + "."):
            msg = msg[len(section) + 1 :]
        raise ConfigError(f"{path}.{msg}" if path else msg) from None


def _check_combinations(cfg: Config) -> None:
    """Checks no single field can make on its own: value ranges the section classes leave open and
    the fields that must agree across sections. Raises ``ConfigError`` naming the field path."""
    _check_optimizer(cfg.optimizer)
    _check_mesh(cfg.mesh, cfg.data)
    _check_model_fits_data(cfg.model, cfg.data)
    _check_train(cfg.train)
    _check_eval(cfg.eval)


def _check_optimizer(o: OptimizerConfig) -> None:
    if o.name not in OPTIMIZERS:
        raise ConfigError(
            f"optimizer.name: unknown optimizer {o.name!r}; registered: {sorted(OPTIMIZERS)}"
        )
    for name, value, ok, what in (
        ("lr", o.lr, o.lr > 0, "> 0"),
        ("warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0"),
        ("min_lr_ratio", o.min_lr_ratio, 0 <= o.min_lr_ratio <= 1, "in [0, 1]"),
        ("weight_decay", o.weight_decay, o.weight_decay >= 0, ">= 0"),
        ("b1", o.b1, 0 <= o.b1 < 1, "in [0, 1)"),
        ("b2", o.b2, 0 <= o.b2 < 1, "in [0, 1)"),
        ("eps", o.eps, o.eps > 0, "> 0"),
        ("grad_clip", o.grad_clip, o.grad_clip >= 0, ">= 0 (0 disables)"),
    ):
        if not ok:
            raise ConfigError(f"optimizer.{name}: must be {what}, got {value!r}")


def _check_mesh(m: MeshConfig, data: DataConfig) -> None:
    """Axis sizes (positive, or one of them -1), and the batch and sequence the axes split."""
    sizes = (("data", m.data), ("fsdp", m.fsdp), ("seq", m.seq), ("tensor", m.tensor))
    for name, value in sizes:
        if value == 0 or value < -1:
            raise ConfigError(
                f"mesh.{name}: must be a positive size or -1 (all remaining), got {value}"
            )
    if m.slices < 1:
        raise ConfigError(f"mesh.slices: must be >= 1, got {m.slices}")
    free = [n for n, v in sizes if v == -1]
    if len(free) > 1:
        raise ConfigError(
            f"mesh.{free[0]}: at most one of mesh.data / mesh.fsdp / mesh.seq / mesh.tensor may "
            "be -1"
        )
    if m.seq > 1 and data.seq_len % m.seq:
        raise ConfigError(
            f"data.seq_len: {data.seq_len} is not divisible by mesh.seq = {m.seq} (each "
            "device of the seq axis holds an equal stretch of every sequence)"
        )
    shards = m.data * m.fsdp * m.slices
    if m.data > 0 and m.fsdp > 0 and data.batch_size % shards:
        raise ConfigError(
            f"data.batch_size: {data.batch_size} is not divisible by mesh.data × mesh.fsdp × "
            f"mesh.slices = {m.data}×{m.fsdp}×{m.slices} = {shards}"
        )


def _check_model_fits_data(model: ModelConfig, data: DataConfig) -> None:
    """The training length against Proteus' context and the mixer's chunks; the vocabulary
    against the tokenizer."""
    p = model.proteus
    if p.blocks > 1 and p.context_len != data.seq_len:
        raise ConfigError(
            f"model.proteus.context_len: {p.context_len} differs from data.seq_len = "
            f"{data.seq_len} (the training context N of the Proteus schedule, SPEC §4)"
        )
    for knob, size in mixer_seq_len_multiples(model).items():
        if data.seq_len % size:
            raise ConfigError(
                f"data.seq_len: {data.seq_len} is not a multiple of {knob} = {size} "
                f"(the chunked {model.name!r} mixer runs whole chunks)"
            )
    # A generated task (data.task) brings its own ids; prepare_plan checks them against the model.
    needed = {"byte": 257, "sentencepiece": data.vocab_size}.get(data.tokenizer, 0)
    if model.vocab_size < needed and not data.task:
        raise ConfigError(
            f"model.vocab_size: {model.vocab_size} is smaller than the {data.tokenizer!r} "
            f"tokenizer's vocabulary ({needed} ids)"
        )


def _check_train(t: TrainConfig) -> None:
    for name in ("steps", "log_every", "checkpoint_every", "keep_checkpoints"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name}: must be >= 1, got {getattr(t, name)}")
    for name in ("eval_every", "max_consecutive_skips", "loss_chunk"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}: must be >= 0, got {getattr(t, name)}")


def _check_eval(e: EvalConfig) -> None:
    if e.eval_batches < 0:
        raise ConfigError(f"eval.eval_batches: must be >= 0, got {e.eval_batches}")
    if e.niah_per_cell < 0:
        raise ConfigError(f"eval.niah_per_cell: must be >= 0, got {e.niah_per_cell}")
    for i, d in enumerate(e.niah_depths):
        if not 0.0 <= d <= 1.0:
            raise ConfigError(f"eval.niah_depths[{i}]: must be in [0, 1], got {d}")
    for field_name in ("niah_lengths", "ruler_lengths", "babilong_lengths"):
        for i, n in enumerate(getattr(e, field_name)):
            if n < 1:
                raise ConfigError(f"eval.{field_name}[{i}]: must be >= 1, got {n}")
    for field_name in ("ruler_per_cell", "babilong_per_length"):
        if getattr(e, field_name) < 1:
            raise ConfigError(f"eval.{field_name}: must be >= 1, got {getattr(e, field_name)}")
    if e.ruler_haystack not in ("text", "noise"):
        raise ConfigError(
            f"eval.ruler_haystack: expected 'text' or 'noise', got {e.ruler_haystack!r}"
        )


def config_from_dict(values: Mapping[str, Any]) -> Config:
    """Builds a validated :class:`Config` from a nested mapping (missing keys take defaults).

    Raises:
      ConfigError: one line naming the field path, for unknown keys, wrong types or impossible
        combinations.
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"config: expected a mapping at top level, got {_describe(values)}")
    cfg = _build_dataclass(Config, values, "")
    _check_combinations(cfg)
    return cfg


def section_from_dict(cls: type, values: Mapping[str, Any], path: str) -> Any:
    """One config section (e.g. ``ModelConfig`` at ``"model"``) from a nested mapping, with the
    checks of :func:`config_from_dict` for that section (unknown keys, types) but not the
    cross-section combinations.

    Raises:
      ConfigError: one line naming the field path (``path.key``).
    """
    if not isinstance(values, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {_describe(values)}")
    return _build_dataclass(cls, values, path)


def config_to_dict(cfg: Any) -> dict:
    """Plain nested dict of a config (tuples become lists); inverse of :func:`config_from_dict`."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(cfg)


# ------------------------------------------------------------------------------------------------
# YAML files and --set overrides
# ------------------------------------------------------------------------------------------------


def deep_merge(base: dict, over: Mapping) -> dict:
    """``base`` with ``over`` merged in, section by section (``over`` wins; neither is changed)."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def flatten_fields(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config dict as ``{"section.field": value}`` (an empty section and
    ``optimizer.extra``, one opaque value, stay whole)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v and k != "extra":
            out.update(flatten_fields(v, path + "."))
        else:
            out[path] = v
    return out


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.expanduser().resolve()
    if path in seen:
        raise ConfigError(f"config file {path}: include cycle ({' -> '.join(map(str, seen))})")
    if not path.is_file():
        raise ConfigError(f"config file {path}: not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(
            f"config file {path}: invalid YAML ({str(err).splitlines()[0]})"
        ) from None
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"config file {path}: expected a mapping at top level, got {_describe(data)}"
        )
    data = dict(data)
    includes: list = []
    for key in ("include", "base"):
        if key in data:
            inc = data.pop(key)
            includes += [inc] if isinstance(inc, str) else list(inc or [])
    merged: dict = {}
    for inc in includes:
        if not isinstance(inc, str):
            raise ConfigError(f"config file {path}: include: expected a path, got {_describe(inc)}")
        merged = deep_merge(merged, _read_yaml(path.parent / inc, seen + (path,)))
    return deep_merge(merged, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parses ``a.b=value`` into (["a", "b"], value) with the value read by ``yaml.safe_load``."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected KEY=VALUE (e.g. train.steps=100)")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {text}: bad key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML: keep the raw string; the type check reports it if a str is wrong
    return parts, value


def add_override_argument(
    parser: Any, help: str = "override one field, e.g. --set train.steps=100"
) -> None:
    """Adds the one ``--set KEY=VALUE`` option (repeatable; into ``args.overrides``) every command
    that reads a config shares; :func:`apply_overrides` / :func:`load_config` parse the values."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY=VALUE",
        help=f"{help} (repeatable)",
    )


def apply_overrides(values: Mapping, overrides: Sequence[str]) -> dict:
    """Applies ``--set a.b=value`` strings to a nested dict (validation catches unknown keys)."""
    out = deep_merge({}, values)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(
                    f"{'.'.join(parts[: i + 1])}: is a value, not a section (--set {text})"
                )
            node = nxt
        node[parts[-1]] = value
    return out


def load_config(paths: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> Config:
    """defaults ← YAML files (later wins) ← ``--set`` overrides → a valid :class:`Config`."""
    return config_from_dict(load_config_values(paths, overrides))


def load_config_values(paths: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> dict:
    """The nested dict of what the YAML files and ``--set`` overrides say (not yet validated;
    missing keys are not filled): for commands that add fields of their own before
    :func:`config_from_dict`."""
    values: dict = {}
    for p in paths:
        values = deep_merge(values, _read_yaml(Path(p)))
    return apply_overrides(values, overrides)


def save_config(cfg: Config, workdir: str | Path) -> Path:
    """Writes ``workdir/config.json`` and ``workdir/config.yaml``; returns the JSON path."""
    workdir = as_path(workdir)
    d = config_to_dict(cfg)
    path = workdir / "config.json"
    atomic_write_text(path, json.dumps(d, indent=2, sort_keys=True) + "\n")
    atomic_write_text(workdir / "config.yaml", yaml.safe_dump(d, sort_keys=False))
    return path


def load_workdir_config(workdir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Reads ``workdir/config.json`` (written by training) and applies ``--set`` overrides."""
    path = as_path(workdir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"workdir {workdir}: no config.json (is this a training workdir?)")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: unreadable JSON ({err})") from None
    return config_from_dict(apply_overrides(values, overrides))
