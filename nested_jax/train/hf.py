"""Hugging Face checkpoints in and out of training workdirs: ``nested-jax import-hf`` and
``nested-jax export-hf``.

**Import.** ``nested-jax import-hf --from HF_DIR [--config X.yaml] [--set k=v] --workdir NEW
[--to hope_attention]`` reads a Llama- or Qwen2-style checkpoint (``config.json`` and
``model.safetensors`` or a sharded index; :mod:`nested_jax.models.hf`) and writes it as step 0 of a
new workdir, one tensor at a time (:mod:`nested_jax.train.hf_import`: the parameters are held
once, step 0 has no optimizer state); ``nested-jax train --workdir NEW`` then continues it
(optimizer state fresh, data from its start). The checkpoint fixes the model's shape fields (sizes,
tying, RoPE, norm epsilon, ``model.attention``), a field ``config.json`` leaves out taking the
value ``transformers`` gives it (:data:`nested_jax.models.hf.TRANSFORMERS_DEFAULTS`); the config
gives everything else (data, optimizer, mesh, ``dtype``, the CMS section). A config that sets one
of the fixed fields to another value is refused, naming it.
With ``--to hope_attention`` the transformer goes straight through the Transformer → Hope-Attention
conversion (SPEC §3.4, as :func:`nested_jax.train.convert.convert_ffn_to_cms`): its SwiGLU is copied
into every CMS level. When ``HF_DIR`` holds a ``tokenizer.json`` and the config names no tokenizer,
the run uses it (the checkpoint's token ids mean nothing under another vocabulary).

**Export.** ``nested-jax export-hf --workdir W [--step N] --out DIR [--arch llama|qwen2]`` writes
the newest (or ``--step``) checkpoint's parameters as a Hugging Face checkpoint that
``AutoModelForCausalLM.from_pretrained(DIR)`` loads, with the run's ``tokenizer.json`` when it has
one. A ``transformer`` exports exactly. A ``hope_attention`` exports its attention and the SwiGLU of
CMS level ``--cms-level`` (default 1): the same function when the CMS has one level (or every
level still holds the same FFN, as right after an import), otherwise a Llama that keeps one level's
FFN — a line says which.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from nested_jax.models import hf
from nested_jax.train.checkpoint import CHECKPOINT_DIR
from nested_jax.train.convert import FFN_TO_LEVEL, load_checkpoint_params, step_zero_parser
from nested_jax.train.hf_import import as_transformer, write_imported_step_zero

__all__ = ["export_checkpoint", "import_checkpoint", "import_config", "main_export", "main_import"]

IMPORT_TARGETS = ("transformer", "hope_attention")


def import_config(values: dict, hf_config: dict, hf_dir: Path, *, to: str = "transformer"):
    """The run's ``Config``: the config values (YAML + ``--set``, not yet validated) with the
    model fields ``hf_config`` fixes.

    Raises:
      ConfigError: one line naming a model field the config sets to another value than the
        checkpoint, or any other invalid field.
    """
    from nested_jax.train.config import ConfigError, config_from_dict, deep_merge, flatten_fields

    if to not in IMPORT_TARGETS:
        raise ConfigError(f"--to: expected one of {IMPORT_TARGETS}, got {to!r}")
    try:
        fields = hf.hf_model_fields(hf_config)
    except ValueError as err:
        raise ConfigError(f"{hf_dir}/{err}") from None
    if to == "hope_attention":
        fields.update(name="hope_attention", ffn="cms")
    said = flatten_fields(values.get("model") or {})
    for key, value in flatten_fields(fields).items():
        if key in said and said[key] != value:
            raise ConfigError(
                f"model.{key}: the config says {said[key]!r}, but {hf_dir}/config.json gives "
                f"{value!r} (leave it out: the checkpoint sets it)"
            )
    values = deep_merge(values, {"model": fields})
    tokenizer_file = hf_dir / "tokenizer.json"
    if "tokenizer" not in (values.get("data") or {}) and tokenizer_file.is_file():
        values = deep_merge(values, {"data": {"tokenizer": str(tokenizer_file)}})
    return config_from_dict(values)


def import_checkpoint(config, hf_dir: str | Path, workdir: str | Path) -> Path:
    """Writes the Hugging Face checkpoint in ``hf_dir`` as step 0 of ``workdir`` under ``config``
    (from :func:`import_config`), streaming it tensor by tensor
    (:func:`nested_jax.train.hf_import.write_imported_step_zero`). Returns the step directory.

    Raises:
      FileNotFoundError / ValueError: one line naming the file or the tensor and its shape.
    """
    return write_imported_step_zero(config, workdir, hf_dir)


def _level_as_swiglu(params: dict, level: int) -> dict:
    """``params`` with the CMS FFN replaced by level ``level``'s SwiGLU (1-based)."""
    levels = params["blocks"]["mlp"]["levels"]
    key = level - 1 if isinstance(next(iter(levels)), int) else str(level - 1)
    if key not in levels:
        raise ValueError(
            f"--cms-level: {level} is not a level of this model ({len(levels)} levels)"
        )
    mlp = {name: {"kernel": levels[key][w]} for name, w in FFN_TO_LEVEL.items()}
    return {**params, "blocks": {**params["blocks"], "mlp": mlp}}


def _levels_equal(params: dict) -> bool:
    levels = list(params["blocks"]["mlp"]["levels"].values())
    return all(
        np.array_equal(np.asarray(a[w]), np.asarray(levels[0][w]))
        for a in levels[1:]
        for w in FFN_TO_LEVEL.values()
    )


def export_checkpoint(
    workdir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    arch: str | None = None,
    cms_level: int = 1,
    max_shard_bytes: int = 5 * 2**30,
) -> dict:
    """Writes a run's checkpoint as a Hugging Face checkpoint directory ``out``.

    Returns:
      ``{"step", "arch", "files", "exact"}``: the exported step, the ``model_type``, the weight
      files, and whether the exported model computes the run's function (False for a
      ``hope_attention`` whose CMS levels differ).
    """
    from nested_jax.train.workdir import saved_data

    source = Path(workdir) if step is None else Path(workdir) / CHECKPOINT_DIR / str(step)
    model_cfg, params, step = load_checkpoint_params(source)
    exact = True
    if model_cfg.name == "hope_attention":
        if not model_cfg.cms.gated:
            raise ValueError("model.cms.gated: false; only gated (SwiGLU) CMS levels export")
        exact = len(model_cfg.cms.periods) == 1 or _levels_equal(params)
        params = _level_as_swiglu(params, cms_level)
    config = hf.hf_config_from_model(model_cfg, arch)
    tensors = hf.hf_tensors_from_params(jax.device_get(params), as_transformer(model_cfg))
    files = hf.write_hf_checkpoint(out, config, tensors, max_shard_bytes=max_shard_bytes)
    data = saved_data(workdir)
    tokenizer_raw = getattr(getattr(data, "tokenizer", None), "raw", None)
    if tokenizer_raw is not None:
        Path(out, "tokenizer.json").write_bytes(tokenizer_raw)
    return {"step": step, "arch": config["model_type"], "files": files, "exact": exact}


def main_import(argv: Sequence[str] | None = None) -> int:
    """``nested-jax import-hf --from HF_DIR [--config F] [--set k=v] --workdir NEW [--to T]``.

    Exit codes: 0 written, 1 unreadable or incompatible checkpoint, 2 bad command line or config.
    """
    from nested_jax.train.config import ConfigError, load_config_values

    p = step_zero_parser(
        "nested-jax import-hf",
        "Write a Hugging Face Llama / Qwen2 checkpoint as step 0 of a new workdir "
        "(then `nested-jax train --workdir NEW`).",
        "Hugging Face model directory",
    )
    p.add_argument("--to", default="transformer", choices=IMPORT_TARGETS, help="target model")
    args = p.parse_args(argv)
    hf_dir = Path(args.source)
    try:
        hf_config = hf.read_hf_config(hf_dir)
        config = import_config(
            load_config_values(args.config, args.overrides), hf_config, hf_dir, to=args.to
        )
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"config error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    try:
        path = import_checkpoint(config, hf_dir, args.workdir)
    except (FileNotFoundError, ValueError) as err:
        print(str(err).splitlines()[0], file=sys.stderr)
        return 1
    print(f"wrote {path}; continue with: nested-jax train --workdir {args.workdir}")
    return 0


def main_export(argv: Sequence[str] | None = None) -> int:
    """``nested-jax export-hf --workdir W --out DIR [--step N] [--arch A] [--cms-level K]``.

    Exit codes: 0 written, 1 unreadable checkpoint or a model with no Hugging Face form, 2 bad
    command line.
    """
    p = argparse.ArgumentParser(
        prog="nested-jax export-hf",
        description="Write a run's checkpoint as a Hugging Face Llama / Qwen2 model directory.",
    )
    p.add_argument("--workdir", required=True, help="training run directory")
    p.add_argument("--out", required=True, help="output directory (config.json, safetensors)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--arch", choices=sorted(hf.ARCHITECTURES), default=None)
    p.add_argument("--cms-level", type=int, default=1, help="hope_attention: the level to export")
    p.add_argument("--max-shard-mb", type=float, default=5 * 1024, help="shard size limit (MiB)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"--out: {out} is not empty; choose a new directory", file=sys.stderr)
        return 2
    try:
        done = export_checkpoint(
            args.workdir,
            out,
            step=args.step,
            arch=args.arch,
            cms_level=args.cms_level,
            max_shard_bytes=int(args.max_shard_mb * 2**20),
        )
    except (FileNotFoundError, ValueError) as err:
        if out.is_dir() and not any(out.iterdir()):
            shutil.rmtree(out)
        print(str(err).splitlines()[0], file=sys.stderr)
        return 1
    print(f"wrote step {done['step']} as {done['arch']} to {out} ({', '.join(done['files'])})")
    if not done["exact"]:
        print(
            f"note: the CMS levels differ; the export keeps level {args.cms_level}'s FFN only, "
            "so it does not compute the run's function"
        )
    return 0
