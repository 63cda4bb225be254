"""Sequence plumbing shared by the chunked forms: chunking, affine scans, scans with remat.

- ``pad_to_multiple`` / ``chunk`` / ``unchunk``: split a time axis into ``[N, C]`` chunks (zero
  padding at the end) and back.
- ``to_head_chunks`` / ``from_head_chunks``: the layout every chunked memory rule scans over,
  ``[B, T, H, ...] → [N, B, H, C, ...]`` (chunk axis first so ``lax.scan`` walks it) and back.
- ``segment_starts``: the packed-row boundaries (SPEC §0), ``True`` where token ``t > 0`` opens a
  new document; every segment-reset mechanism derives its masks from it.
- ``affine_scan``: all ``x_t = a_t · x_{t−1} + b_t`` in parallel (``lax.associative_scan`` over
  affine maps, composed as ``(a₂, b₂) ∘ (a₁, b₁) = (a₂ a₁, a₂ b₁ + b₂)``); used by Titans
  momentum/decay (SPEC §2).
- ``scan_remat``: ``lax.scan`` whose backward stores only every n-th carry (nested scan with
  ``jax.checkpoint`` on the inner n steps), for long chunk recurrences.
- ``zeros_typed`` / ``state_zeros`` / ``cast_like``: scan carries and constants *typed like the
  inputs*, so the rules run inside a user's ``jax.shard_map`` (``check_vma=True``) and on meshes
  with Explicit axes (``tests/core/test_library_face.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.checks import check_positive_int

__all__ = [
    "pad_to_multiple",
    "chunk",
    "unchunk",
    "to_head_chunks",
    "from_head_chunks",
    "segment_starts",
    "affine_scan",
    "scan_remat",
    "zeros_typed",
    "state_zeros",
    "cast_like",
]


def _axis(x, axis: int, name: str = "axis") -> int:
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{name}={axis} is out of range for an array of rank {x.ndim}")
    return axis % x.ndim


def pad_to_multiple(x, multiple: int, axis: int = 1, value=0):
    """Pads ``x`` at the end of ``axis`` so its length is a multiple of ``multiple``.

    Args:
      x: any array; ``axis`` is the time axis.
      multiple: positive int.
      value: the padding value.

    Returns:
      the padded array (``x`` itself when nothing is needed).
    """
    check_positive_int("multiple", multiple)
    axis = _axis(x, axis)
    n = x.shape[axis]
    extra = -n % multiple
    if extra == 0:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, extra)
    return jnp.pad(x, pads, constant_values=value)


def chunk(x, chunk_size: int, axis: int = 1):
    """Splits ``axis`` into ``[N, C]`` after zero padding: ``[B, T, ...] → [B, N, C, ...]``.

    Args:
      x: array with the time axis at ``axis``.
      chunk_size: C > 0; T need not be a multiple of C.

    Returns:
      array with ``axis`` replaced by ``(ceil(T / C), C)``.
    """
    check_positive_int("chunk_size", chunk_size)
    axis = _axis(x, axis)
    x = pad_to_multiple(x, chunk_size, axis)
    n = x.shape[axis] // chunk_size
    return x.reshape(x.shape[:axis] + (n, chunk_size) + x.shape[axis + 1 :])


def unchunk(x, length: int | None = None, axis: int = 1):
    """Inverse of ``chunk``: merges ``axis`` and ``axis + 1`` and trims to ``length``.

    Args:
      x: array ``[..., N, C, ...]`` with N at ``axis``.
      length: original T (default: ``N · C``, nothing trimmed).

    Returns:
      array with ``(N, C)`` replaced by ``length``.
    """
    axis = _axis(x, axis)
    if axis + 1 >= x.ndim:
        raise ValueError(f"unchunk: axis={axis} needs a chunk axis after it, got rank {x.ndim}")
    n, c = x.shape[axis], x.shape[axis + 1]
    x = x.reshape(x.shape[:axis] + (n * c,) + x.shape[axis + 2 :])
    if length is not None:
        if not 0 <= length <= n * c:
            raise ValueError(f"unchunk: length must be in [0, {n * c}], got {length}")
        x = lax.slice_in_dim(x, 0, length, axis=axis)
    return x


def to_head_chunks(x, chunk_size: int):
    """``[B, T, H, ...] → [N, B, H, C, ...]``, zero padded at the end of time (``N = ⌈T / C⌉``).

    The layout the chunked rules scan over: chunks lead (``lax.scan`` walks axis 0), then batch and
    heads (independent), then the ``C`` positions of one chunk. Zero padding is a no-op write for
    every rule whose write strength (β, θ, gate) is zero there; callers pad those inputs too.

    Args:
      x: array ``[B, T, H, ...]`` (rank ≥ 3).
      chunk_size: C > 0; T need not be a multiple of C.

    Returns:
      array ``[N, B, H, C, ...]``.
    """
    check_positive_int("chunk_size", chunk_size)
    if x.ndim < 3:
        raise ValueError(f"to_head_chunks: x must have shape [B, T, H, ...], got {x.shape}")
    x = chunk(x, chunk_size, axis=1)  # [B, N, C, H, ...]
    return jnp.swapaxes(jnp.moveaxis(x, 1, 0), 2, 3)


def from_head_chunks(x, length: int | None = None):
    """Inverse of ``to_head_chunks``: ``[N, B, H, C, ...] → [B, T, H, ...]`` trimmed to ``length``.

    Args:
      x: array ``[N, B, H, C, ...]`` (rank ≥ 4).
      length: original T (default ``N · C``).

    Returns:
      array ``[B, length, H, ...]``.
    """
    if x.ndim < 4:
        raise ValueError(f"from_head_chunks: x must have shape [N, B, H, C, ...], got {x.shape}")
    x = jnp.moveaxis(jnp.swapaxes(x, 2, 3), 0, 1)  # [B, N, C, H, ...]
    return unchunk(x, length, axis=1)


def segment_starts(segment_ids):
    """Where a packed row opens a new document (SPEC §0): bool ``[B, T]``.

    ``out[b, t]`` is ``True`` iff ``t > 0`` and ``segment_ids[b, t] != segment_ids[b, t − 1]``;
    position 0 is never a start (the state there is the initial one anyway).

    Args:
      segment_ids: int ``[B, T]``.

    Returns:
      bool ``[B, T]``.
    """
    if segment_ids.ndim != 2:
        raise ValueError(
            f"segment_starts: segment_ids must have shape [B, T], got {segment_ids.shape}"
        )
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.pad(change, ((0, 0), (1, 0)))


def affine_scan(a, b, axis: int = 0, reverse: bool = False, initial=None):
    """All states of ``x_t = a_t · x_{t−1} + b_t`` by an associative scan (log depth).

    ``a`` broadcasts over ``b``'s trailing dimensions: ``a.shape == b.shape[:a.ndim]`` (e.g. a
    per-token scalar gate ``[T, B]`` against a state ``[T, B, K, V]``). With ``reverse=True`` the
    recurrence runs from the end: ``x_t = a_t · x_{t+1} + b_t``.

    Args:
      a: ``[..., T, ...]`` coefficients (prefix of b's shape).
      b: ``[..., T, ..., *trailing]`` offsets.
      axis: the time axis (must be < ``a.ndim``).
      reverse: scan from the last element.
      initial: optional ``x`` before the first step (shape of one b slice along ``axis``);
        zero when None.

    Returns:
      ``x`` with b's shape (and dtype promoted with a's): every ``x_t``.
    """
    a = jnp.asarray(a)
    b = jnp.asarray(b)
    if a.shape != b.shape[: a.ndim]:
        raise ValueError(
            f"affine_scan: a must have shape b.shape[:a.ndim] = {b.shape[: a.ndim]}, got {a.shape}"
        )
    axis = _axis(a, axis)
    a = a.reshape(a.shape + (1,) * (b.ndim - a.ndim))

    def combine(earlier, later):
        a1, b1 = earlier
        a2, b2 = later
        return a2 * a1, a2 * b1 + b2

    A, X = lax.associative_scan(combine, (a, b), reverse=reverse, axis=axis)
    if initial is not None:
        initial = jnp.asarray(initial)
        expected = b.shape[:axis] + b.shape[axis + 1 :]
        if initial.shape != expected:
            raise ValueError(
                f"affine_scan: initial must have shape {expected}, got {initial.shape}"
            )
        X = X + A * jnp.expand_dims(initial, axis)
    return X


def scan_remat(f, init, xs, remat_every, length: int | None = None):
    """``lax.scan(f, init, xs)`` whose backward keeps only every ``remat_every``-th carry.

    The steps are grouped in blocks of ``remat_every``; an outer scan walks the blocks and each
    block is an inner ``lax.scan`` under ``jax.checkpoint``, so autodiff stores the block-start
    carries and recomputes the inside of one block at a time (memory ∝ T / n + n carries instead of
    T). A trailing partial block is scanned the same way. Values equal ``lax.scan`` exactly.

    Nested: ``remat_every = (n_1, n_2, …)`` (decreasing) makes each block of ``n_1`` steps itself
    a ``scan_remat`` with ``(n_2, …)``, so the backward holds ``T/n_1 + n_1/n_2 + … + n_last``
    carries at a time for one more recomputed forward per extra level (``remat_levels``).

    Args:
      f: ``(carry, x) -> (carry, y)``.
      init: initial carry (pytree).
      xs: pytree of arrays with leading axis T (or None with ``length``).
      remat_every: n > 0, steps per checkpointed block, or a decreasing tuple of them (nested).
      length: T when ``xs`` is None.

    Returns:
      ``(final_carry, ys)`` with ys stacked over T, as ``lax.scan``.
    """
    sizes = tuple(remat_every) if isinstance(remat_every, (tuple, list)) else (remat_every,)
    if not sizes:
        raise ValueError("remat_every: expected a positive int or a non-empty tuple of them")
    for n_i in sizes:
        check_positive_int("remat_every", n_i)
    if any(a <= b for a, b in zip(sizes[:-1], sizes[1:], strict=True)):
        raise ValueError(f"remat_every: nested block sizes must decrease, got {sizes}")
    leaves = jax.tree_util.tree_leaves(xs)
    if leaves:
        T = leaves[0].shape[0]
    elif length is not None:
        T = length
    else:
        raise ValueError("scan_remat: xs has no arrays, pass length")
    n, inner = sizes[0], sizes[1:]
    nb, rem = divmod(T, n)

    def run_block(carry, xs_block, m):
        # checkpoint: autodiff saves only the block's input carry and recomputes its m steps
        # (with `inner` sizes left, those m steps are a nested scan_remat: fewer carries at once)
        inner_fit = tuple(k for k in inner if k < m)
        if inner_fit:
            scan_block = lambda c, x: scan_remat(f, c, x, inner_fit, length=m)  # noqa: E731
        else:
            scan_block = lambda c, x: lax.scan(f, c, x, length=m)  # noqa: E731
        return jax.checkpoint(scan_block)(carry, xs_block)

    def part(start, stop, shape=None):
        def one(x):
            x = x[start:stop]
            return x if shape is None else x.reshape(shape + x.shape[1:])

        return jax.tree_util.tree_map(one, xs)

    carry, ys_parts = init, []
    if nb:
        main = part(0, nb * n, (nb, n))
        carry, ys_main = lax.scan(lambda c, xb: run_block(c, xb, n), carry, main, length=nb)
        ys_parts.append(
            jax.tree_util.tree_map(lambda y: y.reshape((nb * n,) + y.shape[2:]), ys_main)
        )
    if rem:
        carry, ys_tail = run_block(carry, part(nb * n, T), rem)
        ys_parts.append(ys_tail)
    if len(ys_parts) == 1:
        return carry, ys_parts[0]
    ys = jax.tree_util.tree_map(lambda *p: jnp.concatenate(p, axis=0), *ys_parts)
    return carry, ys


def zeros_typed(ref, shape=None, dtype=None):
    """Zeros of ``shape`` that carry ``ref``'s type, for scan carries and constants.

    Inside ``jax.shard_map`` (``check_vma=True``) an array has a set of *varying* manual axes, and
    on a mesh with Explicit axes it has a sharding in its type; ``jnp.zeros``/``jnp.eye`` have
    neither. ``lax.scan`` then rejects a zero initial carry whose update varies like the inputs
    ("carry input and carry output must have equal types"), and a batched matmul rejects operands
    sharded differently. ``jnp.zeros_like`` keeps both (and reads no value of ``ref``, so it costs
    nothing once compiled); ``broadcast_to`` keeps them on ``ref``'s dimensions. Outside a mesh
    this is ``jnp.zeros(shape, dtype)``.

    Args:
      ref: an array (usually a slice of an input) whose shape broadcasts to ``shape``.
      shape: output shape (default ``ref.shape``).
      dtype: output dtype (default ``ref.dtype``).

    Returns:
      zeros ``shape`` typed like ``ref``.
    """
    z = jnp.zeros_like(ref, dtype=dtype)
    return z if shape is None else jnp.broadcast_to(z, shape)


def state_zeros(k, v, dtype=jnp.float32):
    """A zero matrix state ``[B, H, K, V]`` typed like the keys and values it will store.

    ``zeros_typed`` of the first token's outer product ``k_0 v_0ᵀ``: the state varies over (is
    sharded like) the batch and head axes of ``k`` and ``v``, as every state update does.

    Args:
      k: ``[B, T, H, K]`` keys; v: ``[B, T, H, V]`` values.
      dtype: state dtype.

    Returns:
      zeros ``[B, H, K, V]``.
    """
    k0, v0 = k[:, :1].sum(1), v[:, :1].sum(1)  # the first token (zeros when T = 0)
    return zeros_typed(k0[..., :, None] * v0[..., None, :], dtype=dtype)


def cast_like(a, ref):
    """``a`` with its values unchanged, typed like ``ref`` on its leading dimensions.

    For a carry built from shared or constant values (weights broadcast to the batch, an empty
    cache) that the scan then updates row by row from the inputs: see ``zeros_typed``. ``a`` minus
    zeros typed like ``ref`` (``x - (+0)`` is ``x`` exactly, the sign of a zero included; ``or``
    with ``False`` for booleans), an elementwise op whose result takes ``ref``'s sharding on an
    Explicit mesh (a ``where`` would need its cases typed alike already).

    Args:
      a: any array; ref: an array whose shape is a prefix of ``a``'s (e.g. ``[B]`` or ``[B, H]``).

    Returns:
      ``a``, varying over (sharded like) ``ref``'s axes as well.
    """
    ref = ref.reshape(ref.shape + (1,) * (a.ndim - ref.ndim))
    zeros = zeros_typed(ref, a.shape, a.dtype)
    return a | zeros if a.dtype == jnp.bool_ else a - zeros
