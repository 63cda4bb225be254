"""Hugging Face Llama / Qwen2 checkpoints ↔ the Transformer++ shell (SPEC §6): configs, tensors and
the safetensors files, in pure numpy (no torch, no ``safetensors`` package).

The shell (:mod:`nested_jax.models.lm`) is the Llama architecture: pre-RMSNorm blocks
``x + Attn(RMSNorm(x))``, ``x + SwiGLU(RMSNorm(x))``, a final RMSNorm, RoPE in the rotate-half
layout, GQA where query head ``h`` reads KV head ``h // (H / H_kv)``. So a checkpoint maps tensor
for tensor:

====================================================  =================================  =========
Hugging Face name (``i`` = layer)                     nested-jax parameter               layout
====================================================  =================================  =========
``model.embed_tokens.weight [V, d]``                  ``embed [V, d]``                   same
``model.layers.i.input_layernorm.weight [d]``         ``blocks/mixer_norm/scale [L, d]``  row ``i``
``model.layers.i.self_attn.{q,k,v,o}_proj.weight``    ``blocks/mixer/{q,k,v,o}_proj/kernel``  ``Wᵀ``
``model.layers.i.self_attn.{q,k,v}_proj.bias``        ``blocks/mixer/{q,k,v}_proj/bias``  row ``i``
``model.layers.i.post_attention_layernorm.weight``    ``blocks/mlp_norm/scale``          row ``i``
``model.layers.i.mlp.{gate,up,down}_proj.weight``     ``blocks/mlp/{gate,up,down}/kernel``  ``Wᵀ``
``model.norm.weight [d]``                             ``final_norm/scale [d]``           same
``lm_head.weight [V, d]`` (untied only)               ``head/kernel [d, V]``             ``Wᵀ``
====================================================  =================================  =========

(torch's ``Linear`` stores ``W [out, in]``; ``nnx.Linear`` a row-major ``[in, out]`` kernel, and the
shell stacks the layers on a leading ``L`` axis.) Config fields: ``hidden_size → d_model``,
``num_attention_heads → n_heads``, ``num_key_value_heads → n_kv_heads``, ``head_dim``,
``intermediate_size → mlp_hidden``, ``rms_norm_eps → norm_eps``, ``tie_word_embeddings``,
``rope_theta`` and ``rope_scaling`` (``linear``, ``llama3``; transformers ≥ 5 writes both in
``rope_parameters``) → ``model.attention``; Qwen2's q/k/v biases → ``model.attention.qkv_bias``.
What the shell cannot compute (Llama's ``attention_bias`` also biases ``o_proj``; ``mlp_bias``;
an activation other than SiLU; Qwen2's sliding-window layers; YaRN / dynamic RoPE) is refused with
one line naming the field.

Defaults: a ``config.json`` lists only what differs from its architecture's ``transformers``
config class (``LlamaConfig``, ``Qwen2Config``), and the two classes disagree (Qwen2 unties the
head and has 32 KV heads unless told otherwise; Llama unties the head and gives every query head
its own KV head). :func:`hf_model_fields` fills a field left out from
:data:`TRANSFORMERS_DEFAULTS`, the table of those class defaults (the test suite compares it with
the installed ``transformers``), so a checkpoint loads as ``from_pretrained`` loads it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from nested_jax.layers.options import AttentionOptions
from nested_jax.models.config import ModelConfig

__all__ = [
    "ARCHITECTURES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "hf_config_from_model",
    "hf_model_fields",
    "TRANSFORMERS_DEFAULTS",
    "with_transformers_defaults",
    "hf_tensors_from_params",
    "model_config_from_hf",
    "params_from_hf_tensors",
    "read_hf_checkpoint",
    "read_hf_config",
    "read_safetensors",
    "write_hf_checkpoint",
    "write_safetensors",
]

# model_type -> the transformers class that loads it
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}

# HF per-layer module -> (parameter path under ``blocks``, transposed?)
_LAYER_WEIGHTS = {
    "input_layernorm.weight": (("mixer_norm", "scale"), False),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), False),
    **{
        f"self_attn.{p}_proj.weight": (("mixer", f"{p}_proj", "kernel"), True)
        for p in ("q", "k", "v", "o")
    },
    **{f"mlp.{p}_proj.weight": (("mlp", p, "kernel"), True) for p in ("gate", "up", "down")},
}
_QKV_BIASES = {
    f"self_attn.{p}_proj.bias": (("mixer", f"{p}_proj", "bias"), False) for p in ("q", "k", "v")
}
# Buffers some older checkpoints carry (recomputed from the config): read and ignored.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


# ---------------------------------------------------------------- safetensors files


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The tensors of one ``.safetensors`` file as read-only numpy arrays (memory-mapped).

    Format: an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
    ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data
    (offsets relative to its start). BF16 arrives as ``ml_dtypes.bfloat16``.

    Raises:
      ValueError: one line naming the file on a truncated or malformed file or an unknown dtype.
    """
    path = Path(path)
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
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else None
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or end > size - 8 - n:
            raise ValueError(f"{path}: tensor {name} {shape} has a truncated or wrong byte range")
        raw = data[begin:end] if end > begin else np.zeros(0, np.uint8)
        out[name] = raw.view(dtype.newbyteorder("<")).reshape(shape)
    return out


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes ``tensors`` as one ``.safetensors`` file (little-endian, in name order; the header
    padded with spaces to a multiple of 8 bytes, as the reference writer does)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    arrays, offset = [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensors[{name!r}]: dtype {a.dtype} has no safetensors name")
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        header[name] = {
            "dtype": _DTYPE_NAMES[a.dtype.newbyteorder("=")],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        arrays.append(a)
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for a in arrays:
            f.write(a.tobytes())


# ---------------------------------------------------------------- checkpoint directories


def read_hf_config(directory: str | os.PathLike) -> dict:
    """The parsed ``config.json`` of a Hugging Face model directory.

    Raises:
      FileNotFoundError: no ``config.json``. ValueError: not JSON (one line naming the file).
    """
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"--from: {directory} has no config.json (a Hugging Face model dir)"
        )
    try:
        return json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_file}: unreadable JSON ({err})") from None


def read_hf_checkpoint(directory: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """``(config.json as a dict, {tensor name: array})`` of a Hugging Face checkpoint directory:
    ``model.safetensors``, or the shards named by ``model.safetensors.index.json``.

    Raises:
      FileNotFoundError: no ``config.json`` or no safetensors weights (``pytorch_model.bin`` is
        not read: convert it with ``transformers`` first). ValueError: a malformed file (one line).
    """
    directory = Path(directory)
    config = read_hf_config(directory)
    if (directory / INDEX_FILE).is_file():
        index = json.loads((directory / INDEX_FILE).read_text())
        files = sorted(set(index.get("weight_map", {}).values()))
        if not files:
            raise ValueError(f"{directory / INDEX_FILE}: empty weight_map")
    elif (directory / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(
            f"--from: {directory} has no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights "
            "are read)"
        )
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / INDEX_FILE}: shard {name} is missing")
        tensors.update(read_safetensors(directory / name))
    return config, tensors


def write_hf_checkpoint(
    directory: str | os.PathLike,
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Writes ``config.json`` and the tensors, in one ``model.safetensors`` or, above
    ``max_shard_bytes``, in shards ``model-0000k-of-0000n.safetensors`` with the index file that
    ``from_pretrained`` reads. Returns the weight file names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = np.asarray(tensors[name]).nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    for file, members in zip(names, shards, strict=True):
        write_safetensors(directory / file, {n: tensors[n] for n in members}, {"format": "pt"})
    if len(shards) > 1:
        total = sum(np.asarray(t).nbytes for t in tensors.values())
        weight_map = {n: f for f, members in zip(names, shards, strict=True) for n in members}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
    return names


# ---------------------------------------------------------------- configs

# Fields every supported architecture shares the default of. ``head_dim`` absent or None means
# hidden_size // num_attention_heads in both classes (``hf_model_fields`` derives it).
_COMMON = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "head_dim": None,
}

# model_type -> {config.json field: the value its transformers config class gives it}.
# num_key_value_heads None: the class copies num_attention_heads.
TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2": {
        **_COMMON,
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 22016,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "use_sliding_window": False,
    },
}

_ROPE_KEYS = ("rope_parameters", "rope_scaling")


def with_transformers_defaults(hf_config: Mapping[str, Any]) -> dict:
    """``hf_config`` (a parsed ``config.json``) with every field of
    :data:`TRANSFORMERS_DEFAULTS` that it leaves out set as ``transformers`` sets it.

    A ``rope_theta`` inside ``rope_parameters`` / ``rope_scaling`` counts as given. An unknown
    ``model_type`` is returned unchanged (``hf_model_fields`` refuses it, naming the field).
    """
    out = dict(hf_config)
    defaults = TRANSFORMERS_DEFAULTS.get(out.get("model_type"), {})
    for key, value in defaults.items():
        if key == "rope_theta" and any("rope_theta" in (out.get(k) or {}) for k in _ROPE_KEYS):
            continue
        out.setdefault(key, value)
    if out.get("num_key_value_heads") is None and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


def _rope_fields(hf: Mapping[str, Any]) -> tuple[float, dict]:
    """``(rope_theta, AttentionOptions rope fields)`` from ``rope_parameters`` (transformers ≥ 5)
    or the older top-level ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params["rope_theta"] if "rope_theta" in params else hf["rope_theta"])
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, {"rope_scaling": "none"}
    if kind == "linear":
        return theta, {"rope_scaling": "linear", "rope_factor": float(params["factor"])}
    if kind == "llama3":
        return theta, {
            "rope_scaling": "llama3",
            "rope_factor": float(params["factor"]),
            "rope_low_freq_factor": float(params["low_freq_factor"]),
            "rope_high_freq_factor": float(params["high_freq_factor"]),
            "rope_original_max_len": int(params["original_max_position_embeddings"]),
        }
    raise ValueError(
        f"config.json rope_type: {kind!r} is not supported (default, linear, llama3 are)"
    )


def _refuse(condition: bool, field: str, why: str) -> None:
    if condition:
        raise ValueError(f"config.json {field}: {why}")


def hf_model_fields(hf: Mapping[str, Any]) -> dict:
    """The ``model`` config fields a Llama / Qwen2 ``config.json`` determines, as a plain nested
    dict (``attention`` a dict of :class:`AttentionOptions` fields): name, sizes, FFN, tying,
    RoPE, norm epsilon. A field the file leaves out takes its ``transformers`` default
    (:func:`with_transformers_defaults`).

    Raises:
      ValueError: one line naming the ``config.json`` field the shell cannot compute.
    """
    hf = with_transformers_defaults(hf)
    model_type = hf.get("model_type")
    _refuse(
        model_type not in ARCHITECTURES,
        "model_type",
        f"{model_type!r} is not supported (Llama- and Qwen2-style: {sorted(ARCHITECTURES)})",
    )
    _refuse(hf["hidden_act"] != "silu", "hidden_act", "only silu (SwiGLU) is supported")
    _refuse(bool(hf.get("mlp_bias")), "mlp_bias", "the SwiGLU has no bias")
    if model_type == "llama":
        _refuse(
            bool(hf.get("attention_bias")),
            "attention_bias",
            "Llama's attention_bias also biases o_proj, which the shell does not have",
        )
    _refuse(
        bool(hf.get("use_sliding_window")),
        "use_sliding_window",
        "Qwen2 sliding-window layers are not supported",
    )
    theta, rope = _rope_fields(hf)
    try:
        d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        return {
            "name": "transformer",
            "vocab_size": int(hf["vocab_size"]),
            "d_model": d_model,
            "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": n_heads,
            "head_dim": int(hf.get("head_dim") or d_model // n_heads),
            "n_kv_heads": int(hf["num_key_value_heads"]),
            "mlp_hidden": int(hf["intermediate_size"]),
            "ffn": "swiglu",
            "tie_embeddings": bool(hf["tie_word_embeddings"]),
            "rope_theta": theta,
            "norm_eps": float(hf["rms_norm_eps"]),
            "window": 0,
            "attention": {"qkv_bias": model_type == "qwen2", **rope},
        }
    except KeyError as err:
        raise ValueError(f"config.json {err.args[0]}: missing") from None


def model_config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` (``name="transformer"``) computing a Llama / Qwen2 checkpoint's
    function, from its ``config.json`` dict (:func:`hf_model_fields`).

    Args:
      hf: the parsed ``config.json``.
      **overrides: further ``ModelConfig`` fields that do not change the function's shapes
        (``dtype``, ``attention_block``, ``scan_layers``, ``remat``, ...).
    """
    fields = hf_model_fields(hf)
    fields["attention"] = AttentionOptions(**fields["attention"])
    return ModelConfig(**{**fields, **overrides})


def hf_config_from_model(cfg: ModelConfig, model_type: str | None = None) -> dict:
    """The ``config.json`` of a Llama / Qwen2 model computing ``cfg``'s attention shell.

    Args:
      cfg: a ``transformer`` (or ``hope_attention``, whose CMS level becomes the SwiGLU) config.
      model_type: ``llama`` or ``qwen2``; default ``qwen2`` when ``cfg.attention.qkv_bias``,
        else ``llama``.

    Raises:
      ValueError: one line naming the field a Llama / Qwen2 model cannot express (a sliding
        window, q/k/v biases in a Llama).
    """
    model_type = model_type or ("qwen2" if cfg.attention.qkv_bias else "llama")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"--arch: expected one of {sorted(ARCHITECTURES)}, got {model_type!r}")
    if cfg.name not in ("transformer", "hope_attention"):
        raise ValueError(
            f"model.name: {cfg.name!r} has no Hugging Face counterpart (transformer and "
            "hope_attention export)"
        )
    if cfg.window:
        raise ValueError(f"model.window: {cfg.window}; Llama / Qwen2 attention is global")
    if cfg.attention.qkv_bias != (model_type == "qwen2"):
        raise ValueError(
            f"model.attention.qkv_bias: {cfg.attention.qkv_bias}, but {model_type} "
            f"{'has' if model_type == 'qwen2' else 'has no'} q/k/v biases"
        )
    rope: dict[str, Any] = {"rope_theta": float(cfg.rope_theta), "rope_type": "default"}
    a = cfg.attention
    if a.rope_scaling == "linear":
        rope.update(rope_type="linear", factor=float(a.rope_factor))
    elif a.rope_scaling == "llama3":
        rope.update(
            rope_type="llama3",
            factor=float(a.rope_factor),
            low_freq_factor=float(a.rope_low_freq_factor),
            high_freq_factor=float(a.rope_high_freq_factor),
            original_max_position_embeddings=a.rope_original_max_len,
        )
    hidden = cfg.resolved_cms_hidden() if cfg.resolved_ffn() == "cms" else cfg.resolved_mlp_hidden()
    out = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.resolved_kv_heads(),
        "head_dim": cfg.resolved_head_dim(),
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope,
        "dtype": "float32",
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False)
    return out


# ---------------------------------------------------------------- tensors


def _hf_layout(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], bool, tuple[int, ...]]]:
    """HF name -> (parameter path, transposed?, HF shape) for every tensor of ``cfg``'s model."""
    d, h, hd = cfg.d_model, cfg.n_heads, cfg.resolved_head_dim()
    kv, f, v = cfg.resolved_kv_heads(), cfg.resolved_mlp_hidden(), cfg.vocab_size
    shapes = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (h * hd, d),
        "self_attn.k_proj.weight": (kv * hd, d),
        "self_attn.v_proj.weight": (kv * hd, d),
        "self_attn.o_proj.weight": (d, h * hd),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
        "self_attn.q_proj.bias": (h * hd,),
        "self_attn.k_proj.bias": (kv * hd,),
        "self_attn.v_proj.bias": (kv * hd,),
    }
    per_layer = {**_LAYER_WEIGHTS, **(_QKV_BIASES if cfg.attention.qkv_bias else {})}
    layout = {
        "model.embed_tokens.weight": (("embed",), False, (v, d)),
        "model.norm.weight": (("final_norm", "scale"), False, (d,)),
    }
    if not cfg.tie_embeddings:
        layout["lm_head.weight"] = (("head", "kernel"), True, (v, d))
    for i in range(cfg.n_layers):
        for suffix, (path, transposed) in per_layer.items():
            layout[f"model.layers.{i}.{suffix}"] = (("blocks", *path), transposed, shapes[suffix])
    return layout


def _set(tree: dict, path: Iterable[str], value) -> None:
    *parents, last = path
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[last] = value


def params_from_hf_tensors(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict:
    """The pure float32 parameter dict of the ``transformer`` model ``cfg`` holding a Hugging Face
    state dict (the table in the module docstring; per-layer tensors stacked on axis 0).

    Raises:
      ValueError: one line naming the tensor: missing, of the wrong shape, or with no place in
        the model (e.g. ``lm_head.weight`` when ``tie_embeddings``).
    """
    layout = _hf_layout(cfg)
    unused = sorted(n for n in tensors if n not in layout and not n.endswith(_IGNORED_SUFFIXES))
    if unused and not (unused == ["lm_head.weight"] and cfg.tie_embeddings):
        raise ValueError(
            f"tensor {unused[0]} has no place in the model ({len(unused)} unused; e.g. "
            "tie_word_embeddings or attention_bias differs from config.json)"
        )
    stacked: dict[tuple[str, ...], list] = {}
    params: dict = {}
    for name, (path, transposed, shape) in layout.items():
        if name not in tensors:
            raise ValueError(f"tensor {name}: missing (expected shape {list(shape)})")
        a = tensors[name]
        if tuple(a.shape) != shape:
            raise ValueError(f"tensor {name}: shape {list(a.shape)}, expected {list(shape)}")
        a = np.asarray(a, np.float32)
        a = a.T if transposed else a
        if path[0] == "blocks":
            stacked.setdefault(path, []).append(a)
        else:
            _set(params, path, a)
    for path, rows in stacked.items():
        _set(params, path, np.stack(rows))
    return params


def hf_tensors_from_params(params: Mapping, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The Hugging Face state dict (float32 numpy) of a ``transformer`` parameter dict — the
    inverse of :func:`params_from_hf_tensors`."""
    out = {}
    for name, (path, transposed, _shape) in _hf_layout(cfg).items():
        a = params
        for key in path:
            a = a[key]
        a = np.asarray(a, np.float32)
        if path[0] == "blocks":
            a = a[int(name.split(".")[2])]
        out[name] = np.ascontiguousarray(a.T if transposed else a)
    return out
