"""A Hope chunk's in-order updates in parallel form: one triangular solve per layer (SPEC §3.2).

Inside a chunk every memory layer sees fixed inputs ``x_t`` and signals ``g_t`` (computed from the
chunk-start snapshots), so its per-token rule (SPEC §3.1, §3.2)::

    u_t = −γ_t (W_{t−1} x_t + g_t) x_tᵀ      (dgd; plain GD: u_t = −η_t g_t x_tᵀ)
    S_t = μ S_{t−1} + u_t,   W_t = α_t W_{t−1} + S_t      (no momentum: μ = 0, S_t = u_t)

is linear in ``(W, S)``. Unrolled from the chunk start ``(W_0, S_0)`` (0-based tokens, ``b_j =
Σ_{r≤j} log α_r``)::

    W_j = P_j W_0 + Q_j S_0 + Σ_{s≤j} E_{j,s} U_s x_sᵀ,     u_s = U_s x_sᵀ
    P_j = e^{b_j},   Q_j = Σ_{r≤j} e^{b_j − b_r} μ^{r+1},
    E_{j,s} = Σ_{r=s}^{j} e^{b_j − b_r} μ^{r−s}

The state *before* token ``j`` (row ``j`` of the "before" coefficients ``P̄_j = P_{j−1}``,
``Ē_{j,s} = E_{j−1,s}`` for ``s < j``, ``P̄_0 = 1``, ``Q̄_0 = 0``) gives the DGD term
``W_{j−1} x_j`` and the reads ``W_{j−1} z_j``; so with the strictly lower
``K_{j,s} = Ē_{j,s} (x_s · x_j)``::

    U = −Γ (a + g + K U),  a_j = P̄_j W_0 x_j + Q̄_j S_0 x_j   ⇒   (I + Γ K) U = −Γ (a + g)

one unit-lower-triangular ``C × C`` solve per layer (the WY/UT solve of the gated delta rule,
SPEC §1: without momentum this *is* a gated delta rule with key ``x``, value ``−α g``, decay ``α``
and ``β = γ/α``). The chunk end is row ``n`` of the same coefficients (``n`` = the number of valid
tokens, so zero padding at the end of a row is never applied) and ``S_n = μ^n S_0 + Σ_{s<n}
μ^{n−1−s} U_s x_sᵀ``. A read of the running weights is ``W_{j−1} z_j = P̄_j W_0 z_j + Q̄_j S_0 z_j
+ Σ_{s<j} Ē_{j,s} (x_s · z_j) U_s``. Everything is matmuls over the chunk: nothing walks its tokens.

Packed rows fold in as in SPEC §0: a document start at token ``r`` restarts the rows ``j ≥ r``
from the initial memories and zero momenta (:func:`chunk_coefficients`). Values equal the
per-token rule up to float rounding (``tests/core/hope/test_hope.py`` compares with the twin).
Shapes: ``W [B, H, o, i]``, ``x [B, H, C, i]``, ``g [B, H, C, o]``, gates ``[B, H, C]``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from nested_jax.core.dgd import clamped_rate, dgd_step_size
from nested_jax.core.wy import solve_tril
from nested_jax.rules import HopeRule

__all__ = [
    "CHUNK_RESIDUAL",
    "keep_for_backward",
    "ChunkCoefficients",
    "chunk_coefficients",
    "layer_chunk",
    "layer_end",
    "layer_updates",
    "read_running",
]

_TINY_RETENTION = 1e-30

# The name of a chunk's token-sized intermediates that read the memories (products ``W z``, the
# update vectors): the chunk scan's ``jax.checkpoint`` saves them, so the backward does not read
# every weight again to recompute them (``core.hope.chunk._scan``).
CHUNK_RESIDUAL = "hope_chunk_residual"


def keep_for_backward(x):
    """``x`` named :data:`CHUNK_RESIDUAL` (saved by the chunk's checkpoint, not recomputed)."""
    return checkpoint_name(x, CHUNK_RESIDUAL)


class ChunkCoefficients(NamedTuple):
    """Scalar coefficients of one chunk, shared by every layer of every memory (module docstring).

    Row ``j = 0 … C`` describes the state just before token ``j`` (row ``C``: after the chunk).

    Attributes:
      p_before, q_before: ``[B, H, C+1]``: ``P̄_j``, ``Q̄_j``.
      e_before: ``[B, H, C+1, C]``: ``Ē_{j,s}`` (zero for ``s ≥ j`` and across a reset).
      s_before: ``[B, C+1, C]``: ``μ^{j−1−s}`` for ``s < j`` in the same document.
      mu_pow: ``[B, C+1]``: ``μ^j`` (the chunk-start momentum's weight; 0 after a reset).
      fresh: ``[B, C+1]`` bool: a document started in this chunk at or before row ``j``, so the
        row's base weights are the initial memories instead of the chunk-start weights.
      end: ``[B, C+1]`` one-hot of the number of valid tokens ``n`` (the chunk-end row).
    """

    p_before: jax.Array
    q_before: jax.Array
    e_before: jax.Array
    s_before: jax.Array
    mu_pow: jax.Array
    fresh: jax.Array
    end: jax.Array


def chunk_coefficients(alpha, mu: float, valid, reset=None) -> ChunkCoefficients:
    """The chunk's coefficients from the retention gates and the momentum coefficient.

    A packed-row reset at token ``r`` (SPEC §0) restarts the recurrence just before ``r`` from the
    initial memories and zero momenta: rows ``j ≥ r`` only see tokens ``s ≥ r``, their decay
    products start at ``r`` and their base is the initial memory (``fresh``).

    Args:
      alpha: ``[B, H, C]`` retention ``α_t ∈ (0, 1]``.
      mu: momentum coefficient ``μ`` (a Python float; 0 = no momentum).
      valid: ``[B, C]`` bool, a prefix of each row (padding only at the end).
      reset: optional ``[B, C]`` bool: a document starts at the token (only valid tokens count).
    """
    B, C = valid.shape
    idx = jnp.arange(C)
    reset = jnp.zeros((B, C), bool) if reset is None else reset & valid
    last = jax.lax.cummax(jnp.where(reset, idx, 0), axis=1)  # the row's document start in chunk
    start = jnp.concatenate([last, last[:, -1:]], axis=1)  # [B, C+1]; row C: the last token's
    fresh = jnp.concatenate([jnp.cumsum(reset, 1), jnp.sum(reset, 1, keepdims=True)], 1) > 0
    row = jnp.arange(C + 1)[:, None]
    seen = (idx[None, :] < row) & (idx[None, None, :] >= start[:, :, None])  # [B, C+1, C]
    # log α from α ≥ 1e-30: a retention that underflows to 0 (σ of a logit below ≈ −104 in f32)
    # would make log α = −inf and the differences below NaN; the per-token rule just multiplies
    # by α, so clamping changes no value beyond 1e-30 and keeps the 1/α of the backward finite.
    b = jnp.cumsum(jnp.log(jnp.maximum(alpha, _TINY_RETENTION)), axis=-1)  # [B, H, C]
    b_prev = jnp.concatenate([jnp.zeros_like(b[..., :1]), b], axis=-1)  # b_{j−1}, j = 0..C
    on = seen[:, None]  # [B, 1, C+1, C]
    decay = jnp.where(on, jnp.exp(jnp.where(on, b_prev[..., :, None] - b[..., None, :], 0.0)), 0.0)
    lag = np.arange(C)[:, None] - np.arange(C)[None, :]
    mu_mat = np.where(lag >= 0, float(mu) ** np.maximum(lag, 0), 0.0).astype(np.float32)
    mu_next = (float(mu) ** np.arange(1, C + 1)).astype(np.float32)  # μ^{r+1}
    p_start = jnp.take_along_axis(b_prev, jnp.broadcast_to(start[:, None], b_prev.shape), -1)
    gap = np.maximum(np.arange(C + 1)[:, None] - 1 - np.arange(C)[None, :], 0)
    mu_pow = (float(mu) ** np.arange(C + 1)).astype(np.float32)
    count = jnp.sum(valid.astype(jnp.int32), axis=-1)
    return ChunkCoefficients(
        p_before=jnp.exp(b_prev - p_start),
        q_before=jnp.where(fresh[:, None], 0.0, jnp.einsum("bhjr,r->bhj", decay, mu_next)),
        e_before=jnp.where(on, jnp.einsum("bhjr,rs->bhjs", decay, mu_mat), 0.0),
        s_before=jnp.where(seen, (float(mu) ** gap).astype(np.float32), 0.0),
        mu_pow=jnp.where(fresh, 0.0, mu_pow),
        fresh=fresh,
        end=jax.nn.one_hot(count, C + 1, dtype=alpha.dtype),
    )


def _base(W0, W_init, z, fresh, w0z=None):
    """``W_0 z_j`` (``w0z`` when the caller has it) or, on rows after a document start,
    ``W_init z_j``: ``[B, H, C, o]``."""
    out = jnp.einsum("bhoi,bhci->bhco", W0, z) if w0z is None else w0z
    if W_init is None:
        return out
    restart = jnp.einsum("bhoi,bhci->bhco", W_init, z)
    return jnp.where(fresh[:, None, : z.shape[2], None], restart, out)


def read_running(W0, S0, x, U, z, co: ChunkCoefficients, W_init=None, w0z=None):
    """``W_{j−1} z_j`` for every token ``j`` of the chunk: ``[B, H, C, o]`` (module docstring).

    Args:
      W0, S0: ``[B, H, o, i]`` weights and momentum at the chunk start (``S0`` None: none).
      x: ``[B, H, C, i]`` the layer's inputs; U: ``[B, H, C, o]`` its update vectors (None: the
        chunk-start part only, ``P̄_j W_0 z_j + Q̄_j S_0 z_j``).
      z: ``[B, H, C, i]`` the queries.
      W_init: ``[B, H, o, i]`` the weights a document start resets to (None: no resets).
      w0z: optional ``W_0 z`` ``[B, H, C, o]`` already computed (saves one read of ``W_0``).
    """
    C = x.shape[2]
    out = co.p_before[..., :C, None] * _base(W0, W_init, z, co.fresh, w0z)
    if S0 is not None:
        out = out + co.q_before[..., :C, None] * jnp.einsum("bhoi,bhci->bhco", S0, z)
    if U is None:
        return out
    mix = co.e_before[..., :C, :] * jnp.einsum("bhci,bhsi->bhcs", z, x)
    return out + jnp.einsum("bhcs,bhso->bhco", mix, U)


def layer_updates(
    W0, S0, x, g, lr, co: ChunkCoefficients, *, rule: HopeRule, W_init=None, w0x=None
):
    """One memory layer's update vectors ``U [B, H, C, o]`` over one chunk (``u_t = U_t x_tᵀ``).

    Args:
      W0, S0: ``[B, H, o, i]`` at the chunk start (``S0`` None without momentum).
      x: ``[B, H, C, i]`` inputs; g: ``[B, H, C, o]`` signals (both from the chunk-start
        snapshot; zero on padded tokens).
      lr: ``[B, H, C]`` inner rate ``η_t`` (zero on padded tokens).
      co: :func:`chunk_coefficients` of the chunk (its ``μ`` is ``rule.mu``).
      rule: the :class:`HopeRule`; read: ``dgd`` and ``step`` (the DGD step ``γ =
        dgd_step_size(η, x, step)``, or plain GD: ``γ = η``, no ``W_{t−1} x_t`` term),
        ``dgd_target`` (SPEC §3.2: ``gradient``, the ``W_{t−1} x_t`` term above, or
        ``proximal``, ``u_t = −γ_t g_t x_tᵀ``: no solve) and ``grad_clip`` (softclamp of each
        token's layer gradient ``g xᵀ`` in the rate, :func:`core.dgd.clamped_rate`; 0 = off).
      W_init: ``[B, H, o, i]`` the weights a document start resets to (None: no resets).
      w0x: optional ``W_0 x`` ``[B, H, C, o]`` already computed (the signals' own product when
        the snapshot is the running memory).
    """
    lr = clamped_rate(lr, g, x, rule.grad_clip)
    if rule.dgd and rule.dgd_target == "proximal":
        return -dgd_step_size(lr, x, step=rule.step)[..., None] * g
    if not rule.dgd:
        return -lr[..., None] * g
    gamma = dgd_step_size(lr, x, step=rule.step)[..., None]  # [B, H, C, 1]
    a = keep_for_backward(read_running(W0, S0, x, None, x, co, W_init, w0x))  # P̄W_0x + Q̄S_0x
    k_mat = co.e_before[..., :-1, :] * jnp.einsum("bhci,bhsi->bhcs", x, x)
    # (I + Γ K) U = −Γ(a + g), unit lower: the WY form's solve (runs on Explicit meshes too)
    return keep_for_backward(solve_tril(gamma * k_mat, -gamma * (a + g)))


def _after(x, dep):
    """``x``, computed after ``dep`` (``x + 0·dep[0…]``, gradient stopped): a data dependency that
    XLA cannot fold away. The chunk-end weights and momenta are written after every read of the
    chunk-start ones, so XLA writes them in place instead of copying the carried stacks each
    chunk. Exact for finite ``dep``."""
    return x + 0.0 * lax.stop_gradient(dep[(0,) * dep.ndim]).astype(x.dtype)


def _outer_sum(U, x):
    """``Σ_s U_s x_sᵀ`` ``[B, H, o, i]`` of ``U [B, H, C, o]``, ``x [B, H, C, i]``, with ``U``
    transposed first (token-sized): the backward's products with the weight-sized cotangent then
    need no transpose of it (XLA:CPU would otherwise transpose the whole stack per chunk)."""
    return jnp.einsum("bhos,bhsi->bhoi", jnp.swapaxes(U, -1, -2), x)


def layer_end(W0, S0, x, U, co: ChunkCoefficients, W_init=None, after=None):
    """The chunk-end ``(W_n, S_n)`` of one memory layer from its update vectors (module
    docstring): ``W_n = P̄_n base + Q̄_n S_0 + Σ_s Ē_{n,s} U_s x_sᵀ``, ``S_n = μ^n S_0 +
    Σ_s μ^{n−1−s} U_s x_sᵀ`` (``base`` is ``W_init`` when a document started in the chunk; ``S0``
    None: no momentum, returns ``S_n`` None). Shapes as :func:`layer_updates`. ``after``: an
    array computed from other reads of ``W0`` or ``S0`` (the caller's read-before-write output),
    which the writes are ordered after (:func:`_after`)."""
    end = lambda c: jnp.einsum("bj,bhj...->bh...", co.end, c)  # noqa: E731  (row n)
    base = W0
    if W_init is not None:
        restarted = jnp.sum(co.end * co.fresh, axis=1)[:, None, None, None] > 0
        base = jnp.where(restarted, W_init, W0)
    W = end(co.p_before)[..., None, None] * base
    # The coefficients scale U first, so the product is U'ᵀ x with both operands batched like
    # the weights (under the caller's vmap over stacked memories the contraction keeps that
    # axis as a batch axis instead of transposing the whole stack).
    W = W + _outer_sum(end(co.e_before)[..., None] * U, x)
    if after is not None:
        W = _after(W, after)
    if S0 is None:
        return W, None
    W = W + end(co.q_before)[..., None, None] * S0
    s_end = jnp.einsum("bj,bjs->bs", co.end, co.s_before)  # μ^{n−1−s}
    S = jnp.einsum("bj,bj->b", co.end, co.mu_pow)[:, None, None, None] * S0
    S = S + _outer_sum(s_end[:, None, :, None] * U, x)
    return W, _after(S, W)  # S_0 is read by W_n too: S_n overwrites it after


def layer_chunk(W0, S0, x, g, lr, co: ChunkCoefficients, *, rule: HopeRule, W_init=None):
    """One memory layer over one chunk: ``(U, W_n, S_n)`` (:func:`layer_updates` under ``rule``,
    then :func:`layer_end`)."""
    U = layer_updates(W0, S0, x, g, lr, co, rule=rule, W_init=W_init)
    return (U, *layer_end(W0, S0, x, U, co, W_init))
