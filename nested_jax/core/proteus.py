"""Proteus: incremental memory activation — block schedules and gated read/write (SPEC §4).

Memory coordinates are split into ``E`` contiguous blocks (matrix memory ``S [.., K, V]``: blocks
of key rows; MLP memory: blocks of hidden units, i.e. rows of ``W_2`` and columns of ``W_1`` for
``M(z) = z + W_1 σ(W_2 z)``). With training context ``N`` and 1-based position ``t``::

    Δ = max(1, ⌊N/E⌋),   k(t) = min(E, 1 + ⌊(t−1)/Δ⌋),   g_t = 1 on the first k(t) blocks
    M^{(g)}_{t-1} = g_t ⊙ M_{t-1};   y_t = Read(M^{(g)}_{t-1}, q_t)
    M_t = g_t ⊙ Write(M^{(g)}_{t-1}) + (1 − g_t) ⊙ M_{t-1}
    invariant: (1 − g_t) ⊙ M_t = (1 − g_t) ⊙ M_{t-1}     (write, decay and momentum alike)

Beyond ``N`` the schedule stays fully open (``k = E``; ``Δ`` is never stretched). ``E = 1`` is the
plain backbone (every mask is all ones). :class:`ProteusRule` holds ``(E, N)`` as one frozen value
(built from the ``model.proteus`` config section; ops take it as ``rule``).

**Block split** (when ``E`` does not divide the size ``D`` of the blocked axis): every block has
``⌊D/E⌋`` coordinates and the *last* block absorbs the remainder (the paper's reading,
``d = dim/E`` with the remainder in the last block). ``D ≥ E`` is required so no block is empty.

The write is merged with ``jnp.where`` on the mask, so locked coordinates keep their exact bits (no
``0·x`` arithmetic: a locked ``inf``/``nan`` stays itself and active values are not rounded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nested_jax.core.checks import check_positive_int

__all__ = [
    "proteus_block_len",
    "proteus_active_blocks",
    "proteus_chunk_constant",
    "proteus_block_ids",
    "proteus_block_mask",
    "proteus_key_mask",
    "proteus_hidden_mask",
    "proteus_mlp_masks",
    "proteus_gate",
    "proteus_gated_update",
    "proteus_gated_step",
]


def proteus_block_len(context_len: int, num_blocks: int) -> int:
    """``Δ = max(1, ⌊N/E⌋)``: positions per newly opened block (SPEC §4).

    Args:
      context_len: training context ``N`` (positive int).
      num_blocks: ``E`` (positive int).

    Returns:
      ``Δ`` as a Python int.
    """
    n = check_positive_int("context_len", context_len)
    e = check_positive_int("num_blocks", num_blocks)
    return max(1, n // e)


def proteus_active_blocks(t, context_len: int, num_blocks: int):
    """Number of open blocks ``k(t) = min(E, 1 + ⌊(t−1)/Δ⌋)`` (SPEC §0.1, §4).

    Example: ``N = 8192, E = 16`` gives ``Δ = 512``; ``t = 1…512 → 1``, ``513 → 2``, ``4096 → 8``,
    ``7680 → 15``, ``7681 → 16`` and every ``t > N`` stays at 16 (fully open).

    Args:
      t: 1-based position, a Python int (``t ≥ 1``) or an integer array of any shape (positions
        ``≤ 0`` are not validated inside ``jit`` and give ``k ≤ 0``, i.e. nothing open).
      context_len: ``N``.
      num_blocks: ``E``.

    Returns:
      ``k(t)``: a Python int for a Python int ``t``, otherwise an int32 array shaped like ``t``.
    """
    delta = proteus_block_len(context_len, num_blocks)
    if isinstance(t, (int, np.integer)) and not isinstance(t, bool):
        if t < 1:
            raise ValueError(f"t is 1-based and must be >= 1, got {t}")
        return min(num_blocks, 1 + (int(t) - 1) // delta)
    t = jnp.asarray(t)
    if not jnp.issubdtype(t.dtype, jnp.integer):
        raise ValueError(f"t must be an integer position (1-based), got dtype {t.dtype}")
    return jnp.minimum(num_blocks, 1 + (t.astype(jnp.int32) - 1) // delta)


def proteus_chunk_constant(chunk_size: int, context_len: int, num_blocks: int) -> bool:
    """Whether ``k(t)`` is constant inside every chunk of ``chunk_size`` positions (static check).

    Chunks cover positions ``nC+1 … nC+C``; ``k`` steps up at ``t = jΔ + 1`` for ``j = 1 … E−1``, so
    the mask is chunk-constant iff every ``jΔ`` is a multiple of ``C`` (e.g. when ``C`` divides
    ``Δ``, or ``E = 1``). Chunked forms can then use one mask per chunk; otherwise they must split
    the chunk or mask per position.

    Args:
      chunk_size: ``C``.
      context_len: ``N``.
      num_blocks: ``E``.

    Returns:
      Python bool.
    """
    c = check_positive_int("chunk_size", chunk_size)
    delta = proteus_block_len(context_len, num_blocks)
    return all((j * delta) % c == 0 for j in range(1, num_blocks))


def proteus_block_ids(size: int, num_blocks: int) -> np.ndarray:
    """Block index of every coordinate of a blocked axis of length ``size`` (static, numpy).

    Blocks are contiguous with ``⌊size/E⌋`` coordinates each; the last block absorbs the remainder.

    Args:
      size: length ``D`` of the blocked axis (``D ≥ E``).
      num_blocks: ``E``.

    Returns:
      int32 numpy array ``[D]`` with values in ``[0, E)``, non-decreasing.
    """
    d = check_positive_int("size", size)
    e = check_positive_int("num_blocks", num_blocks)
    if d < e:
        raise ValueError(f"size ({d}) must be >= num_blocks ({e}) so that no block is empty")
    per = d // e
    return np.minimum(np.arange(d) // per, e - 1).astype(np.int32)


def proteus_block_mask(active, size: int, num_blocks: int, dtype=jnp.float32):
    """Mask of the first ``active`` blocks over an axis of length ``size``.

    Args:
      active: number of open blocks ``k``, int or integer array ``[...]``.
      size: length ``D`` of the blocked axis.
      num_blocks: ``E``.
      dtype: mask dtype (``bool`` or a float dtype; 1 = open).

    Returns:
      ``[..., D]`` mask, 1 on coordinates of blocks ``< k``.
    """
    ids = jnp.asarray(proteus_block_ids(size, num_blocks))
    active = jnp.asarray(active)
    return (ids < active[..., None]).astype(dtype)


def proteus_key_mask(t, context_len: int, num_blocks: int, key_dim: int, dtype=jnp.float32):
    """Key-row mask ``g_t`` of a matrix memory ``S [.., K, V]`` at position ``t`` (SPEC §4).

    Apply it to a state as ``mask[..., :, None]`` (rows of ``S`` are keys; the read ``o = Sᵀ q``
    then only sees open rows).

    Args:
      t: 1-based position(s), int or integer array ``[...]``.
      context_len: training context ``N``.
      num_blocks: ``E``.
      key_dim: ``K`` (``≥ E``).
      dtype: mask dtype.

    Returns:
      ``[..., K]`` mask.
    """
    return proteus_block_mask(
        proteus_active_blocks(t, context_len, num_blocks), key_dim, num_blocks, dtype
    )


def proteus_hidden_mask(t, context_len: int, num_blocks: int, hidden_dim: int, dtype=jnp.float32):
    """Hidden-unit mask of an MLP memory at position ``t`` (SPEC §4); same split as the key mask.

    Args:
      t: 1-based position(s), int or integer array ``[...]``.
      context_len: ``N``.
      num_blocks: ``E``.
      hidden_dim: number of hidden units ``h`` (``≥ E``).
      dtype: mask dtype.

    Returns:
      ``[..., h]`` mask (also the mask of a hidden bias ``b_2 [.., h]``).
    """
    return proteus_block_mask(
        proteus_active_blocks(t, context_len, num_blocks), hidden_dim, num_blocks, dtype
    )


def proteus_mlp_masks(t, context_len: int, num_blocks: int, hidden_dim: int, dtype=jnp.float32):
    """Masks for the two weights of ``M(z) = z + W_1 σ(W_2 z)`` (SPEC §3.2, §4).

    ``W_1 [.., d_out, h]`` is blocked on its columns, ``W_2 [.., h, d_in]`` on its rows.

    Args:
      t: 1-based position(s), int or integer array ``[...]``.
      context_len: ``N``.
      num_blocks: ``E``.
      hidden_dim: ``h``.
      dtype: mask dtype.

    Returns:
      ``(mask_w1 [..., 1, h], mask_w2 [..., h, 1])``, broadcastable against ``W_1`` and ``W_2``.
    """
    m = proteus_hidden_mask(t, context_len, num_blocks, hidden_dim, dtype)
    return m[..., None, :], m[..., :, None]


def proteus_gate(state, mask):
    """Gated read state ``M^{(g)} = g ⊙ M`` (SPEC §4): locked coordinates read as zero.

    Args:
      state: an array or pytree of arrays (e.g. ``S [B, H, K, V]``).
      mask: one mask broadcastable to every leaf (e.g. ``key_mask[..., :, None]``), or a pytree of
        masks with the structure of ``state`` (e.g. the two :func:`proteus_mlp_masks`); ``None``
        = all open (returns ``state``).

    Returns:
      pytree like ``state``; a locked coordinate is ``0`` (``jnp.where``, not a product, so a locked
      ``inf`` does not become ``nan``).
    """
    if mask is None:
        return state
    masks = _mask_tree(state, mask)
    return jax.tree.map(lambda x, m: jnp.where(m != 0, x, jnp.zeros((), x.dtype)), state, masks)


def proteus_gated_update(prev, candidate, mask):
    """Merge a candidate write so that locked coordinates keep their previous bits (SPEC §4).

    ``M_t = where(g_t, M_cand, M_{t-1})``, hence ``(1 − g_t) ⊙ M_t = (1 − g_t) ⊙ M_{t-1}``
    exactly. Apply it to every stored state (memory, momentum, …) after computing the candidate from
    the gated state, so that the write, the decay and the momentum all stay off locked coordinates.

    Args:
      prev: previous state, an array or pytree (e.g. ``(M, S)`` of Titans, each ``[B, H, K, V]``).
      candidate: the ungated next state, same structure, shapes and dtypes.
      mask: one mask broadcastable to every leaf, or a pytree of masks like ``prev``; ``None`` = all
        open (returns ``candidate``).

    Returns:
      the merged state, structured like ``prev``.
    """
    if jax.tree.structure(prev) != jax.tree.structure(candidate):
        raise ValueError(
            "candidate must have the structure of prev: "
            f"{jax.tree.structure(candidate)} vs {jax.tree.structure(prev)}"
        )
    if mask is None:
        return candidate
    masks = _mask_tree(prev, mask)

    def merge(p, c, m):
        if p.shape != c.shape:
            raise ValueError(f"candidate leaf has shape {c.shape}, expected prev's {p.shape}")
        return jnp.where(m != 0, c, p)

    return jax.tree.map(merge, prev, candidate, masks)


def proteus_gated_step(step_fn: Callable[..., tuple[Any, Any]], state, mask, *args, **kwargs):
    """One gated token step: read and write on ``g ⊙ M``, then merge (SPEC §4).

    ``(y, cand) = step_fn(proteus_gate(state, mask), *args, **kwargs)`` followed by
    ``proteus_gated_update(state, cand, mask)``. Any ``*_step(state, ...) -> (out, new_state)``
    (SPEC §0) can be wrapped. The output is whatever ``step_fn`` reads from the gated state: for a
    rule that reads *after* its write (GDN: ``o_t = S_tᵀ q_t``), also gate the query
    (``key_mask ⊙ q_t`` equals reading ``g ⊙ S_t`` for key-row masks).

    ``E = 1``: an all-ones mask gives the backbone's values, but ``where`` changes XLA's fusion, so
    results can differ in the last ulp; pass ``mask=None`` (static) when ``num_blocks == 1`` to run
    ``step_fn`` untouched, which makes ``E = 1`` equal to the backbone bit for bit.

    Args:
      step_fn: ``(state, *args, **kwargs) -> (output, new_state)``.
      state: current state (array or pytree).
      mask: as in :func:`proteus_gated_update`, or ``None`` for no gating (E = 1).
      *args: forwarded to ``step_fn``.
      **kwargs: forwarded to ``step_fn``.

    Returns:
      ``(output, new_state)`` with locked coordinates of ``new_state`` equal to ``state``'s.
    """
    out, cand = step_fn(proteus_gate(state, mask), *args, **kwargs)
    return out, proteus_gated_update(state, cand, mask)


def _mask_tree(tree, mask):
    if isinstance(mask, (jax.Array, np.ndarray, bool, int, float)):
        return jax.tree.map(lambda _: mask, tree)
    treedef = jax.tree.structure(tree)
    try:
        leaves = treedef.flatten_up_to(mask)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"mask must be one array or a pytree with the structure of the state ({treedef})"
        ) from e
    return jax.tree.unflatten(treedef, leaves)
