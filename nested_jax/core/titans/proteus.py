"""Proteus-wrapped Titans memories: matrix (``L_M = 1``) and MLP (``L_M ≥ 2``) (SPEC §2, §4).

With training context ``N``, ``E`` blocks, ``Δ = max(1, ⌊N/E⌋)`` and the 1-based absolute position
``t = t0 + i + 1`` of local token ``i``, the mask ``g_t`` opens the first ``k(t)`` blocks and::

    M^{(g)}_{t-1} = g_t ⊙ M_{t-1}
    candidate     = the backbone's step on M^{(g)}_{t-1}   (write, decay and momentum)
    M_t           = where(g_t, candidate, M_{t-1})          # locked coordinates keep their bits
    y_t           = Read(g_t ⊙ M_t, q_t)   (read_before_write: Read(M^{(g)}_{t-1}, q_t))

Blocked axes (contiguous blocks, remainder in the last block):

- matrix memory ``M, S [B, H, K, V]``: key rows. The read-after-write ``(g ⊙ M_t)ᵀ q`` equals
  ``M_tᵀ (g ⊙ q)``, so the query is masked; the key is masked too, which makes the step's gradient
  ``k (Mᵀk − v)ᵀ`` equal to ``g ⊙ ∇ℓ(M^{(g)})`` exactly (and the softclamp norm sees only it).
- MLP memory (weights ``W_l [B, H, d_l, d_{l+1}]``, ``M(z) = z + W_1ᵀσ(W_0ᵀz)`` for ``L_M = 2``):
  hidden units, i.e. columns of ``W_0`` and rows of ``W_1``. **Decision** for ``L_M ≥ 3``: every
  hidden layer is blocked with the same schedule and a middle weight's coordinate is open iff both
  of its units are. With ``σ(0) = 0`` (SiLU, GELU, tanh, ReLU) a locked hidden unit of the gated
  memory outputs 0, so the gradient on locked coordinates is exactly 0 and the step's own read is
  ``Read(g ⊙ M_t)``; activations with ``σ(0) ≠ 0`` are refused.

Every form takes the memory rule whole, ``rule=TitansRule()`` (as its backbone does), and the
schedule whole, ``schedule=ProteusRule(blocks=E, context_len=N)``. Forms: ``*_step``;
``*_recurrent`` (``lax.scan`` of the step; ``t0`` may be traced); ``*_chunked`` (static ``t0``):
each span of constant mask (``proteus_spans``) is one backbone chunked call from the gated state,
then the locked coordinates are put back with ``where``. The Titans chunked form takes gradients
at chunk starts, and **its chunk grid restarts at every Δ-boundary** (the mask changes there);
with ``rule.memory_chunk = 1`` it equals the recurrent form, and when ``memory_chunk`` divides
``Δ`` and ``t0`` the grid is the global one. Spans of one length run as one ``lax.scan``
(``run_proteus_spans``); a Titans padding token is not a no-op (``M ← M + S``), so spans are
grouped by length, never padded. Static dispatch as in ``core/associative/proteus.py``: ``E = 1``
or fully open calls are the backbone bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.checks import require_initial_state
from nested_jax.core.proteus import (
    _check_blocked,
    _check_schedule_rule,
    _check_silent_at_zero,
    _check_static_t0,
    _check_t0,
    _is_int,
    _positions,
    _statically_open,
    _zero_where,
    proteus_active_blocks,
    proteus_block_ids,
    proteus_gate,
    proteus_gated_step,
    proteus_gated_update,
    proteus_spans,
    run_proteus_spans,
)
from nested_jax.core.scan import state_zeros
from nested_jax.core.titans.chunk import titans_mlp_chunked
from nested_jax.core.titans.linear import (
    TitansLinearState,
    titans_linear_chunked,
    titans_linear_recurrent,
    titans_linear_step,
)
from nested_jax.core.titans.mlp import titans_mlp_recurrent, titans_mlp_step
from nested_jax.core.titans.net import (
    MLP_STATE_CONSTRUCTOR,
    TitansMLPState,
    activation_of,
    check_rule,
)
from nested_jax.rules import ProteusRule, TitansRule

__all__ = [
    "proteus_titans_linear_step",
    "proteus_titans_linear_recurrent",
    "proteus_titans_linear_chunked",
    "proteus_titans_mlp_masks",
    "proteus_titans_mlp_step",
    "proteus_titans_mlp_recurrent",
    "proteus_titans_mlp_chunked",
]


def _check_titans_seq(fn, q, k, v, theta, eta, alpha, per_token: bool):
    """Rank/shape checks shared by the Titans wrappers; returns ``(B, H, K)``.

    The backbone validates everything again (dtypes, grad_clip, state shapes); this only makes
    sure the shapes the wrapper reads are there, with errors naming the argument.
    """
    rank, lead, sfx = (3, "[B, H", "_t") if per_token else (4, "[B, T, H", "")
    for name, x in ((f"q{sfx}", q), (f"k{sfx}", k), (f"v{sfx}", v)):
        if getattr(x, "ndim", None) != rank:
            raise ValueError(
                f"{fn}: {name} must have shape {lead}, D], got {getattr(x, 'shape', None)}"
            )
    if k.shape != q.shape:
        raise ValueError(
            f"{fn}: k{sfx} must have shape {lead}, K] = {q.shape} like q, got {k.shape}"
        )
    for name, x in ((f"theta{sfx}", theta), (f"eta{sfx}", eta), (f"alpha{sfx}", alpha)):
        if getattr(x, "shape", None) != q.shape[:-1]:
            raise ValueError(
                f"{fn}: {name} must have shape {lead}] = {q.shape[:-1]}, got "
                f"{getattr(x, 'shape', None)}"
            )
    return q.shape[0], q.shape[-2], q.shape[-1]


def _linear_state(fn, initial_state, k, v) -> TitansLinearState:
    """None → zeros typed like ``k``, ``v`` (``scan.state_zeros``); ``TitansLinearState``/``(M, S)``
    → f32; a bare ``M`` → ``(M, 0)``. ``k [B, (T,) H, K]``, ``v [B, (T,) H, V]``."""
    if k.ndim == 3:  # one token
        k, v = k[:, None], v[:, None]
    B, _, H, K = k.shape
    V = v.shape[-1]
    if initial_state is None:
        z = state_zeros(k, v)
        return TitansLinearState(z, z)
    if isinstance(initial_state, tuple) and len(initial_state) == 2:
        M, S = initial_state
    else:
        M, S = initial_state, None
    for name, x in (("initial_state.M", M), ("initial_state.S", S)):
        if x is not None and getattr(x, "shape", None) != (B, H, K, V):
            raise ValueError(
                f"{fn}: {name} must have shape [B, H, K, V] = {(B, H, K, V)}, got "
                f"{getattr(x, 'shape', None)}"
            )
    M = M.astype(jnp.float32)
    return TitansLinearState(M, jnp.zeros_like(M) if S is None else S.astype(jnp.float32))


def _key_open(active, K: int, e: int):
    """Open key rows: static ``active`` → numpy ``[K]``; traced ``[B]`` → ``[B, K]``."""
    ids = proteus_block_ids(K, e)
    if _is_int(active):
        return ids < active
    return jnp.asarray(ids) < active[:, None]


def _state_rows(open_k):
    """Key mask ``[K]`` / ``[B, K]`` → broadcastable to ``[B, H, K, V]``."""
    return open_k[:, None] if open_k.ndim == 1 else open_k[:, None, :, None]


def _seq_rows(open_k):
    """Key mask ``[K]`` / ``[B, K]`` → broadcastable to a sequence ``[B, T, H, K]``."""
    return open_k if open_k.ndim == 1 else open_k[:, None, None, :]


def _token_rows(open_k):
    """Key mask ``[K]`` / ``[B, K]`` → broadcastable to a token ``[B, H, K]``."""
    return open_k if open_k.ndim == 1 else open_k[:, None, :]


def _linear_setup(fn, xs, schedule, rule, t0, per_token: bool):
    """Shared checks of the matrix-memory wrappers (``xs = (q, k, v, θ, η, α)``); returns
    ``(N, E, K)``."""
    check_rule(fn, rule)
    n, e = _check_schedule_rule(fn, schedule)
    B, _, K = _check_titans_seq(fn, *xs, per_token=per_token)
    _check_blocked(fn, "key dim K", K, e)
    if per_token:
        _check_t0(fn, t0, B, name="t (1-based)", low=1)
    else:
        _check_t0(fn, t0, B)
    return n, e, K


def proteus_titans_linear_step(
    state,
    q_t,
    k_t,
    v_t,
    theta_t,
    eta_t,
    alpha_t,
    *,
    t,
    rule: TitansRule = TitansRule(),
    schedule: ProteusRule,
):
    """One Titans matrix-memory token (L_M = 1) with Proteus key-row blocks (SPEC §2, §4).

    With ``g`` the key-row mask at ``t``, ``M̃ = g ⊙ M``, ``S̃ = g ⊙ S``, ``k̃ = g ⊙ k_t``:
    ``u = k̃ (M̃ᵀk̃ − v_t)ᵀ = g ⊙ ∇ℓ(M̃; k_t, v_t)``, ``S_t = where(g, η S̃ − θ u, S)``,
    ``M_t = where(g, (1 − α) M̃ + S_t, M)``, ``o_t = M_tᵀ (g ⊙ q_t)`` (``M_{t-1}`` with
    ``rule.read_before_write``).

    Args:
      state: ``TitansLinearState(M, S)`` or a bare ``M`` (zero momentum), ``[B, H, K, V]``.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; theta_t, eta_t, alpha_t: ``[B, H]``.
      t: 1-based absolute position, int or integer array ``[]`` / ``[B]``.
      rule: :class:`~nested_jax.rules.TitansRule`, as ``titans_linear_step``.
      schedule: :class:`~nested_jax.rules.ProteusRule` ``(E, N)`` (``K ≥ E``; ``E = 1``: the
        backbone).

    Returns:
      ``(o_t [B, H, V] in v_t's dtype, TitansLinearState f32)``.
    """
    fn = "proteus_titans_linear_step"
    token = (q_t, k_t, v_t, theta_t, eta_t, alpha_t)
    n, e, K = _linear_setup(fn, token, schedule, rule, t, per_token=True)
    step = functools.partial(titans_linear_step, rule=rule)
    if _statically_open(t - 1 if _is_int(t) else t, n, e):
        return step(state, *token)
    st = _linear_state(fn, state, k_t, v_t)
    open_k = _key_open(proteus_active_blocks(_positions(t, q_t.shape[0]), n, e), K, e)
    return _titans_key_step(step, st, open_k, token)


def _titans_key_step(step_fn, st, open_k, token):
    """Gated step of a key-row-blocked Titans memory: masked q, k on the gated state, then merge."""
    rows = _token_rows(open_k)
    q_t, k_t, *rest = token
    return proteus_gated_step(
        step_fn, st, _state_rows(open_k), _zero_where(rows, q_t), _zero_where(rows, k_t), *rest
    )


def proteus_titans_linear_recurrent(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    initial_state=None,
    rule: TitansRule = TitansRule(),
    schedule: ProteusRule,
    t0=0,
):
    """Titans matrix memory with Proteus key-row blocks, token by token (SPEC §2, §4; ground truth).

    ``lax.scan`` of :func:`proteus_titans_linear_step` at positions ``t0 + 1 … t0 + T``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``.
      initial_state: None (zeros), ``TitansLinearState(M, S)`` or a bare ``M``, ``[B, H, K, V]``.
      rule: :class:`~nested_jax.rules.TitansRule`, as ``titans_linear_recurrent``.
      schedule: :class:`~nested_jax.rules.ProteusRule` ``(E, N)`` (``K ≥ E``).
      t0: tokens already seen: Python int, or integer array ``[]`` / ``[B]`` (traced).

    Returns:
      ``(o [B, T, H, V] in v's dtype, TitansLinearState(M, S) f32 [B, H, K, V])``.
    """
    fn = "proteus_titans_linear_recurrent"
    xs = (q, k, v, theta, eta, alpha)
    n, e, K = _linear_setup(fn, xs, schedule, rule, t0, per_token=False)
    if _statically_open(t0, n, e):
        return titans_linear_recurrent(*xs, initial_state=initial_state, rule=rule)
    st = _linear_state(fn, initial_state, k, v)
    pos0 = _positions(t0, q.shape[0])
    step = functools.partial(titans_linear_step, rule=rule)

    def body(s, xs):
        i, *tok = xs
        open_k = _key_open(proteus_active_blocks(pos0 + i + 1, n, e), K, e)
        o_t, s = _titans_key_step(step, s, open_k, tok)
        return s, o_t

    tm = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    xs = (jnp.arange(q.shape[1], dtype=jnp.int32), *map(tm, xs))
    st, o = lax.scan(body, st, xs)
    return jnp.moveaxis(o, 0, 1), st


def proteus_titans_linear_chunked(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    initial_state=None,
    rule: TitansRule = TitansRule(),
    schedule: ProteusRule,
    t0: int = 0,
):
    """Titans matrix memory with Proteus key-row blocks in chunk form (SPEC §2, §4).

    Each span of constant mask ``g`` (``proteus_spans``) is one ``titans_linear_chunked`` call on
    ``(g ⊙ q, g ⊙ k)`` from ``(g ⊙ M, g ⊙ S)``; the locked rows of ``M`` and ``S`` are then put
    back with ``where``. The chunk grid restarts at every span (the mask changes there), so with
    ``rule.memory_chunk = 1`` this equals the recurrent form, and with ``memory_chunk`` dividing
    ``Δ`` and ``t0`` the chunks are the global ones.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``; any T.
      initial_state: None (zeros), ``TitansLinearState(M, S)`` or a bare ``M``, ``[B, H, K, V]``.
      rule: :class:`~nested_jax.rules.TitansRule`, as ``titans_linear_chunked`` (pooled gates are
        pooled over chunks of each span).
      schedule: :class:`~nested_jax.rules.ProteusRule` ``(E, N)`` (``K ≥ E``).
      t0: tokens already seen (static Python int ``≥ 0``).

    Returns:
      ``(o [B, T, H, V] in v's dtype, TitansLinearState(M, S) f32 [B, H, K, V])``.
    """
    fn = "proteus_titans_linear_chunked"
    xs = (q, k, v, theta, eta, alpha)
    t0 = _check_static_t0(fn, t0)
    n, e, K = _linear_setup(fn, xs, schedule, rule, t0, per_token=False)
    run = functools.partial(titans_linear_chunked, rule=rule)
    if _statically_open(t0, n, e):
        return run(*xs, initial_state=initial_state)
    spans = proteus_spans(q.shape[1], t0, n, e)
    if not spans:
        return run(*xs, initial_state=initial_state)
    st = _linear_state(fn, initial_state, k, v)

    def open_fn(s, xs):
        return run(*xs, initial_state=s)

    def span_fn(s, xs, active):
        open_k = _key_open(active, K, e)
        rows = _state_rows(open_k)
        qs, ks, *rest = xs
        o, cand = run(
            _zero_where(_seq_rows(open_k), qs), _zero_where(_seq_rows(open_k), ks), *rest,
            initial_state=proteus_gate(s, rows),
        )  # fmt: skip
        return o, proteus_gated_update(s, cand, rows)

    return run_proteus_spans(span_fn, open_fn, st, xs, spans, e)


# MLP memory ------------------------------------------------------------------------------------


def _mlp_dims(fn, state) -> tuple[int, ...]:
    if not isinstance(state, TitansMLPState) or not isinstance(state.weights, (tuple, list)):
        raise ValueError(
            f"{fn}: state must be a TitansMLPState(weights, momentum), got {type(state)}"
        )
    if not state.weights:
        raise ValueError(f"{fn}: state.weights must be a non-empty tuple of [B, H, d_l, d_(l+1)]")
    for i, w in enumerate(state.weights):
        if getattr(w, "ndim", None) != 4:
            raise ValueError(
                f"{fn}: state.weights[{i}] must have shape [B, H, d_l, d_(l+1)], got "
                f"{getattr(w, 'shape', None)}"
            )
    return (state.weights[0].shape[2], *(w.shape[3] for w in state.weights))


def proteus_titans_mlp_masks(active, dims, num_blocks: int):
    """Open coordinates of every weight of an MLP memory with ``active`` blocks open (SPEC §4).

    ``L = 1`` (matrix memory): key rows of ``W_0``. ``L ≥ 2``: hidden units: columns of ``W_l`` for
    ``l < L−1`` and rows of ``W_l`` for ``l > 0`` (a middle weight is open where both units are).

    Args:
      active: number of open blocks, a Python int or an integer array ``[B]``.
      dims: ``(d_0 = K, d_1, …, d_L = V)``.
      num_blocks: ``E`` (every blocked size ``≥ E``).

    Returns:
      tuple of ``L`` bool masks broadcastable to ``W_l [B, H, d_l, d_{l+1}]`` (static int →
      numpy ``[d_l or 1, d_{l+1} or 1]``; array → ``[B, 1, d_l or 1, d_{l+1} or 1]``).
    """
    L = len(dims) - 1
    static = _is_int(active)

    def side(size, blocked, row):
        if not blocked:
            return None
        m = _key_open(active, size, num_blocks)  # [d] or [B, d]
        shape = (size, 1) if row else (1, size)
        return m.reshape(shape) if static else m.reshape(m.shape[0], 1, *shape)

    masks = []
    for i in range(L):
        rows = side(dims[i], blocked=(L == 1 or i > 0), row=True)
        cols = side(dims[i + 1], blocked=(i < L - 1), row=False)
        masks.append(rows if cols is None else cols if rows is None else rows & cols)
    return tuple(masks)


def _mlp_setup(fn, state, schedule, rule, t0, residual):
    """Shared checks; returns ``(n, e, dims)``. Refuses what the hidden-unit gating cannot do."""
    check_rule(fn, rule)
    n, e = _check_schedule_rule(fn, schedule)
    dims = _mlp_dims(fn, state)
    L = len(dims) - 1
    _check_blocked(
        fn, "key dim K" if L == 1 else "every hidden size", min(dims[1:-1] or dims[:1]), e
    )
    if _statically_open(t0, n, e):
        return n, e, dims
    if L == 1 and residual:
        # a residual z + Wᵀz would read the unmasked query: masking q, k is only exact without it
        raise ValueError(f"{fn}: residual=True with L_M = 1 is not supported with num_blocks > 1")
    if L >= 2:
        _check_silent_at_zero(fn, activation_of(rule))
    return n, e, dims


def _mlp_gated_step(step_fn, st, masks, token):
    """Gated step of an MLP memory (key rows of q, k masked too for ``L = 1``), then merge."""
    mask_tree = TitansMLPState(masks, masks)
    q_t, k_t, *rest = token
    if len(masks) == 1:
        rows = masks[0][..., 0]  # [K] or [B, 1, K]
        q_t, k_t = _zero_where(rows, q_t), _zero_where(rows, k_t)
    return proteus_gated_step(step_fn, st, mask_tree, q_t, k_t, *rest)


def proteus_titans_mlp_step(
    state: TitansMLPState,
    q_t,
    k_t,
    v_t,
    theta_t,
    eta_t,
    alpha_t,
    *,
    t,
    rule: TitansRule = TitansRule(),
    schedule: ProteusRule,
    residual=None,
):
    """One token of the Titans MLP memory with Proteus blocks (SPEC §2, §4).

    ``M̃ = g ⊙ M`` (hidden units for ``L ≥ 2``, key rows for ``L = 1``), the backbone step on
    ``(M̃, g ⊙ S)``, then ``where(g, ·, previous)`` on weights and momentum. With ``σ(0) = 0`` a
    locked unit of ``M̃`` is silent, so the step's gradient is 0 on locked coordinates (equal to
    ``g ⊙ ∇ℓ(M̃)``) and its read is ``(g ⊙ M_t)(q_t)`` (``M̃(q_t)`` with ``read_before_write``).

    Args:
      state: ``TitansMLPState`` with ``W_l, S_l [B, H, d_l, d_{l+1}]``.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; theta_t, eta_t, alpha_t: ``[B, H]``.
      t: 1-based absolute position, int or integer array ``[]`` / ``[B]``.
      rule: :class:`~nested_jax.rules.TitansRule`, as ``titans_mlp_step`` (its activation must
        satisfy ``σ(0) = 0`` when ``E > 1``).
      schedule: :class:`~nested_jax.rules.ProteusRule` ``(E, N)``.
      residual: as ``titans_mlp_step``.

    Returns:
      ``(y_t [B, H, V] in v_t's dtype, TitansMLPState f32)``.
    """
    fn = "proteus_titans_mlp_step"
    token = (q_t, k_t, v_t, theta_t, eta_t, alpha_t)
    B, _, _ = _check_titans_seq(fn, *token, per_token=True)
    _check_t0(fn, t, B, name="t (1-based)", low=1)
    t_prev = t - 1 if _is_int(t) else t
    n, e, dims = _mlp_setup(fn, state, schedule, rule, t_prev, residual)
    step = functools.partial(titans_mlp_step, rule=rule, residual=residual)
    if _statically_open(t_prev, n, e):
        return step(state, *token)
    masks = proteus_titans_mlp_masks(proteus_active_blocks(_positions(t, B), n, e), dims, e)
    return _mlp_gated_step(step, state, masks, token)


def proteus_titans_mlp_recurrent(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    initial_state: TitansMLPState | None = None,
    rule: TitansRule = TitansRule(),
    schedule: ProteusRule,
    t0=0,
    residual=None,
):
    """Titans MLP memory with Proteus blocks, token by token (SPEC §2, §4; ground truth).

    ``lax.scan`` of :func:`proteus_titans_mlp_step` at positions ``t0 + 1 … t0 + T``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``.
      initial_state: ``TitansMLPState`` (``[B, H, d_l, d_{l+1}]`` arrays,
        ``titans_mlp_state(weights, B)``); required (None raises ``ValueError``).
      rule, schedule, residual: as :func:`proteus_titans_mlp_step`.
      t0: tokens already seen: Python int, or integer array ``[]`` / ``[B]`` (traced).

    Returns:
      ``(y [B, T, H, V] in v's dtype, final TitansMLPState f32)``.
    """
    fn = "proteus_titans_mlp_recurrent"
    state = require_initial_state(fn, initial_state, MLP_STATE_CONSTRUCTOR)
    xs = (q, k, v, theta, eta, alpha)
    B, _, _ = _check_titans_seq(fn, *xs, per_token=False)
    _check_t0(fn, t0, B)
    n, e, dims = _mlp_setup(fn, state, schedule, rule, t0, residual)
    if _statically_open(t0, n, e):
        return titans_mlp_recurrent(*xs, initial_state=state, rule=rule, residual=residual)
    pos0 = _positions(t0, B)
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731
    step = functools.partial(titans_mlp_step, rule=rule, residual=residual)

    def body(s, xs):
        i, *tok = xs
        masks = proteus_titans_mlp_masks(proteus_active_blocks(pos0 + i + 1, n, e), dims, e)
        y_t, s = _mlp_gated_step(step, s, masks, tok)
        return s, y_t

    tm = lambda x: jnp.moveaxis(x, 1, 0)  # noqa: E731
    xs = (jnp.arange(q.shape[1], dtype=jnp.int32), *map(tm, xs))
    st, y = lax.scan(body, f32(state), xs)
    return jnp.moveaxis(y, 0, 1), st


def proteus_titans_mlp_chunked(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    initial_state: TitansMLPState | None = None,
    rule: TitansRule = TitansRule(),
    schedule: ProteusRule,
    t0: int = 0,
    residual=None,
):
    """Titans MLP memory with Proteus blocks in chunk form (SPEC §2, §4).

    Each span of constant mask (``proteus_spans``) is one ``titans_mlp_chunked`` call from the
    gated state (weights and momentum; masked q, k for ``L = 1``), then the locked coordinates are
    put back with ``where``. Locked coordinates stay exactly 0 inside the span (silent units, zero
    gradients), so reads are those of the gated memory. The chunk grid restarts at every span;
    ``rule.memory_chunk = 1`` equals the recurrent form.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``; any T.
      initial_state: ``TitansMLPState`` (``[B, H, d_l, d_{l+1}]`` arrays,
        ``titans_mlp_state(weights, B)``); required (None raises ``ValueError``).
      rule: :class:`~nested_jax.rules.TitansRule`, as ``titans_mlp_chunked`` (``σ(0) = 0``
        required when ``E > 1``).
      schedule: :class:`~nested_jax.rules.ProteusRule` ``(E, N)``.
      t0: tokens already seen (static Python int ``≥ 0``).
      residual: as ``titans_mlp_chunked``.

    Returns:
      ``(y [B, T, H, V] in v's dtype, final TitansMLPState f32)``.
    """
    fn = "proteus_titans_mlp_chunked"
    state = require_initial_state(fn, initial_state, MLP_STATE_CONSTRUCTOR)
    xs = (q, k, v, theta, eta, alpha)
    _check_titans_seq(fn, *xs, per_token=False)
    t0 = _check_static_t0(fn, t0)
    n, e, dims = _mlp_setup(fn, state, schedule, rule, t0, residual)
    run = functools.partial(titans_mlp_chunked, rule=rule, residual=residual)
    if _statically_open(t0, n, e):
        return run(*xs, initial_state=state)
    spans = proteus_spans(q.shape[1], t0, n, e)
    if not spans:
        return run(*xs, initial_state=state)
    L = len(dims) - 1
    st = jax.tree.map(lambda x: x.astype(jnp.float32), state)

    def open_fn(s, xs):
        return run(*xs, initial_state=s)

    def span_fn(s, xs, active):
        masks = proteus_titans_mlp_masks(active, dims, e)
        tree = TitansMLPState(masks, masks)
        qs, ks, *rest = xs
        if L == 1:
            rows = _seq_rows(_key_open(active, dims[0], e))
            qs, ks = _zero_where(rows, qs), _zero_where(rows, ks)
        o, cand = run(qs, ks, *rest, initial_state=proteus_gate(s, tree))
        return o, proteus_gated_update(s, cand, tree)

    return run_proteus_spans(span_fn, open_fn, st, xs, spans, e)
