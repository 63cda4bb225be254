"""A Hugging Face checkpoint streamed into step 0 of a new workdir, one tensor at a time.

Memory: the import holds the run's parameters once (in their training dtype, on their
shardings) plus one parameter being filled and one checkpoint tensor being read. Nothing else is
materialised: the parameters are never randomly initialised first (their shapes come from the
array-free :class:`nested_jax.train.setup.StepPlan`), the safetensors files are read with plain
file reads (a memory map would keep every page it touched resident), and step 0 holds no
optimizer state, which ``nested-jax train`` creates fresh on resume (its moments start at zero
whatever the weights, and would triple the footprint of an AdamW import).

Strictness: before any tensor is read, every tensor name and shape in the files is checked against
the model the config describes; a tensor the model has no place for is an error naming it, never
skipped. The one exception is a tied checkpoint that also stores ``lm_head.weight``: it is read and
must equal ``model.embed_tokens.weight`` bit for bit (``transformers`` ties the two). Rotary
``inv_freq`` buffers, which older checkpoints carry and ``transformers`` recomputes from the
config, are not read.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nested_jax.models import hf
from nested_jax.models.config import ModelConfig
from nested_jax.train.convert import FFN_TO_LEVEL

__all__ = ["SafetensorsFiles", "as_transformer", "stream_params", "write_imported_step_zero"]

_LEVEL_TO_FFN = {level: ffn for ffn, level in FFN_TO_LEVEL.items()}


def as_transformer(model: ModelConfig) -> ModelConfig:
    """The Transformer++ with ``model``'s attention shell and a SwiGLU of its CMS level width
    (the Hugging Face model a ``hope_attention`` comes from or exports to)."""
    if model.name == "transformer":
        return model
    return dataclasses.replace(
        model, name="transformer", ffn="swiglu", mlp_hidden=model.resolved_cms_hidden()
    )


class SafetensorsFiles:
    """The tensors of a Hugging Face checkpoint directory (``model.safetensors`` or the shards of
    ``model.safetensors.index.json``), indexed from the file headers; :meth:`read` loads one.

    Raises:
      FileNotFoundError: no weights, or a shard the index names is missing. ValueError: a
        malformed header, an unsupported dtype, a byte range outside the file, or a tensor stored
        twice (one line naming the file and the tensor).
    """

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index_file = directory / hf.INDEX_FILE
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text()).get("weight_map", {})
            files = sorted(set(weight_map.values()))
            if not files:
                raise ValueError(f"{index_file}: empty weight_map")
        elif (directory / hf.SINGLE_FILE).is_file():
            files = [hf.SINGLE_FILE]
        else:
            raise FileNotFoundError(
                f"--from: {directory} has no {hf.SINGLE_FILE} or {hf.INDEX_FILE} (only "
                "safetensors weights are read)"
            )
        # name -> (file, dtype, shape, absolute byte offset)
        self.entries: dict[str, tuple[Path, np.dtype, tuple[int, ...], int]] = {}
        for name in files:
            path = directory / name
            if not path.is_file():
                raise FileNotFoundError(f"{index_file}: shard {name} is missing")
            for tensor, entry in _header_entries(path).items():
                if tensor in self.entries:
                    raise ValueError(
                        f"{path}: tensor {tensor} is also in {self.entries[tensor][0]}"
                    )
                self.entries[tensor] = entry

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a fresh (writable, not memory-mapped) array in its stored dtype."""
        path, dtype, shape, offset = self.entries[name]
        out = np.empty(shape, dtype)
        with open(path, "rb") as f:
            f.seek(offset)
            got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        if got != out.nbytes:
            raise ValueError(f"{path}: tensor {name} is truncated ({got} of {out.nbytes} bytes)")
        return out


def _header_entries(path: Path) -> dict[str, tuple[Path, np.dtype, tuple[int, ...], int]]:
    """The tensors listed in one safetensors file's header (8-byte little-endian length ``N``,
    ``N`` bytes of JSON, then the data), checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ValueError(f"{path}: not a safetensors file (header length {n}, size {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: unreadable safetensors header ({err})") from None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = hf._DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or 8 + n + end > size:
            raise ValueError(f"{path}: tensor {name} {shape} has a truncated or wrong byte range")
        out[name] = (path, dtype.newbyteorder("<"), shape, 8 + n + begin)
    return out


def _check_names(files: SafetensorsFiles, layout: dict) -> None:
    """Every tensor of ``layout`` is in ``files`` at its shape, and every tensor in ``files`` has a
    place (module docstring)."""
    for name, (_, _, shape) in layout.items():
        if name not in files.entries:
            raise ValueError(f"tensor {name}: missing (expected shape {list(shape)})")
        if files.shape(name) != shape:
            raise ValueError(
                f"tensor {name}: shape {list(files.shape(name))}, expected {list(shape)}"
            )
    for name in sorted(files.entries):
        if name in layout or name.endswith(hf._IGNORED_SUFFIXES) or name == "lm_head.weight":
            continue
        raise ValueError(
            f"tensor {name} has no place in the model (is attention_bias or another "
            "config.json field other than the weights say?)"
        )
    if "lm_head.weight" in files.entries and "lm_head.weight" not in layout:
        embed = files.read("model.embed_tokens.weight")
        head = files.read("lm_head.weight")
        if head.shape != embed.shape or not np.array_equal(head, embed):
            raise ValueError(
                "tensor lm_head.weight differs from model.embed_tokens.weight, but config.json "
                "ties them (tie_word_embeddings: true); transformers would drop it"
            )


def _sources(layout: dict) -> dict[tuple, list[tuple[str, bool]]]:
    """transformer parameter path -> ``[(HF name, transposed?)]``, one per layer for the stacked
    ``blocks`` parameters (in layer order)."""
    out: dict[tuple, list[tuple[str, bool]]] = {}
    for name, (path, transposed, _) in layout.items():
        out.setdefault(path, []).append((name, transposed))
    for path, names in out.items():
        if path[0] == "blocks":
            names.sort(key=lambda item: int(item[0].split(".")[2]))
    return out


def _source_path(path: tuple) -> tuple | None:
    """The transformer parameter a target parameter copies (a CMS level holds the SwiGLU); None
    for a parameter that keeps its initial value (the CMS mixing logits)."""
    if path[:3] == ("blocks", "mlp", "levels") and len(path) == 5:
        if path[4] not in _LEVEL_TO_FFN:
            raise ValueError(f"--to: unexpected CMS parameter {'/'.join(map(str, path))}")
        return ("blocks", "mlp", _LEVEL_TO_FFN[path[4]], "kernel")
    if path == ("blocks", "mlp", "mix_logits"):
        return None
    return path


def _fill(
    files: SafetensorsFiles, names: list[tuple[str, bool]], target, stacked: bool
) -> np.ndarray:
    """One parameter in ``target``'s dtype, read tensor by tensor (layer ``i`` into row ``i`` when
    ``stacked``)."""
    out = np.empty(target.shape, target.dtype)
    for i, (name, transposed) in enumerate(names):
        a = files.read(name)
        a = a.T if transposed else a
        want = out.shape[1:] if stacked else out.shape
        if a.shape != want:
            raise ValueError(f"tensor {name}: gives shape {list(a.shape)}, the model needs {want}")
        if stacked:
            out[i] = a
        else:
            out[...] = a
        del a
    return out


def _flat_paths(tree: dict) -> list[tuple[tuple, Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), v) for p, v in leaves]


def stream_params(
    files: SafetensorsFiles,
    source_cfg: ModelConfig,
    abstract: dict,
    initial: Callable[[list[tuple]], list[jax.Array]],
) -> dict:
    """The target parameters filled from a Hugging Face checkpoint, one parameter at a time.

    Args:
      files: the checkpoint's tensors.
      source_cfg: the ``transformer`` the checkpoint is (:func:`hf.model_config_from_hf`).
      abstract: the target's pure parameter dict of ``ShapeDtypeStruct`` with shardings (a
        ``transformer``, or a model with its FFN replaced by gated CMS levels).
      initial: ``initial(paths)``: the initial values of the target parameters the checkpoint
        does not give (the CMS mixing logits).

    Returns:
      the pure parameter dict, each leaf placed on its sharding.

    Raises:
      ValueError: one line naming the tensor or parameter (see the module docstring).
    """
    layout = hf._hf_layout(source_cfg)
    _check_names(files, layout)
    sources = _sources(layout)
    leaves = _flat_paths(abstract)
    keep = [path for path, _ in leaves if _source_path(path) is None]
    kept = dict(zip(keep, initial(keep) if keep else [], strict=True))
    used, values = set(), []
    for path, target in leaves:
        spath = _source_path(path)
        if spath is None:
            values.append(kept[path])
            continue
        if spath not in sources:
            raise ValueError(f"--to: the checkpoint has no tensor for {'/'.join(map(str, path))}")
        used.add(spath)
        host = _fill(files, sources[spath], target, spath[0] == "blocks")
        # Waits for the copy: a pending transfer keeps ``host`` alive, and the save would then
        # hold every parameter twice (the host buffers and the arrays it writes from).
        values.append(jax.block_until_ready(jax.device_put(host, target.sharding)))
        del host
    unused = sorted(set(sources) - used)
    if unused:
        name = sources[unused[0]][0][0]
        raise ValueError(f"tensor {name} has no place in the target model")
    treedef = jax.tree_util.tree_structure(abstract)
    return jax.tree_util.tree_unflatten(treedef, values)


def _initial_leaves(plan) -> Callable[[list[tuple]], list[jax.Array]]:
    """``initial(paths)`` computing only those parameters of the model's initialiser (the rest
    is dead code to XLA, so nothing else is allocated)."""

    def initial(paths: list[tuple]) -> list[jax.Array]:
        table = dict(_flat_paths(plan.params))
        shardings = [table[p].sharding for p in paths]

        def init():
            _, params, _ = nnx.split(plan.create_model(), nnx.Param, ...)
            flat = dict(_flat_paths(nnx.to_pure_dict(params)))
            return [flat[p] for p in paths]

        return jax.jit(init, out_shardings=shardings)()

    return initial


def write_imported_step_zero(config: Any, workdir: str | Path, hf_dir: str | Path) -> Path:
    """Writes the Hugging Face checkpoint in ``hf_dir`` as step 0 of the new ``workdir``: the
    parameters, step 0 and no optimizer state (``nested-jax train --workdir`` creates it; data
    from its start). Returns the step directory.

    Raises:
      FileNotFoundError / ValueError: one line naming the file or the tensor; nothing is written.
    """
    from nested_jax.parallel.mesh import replicated
    from nested_jax.train.checkpoint import save_limit_gb
    from nested_jax.train.convert import new_workdir_checkpoints, save_step_zero
    from nested_jax.train.setup import prepare_plan

    ckpt_dir = new_workdir_checkpoints(workdir)
    files = SafetensorsFiles(hf_dir)
    mesh, bundle, plan = prepare_plan(config)
    abstract = plan.abstract_state()["params"]
    params = stream_params(files, as_transformer(config.model), abstract, _initial_leaves(plan))
    zero = jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh))
    state = {"step": zero, "params": params, "consecutive_skips": zero}
    # Writes a few parameters at a time: unbounded, the save's encode buffers would add a second
    # copy of the parameters to the footprint.
    save_step_zero(config, workdir, bundle, state, save_concurrent_gb=save_limit_gb(state))
    return ckpt_dir / "0"
