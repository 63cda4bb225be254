"""Initialise a CMS model (Hope-Attention) from a trained Transformer checkpoint (SPEC §3.4).

The target shares the source's shell and mixer, so every parameter is copied at the same path
(embedding, head, norms, attention), except the block FFN: the source SwiGLU kernels
``blocks/mlp/{gate,up,down}/kernel`` are copied into **every** CMS level
``blocks/mlp/levels/<ℓ>/{w_gate,w_up,w_down}`` (gated levels hold exactly a SwiGLU; row-major
kernels like ``nnx.Linear``). ``mix_logits`` (``independent`` variant) keep their initial zeros
(uniform weights).

Why the function is kept: the shell adds ``CMS(z) − z`` (``z`` the normed stream; see
``nested_jax.layers.cms``), and each level is ``z + f(z)`` with ``f`` the copied SwiGLU, so

- one level (any variant): ``CMS(z) − z = f(z)`` — the converted model's logits equal the
  transformer's;
- ``independent`` with ``k`` levels: ``Σ_ℓ w_ℓ (z + f(z)) − z = f(z)`` (``Σ w_ℓ = 1``) — equal too;
- ``nested``: only level 1 reads — equal too;
- ``sequential`` with ``k > 1``: ``f`` is composed ``k`` times (SPEC §3.4's initialisation, a
  different function that training then adapts).

Two ways to use it:

- :func:`init_params_from_checkpoint` (a library call, e.g. from the training loop when a run
  starts from scratch) returns the converted parameters placed on the target's shardings;
- ``python -m nested_jax.train.convert --from SRC_WORKDIR --config hope.yaml --workdir NEW`` writes
  the converted state as step 0 of a new workdir; ``nested-jax train --workdir NEW`` then resumes
  from it (optimizer state freshly initialised, data from its start).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from nested_jax.models.config import ModelConfig
from nested_jax.train.checkpoint import CHECKPOINT_DIR

__all__ = [
    "FFN_TO_LEVEL",
    "check_convertible",
    "convert_ffn_to_cms",
    "init_params_from_checkpoint",
    "load_checkpoint_params",
    "main",
    "step_zero_parser",
    "write_initial_checkpoint",
    "write_step_zero",
]

# SwiGLU submodule name -> CMS level kernel name (both row-major [in, out]).
FFN_TO_LEVEL = {"gate": "w_gate", "up": "w_up", "down": "w_down"}


def check_convertible(src: ModelConfig, dst: ModelConfig) -> None:
    """Raises a one-line ``ValueError`` unless ``src`` (SwiGLU FFN) converts into ``dst`` (CMS).

    Requires the same mixer class and shapes of the shared parameters (checked leaf by leaf by
    :func:`convert_ffn_to_cms`), a SwiGLU source FFN, a CMS target FFN with gated levels of the
    source's hidden width. Non-shape fields (``window``, ``rope_theta``, ``norm_eps``, ``dtype``)
    may differ; the converted model computes the source's function only when they are equal.
    """
    from nested_jax.models.registry import get_mixer

    if src.resolved_ffn() != "swiglu":
        raise ValueError(f"init_from: the source model {src.name!r} has no SwiGLU FFN to copy")
    if dst.resolved_ffn() != "cms":
        raise ValueError(
            f"model.ffn: the target {dst.name!r} must have a CMS FFN (ffn=cms) to copy a "
            "transformer FFN into"
        )
    if get_mixer(src.name) is not get_mixer(dst.name):
        raise ValueError(
            f"model.name: the target mixer {dst.name!r} differs from the source {src.name!r}; "
            "only the FFN is converted (e.g. transformer -> hope_attention)"
        )
    if not dst.cms.gated:
        raise ValueError("model.cms.gated: must be true to hold a copied SwiGLU FFN")
    if dst.resolved_cms_hidden() != src.resolved_mlp_hidden():
        raise ValueError(
            f"model.cms.hidden: the CMS level width {dst.resolved_cms_hidden()} differs from the "
            f"source SwiGLU width {src.resolved_mlp_hidden()} (set model.cms.hidden to it)"
        )


def _flat(tree: dict) -> dict[tuple, Any]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p): v for p, v in leaves}


def _unflat_like(target: dict, values: dict[tuple, Any]) -> dict:
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    keys = [tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p) for p, _ in paths]
    return jax.tree_util.tree_unflatten(treedef, [values[k] for k in keys])


def _where(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def convert_ffn_to_cms(src_params: dict, dst_params: dict) -> dict:
    """The target parameters filled from a SwiGLU-FFN model's parameters (SPEC §3.4); with a
    SwiGLU target (same paths), a shape-checked placement of the source onto the target.

    Args:
      src_params: pure parameter dict of the source LM (``blocks/mlp/{gate,up,down}/kernel``).
      dst_params: pure parameter dict of the target LM (``blocks/mlp/levels/<ℓ>/...``): gives the
        structure, shapes, dtypes and shardings; only ``blocks/mlp/mix_logits`` keeps its value.

    Returns:
      dict with ``dst_params``' structure: source arrays at the shared paths, the source FFN in
      every level, placed like the target leaves (``jax.device_put`` onto their shardings).

    Raises:
      ValueError: one line naming the parameter path on a missing leaf, an unused source leaf or a
        shape mismatch.
    """
    src, dst = _flat(src_params), _flat(dst_params)
    used, out = set(), {}
    for path, target in dst.items():
        if path[:3] == ("blocks", "mlp", "levels") and len(path) == 5:
            names = {v: k for k, v in FFN_TO_LEVEL.items()}
            if path[4] not in names:
                raise ValueError(f"init_from: unexpected CMS parameter {_where(path)}")
            spath = ("blocks", "mlp", names[path[4]], "kernel")
        elif path == ("blocks", "mlp", "mix_logits"):
            out[path] = target  # uniform mixing: Σ w_ℓ f = f
            continue
        else:
            spath = path
        if spath not in src:
            raise ValueError(
                f"init_from: the source checkpoint has no parameter {_where(spath)} "
                f"(needed for {_where(path)})"
            )
        value = src[spath]
        if tuple(np.shape(value)) != tuple(np.shape(target)):
            raise ValueError(
                f"init_from: shape mismatch at {_where(path)}: source {_where(spath)} has "
                f"{tuple(np.shape(value))}, target needs {tuple(np.shape(target))}"
            )
        used.add(spath)
        value = jnp.asarray(value, dtype=target.dtype)
        sharding = getattr(target, "sharding", None)
        out[path] = value if sharding is None else jax.device_put(value, sharding)
    unused = sorted(set(src) - used)
    if unused:
        raise ValueError(
            f"init_from: the source parameter {_where(unused[0])} has no place in the target "
            f"({len(unused)} unused; e.g. tie_embeddings differs)"
        )
    return _unflat_like(dst_params, out)


def _step_dir(source: Path) -> tuple[Path, int | None]:
    """``(checkpoints directory, step or None = newest)`` for a workdir or a step directory."""
    if (source / CHECKPOINT_DIR).is_dir():
        return source / CHECKPOINT_DIR, None
    if source.name.isdigit() and source.parent.name == CHECKPOINT_DIR and source.is_dir():
        return source.parent, int(source.name)
    raise FileNotFoundError(
        f"init_from: no checkpoint at {source} (expected a training workdir with "
        f"{CHECKPOINT_DIR}/<step>/ or such a step directory)"
    )


def _abstract_params(model_cfg: ModelConfig, mesh: jax.sharding.Mesh | None) -> dict:
    from nested_jax.models import build_model

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: build_model(model_cfg, rngs=nnx.Rngs(0)))
    abs_params = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(abs_params)
    if mesh is None:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
        sh = jax.tree.map(
            lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), pure
        )
    else:
        from nested_jax.parallel.mesh import state_shardings

        sh = nnx.to_pure_dict(state_shardings(abs_params, mesh))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), pure, sh)


def load_checkpoint_params(
    source: str | Path, *, mesh: jax.sharding.Mesh | None = None
) -> tuple[ModelConfig, dict, int]:
    """The model config and parameters of a training checkpoint (read-only; optimizer not read).

    Args:
      source: a training workdir (its newest checkpoint) or a ``<workdir>/checkpoints/<step>``
        directory.
      mesh: place the parameters with the model's logical shardings on this mesh (default: one
        device, replicated).

    Returns:
      ``(model_config, params, step)``.

    Raises:
      FileNotFoundError: no checkpoint there. ValueError: an unreadable checkpoint or config (one
      line naming the directory).
    """
    from nested_jax.train.config import ConfigError, config_from_dict

    source = Path(source)
    directory, step = _step_dir(source)
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    manager = ocp.CheckpointManager(directory.resolve(), options=options)
    try:
        steps = sorted(manager.all_steps())
        if step is None:
            if not steps:
                raise FileNotFoundError(f"init_from: no complete checkpoint in {directory}")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(f"init_from: {source} is not a complete checkpoint")
        where = directory / str(step)
        try:
            saved = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
            model_cfg = config_from_dict(saved["config"]).model
        except ConfigError as err:
            raise ValueError(f"init_from: the config saved in {where} is invalid ({err})") from None
        except Exception as err:
            raise ValueError(
                f"init_from: checkpoint {where} is unreadable ({_reason(err)})"
            ) from None
        target = {"params": _abstract_params(model_cfg, mesh)}
        restore_args = jax.tree.map(
            lambda a: ocp.ArrayRestoreArgs(
                sharding=a.sharding, global_shape=a.shape, dtype=a.dtype
            ),
            target,
        )
        try:
            # partial_restore: read only the parameters of the saved train state (no optimizer
            # state, whose layout depends on the source's optimizer).
            args = ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True
            )
            restored = manager.restore(step, args=ocp.args.Composite(state=args))
            params = restored["state"]["params"]
            jax.block_until_ready(params)
        except Exception as err:
            raise ValueError(
                f"init_from: checkpoint {where} is unreadable ({_reason(err)})"
            ) from None
    finally:
        manager.close()
    return model_cfg, params, step


def _reason(err: Exception) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}"[:300]


def init_params_from_checkpoint(
    source: str | Path, model_cfg: ModelConfig, target_params: dict, *, mesh=None
) -> dict:
    """Converted parameters for ``model_cfg`` from the transformer checkpoint at ``source``.

    Args:
      source: the transformer's workdir or ``checkpoints/<step>`` directory.
      model_cfg: the target model (a CMS FFN; see :func:`check_convertible`).
      target_params: the target's freshly initialised pure parameter dict (structure, shardings,
        the kept ``mix_logits``).
      mesh: mesh to read the source parameters onto (default: one device).

    Returns:
      the converted pure parameter dict (see :func:`convert_ffn_to_cms`).
    """
    src_cfg, src_params, _ = load_checkpoint_params(source, mesh=mesh)
    check_convertible(src_cfg, model_cfg)
    return convert_ffn_to_cms(src_params, target_params)


def write_initial_checkpoint(config: Any, workdir: str | Path, source: str | Path) -> Path:
    """Writes the converted model as step 0 of a new training workdir (then resume with train).

    Args:
      config: the target run's ``Config`` (model with a CMS FFN).
      workdir: a new run directory (must not hold checkpoints yet).
      source: the transformer's workdir or ``checkpoints/<step>`` directory.

    Returns:
      the step-0 checkpoint directory.
    """
    from nested_jax.train.workdir import saved_data

    # The converted model reads the token ids of the transformer it comes from: its tokenizer.
    source_ckpts, _ = _step_dir(Path(source))
    source_data = saved_data(source_ckpts.parent)
    tokenizer = None if source_data is None else source_data.tokenizer

    def fill(target: dict, mesh: jax.sharding.Mesh) -> dict:
        return init_params_from_checkpoint(source, config.model, target, mesh=mesh)

    return write_step_zero(config, workdir, fill, tokenizer=tokenizer)


def write_step_zero(
    config: Any,
    workdir: str | Path,
    fill: Callable[[dict, jax.sharding.Mesh], dict],
    *,
    tokenizer: Any = None,
) -> Path:
    """Writes step 0 of a new training workdir whose parameters come from elsewhere.

    Args:
      config: the run's ``Config``.
      workdir: a new run directory (must not hold checkpoints yet).
      fill: ``fill(target_params, mesh) -> params``: the parameters, given the freshly initialised
        pure parameter dict (structure, shapes, shardings) and the run's mesh.
      tokenizer: the tokenizer object to record (default: the one ``config.data`` names).

    Returns:
      the step-0 checkpoint directory; ``nested-jax train --workdir`` resumes from it (optimizer
      state freshly initialised, data from its start).
    """
    from nested_jax.train.setup import prepare_run

    ckpt_dir = new_workdir_checkpoints(workdir)
    mesh, bundle, setup = prepare_run(config, tokenizer=tokenizer)
    params = fill(setup.state["params"], mesh)
    # The optimizer state of the loop's own freshly built optimizer (its moments and
    # accumulators start at zero whatever the parameter values), so the resume target matches.
    save_step_zero(config, workdir, bundle, {**setup.state, "params": params})
    return ckpt_dir / "0"


def new_workdir_checkpoints(workdir: str | Path) -> Path:
    """``workdir``'s checkpoint directory, once it is known to hold no checkpoint yet.

    Raises:
      ValueError: naming ``--workdir`` when it already has checkpoints.
    """
    ckpt_dir = Path(workdir) / CHECKPOINT_DIR
    if ckpt_dir.is_dir() and any(ckpt_dir.iterdir()):
        raise ValueError(f"--workdir: {workdir} already has checkpoints; use a new workdir")
    return ckpt_dir


def save_step_zero(
    config: Any,
    workdir: str | Path,
    bundle: Any,
    state: dict,
    *,
    save_concurrent_gb: int | None = None,
) -> None:
    """Saves `state` as checkpoint 0 of `workdir` with the data iterator at its start, then the
    run's ``config.json`` and data spec (process 0), as ``nested-jax train`` would write them.

    Args:
      config: the run's ``Config``; bundle: its prepared data (tokenizer, documents, corpus).
      state: the train state to save (``step``, ``params``, ...; without ``opt_state`` the first
        ``train`` builds a fresh one).
      save_concurrent_gb: bound on the bytes orbax writes at once (None: orbax's default).
    """
    from nested_jax.data import pipeline
    from nested_jax.data.identity import data_spec, tokenizer_payload
    from nested_jax.train.checkpoint import Checkpointer
    from nested_jax.train.config import config_to_dict, save_config
    from nested_jax.train.workdir import write_data_spec

    workdir = Path(workdir)
    iterator = pipeline.make_train_iterator(
        config.data,
        bundle.tokenizer,
        bundle.train_docs,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    spec = data_spec(config.data, bundle.tokenizer, bundle.corpus)
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(
        workdir,
        keep=config.train.keep_checkpoints,
        async_save=False,
        save_concurrent_gb=save_concurrent_gb,
    )
    try:
        tokenizer_file = tokenizer_payload(bundle.tokenizer)[1]
        ckpt.save(0, state, iterator, config_to_dict(config), spec, tokenizer_file)
        ckpt.wait()
    finally:
        ckpt.close()
    if jax.process_index() == 0:
        save_config(config, workdir)
        write_data_spec(workdir, spec, bundle.tokenizer)


def step_zero_parser(prog: str, description: str, source_help: str) -> argparse.ArgumentParser:
    """The command line of a command that writes step 0 of a new workdir from a source:
    ``--from SRC --config FILE... --set k=v... --workdir NEW`` (``args.source``, ``args.config``,
    ``args.overrides``, ``args.workdir``)."""
    from nested_jax.train.config import add_override_argument

    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--from", dest="source", required=True, help=source_help)
    p.add_argument("--config", action="append", default=[], metavar="FILE", help="run preset")
    add_override_argument(p, "override a field of the run config")
    p.add_argument("--workdir", required=True, help="new run directory")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m nested_jax.train.convert --from SRC --config X.yaml [--set k=v] --workdir NEW``.

    Exit codes: 0 done, 1 conversion error, 2 bad command line or config.
    """
    from nested_jax.train.config import ConfigError, load_config

    p = step_zero_parser(
        "python -m nested_jax.train.convert",
        "Initialise a CMS model (hope_attention) from a trained transformer run (SPEC §3.4): "
        "writes step 0 of a new workdir; then `nested-jax train --workdir NEW`.",
        "transformer workdir or step dir",
    )
    args = p.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    try:
        path = write_initial_checkpoint(config, args.workdir, args.source)
    except (FileNotFoundError, ValueError) as err:
        print(str(err).splitlines()[0], file=sys.stderr)
        return 1
    print(f"wrote {path}; continue with: nested-jax train --workdir {args.workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
