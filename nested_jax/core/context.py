"""Context (sequence) parallelism for the linear memories: one sequence split over devices.

Call these inside ``jax.shard_map`` with the time axis of ``q, k, v, gates`` split over the mesh
axis ``axis_name`` (device ``i`` holds tokens ``[i·T_loc, (i+1)·T_loc)`` of every sequence); each
returns this device's outputs and the state after the whole sequence, equal (values and gradients)
to the single-device chunked rule on the whole sequence. SPEC §1 (GDN, delta rule, linear
attention), SPEC §2 with ``L_M = 1`` (Titans matrix memory with momentum).

Why it is exact. For these rules each value column of the state evolves on its own and linearly
in (that column, that column of ``v``): with ``x = [M; S]`` the state rows stacked (``n = K`` for
the one-matrix rules, ``n = 2K`` for Titans' memory and momentum), a stretch of tokens maps its
incoming state ``x ∈ R^{n×V}`` to::

    x_out = L x + b,          o_t = o⁰_t + xᵀ ℓ_t                       (per batch row and head)

with ``L ∈ R^{n×n}``, ``b = x_out(x = 0)``, ``o⁰_t`` the outputs from a zero state and
``ℓ_t ∈ R^n`` the read of the identity. All four come from ONE run of the existing chunked rule on
this device's stretch with ``n`` extra value columns: initial state ``[I_n | 0]``, values
``[0 | v]``; its final state is ``[L | b]`` and its outputs ``[ℓ | o⁰]``. The devices then
exchange ``(L_p, b_p)`` (an ``all_gather`` over ``axis_name``: ``P·n·(n+V)`` numbers per batch
row and head), every device folds the maps of the devices before it into its incoming state
``x_i = L_{i-1}(… (L_0 x_0 + b_0) …) + b_{i-1}`` and finishes its outputs with one product. The
gradients come from autodiff through the same program (the ``all_gather`` transposes to a
reduce-scatter), so they are the single-device gradients up to float rounding.

Cost per device: one chunked pass over ``T/P`` tokens at value width ``n + V`` (for ``K = V`` about
2× the work of a ``V``-wide pass for GDN, 3× for Titans), so compute per device falls as ``1/P``
up to that factor and activation memory per device as ``1/P`` up to the same factor. Limits:

- not for the MLP memories (Titans ``L_M ≥ 2``, Hope, the CMS): their state maps are not affine
  (the surprise goes through the nonlinearity), so no exact fold exists; those run with the whole
  sequence on one device (split batch and heads instead);
- no ``grad_clip`` for Titans: the softclamp couples the value columns through ``‖Mᵀk − v‖``;
  no ``grad_horizon`` either (a device cannot cut the gradient of a state it only folds in);
- packed documents (``segment_ids``, GDN only): a document start on a device cuts that device
  off from the incoming state, so the identity run counts only until this device's first start
  (the module's ``carried`` mask: ``ℓ_t`` zeroed from it on, ``L`` zeroed if it exists) and the
  value run restarts from zero, which is exact when the state entering the sequence is zero
  (``initial_state=None``, how the LM shell trains). Titans restarts its chunk grid at every
  document start, which a device cannot know for a document that began on an earlier device, so
  Titans takes no ``segment_ids``;
- Titans: ``T_loc`` must be a multiple of ``rule.memory_chunk``, so that the devices' chunks are
  the single-device chunks (GDN's chunk form is exact for any chunking, so it takes any
  ``T_loc``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp
from jax import lax

from nested_jax.core.associative.forms import gated_delta_chunked, validate_seq
from nested_jax.core.scan import segment_starts, zeros_typed
from nested_jax.core.titans.linear import TitansLinearState, state_of, titans_linear_chunked
from nested_jax.core.titans.net import check_rule, validate_common
from nested_jax.rules import TitansRule

__all__ = [
    "FOLDS",
    "affine_state_context",
    "carried_mask",
    "gated_delta_context_parallel",
    "titans_linear_context_parallel",
]


def _identity_rows(num_states: int, values, K: int):
    """The augmented initial states ``[E_j | 0]`` (``E_j`` the rows ``j·K … (j+1)·K`` of
    ``I_n``, ``n = num_states·K``), each ``[B, H, K, n + V]`` f32, typed like the augmented
    ``values [B, T, H, n + V]`` (so they are scan carries of the rule under ``shard_map``)."""
    B, _, H, width = values.shape
    n = num_states * K
    eye = jnp.eye(n, width, dtype=jnp.float32).reshape(num_states, K, width)
    typed = zeros_typed(values[:, 0, :, None, :1], (B, H, K, width))
    return tuple(typed + eye[j] for j in range(num_states))


def carried_mask(segment_ids, axis_name: str):
    """``[B, T_loc]`` f32: 1 until this device's first document start, 0 from it on.

    A start is a token whose segment id differs from the token before it in the WHOLE sequence;
    for this device's first token that is the previous device's last token (``all_gather`` of
    the devices' last ids). The sequence's first token is never a start.
    """
    last_ids = lax.all_gather(segment_ids[:, -1], axis_name)  # [P, B]
    i = lax.axis_index(axis_name)
    before = jnp.where(i > 0, last_ids[jnp.maximum(i - 1, 0)], segment_ids[:, 0])
    starts = segment_starts(jnp.concatenate([before[:, None], segment_ids], axis=1))[:, 1:]
    return (jnp.cumsum(starts, axis=1) == 0).astype(jnp.float32)


FOLDS = ("gather", "prefix")


def _fold_incoming(maps, biases, x0, axis_name: str, fold: str = "gather"):
    """Every device's incoming state from all devices' ``(L_p, b_p)``.

    ``maps [B, H, n, n]`` and ``biases [B, H, n, V]`` are this device's; ``x0 [B, H, n, V]`` the
    state entering device 0. Returns ``(x_i, x_P)``: the state entering this device and the state
    after the last one. ``fold``: ``"gather"`` (every device gathers all ``P`` maps and folds
    them in order) or ``"prefix"`` (:func:`_fold_by_prefix`, log-depth, no gathered maps).
    """
    if fold == "prefix":
        return _fold_by_prefix(maps, biases, x0, axis_name)
    # "invarying": every device holds the same gathered maps (so the state after the sequence is
    # typed replicated over the axis under shard_map's varying-axes check)
    every_map = lax.all_gather(maps, axis_name, to="invarying")  # [P, B, H, n, n]
    every_bias = lax.all_gather(biases, axis_name, to="invarying")
    # A Python loop over the P devices (static, small): unlike a scan carry, its values may mix
    # the replicated x0 with the gathered maps under shard_map's varying-axes types.
    x, incoming = x0, []
    for L, b in zip(every_map, every_bias, strict=True):
        incoming.append(x)
        x = L @ x + b
    return jnp.stack(incoming)[lax.axis_index(axis_name)], x


def _fold_by_prefix(maps, biases, x0, axis_name: str):
    """:func:`_fold_incoming` by a parallel prefix over the devices (Hillis–Steele).

    Round ``r`` sends every device's composite map to the device ``d = 2^r`` after it, which
    composes it before its own: ``(L, b) ← (L L', L b' + b)``; after ``⌈log₂ P⌉`` rounds device
    ``i`` holds the composite of devices ``0 … i``, so ``x_{i+1} = L x_0 + b``; one more shift
    gives every device its incoming state and a sum picks the last device's. Each round moves
    one ``n × (n + V)`` map per device (``ppermute``), so a device holds ``O(log P)`` maps, not
    the gather's ``P``; the gradients come from autodiff (a ``ppermute`` transposes to the
    reverse one).
    """
    P = lax.axis_size(axis_name)
    me = lax.axis_index(axis_name)
    L, b = maps, biases
    d = 1
    while d < P:
        shift = [(i, i + d) for i in range(P - d)]
        L_before, b_before = lax.ppermute((L, b), axis_name, shift)  # zeros on devices < d
        has = me >= d
        L, b = jnp.where(has, L @ L_before, L), jnp.where(has, L @ b_before + b, b)
        d *= 2
    after = L @ x0 + b  # the state after this device
    before = lax.ppermute(after, axis_name, [(i, i + 1) for i in range(P - 1)])
    incoming = jnp.where(me == 0, x0, before)
    last = lax.psum(jnp.where(me == P - 1, after, 0.0), axis_name)
    return incoming, last


def affine_state_context(
    run: Callable, initial_states: Sequence, v, axis_name: str, carried=None, fold: str = "gather"
) -> tuple[jnp.ndarray, tuple]:
    """Context parallelism for any memory whose state is affine per value column (module doc).

    Args:
      run: ``run(initial_states, v) -> (o, final_states)``: the rule on this device's stretch of
        tokens, with ``initial_states`` a tuple of ``[B, H, K, V']`` and ``v [B, T_loc, H, V']``
        for any width ``V'``; ``o [B, T_loc, H, V']``, ``final_states`` a tuple like
        ``initial_states``.
      initial_states: the states entering the WHOLE sequence, a tuple of ``[B, H, K, V]`` f32
        (the same on every device).
      v: ``[B, T_loc, H, V]`` this device's values.
      axis_name: the mesh axis the time dimension is split over.
      carried: optional ``[B, T_loc]`` f32, 1 while a token still sees the incoming state and 0
        from this device's first document start on (``run`` then restarts its value columns from
        zero at every start); None: every token sees it.
      fold: how the devices' maps are combined, one of :data:`FOLDS`: ``"gather"`` (an
        ``all_gather`` of all ``P`` maps, each device folds them in order: ``P`` products,
        ``P·n·(n+V)`` numbers held per device) or ``"prefix"`` (a parallel prefix of
        ``⌈log₂ P⌉`` ``ppermute`` rounds: ``O(log P)`` maps per device). Equal up to rounding;
        which is faster where: docs/RESULTS.md.

    Returns:
      ``(o [B, T_loc, H, V] f32, final_states)``: this device's outputs and the states after the
      whole sequence (a tuple like ``initial_states``, the same on every device).
    """
    if fold not in FOLDS:
        raise ValueError(f"fold: expected one of {FOLDS}, got {fold!r}")
    m = len(initial_states)
    B, H, K, V = initial_states[0].shape
    n = m * K
    values = jnp.concatenate(
        [jnp.zeros((*v.shape[:-1], n), jnp.float32), v.astype(jnp.float32)], -1
    )
    o, finals = run(_identity_rows(m, values, K), values)
    stacked = jnp.concatenate(finals, axis=-2)  # [B, H, n, n + V] = [L | b]
    L, reads = stacked[..., :n], o[..., :n]
    if carried is not None:
        L = L * carried[:, -1, None, None, None]
        reads = reads * carried[:, :, None, None]
    x0 = jnp.concatenate([s.astype(jnp.float32) for s in initial_states], axis=-2)
    x_in, x_last = _fold_incoming(L, stacked[..., n:], x0, axis_name, fold)
    out = o[..., n:] + jnp.einsum("bthn,bhnv->bthv", reads, x_in)
    return out, tuple(x_last[..., j * K : (j + 1) * K, :] for j in range(m))


def gated_delta_context_parallel(
    q, k, v, g, beta, *, axis_name: str, scale=None, initial_state=None, segment_ids=None,
    chunk_size: int = 64, fold: str = "gather",
):  # fmt: skip
    """Gated delta rule with the time axis split over ``axis_name`` (SPEC §1; module doc).

    Inside ``jax.shard_map``, with every operand's ``T`` split over ``axis_name``; equals
    ``gated_delta_chunked`` on the whole sequence. Pass ``g = 0`` for the delta rule.

    Args:
      q, k: ``[B, T_loc, H, K]``; v: ``[B, T_loc, H, V]``; g, beta: ``[B, T_loc, H]``: this
        device's tokens.
      axis_name: the mesh axis that splits time (devices in sequence order along it).
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]`` entering the whole sequence (same on every device).
      segment_ids: optional ``[B, T_loc]`` int, this device's ids of packed documents (the state
        resets to zero at every document start); only with ``initial_state=None``.
      chunk_size: the WY/UT chunk of the local pass (any ``T_loc``).
      fold: how the devices' state maps are combined (``affine_state_context``).

    Returns:
      ``(o [B, T_loc, H, V] in v's dtype, final_state [B, H, K, V] f32)``, the final state after
      the whole sequence.
    """
    fn = "gated_delta_context_parallel"
    B, _, H, K, V = validate_seq(fn, q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    if segment_ids is not None and initial_state is not None:
        raise ValueError(
            f"{fn}: segment_ids needs initial_state=None (documents restart from a zero state; "
            "a non-zero restart state is not a column of the identity run)"
        )
    s0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state
    carried = None if segment_ids is None else carried_mask(segment_ids, axis_name)

    def run(states, values):
        # With segment_ids the rule restarts from ``states`` at each document start: the value
        # columns from zero (exact), the identity columns from I (masked off by ``carried``).
        o, final = gated_delta_chunked(
            q, k, values, g, beta, scale=scale, initial_state=states[0],
            segment_ids=segment_ids, chunk_size=chunk_size,
        )  # fmt: skip
        return o, (final,)

    o, (final,) = affine_state_context(
        run, (s0.astype(jnp.float32),), v, axis_name, carried=carried, fold=fold
    )
    return o.astype(v.dtype), final


def titans_linear_context_parallel(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    axis_name: str,
    initial_state=None,
    rule: TitansRule = TitansRule(),
    fold: str = "gather",
):
    """Titans matrix memory with momentum, time split over ``axis_name`` (SPEC §2, ``L_M = 1``).

    The joint state ``x = [M; S]`` (memory and momentum stacked, ``n = 2K``) is affine per value
    column over a stretch of chunks (module doc), so this equals ``titans_linear_chunked`` on the
    whole sequence with the same rule.

    Args:
      q, k: ``[B, T_loc, H, K]``; v: ``[B, T_loc, H, V]``; theta, eta, alpha: ``[B, T_loc, H]``.
      axis_name: the mesh axis that splits time.
      initial_state: None (zeros), ``TitansLinearState(M, S)`` or a bare ``M`` entering the whole
        sequence.
      rule: :class:`~nested_jax.rules.TitansRule`, as in ``titans_linear_chunked``:
        ``memory_chunk`` must divide ``T_loc`` (the devices' chunks are the global ones);
        ``read_before_write``, ``per_chunk_gates`` and ``remat`` apply; ``grad_clip`` and
        ``grad_horizon`` must be 0 (the softclamp is not affine; the module doc says why).
      fold: how the devices' state maps are combined (``affine_state_context``).

    Returns:
      ``(o [B, T_loc, H, V] in v's dtype, TitansLinearState(M, S) f32)`` after the whole sequence.
    """
    fn = "titans_linear_context_parallel"
    check_rule(fn, rule)
    B, T, H, K, V = validate_common(fn, q, k, v, theta, eta, alpha, per_token=False)
    for name in ("grad_clip", "grad_horizon"):
        if getattr(rule, name):
            raise ValueError(
                f"{fn}: rule.{name} must be 0 (not offered with context parallelism), got "
                f"{getattr(rule, name)!r}"
            )
    if T % rule.memory_chunk:
        raise ValueError(
            f"{fn}: rule.memory_chunk must divide the local length T_loc = {T} (so each device's "
            f"chunks are the single-device chunks), got {rule.memory_chunk}"
        )
    st = state_of(fn, initial_state, B, H, K, V)

    def run(states, values):
        o, final = titans_linear_chunked(
            q, k, values, theta, eta, alpha, initial_state=TitansLinearState(*states), rule=rule
        )
        return o, tuple(final)

    o, (M, S) = affine_state_context(run, (st.M, st.S), v, axis_name, fold=fold)
    return o.astype(v.dtype), TitansLinearState(M, S)
