"""Linear associative memories: linear attention, delta rule, gated delta rule (SPEC §1).

Every rule has three forms with one meaning (SPEC §0):

- ``*_step``: one token, ``(state, q_t, k_t, v_t, ...) -> (o_t, new_state)``, per-token arrays
  ``[B, H, D]``;
- ``*_recurrent``: ``lax.scan`` of the step over time, the ground truth;
- ``*_chunked``: the WY/UT chunk form (derivation in ``associative/README.md``; its stages ``kkt →
  solve_tril → w_u → state_pass → chunk_output`` in ``core/wy.py``), parallel inside chunks of
  size ``C`` and sequential across chunks.

Per head, with column vectors, ``S ∈ R^{K×V}`` and ``α_t = exp(g_t)``::

    linear attention   S_t = α_t S_{t-1} + k_t v_tᵀ                         (α_t = 1 when g is None)
    delta rule         S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ
    gated delta (GDN)  S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ
    read               o_t = S_tᵀ (scale · q_t)

GDN is FLA's ``naive_recurrent_gated_delta_rule`` (decay first, then the residual write).
Shapes: ``q, k`` ``[B, T, H, K]``; ``v`` ``[B, T, H, V]``; ``g, beta`` ``[B, T, H]``; states
``[B, H, K, V]``. ``scale`` defaults to ``K ** -0.5``. All accumulation is in f32; outputs take
``v``'s dtype, final states are f32.

Packed sequences: with ``segment_ids [B, T]`` (integer), the state is reset to ``initial_state``
(zero when ``None``) before the first token of every segment after the first, i.e. at every
``t > 0`` with ``segment_ids[:, t] != segment_ids[:, t - 1]``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from nested_jax.core.scan import (
    from_head_chunks,
    pad_to_multiple,
    segment_starts,
    state_zeros,
    to_head_chunks,
    zeros_typed,
)
from nested_jax.core.wy import chunk_output, kkt, solve_tril, state_pass, w_u, wy_delta_core

__all__ = [
    "linear_attention_step",
    "linear_attention_recurrent",
    "linear_attention_chunked",
    "delta_rule_step",
    "delta_rule_recurrent",
    "delta_rule_chunked",
    "gated_delta_step",
    "gated_delta_recurrent",
    "gated_delta_chunked",
]


# --------------------------------------------------------------------------------------------------
# Validation (trace time; shapes are static)
# --------------------------------------------------------------------------------------------------


def _check_float(name: str, x) -> None:
    if not jnp.issubdtype(
        jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype, jnp.floating
    ):
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")


def validate_seq(
    fn: str,
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    segment_ids,
    chunk_size=None,
):
    """Checks a sequence call; returns ``(B, T, H, K, V)``; ValueError names the bad argument."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or x.ndim != 4:
            shape = getattr(x, "shape", None)
            raise ValueError(
                f"{fn}: {name} must have shape [B, T, H, D] (rank 4), got shape {shape}"
            )
        _check_float(name, x)
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"{fn}: k must have shape [B, T, H, K] = {q.shape} like q, got {k.shape}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(
            f"{fn}: v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {v.shape}"
        )
    V = v.shape[3]
    for name, x in (("g", g), ("beta", beta)):
        if x is None:
            continue
        if not hasattr(x, "shape") or x.shape != (B, T, H):
            shape = getattr(x, "shape", None)
            raise ValueError(
                f"{fn}: {name} must have shape [B, T, H] = [{B}, {T}, {H}], got {shape}"
            )
        _check_float(name, x)
    if initial_state is not None:
        if not hasattr(initial_state, "shape") or initial_state.shape != (B, H, K, V):
            shape = getattr(initial_state, "shape", None)
            raise ValueError(
                f"{fn}: initial_state must have shape [B, H, K, V] = "
                f"[{B}, {H}, {K}, {V}], got {shape}"
            )
        _check_float("initial_state", initial_state)
    if segment_ids is not None:
        if not hasattr(segment_ids, "shape") or segment_ids.shape != (B, T):
            shape = getattr(segment_ids, "shape", None)
            raise ValueError(f"{fn}: segment_ids must have shape [B, T] = [{B}, {T}], got {shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(
                f"{fn}: segment_ids must have an integer dtype, got {segment_ids.dtype}"
            )
    if chunk_size is not None:
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise ValueError(f"{fn}: chunk_size must be a positive int, got {chunk_size!r}")
    return B, T, H, K, V


def _validate_step(fn: str, state, q_t, k_t, v_t, g_t, beta_t):
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if not hasattr(x, "shape") or x.ndim != 3:
            shape = getattr(x, "shape", None)
            raise ValueError(f"{fn}: {name} must have shape [B, H, D] (rank 3), got shape {shape}")
        _check_float(name, x)
    B, H, K = q_t.shape
    if k_t.shape != q_t.shape:
        raise ValueError(
            f"{fn}: k_t must have shape [B, H, K] = {q_t.shape} like q_t, got {k_t.shape}"
        )
    if v_t.shape[:2] != (B, H):
        raise ValueError(f"{fn}: v_t must have shape [B, H, V] = [{B}, {H}, V], got {v_t.shape}")
    V = v_t.shape[2]
    for name, x in (("g_t", g_t), ("beta_t", beta_t)):
        if x is None:
            continue
        if not hasattr(x, "shape") or x.shape != (B, H):
            shape = getattr(x, "shape", None)
            raise ValueError(f"{fn}: {name} must have shape [B, H] = [{B}, {H}], got {shape}")
        _check_float(name, x)
    if not hasattr(state, "shape") or state.shape != (B, H, K, V):
        shape = getattr(state, "shape", None)
        raise ValueError(
            f"{fn}: state must have shape [B, H, K, V] = [{B}, {H}, {K}, {V}], got {shape}"
        )
    _check_float("state", state)


def _scale(scale, K):
    return K**-0.5 if scale is None else scale


# --------------------------------------------------------------------------------------------------
# Step forms
# --------------------------------------------------------------------------------------------------


def _step_math(S, q_t, k_t, v_t, g_t, beta_t, scale, delta: bool):
    """One token of the general rule in f32: S [B,H,K,V], tokens [B,H,D], gates [B,H]."""
    f32 = jnp.float32
    q_t, k_t, v_t = q_t.astype(f32) * scale, k_t.astype(f32), v_t.astype(f32)
    if g_t is not None:
        S = jnp.exp(g_t.astype(f32))[..., None, None] * S
    if delta:
        err = v_t - jnp.einsum("bhk,bhkv->bhv", k_t, S)
        write = beta_t.astype(f32)[..., None] * err
    else:
        write = v_t
    S = S + k_t[..., :, None] * write[..., None, :]
    o_t = jnp.einsum("bhk,bhkv->bhv", q_t, S)
    return o_t, S


def linear_attention_step(state, q_t, k_t, v_t, g_t=None, *, scale=None):
    """One token of (gated) linear attention (SPEC §1).

    ``S_t = α_t S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale · q_t)``.

    Args:
      state: ``[B, H, K, V]`` previous state ``S_{t-1}``.
      q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``.
      g_t: optional ``[B, H]`` log decay (``α_t = exp(g_t)``); ``None`` means no decay.
      scale: multiplies ``q_t``; default ``K ** -0.5``.

    Returns:
      ``(o_t [B, H, V] in v_t's dtype, new_state [B, H, K, V] f32)``.
    """
    _validate_step("linear_attention_step", state, q_t, k_t, v_t, g_t, None)
    S = state.astype(jnp.float32)
    o, S = _step_math(S, q_t, k_t, v_t, g_t, None, _scale(scale, q_t.shape[-1]), delta=False)
    return o.astype(v_t.dtype), S


def delta_rule_step(state, q_t, k_t, v_t, beta_t, *, scale=None):
    """One token of the delta rule (SPEC §1): ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``.

    Args:
      state: ``[B, H, K, V]``; q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; beta_t: ``[B, H]``.
      scale: multiplies ``q_t``; default ``K ** -0.5``.

    Returns:
      ``(o_t [B, H, V], new_state [B, H, K, V] f32)`` with ``o_t = S_tᵀ (scale · q_t)``.
    """
    _validate_step("delta_rule_step", state, q_t, k_t, v_t, None, beta_t)
    S = state.astype(jnp.float32)
    o, S = _step_math(S, q_t, k_t, v_t, None, beta_t, _scale(scale, q_t.shape[-1]), delta=True)
    return o.astype(v_t.dtype), S


def gated_delta_step(state, q_t, k_t, v_t, g_t, beta_t, *, scale=None):
    """One token of the gated delta rule (SPEC §1, FLA's naive recurrent GDN).

    ``S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ (scale · q_t)``,
    ``α_t = e^{g_t}``.

    Args:
      state: ``[B, H, K, V]``; q_t, k_t: ``[B, H, K]``; v_t: ``[B, H, V]``; g_t, beta_t: ``[B, H]``.
      scale: multiplies ``q_t``; default ``K ** -0.5``.

    Returns:
      ``(o_t [B, H, V], new_state [B, H, K, V] f32)``.
    """
    _validate_step("gated_delta_step", state, q_t, k_t, v_t, g_t, beta_t)
    S = state.astype(jnp.float32)
    o, S = _step_math(S, q_t, k_t, v_t, g_t, beta_t, _scale(scale, q_t.shape[-1]), delta=True)
    return o.astype(v_t.dtype), S


# --------------------------------------------------------------------------------------------------
# Recurrent forms (ground truth)
# --------------------------------------------------------------------------------------------------


def _recurrent(q, k, v, g, beta, scale, initial_state, segment_ids, delta: bool):
    K = q.shape[-1]
    f32 = jnp.float32
    s0 = state_zeros(k, v) if initial_state is None else initial_state.astype(f32)
    scale = _scale(scale, K)

    def tm(x):  # time-major so lax.scan walks over T
        return None if x is None else jnp.moveaxis(x, 1, 0)

    resets = None if segment_ids is None else tm(segment_starts(segment_ids))

    def body(S, xs):
        q_t, k_t, v_t, g_t, b_t, r_t = xs
        if r_t is not None:
            S = jnp.where(r_t[:, None, None, None], s0, S)
        o_t, S = _step_math(S, q_t, k_t, v_t, g_t, b_t, scale, delta)
        return S, o_t

    S, o = lax.scan(body, s0, (tm(q), tm(k), tm(v), tm(g), tm(beta), resets))
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), S


def linear_attention_recurrent(
    q, k, v, g=None, *, scale=None, initial_state=None, segment_ids=None
):
    """(Gated) linear attention by a scan over tokens (SPEC §1; ground truth).

    ``S_t = α_t S_{t-1} + k_t v_tᵀ`` (``α_t = e^{g_t}``, or 1 when ``g`` is None),
    ``o_t = S_tᵀ (scale·q_t)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: optional ``[B, T, H]`` log decay (≤ 0).
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` int; the state resets to ``initial_state`` at segment starts.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    validate_seq("linear_attention_recurrent", q, k, v, g, None, initial_state, segment_ids)
    return _recurrent(q, k, v, g, None, scale, initial_state, segment_ids, delta=False)


def delta_rule_recurrent(q, k, v, beta, *, scale=None, initial_state=None, segment_ids=None):
    """Delta rule (DeltaNet) by a scan over tokens (SPEC §1; ground truth).

    ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ (scale·q_t)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` int; the state resets to ``initial_state`` at segment starts.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    validate_seq("delta_rule_recurrent", q, k, v, None, beta, initial_state, segment_ids)
    return _recurrent(q, k, v, None, beta, scale, initial_state, segment_ids, delta=True)


def gated_delta_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None):
    """Gated delta rule (GDN) by a scan over tokens (SPEC §1; FLA's naive GDN; ground truth).

    ``S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ (scale·q_t)``,
    ``α_t = e^{g_t}``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` int; the state resets to ``initial_state`` at segment starts.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    validate_seq("gated_delta_recurrent", q, k, v, g, beta, initial_state, segment_ids)
    return _recurrent(q, k, v, g, beta, scale, initial_state, segment_ids, delta=True)


# --------------------------------------------------------------------------------------------------
# Chunked (WY/UT) forms: the stages of core/wy.py on [N, B, H, C, ·] chunks
# --------------------------------------------------------------------------------------------------


def _chunked(q, k, v, g, beta, scale, initial_state, segment_ids, C, delta: bool,
             writes: bool = False):  # fmt: skip
    """Shared chunk form (associative/README.md §2). Padding tokens have k = v = 0, g = 0,
    β = 0, so they neither write nor decay the state. ``writes`` (delta rules): also return the
    writes ``U`` ``[B, T, H, V]`` f32 (rows ``Δ_t = β_t e_t``)."""
    T, K = q.shape[1], q.shape[-1]
    f32 = jnp.float32
    q, k, v32 = q.astype(f32) * _scale(scale, K), k.astype(f32), v.astype(f32)
    gamma, d, m = _chunk_decays(g, segment_ids, C, to_head_chunks(q[..., 0], C))
    s0 = None if initial_state is None else initial_state.astype(f32)
    bc = to_head_chunks(beta.astype(f32), C) if delta else None  # [N, B, H, C]
    zero = state_zeros(k, v)  # typed like the inputs (shard_map / Explicit meshes)
    if delta and (m is None or s0 is None):
        # time-major in and out: the core slices each chunk itself (no transposing pass)
        init = zero if s0 is None else s0
        q, k, v32 = (pad_to_multiple(x, C) for x in (q, k, v32))
        O, S_final, *U = wy_delta_core(
            q, k, v32, bc, gamma, d if m is None else d * m, init, writes
        )  # positional: ``writes`` is the custom VJP's static argument
        return (O[:, :T].astype(v.dtype), S_final) + tuple(u[:, :T] for u in U)
    Q, Kc, Vc = (to_head_chunks(x, C) for x in (q, k, v32))  # [N, B, H, C, ·]
    O, S_final, U = _chunked_autodiff(Q, Kc, Vc, bc, gamma, d, m, s0, zero)
    out = (from_head_chunks(O, T).astype(v.dtype), S_final)
    return out + ((from_head_chunks(U, T),) if writes else ())


def _chunk_decays(g, segment_ids, C, ref):
    """Decays of the chunk form (associative/README.md §2, §4); ``ref [N, B, H, C]`` (a slice of the
    chunked queries) gives the leading shape ``(N, B, H)`` and the type of the constant decays.

    Returns ``Γ [N, B, H, C, C]`` (``e^{b_i − b_j}`` on the causal same-segment mask, else 0),
    ``d [N, B, H, C]`` (``e^{Σ g}`` from the segment-local chunk start) and ``m [N, B, 1, C]``
    (1 while no segment started in the chunk up to i; ``None`` without ``segment_ids``).
    """
    f32 = jnp.float32
    causal = jnp.tril(jnp.ones((C, C), bool))
    if segment_ids is not None:
        # padded before the cumsum so that padding continues the last segment
        resets = pad_to_multiple(segment_starts(segment_ids), C)  # [B, Tp]
        z = to_head_chunks(jnp.cumsum(resets, axis=1)[:, :, None], C)  # [N, B, 1, C] segment index
        mask = causal & (z[..., :, None] == z[..., None, :])  # same segment and j ≤ i
        # m_i = 1 while no reset happened in this chunk up to i: those tokens see the carried state.
        m = (jnp.cumsum(to_head_chunks(resets[:, :, None], C), axis=-1) == 0).astype(f32)
    else:
        mask, m = causal, None
    if g is None:
        # typed like the inputs (scan.zeros_typed): they enter the scan and the custom VJP
        zeros = zeros_typed(ref[..., None], (*ref.shape, C), f32)  # [N, B, H, C, C]
        return mask.astype(f32) + zeros, 1.0 + zeros_typed(ref, dtype=f32), m
    # Decays are only ever exponentiated on the mask, where b_i − b_j ≤ 0 for g ≤ 0: no overflow,
    # and the masked-out entries get an exact zero (and a zero gradient), never exp(−inf).
    gc = to_head_chunks(g.astype(f32), C)  # [N, B, H, C]
    b = jnp.cumsum(gc, axis=-1)
    diff = b[..., :, None] - b[..., None, :]
    gamma = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)
    # log decay from the (segment-local) chunk start to i: Σ_{j ≤ i, same segment} g_j
    logd = b if segment_ids is None else jnp.sum(jnp.where(mask, gc[..., None, :], 0.0), -1)
    return gamma, jnp.exp(logd), m


def _chunked_autodiff(Q, Kc, Vc, bc, gamma, d, m, s0, zero):
    """Linear attention (``bc is None``: ``W = 0``, ``U = V``), and the delta rules when a segment
    restarts from a non-zero initial state: plain autodiff of the wy stages, with the ``s0``
    restart as a second incoming state of coefficient ``d ⊙ (1 − m)`` (associative/README.md §4).
    ``zero`` is the ``[B, H, K, V]`` state used when ``s0`` is None. Returns ``(O, S_final, U)``
    (``U`` the writes ``[N, B, H, C, V]``)."""
    # The order of operations fixes the order in which autodiff sums cotangents, so it is kept as
    # it was before the stages were factored out (gradients bit-identical).
    N, B, H, C, K = Kc.shape
    restart = m is not None and s0 is not None
    d_carry = d if m is None else d * m  # coefficient of the carried state for token i
    init = zero if s0 is None else s0
    d_last = d_carry[..., -1]
    k_dec = Kc * gamma[..., -1, :][..., None]  # e^{b_C − b_j} within the last token's segment
    if bc is not None:
        T = solve_tril(kkt(Kc, bc, gamma))
        W, U = w_u(Kc, Vc, bc, d_carry, T=T)
        if restart:
            W0 = T @ (Kc * (bc * d * (1.0 - m))[..., None])
            U = U - W0 @ s0
    else:
        W, U = None, Vc
    bias = (d[..., -1] * (1.0 - m[..., -1]))[..., None, None] * s0 if restart else None
    S_final, S_starts, U = state_pass(W, U, k_dec, d_last, init, bias)
    O = chunk_output(Q, Kc, gamma, d_carry, S_starts, U)
    if restart:
        O = O + (Q * (d * (1.0 - m))[..., None]) @ s0
    return O, S_final, U


def linear_attention_chunked(
    q, k, v, g=None, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64
):
    """(Gated) linear attention in chunk form (SPEC §1; equals ``linear_attention_recurrent``).

    Inside a chunk: ``O = (Q ⊙ d) S_n + (Q Kᵀ ⊙ Γ) V``, ``S_{n+1} = d_C S_n + (K ⊙ Γ_{C,:})ᵀ V``
    (``Γ_ij = e^{b_i − b_j}`` for j ≤ i, ``b`` the in-chunk cumulative log decay, ``d = e^{b}``).

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: optional ``[B, T, H]`` log decay.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` int; the state resets to ``initial_state`` at segment starts.
      chunk_size: chunk length C (> 0); T need not be a multiple of C.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    validate_seq(
        "linear_attention_chunked", q, k, v, g, None, initial_state, segment_ids, chunk_size
    )
    return _chunked(q, k, v, g, None, scale, initial_state, segment_ids, chunk_size, delta=False)


def delta_rule_chunked(
    q, k, v, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64
):
    """Delta rule in WY/UT chunk form (SPEC §1; equals ``delta_rule_recurrent``).

    See ``gated_delta_chunked`` with ``g = 0``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
      scale, initial_state, segment_ids, chunk_size: as in ``gated_delta_chunked``.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    validate_seq("delta_rule_chunked", q, k, v, None, beta, initial_state, segment_ids, chunk_size)
    return _chunked(q, k, v, None, beta, scale, initial_state, segment_ids, chunk_size, delta=True)


def gated_delta_chunked(
    q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64
):
    """Gated delta rule in WY/UT chunk form (SPEC §1; equals ``gated_delta_recurrent``).

    Per chunk (derivation in associative/README.md §2): ``A = strict_tril(diag(β) K Kᵀ ⊙ Γ)``,
    ``T = (I + A)^{-1}`` (blockwise doubling over forward substitution; never powers of A),
    ``W = T diag(β e^{b}) K``, ``Ũ = T diag(β) V``; sequentially over chunks ``U_n = Ũ − W S_n``,
    ``S_{n+1} = e^{b_C} S_n + (K ⊙ e^{b_C − b})ᵀ U_n``; then
    ``O = (Q ⊙ e^{b}) S_n + (Q Kᵀ ⊙ Γ) U_n``.
    Gradients: a hand-written VJP that runs the state recurrence backwards (README §3,
    ``wy.wy_delta_core``); segment resets fold into the masks of Γ (README §4).

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` int; the state resets to ``initial_state`` at segment starts.
      chunk_size: chunk length C (> 0); T need not be a multiple of C.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    validate_seq("gated_delta_chunked", q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    return _chunked(q, k, v, g, beta, scale, initial_state, segment_ids, chunk_size, delta=True)


def gated_delta_chunked_writes(
    q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None, chunk_size=64
):
    """``gated_delta_chunked`` that also returns its writes, from the same pass over the chunks.

    The write of token ``t`` is ``Δ_t = β_t e_t`` with the residual ``e_t = v_t − α_t S_{t−1}ᵀ
    k_t`` (SPEC §1; the rows ``U_n`` of the chunk form, README §2), differentiable like the
    output (the VJP adds its cotangent to ``U_n``'s). HOLA's ``beta_e`` scores are ``‖Δ_t‖``
    (SPEC §5), so its state path gives them without the separate residual pass
    (``hola.gdn_residuals``). Arguments as ``gated_delta_chunked``.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32, writes [B, T, H, V] f32)``.
    """
    validate_seq(
        "gated_delta_chunked_writes", q, k, v, g, beta, initial_state, segment_ids, chunk_size
    )
    return _chunked(
        q, k, v, g, beta, scale, initial_state, segment_ids, chunk_size, delta=True, writes=True
    )
