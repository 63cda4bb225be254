"""Device mesh, logical-axis rules and shardings for parameters, activations and batches.

Model code names array dimensions logically (``nnx.with_partitioning(init, ("embed", "mlp"))`` for
parameters, :func:`constrain` for activations); ONE table, :data:`LOGICAL_AXIS_RULES`, maps those
names to mesh axes. The mesh has axes ``("data", "fsdp", "seq", "tensor")`` (Auto axis types,
GSPMD-style):

- ``data``: pure data parallelism (parameters replicated); with ``mesh.slices > 1`` it spans the
  slices of a multi-slice job, so only gradients cross the slower DCN links;
- ``fsdp``: batch split AND parameters / optimizer state sharded on their ``embed`` dimension;
- ``seq``: context parallelism, one sequence's tokens split over devices (activations on their
  ``seq`` dimension; the linear memories fold their states across it explicitly,
  :mod:`nested_jax.core.context`; size 1 unless a long-context preset asks for it);
- ``tensor``: model parallelism over heads, MLP width and vocabulary (Megatron-style; GSPMD inserts
  the collectives).

Activations are pinned to the batch axes at block boundaries and for the logits
(:func:`constrain`); without that, GSPMD may shard the residual stream over features (``embed`` and
``batch`` share ``fsdp``) and build partial-sum logits of the GLOBAL batch on every chip, so memory
per chip would grow with the number of chips.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "seq", "tensor")
BATCH_AXES = ("data", "fsdp")  # the mesh axes a batch is split over

# logical name -> mesh axis (str), tuple of mesh axes, or None (replicated).
if TYPE_CHECKING:  # flax only for the parameter helpers: the ops import this module without it
    from flax import nnx

LOGICAL_AXIS_RULES: dict[str, Any] = {
    "batch": BATCH_AXES,
    "embed": "fsdp",
    "vocab": "tensor",
    "mlp": "tensor",
    "heads": "tensor",
    "kv": "tensor",
    "conv": None,
    "layers": None,
    "seq": "seq",
}


def resolve_mesh_shape(
    data: int, fsdp: int, n_devices: int, tensor: int = 1, seq: int = 1
) -> tuple[int, int, int, int]:
    """Resolves the one -1 entry to the remaining devices; checks ``data × fsdp × seq × tensor``.

    Args:
      data, fsdp, seq, tensor: axis sizes (positive, or -1 = "all remaining" for at most one).
      n_devices: the devices of the mesh (of one slice when the job has several).
    Returns:
      ``(data, fsdp, seq, tensor)``.
    Raises:
      ValueError: naming ``mesh.<axis>`` when the sizes do not fit the devices.
    """
    sizes = {"data": data, "fsdp": fsdp, "seq": seq, "tensor": tensor}
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(
            f"mesh.{free[0]}: at most one of mesh.data / mesh.fsdp / mesh.seq / mesh.tensor may "
            "be -1"
        )
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if n_devices % fixed:
            first = next(n for n, s in sizes.items() if s > 1)
            raise ValueError(
                f"mesh.{first}: {fixed} does not divide the {n_devices} available devices"
            )
        sizes[free[0]] = n_devices // fixed
    elif fixed != n_devices:
        formula = " × ".join(f"mesh.{n}" for n in sizes)
        values = "×".join(str(s) for s in sizes.values())
        raise ValueError(
            f"mesh.fsdp: {formula} = {values} = {fixed} but {n_devices} devices are available "
            "(use -1 for 'all remaining')"
        )
    return sizes["data"], sizes["fsdp"], sizes["seq"], sizes["tensor"]


def _device_grid(shape: tuple[int, ...], devices: list, slices: int) -> np.ndarray:
    """Devices arranged as ``shape`` (data axis first, already multiplied by ``slices``).

    TPU devices go through ``mesh_utils`` so that neighbouring mesh coordinates are ICI
    neighbours (and, with several slices, the data axis is the one that crosses DCN).
    """
    from jax.experimental import mesh_utils

    # allow_split_physical_axes: a mesh axis may take part of a physical ring (data 4 × fsdp 64 on
    # a 16x16 slice, tensor 2 on a 4x4), which mesh_utils refuses otherwise.
    if slices > 1:
        ici = (shape[0] // slices,) + tuple(shape[1:])
        dcn = (slices,) + (1,) * (len(shape) - 1)
        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, allow_split_physical_axes=True
        )
    if devices and devices[0].platform == "tpu":
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return np.asarray(devices).reshape(shape)


def make_mesh(mesh_cfg: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the ("data", "fsdp", "seq", "tensor") mesh from a :class:`MeshConfig`.

    Args:
      mesh_cfg: object with int attributes ``data``, ``fsdp`` (-1 = remaining) and optionally
        ``seq``, ``tensor`` (default 1) and ``slices`` (default 1: the number of TPU slices
        joined over DCN; the sizes above are per slice and ``data`` is multiplied by ``slices``).
      devices: devices to use (default: all of ``jax.devices()``; a TPU topology's devices for an
        ahead-of-time compile).
    Returns:
      a ``jax.sharding.Mesh`` with Auto axis types.
    Raises:
      ValueError: naming the mesh field when the sizes do not fit the devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    slices = int(getattr(mesh_cfg, "slices", 1))
    if slices < 1 or len(devices) % slices:
        raise ValueError(f"mesh.slices: {slices} does not divide the {len(devices)} devices")
    data, fsdp, seq, tensor = resolve_mesh_shape(
        mesh_cfg.data,
        mesh_cfg.fsdp,
        len(devices) // slices,
        int(getattr(mesh_cfg, "tensor", 1)),
        int(getattr(mesh_cfg, "seq", 1)),
    )
    shape = (data * slices, fsdp, seq, tensor)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return Mesh(_device_grid(shape, devices, slices), MESH_AXES, axis_types=auto)


def batch_shards(mesh: Mesh) -> int:
    """How many pieces a batch is split into on `mesh` (the product of the batch axes)."""
    return math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pins activation `x` to the mesh axes its logical dimension names map to.

    With a mesh in context (``jax.set_mesh(mesh)``, or a function wrapped by :func:`traced_on`,
    as the train and eval steps built with a mesh are) this is a ``with_sharding_constraint``
    through :data:`LOGICAL_AXIS_RULES` (dimensions that do not divide the axes stay replicated);
    outside any mesh (a laptop, a unit test) it returns `x` unchanged.

    Args:
      x: any array; logical: one name (or None) per dimension of `x`, e.g. ``("batch", None,
        "vocab")`` for ``[B, T, V]`` logits.
    Raises:
      ValueError: when `logical` does not name every dimension of `x`.
    """
    if len(logical) != x.ndim:
        raise ValueError(f"logical: expected {x.ndim} names for shape {x.shape}, got {logical}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_mesh_spec(logical, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, spec)


def traced_on(mesh: Mesh | None, fn: Callable) -> Callable:
    """`fn` whose body runs with `mesh` as the context mesh (``jax.sharding.use_abstract_mesh``).

    Unlike ``jax.set_mesh`` around a call, this holds inside a trace, so the activation
    constraints (:func:`constrain`) and the ``shard_map`` of the Pallas ops apply however `fn` is
    jitted or lowered: under the caller's ``jax.set_mesh`` or not. None returns `fn` unchanged.
    """
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def on_mesh(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return on_mesh


def logical_to_mesh_spec(
    logical: Sequence[str | None] | None,
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    rules: Mapping[str, Any] = LOGICAL_AXIS_RULES,
) -> PartitionSpec:
    """Maps a tuple of logical axis names to a mesh ``PartitionSpec`` through `rules`.

    A dimension is replicated when its name is None/unknown, when its mesh axes are already used by
    an earlier dimension, or (given `shape` and `mesh`) when its size is not divisible by the mesh
    axes' total size — so odd sizes (a vocab of 257, a tiny test model) stay correct instead of
    failing to shard.
    """
    if not logical:
        return PartitionSpec()
    used: set[str] = set()
    out = []
    for i, name in enumerate(logical):
        target = rules.get(name) if name is not None else None
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        if mesh is not None:
            axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
        if any(a in used for a in axes):
            axes = ()
        if axes and shape is not None and mesh is not None:
            size = int(np.prod([mesh.shape[a] for a in axes]))
            if shape[i] % size:
                axes = ()
        used.update(axes)
        out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def _variable_logical_axes(var: nnx.Variable) -> tuple | None:
    meta = var.get_metadata()
    for key in ("out_sharding", "sharding", "sharding_names"):
        names = meta.get(key)
        if names is not None:
            return tuple(names)
    return None


def state_shardings(
    state: nnx.State, mesh: Mesh, rules: Mapping[str, Any] = LOGICAL_AXIS_RULES
) -> nnx.State:
    """NamedShardings for every array of an nnx ``State`` from its variables' logical-axis metadata.

    Args:
      state: an ``nnx.State`` (concrete or abstract, e.g. from ``nnx.eval_shape``) whose Variables
        carry ``nnx.with_partitioning`` names (or none: replicated).
      mesh: the device mesh.
    Returns:
      a State of the same structure with ``NamedSharding`` leaves.
    """

    from flax import nnx  # here, not at the top: the ops import this module without flax

    def one(var):
        if not isinstance(var, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        value = var.get_value() if hasattr(var, "get_value") else var.value
        spec = logical_to_mesh_spec(_variable_logical_axes(var), np.shape(value), mesh, rules)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _dict_keys(path) -> tuple:
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def shardings_like_params(tree: Any, params: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for a tree derived from the parameters (optimizer moments, EMA copies, ...).

    A leaf whose key path ends with a parameter's dict path and has that parameter's shape gets
    the parameter's sharding; anything else (counts, scalars, reshaped buffers) is replicated.
    Works for any optimizer state layout (masked / partitioned transforms included) because it
    matches by path and shape, not by tree structure.

    Args:
      tree: pytree of arrays or ``ShapeDtypeStruct`` (e.g. ``jax.eval_shape(tx.init, params)``).
      params: the parameter pytree (nested dicts) the tree was derived from.
      param_shardings: shardings with the structure of `params`.
    Returns:
      a pytree of ``NamedSharding`` with the structure of `tree`.
    """
    by_path = {}
    for (path, p), sh in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(param_shardings), strict=True
    ):
        by_path[_dict_keys(path)] = (tuple(np.shape(p)), sh)
    repl = NamedSharding(mesh, PartitionSpec())

    def one(path, leaf):
        keys = _dict_keys(path)
        for start in range(len(keys)):
            hit = by_path.get(keys[start:])
            if hit is not None and hit[0] == tuple(np.shape(leaf)):
                return hit[1]
        return repl

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a ``[batch, ...]`` array: batch split over (data, fsdp), the rest replicated
    (so the ``tensor`` axis holds identical copies of the batch)."""
    spec = logical_to_mesh_spec(("batch",) + (None,) * (ndim - 1), None, mesh)
    return NamedSharding(mesh, spec)


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def global_batch_from_local(local: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Assembles global ``[global_batch, ...]`` arrays from this process's rows of the batch.

    Each process passes its own ``[global_batch / process_count, ...]`` numpy rows (as the data
    pipeline yields them); ``jax.make_array_from_process_local_data`` stitches them into arrays
    sharded by :func:`batch_sharding`. With one process the local batch is the global batch.
    """
    out = {}
    for k, v in local.items():
        v = np.asarray(v)
        global_shape = (v.shape[0] * jax.process_count(),) + v.shape[1:]
        out[k] = jax.make_array_from_process_local_data(
            batch_sharding(mesh, v.ndim), v, global_shape
        )
    return out
