"""Device mesh, logical-axis rules and shardings for parameters and batches.

Model code names array dimensions logically (``nnx.with_partitioning(init, ("embed", "mlp"))``); ONE
table, :data:`LOGICAL_AXIS_RULES`, maps those names to mesh axes. The mesh has axes ``("data",
"fsdp")`` (Auto axis types, GSPMD-style): parameters are sharded along ``fsdp`` on their ``embed``
dimension and replicated across ``data``; batches are split along ``(data, fsdp)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp")

# logical name -> mesh axis (str), tuple of mesh axes, or None (replicated).
LOGICAL_AXIS_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": None,
    "mlp": None,
    "heads": None,
    "kv": None,
    "conv": None,
    "layers": None,
    "seq": None,
}


def resolve_mesh_shape(data: int, fsdp: int, n_devices: int) -> tuple[int, int]:
    """Resolves a -1 entry to the remaining devices and checks ``data × fsdp == n_devices``.

    Raises:
      ValueError: naming ``mesh.data`` / ``mesh.fsdp`` when the sizes do not fit the devices.
    """
    if data == -1 and fsdp == -1:
        raise ValueError("mesh.data: at most one of mesh.data / mesh.fsdp may be -1")
    if fsdp == -1:
        if n_devices % data:
            raise ValueError(f"mesh.data: {data} does not divide the {n_devices} available devices")
        fsdp = n_devices // data
    elif data == -1:
        if n_devices % fsdp:
            raise ValueError(f"mesh.fsdp: {fsdp} does not divide the {n_devices} available devices")
        data = n_devices // fsdp
    if data * fsdp != n_devices:
        raise ValueError(
            f"mesh.fsdp: mesh.data × mesh.fsdp = {data}×{fsdp} = {data * fsdp} but {n_devices} "
            "devices are available (use -1 for 'all remaining')"
        )
    return data, fsdp


def make_mesh(mesh_cfg: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the ("data", "fsdp") mesh from a :class:`MeshConfig` (``data``, ``fsdp``; -1 =
    remaining).

    Args:
      mesh_cfg: object with int attributes ``data`` and ``fsdp``.
      devices: devices to use (default: all of ``jax.devices()``).
    Returns:
      a ``jax.sharding.Mesh`` with Auto axis types.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(mesh_cfg.data, mesh_cfg.fsdp, len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


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
    """Sharding of a ``[batch, ...]`` array: batch split over (data, fsdp), the rest replicated."""
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
