"""Training-test helpers (used by tests/train and tests/eval): a small corpus, a tiny config."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = (
    "the of and to a in that it was her she not be he his as had with for you which at by on "
    "elizabeth darcy sister mother letter house morning evening ball walk garden said could would"
).split()


def write_corpus(
    directory: Path, n_docs: int = 12, words_per_doc: int = 250, seed: int = 0
) -> Path:
    """Writes `n_docs` small English-like .txt documents into `directory`."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS) for _ in range(words_per_doc))
        (directory / f"doc{i:02d}.txt").write_text(text.capitalize() + ".\n")
    return directory


def tiny_values(corpus: Path, data_dir: Path, **extra) -> dict:
    """``{"section.field": value}`` of a tiny byte-level model that trains in seconds."""
    values = {
        "model.name": "transformer",
        "model.d_model": 32,
        "model.n_layers": 1,
        "model.n_heads": 2,
        "model.chunk_size": 16,
        "data.corpus": str(corpus),
        "data.data_dir": str(data_dir),
        "data.seq_len": 32,
        "data.batch_size": 8,
        "data.val_fraction": 0.2,
        "optimizer.warmup_steps": 2,
        "optimizer.lr": 0.01,
        "train.steps": 4,
        "train.log_every": 1,
        "train.eval_every": 0,
        "train.checkpoint_every": 2,
        "train.keep_checkpoints": 5,
        "train.progress_bar": False,
        "eval.eval_batches": 1,
        "eval.niah_lengths": [48],
        "eval.niah_depths": [0.5],
        "eval.niah_per_cell": 2,
        "mesh.data": 1,
        "mesh.fsdp": -1,
    }
    values.update(extra)
    return values


def tiny_overrides(corpus: Path, data_dir: Path, **extra) -> list[str]:
    """`--set` overrides of :func:`tiny_values`."""
    out = []
    for k, v in tiny_values(corpus, data_dir, **extra).items():
        v = str(v).lower() if isinstance(v, bool) else v
        out.append(f"{k}={v}")
    return out


def write_tiny_config(path: Path, corpus: Path, data_dir: Path, **extra) -> Path:
    """Writes :func:`tiny_values` as a YAML preset (for `nested-jax train --config`)."""
    import yaml

    nested: dict = {}
    for key, value in tiny_values(corpus, data_dir, **extra).items():
        section, field = key.split(".", 1)
        nested.setdefault(section, {})[field] = str(value) if isinstance(value, Path) else value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(nested))
    return path


def defaults_preset(directory: Path) -> Path:
    """An empty YAML preset (the built-in defaults) for `train --config`, as tests give every
    field by `--set`: a new workdir needs a --config."""
    path = directory / "defaults.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# the built-in defaults; the test sets the rest with --set\n")
    return path


def subprocess_env(root: Path, *, devices: int, drop: tuple[str, ...] = ()) -> dict:
    """Environment of a `nested-jax` child process: `devices` fake CPU devices, this checkout on
    the path, and an XLA compilation cache under `root` shared by all children (only the first
    compiles). `drop` removes variables a runner reads (fault switches)."""
    import os

    env = dict(os.environ)
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(root / "xla_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
    )
    for name in drop:
        env.pop(name, None)
    return env
