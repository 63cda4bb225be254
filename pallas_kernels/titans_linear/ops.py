"""Jitted entry of the Pallas Titans matrix memory (SPEC §2 with ``L_M = 1``): layout, padding,
gate coefficients, ``custom_vjp``.

``titans_linear_pallas`` has the contract of ``nested_jax.core.titans.linear.titans_linear_chunked``
and takes the same :class:`~nested_jax.rules.TitansRule` (``rule=``; its ``memory_chunk`` is the
kernels' chunk, a multiple of 8) (returns ``(o [B, T, H, V] in v's dtype, (M, S) f32
[B, H, K, V])``). The gate coefficients of every chunk (cumulative products of ``η`` and
``1 − α``, resets folded into the gates, the rows of the last real token and of a
document-local chunk start) are computed here in plain ``jnp`` by the core's own
``chunk_coefficients`` / ``reset_coefficients`` and reach θ, η, α in the backward by autodiff of
that O(T·C) preparation; the kernels of ``kernel.py`` do everything that touches the states.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.scan import pad_to_multiple
from nested_jax.core.titans.chunk import (
    chunk_coefficients,
    chunk_pool,
    local_chunk_starts,
    reset_coefficients,
)
from nested_jax.core.titans.linear import TitansLinearState, state_of
from nested_jax.core.titans.net import (
    check_rule,
    segment_resets,
    validate_common,
    validate_horizon,
    validate_segment_ids,
)
from nested_jax.rules import TitansRule
from pallas_kernels.common import SUBLANES, from_heads_major, heads_major
from pallas_kernels.titans_linear.kernel import (
    scalar_names,
    titans_linear_bwd_call,
    titans_linear_fwd_call,
)

__all__ = ["titans_linear_pallas"]


def _gate_chunks(x, C):
    """``[B, T, H]`` (or ``[B, T]``: a head axis of 1) → ``[B, H, N, C]`` f32, zero padded."""
    x = x.astype(jnp.float32)
    if x.ndim == 2:
        x = x[..., None]
    x = jnp.moveaxis(pad_to_multiple(x, C), 2, 1)
    return x.reshape(x.shape[0], x.shape[1], -1, C)


def _coefficient_tables(theta, eta, alpha, segment_ids, C, rbw):
    """Per-chunk scalars ``[B·H, N, len(scalar_names), C]`` and ``D_read [B·H, N, C, C]`` (f32).

    The core's unrolled chunk (``core.titans.chunk``): with ``P`` the cumulative products of
    ``η`` and ``1 − α`` (rows ``t = 0..C``, 0 = chunk start), ``W_t = A_t M⁰ + C_t S⁰ −
    Σ_j D_tj θ̃_j u_j`` and ``S_t = E_t S⁰ − Σ_j P^η_tj θ̃_j u_j``. Reads take rows ``1..C``
    (``0..C−1`` with read-before-write), the final state the row of the chunk's last real token
    (padding never reaches it). Packed rows: at a reset ``η ← 0``, ``1 − α ← 0`` and the reset
    state enters as sources (``reset_coefficients``); ``d_r``, ``x_m`` are the row ``r`` of a
    document-local chunk start inside the chunk (``local_chunk_starts``).
    """
    B, T, H = theta.shape
    packed = segment_ids is not None
    th, et, al = (_gate_chunks(x, C) for x in (theta, eta, alpha))
    N = th.shape[2]
    last = jnp.minimum(C, T - C * jnp.arange(N))  # row (1..C) of each chunk's last real token
    sel = jax.nn.one_hot(last, C + 1, dtype=jnp.float32)  # [N, C+1]
    if packed:
        r = segment_resets(segment_ids)
        reset = _gate_chunks(r, C)  # [B, 1, N, C]
        bound = _gate_chunks(local_chunk_starts(r, C), C)
        keep = 1.0 - reset
        src_m, src_s = reset * (1.0 - al), reset * et
        et, al = et * keep, 1.0 - (1.0 - al) * keep
    A, Cc, E, peta, D = chunk_coefficients(et, al)
    coef_w = {"M0": A, "S0": Cc}
    coef_s = {"M0": jnp.zeros_like(E), "S0": E}
    if packed:
        (fw, gw), (fs, hs) = reset_coefficients(al, D, peta, E, src_m, src_s)
        coef_w.update(Mi=fw, Si=gw)
        coef_s.update(Mi=fs, Si=hs)
    rows = slice(0, -1) if rbw else slice(1, None)
    shape = th.shape

    def pick(c, onehot):  # the chunk scalar at the one-hot row, repeated over the lanes
        return jnp.broadcast_to(jnp.sum(c * onehot, -1)[..., None], shape)

    def row_of(m, onehot):  # the row of a [.., C+1, C] table
        return jnp.broadcast_to(jnp.sum(m * onehot[..., :, None], -2), shape)

    named = {"theta": th, "d_fin": row_of(D, sel), "p_fin": row_of(peta, sel)}
    for m in coef_w:
        named[f"r_{m}"] = jnp.broadcast_to(coef_w[m][..., rows], shape)
        named[f"w_{m}"] = pick(coef_w[m], sel)
        named[f"s_{m}"] = pick(coef_s[m], sel)
    if packed:
        after = (jnp.cumsum(reset, axis=-1) > 0).astype(jnp.float32)
        bnd = bound.at[..., 0].set(0.0)  # a start at offset 0 is the chunk's own (b0)
        row_r = jnp.pad(bnd, [(0, 0)] * 3 + [(0, 1)])  # token offset r ↔ row r
        named["d_r"] = row_of(D, row_r)
        for m in coef_w:
            named[f"x_{m}"] = pick(coef_w[m], row_r)
        mid = (jnp.cumsum(bnd, axis=-1) > 0).astype(jnp.float32) * (1.0 - after)
        named["after"] = jnp.broadcast_to(after, shape)
        named["mid"] = jnp.broadcast_to(mid, shape)
        named["has_r"] = pick(bnd, 1.0)
        named["has_i"] = pick(reset, 1.0)
        named["b0"] = jnp.broadcast_to(bound[..., :1], shape)
    sc = jnp.stack([named[n] for n in scalar_names(packed)], axis=-2)
    dread = jnp.broadcast_to(D[..., rows, :], (*shape, C))
    return sc.reshape(B * H, N, *sc.shape[3:]), dread.reshape(B * H, N, C, C)


def _kernel_inputs(q, k, v, theta, eta, alpha, segment_ids, chunk, rbw):
    """Heads-major padded operands and the coefficient tables with their VJP (to θ, η, α)."""
    tables, tables_vjp = jax.vjp(
        lambda th, et, al: _coefficient_tables(th, et, al, segment_ids, chunk, rbw),
        theta, eta, alpha,
    )  # fmt: skip
    return (*(heads_major(x, chunk) for x in (q, k, v)), *tables), tables_vjp


def _flat(x):
    """``[B, H, K, V] → [B·H, K, V]``."""
    return x.reshape(-1, *x.shape[2:])


def _run(q, k, v, theta, eta, alpha, m0, s0, reset, segment_ids, static, save_states):
    chunk, rbw, grad_clip, _, interpret = static
    B, T = q.shape[:2]
    args, _ = _kernel_inputs(q, k, v, theta, eta, alpha, segment_ids, chunk, rbw)
    reset_flat = None if reset is None else tuple(_flat(x) for x in reset)
    o, m_fin, s_fin, *states = titans_linear_fwd_call(
        *args, _flat(m0), _flat(s0), reset_flat, chunk=chunk, grad_clip=grad_clip,
        interpret=interpret, save_states=save_states,
    )  # fmt: skip
    out = (from_heads_major(o, B, T), (m_fin.reshape(m0.shape), s_fin.reshape(s0.shape)))
    return out, states


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _titans(q, k, v, theta, eta, alpha, m0, s0, reset, segment_ids, static):
    return _run(q, k, v, theta, eta, alpha, m0, s0, reset, segment_ids, static, False)[0]


def _titans_fwd(q, k, v, theta, eta, alpha, m0, s0, reset, segment_ids, static):
    out, states = _run(q, k, v, theta, eta, alpha, m0, s0, reset, segment_ids, static, True)
    return out, (q, k, v, theta, eta, alpha, m0, s0, reset, segment_ids, tuple(states))


def _titans_bwd(static, res, cts):
    chunk, rbw, grad_clip, horizon, interpret = static
    q, k, v, theta, eta, alpha, m0, s0, reset, segment_ids, states = res
    do, (dm_fin, ds_fin) = cts
    B, T = q.shape[:2]
    args, tables_vjp = _kernel_inputs(q, k, v, theta, eta, alpha, segment_ids, chunk, rbw)
    reset_flat = None if reset is None else tuple(_flat(x) for x in reset)
    dq, dk, dv, dsc, ddread, dm0, ds0, *dreset = titans_linear_bwd_call(
        *args, states, reset_flat, heads_major(do, chunk), _flat(dm_fin), _flat(ds_fin),
        chunk=chunk, grad_clip=grad_clip, horizon=horizon, interpret=interpret,
    )  # fmt: skip
    dth, det, dal = tables_vjp((dsc, ddread))
    dq, dk, dv = (from_heads_major(d, B, T).astype(x.dtype) for d, x in ((dq, q), (dk, k), (dv, v)))
    gates = tuple(d.astype(x.dtype) for d, x in ((dth, theta), (det, eta), (dal, alpha)))
    dreset = None if reset is None else tuple(d.reshape(m0.shape) for d in dreset)
    return (dq, dk, dv, *gates, dm0.reshape(m0.shape), ds0.reshape(s0.shape), dreset, None)


_titans.defvjp(_titans_fwd, _titans_bwd)


def _zero_state(q, shape):
    """The zero f32 state, varying over the manual mesh axes ``q`` varies over (so that under
    ``jax.shard_map`` its cotangent has the type of the kernels' outputs)."""
    varying = tuple(sorted(jax.typeof(q).manual_axis_type.varying))
    return lax.pcast(jnp.zeros(shape, jnp.float32), varying, to="varying")


def _as_state(fn, x, q, B, H, K, V, name):
    if x is None:
        z = _zero_state(q, (B, H, K, V))
        return z, z
    st = state_of(fn, x, B, H, K, V, name=name)
    return st.M, st.S


@functools.partial(jax.jit, static_argnames=("rule", "interpret"))
def titans_linear_pallas(
    q,
    k,
    v,
    theta,
    eta,
    alpha,
    *,
    initial_state=None,
    rule: TitansRule = TitansRule(),
    segment_ids=None,
    reset_state=None,
    interpret: bool = False,
):
    """Titans matrix memory by the Pallas chunk kernels (SPEC §2, ``L_M = 1``; SPEC §0.1).

    Equals ``titans_linear_chunked(..., rule=rule)``: per token
    ``S_t = η_t S_{t-1} − θ_t k_t (M⁰ᵀk_t − v_t)ᵀ``, ``M_t = (1 − α_t) M_{t-1} + S_t``,
    ``o_t = M_tᵀ q_t`` (``M_{t-1}ᵀ q_t`` with ``read_before_write``), the surprise taken at the
    memory ``M⁰`` of the chunk start. Gradients: ``custom_vjp`` with the reverse-chunk kernel.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; theta, eta, alpha: ``[B, T, H]``; any T (the
        last chunk is padded; the final state is read at the last real token). Any float dtypes
        (computed in f32).
      initial_state: None (zeros), ``TitansLinearState(M, S)`` / ``(M, S)`` or a bare ``M``,
        ``[B, H, K, V]``.
      rule: :class:`~nested_jax.rules.TitansRule` (a jit static), as ``titans_linear_chunked``:
        ``memory_chunk`` (the chunk ``b``, a multiple of 8: the kernels' chunk is a whole number
        of TPU sublanes; ``T`` is padded to a multiple), ``read_before_write``, ``grad_clip``
        (softclamp ``c`` of ``‖u_t‖ = ‖k_t‖‖e_t‖``, 0 = off), ``per_chunk_gates`` and
        ``grad_horizon`` (the carried state's cotangent is zeroed before every chunk that starts
        at a positive multiple of it). ``remat`` does not apply (the backward kernel recomputes
        each chunk from the saved chunk-start states).
      segment_ids: optional ``[B, T]`` int (packed rows): the state resets to ``reset_state`` at
        every document start and every document keeps its own chunk grid, as
        ``titans_mlp_chunked`` does.
      reset_state: the state of a document start (same forms as ``initial_state``; default
        ``initial_state``). Only with ``segment_ids``.
      interpret: run the Pallas interpreter (any backend) instead of compiling for TPU.

    Returns:
      ``(o [B, T, H, V] in v's dtype, TitansLinearState(M, S) f32 [B, H, K, V])``.
    """
    fn = "titans_linear_pallas"
    check_rule(fn, rule)
    C = rule.memory_chunk
    if C % SUBLANES:
        raise ValueError(
            f"{fn}: rule.memory_chunk must be a multiple of {SUBLANES} (the kernels' chunk is a "
            f"whole number of TPU sublanes), got {C}"
        )
    B, T, H, K, V = validate_common(fn, q, k, v, theta, eta, alpha, per_token=False)
    validate_segment_ids(fn, segment_ids, B, T)
    validate_horizon(fn, rule)
    if reset_state is not None and segment_ids is None:
        raise ValueError(f"{fn}: reset_state needs segment_ids (it is the state of a reset)")
    m0, s0 = _as_state(fn, initial_state, q, B, H, K, V, "initial_state")
    reset = None
    if segment_ids is not None:
        reset = (m0, s0) if reset_state is None else state_of(fn, reset_state, B, H, K, V,
                                                                name="reset_state")  # fmt: skip
        reset = tuple(reset)
    if rule.per_chunk_gates:
        theta, eta, alpha = (chunk_pool(x.astype(jnp.float32), C, T) for x in (theta, eta, alpha))
    clip = float(rule.grad_clip) or None
    static = (C, rule.read_before_write, clip, rule.grad_horizon, bool(interpret))
    o, (M, S) = _titans(q, k, v, theta, eta, alpha, m0, s0, reset, segment_ids, static)
    return o, TitansLinearState(M, S)
