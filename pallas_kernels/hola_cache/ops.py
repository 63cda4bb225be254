"""Jitted entry of the Pallas HOLA cache read (SPEC §5): padding, layout, ``custom_vjp``.

``hola_cache_read_pallas`` computes ``nested_jax.core.hola.cache.read_blocks`` (every block's
read over ``[A_{n−1} ‖ block (causal, filled) ‖ sink]``, given the stacked caches), with its
arguments unpacked (the cache triple and the read parameters as separate arrays); ``ops.hola``
wraps it as the ``read=`` of ``core.hola.stream.cache_blocks``'s two-phase form. The block ``C``
and the window ``w`` are padded here to multiples of 8 (padded slots are unfilled, padded entries
invalid: they get zero probability), the layout made heads-major, and the parameters packed into
one ``[B·H, 3, K]`` row block whose gradient JAX reduces back to ``γ_q, γ_k [H, K]`` and
``sink [H]``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.rules import READ_NORMS
from pallas_kernels.common import SUBLANES
from pallas_kernels.hola_cache.kernel import hola_cache_bwd_call, hola_cache_fwd_call

__all__ = ["BlockSizes", "hola_cache_read_pallas"]

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the HOLA cache-read kernels (not part of the rule: any value gives the same read).

    Attributes:
      block_q: the most queries per grid step (a positive multiple of 8). The tile is the largest
        multiple of 8 that divides the block (``C`` padded to a multiple of 8) and is at most
        ``block_q``.
    """

    block_q: int

    def __post_init__(self):
        b = self.block_q
        if not isinstance(b, int) or isinstance(b, bool) or b <= 0 or b % SUBLANES:
            raise ValueError(f"BlockSizes: block_q must be a positive multiple of 8, got {b!r}")

    @classmethod
    def get_default(cls) -> BlockSizes:
        """``block_q=256``: the default block ``C = 256`` in one tile per grid step."""
        return cls(block_q=256)


def _round8(x: int) -> int:
    return -(-x // SUBLANES) * SUBLANES


def _query_tile(C: int, block_q: int) -> int:
    """The largest multiple of 8 dividing ``C`` (a multiple of 8) and at most ``block_q``."""
    return max(b for b in range(SUBLANES, min(C, block_q) + 1, SUBLANES) if C % b == 0)


def _pad_axis(x, axis, size, value=0):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _vary_like(x, ref):
    """``x`` varying over the manual mesh axes ``ref`` varies over (under ``jax.shard_map``), so
    that its cotangent, computed from varying operands, has its type."""
    missing = set(jax.typeof(ref).manual_axis_type.varying)
    missing -= set(jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def _flat(x):
    """``[B, H, ...] → [B·H, ...]``."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _read(q, k, v, ck, cv, cmask, fmask, par, static):
    return hola_cache_fwd_call(q, k, v, ck, cv, cmask, fmask, par, **dict(static))


def _read_fwd(q, k, v, ck, cv, cmask, fmask, par, static):
    o = hola_cache_fwd_call(q, k, v, ck, cv, cmask, fmask, par, **dict(static))
    return o, (q, k, v, ck, cv, cmask, fmask, par)


def _read_bwd(static, res, do):
    q, k, v, ck, cv, cmask, fmask, par = res
    dq, dk, dv, dck, dcv, dpar = hola_cache_bwd_call(*res, do, **dict(static))
    return dq, dk, dv, dck, dcv, None, None, jnp.sum(dpar, axis=1)


_read.defvjp(_read_fwd, _read_bwd)


@functools.partial(
    jax.jit, static_argnames=("read_norm", "cache_scale", "block_sizes", "interpret")
)
def hola_cache_read_pallas(
    qh,
    kh,
    vh,
    ck,
    cv,
    cval,
    filled,
    gamma_q,
    gamma_k,
    sink,
    read_norm="rmsnorm",
    cache_scale=None,
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
):
    """Every HOLA block's cache read by the Pallas kernels (SPEC §5).

    Block ``n`` holds the slots ``[nC, (n+1)C)``; its query at slot ``t`` reads ``[A_{n−1} ‖
    filled block slots ≤ t ‖ sink]`` with ``q̃ = N_q(q), k̃ = N_k(k)`` and logits
    ``cache_scale · q̃ᵀ k̃`` (``core.hola.cache.read_blocks``, whose arguments these are,
    unpacked: ``(ck, cv, cval)`` for its ``cache`` and ``gamma_q, gamma_k, sink`` for its
    ``params``).
    Gradients (``custom_vjp``, the backward kernel) reach ``qh, kh, vh``, the cache entries
    ``ck, cv``, ``gamma_q, gamma_k`` and ``sink``.

    Args:
      qh, kh: ``[B, H, L, K]``; vh: ``[B, H, L, V]`` slots (``L = n·C``; any float dtype, read in
        f32).
      ck: ``[B, H, n, w, K]``; cv: ``[B, H, n, w, V]``; cval: ``bool [B, H, n, w]``, the caches
        ``A_{n−1}`` of the blocks.
      filled: ``bool [n, C]`` the slots that hold a token.
      gamma_q, gamma_k: ``[H, K]``; sink: ``[H]``.
      read_norm: ``"rmsnorm"`` | ``"l2"``; cache_scale: the logit scale (default ``K ** -0.5``).
      block_sizes: :class:`BlockSizes` (default ``BlockSizes.get_default()``).
      interpret: run the Pallas interpreter (any backend) instead of compiling for TPU.

    Returns:
      ``o [B, H, L, V]`` f32.
    """
    fn = "hola_cache_read_pallas"
    if block_sizes is None:
        block_sizes = BlockSizes.get_default()
    if not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"{fn}: block_sizes must be a BlockSizes, got {block_sizes!r}")
    if read_norm not in READ_NORMS:
        raise ValueError(f"{fn}: read_norm must be one of {READ_NORMS}, got {read_norm!r}")
    if getattr(qh, "ndim", None) != 4:
        raise ValueError(f"{fn}: qh must have shape [B, H, L, K], got {getattr(qh, 'shape', None)}")
    B, H, L, K = qh.shape
    if getattr(filled, "ndim", None) != 2 or filled.shape[0] * filled.shape[1] != L:
        raise ValueError(
            f"{fn}: filled must have shape [n, C] with n·C = L = {L}, got "
            f"{getattr(filled, 'shape', None)}"
        )
    n, C = filled.shape
    W = ck.shape[3] if getattr(ck, "ndim", None) == 5 else None
    V = vh.shape[-1] if getattr(vh, "ndim", None) == 4 else None
    expected = {
        "kh": (kh, (B, H, L, K)),
        "vh": (vh, (B, H, L, V)),
        "ck": (ck, (B, H, n, W, K)),
        "cv": (cv, (B, H, n, W, V)),
        "cval": (cval, (B, H, n, W)),
        "gamma_q": (gamma_q, (H, K)),
        "gamma_k": (gamma_k, (H, K)),
        "sink": (sink, (H,)),
    }
    for name, (x, shape) in expected.items():
        if None in shape or getattr(x, "shape", None) != shape:
            raise ValueError(
                f"{fn}: {name} must have shape {shape} (B, H, L, K, n, w from qh, filled, ck), "
                f"got {getattr(x, 'shape', None)}"
            )
    cs = K**-0.5 if cache_scale is None else float(cache_scale)
    Cp, Wp = _round8(C), _round8(W)

    def tokens(x):  # [B, H, n·C, D] → [B·H, n·Cp, D] f32
        x = _pad_axis(x.astype(_F32).reshape(B, H, n, C, -1), 3, Cp)
        return x.reshape(B * H, n * Cp, -1)

    def entries(x):  # [B, H, n, w, D] → [B·H, n·Wp, D] f32
        return _pad_axis(x.astype(_F32), 3, Wp).reshape(B * H, n * Wp, -1)

    cmask = _pad_axis(cval, 3, Wp, False).astype(_F32).reshape(B * H, n, 1, Wp)
    fmask = _pad_axis(filled, 1, Cp, False).astype(_F32).reshape(n, 1, Cp)
    rows = jnp.stack(
        [gamma_q.astype(_F32), gamma_k.astype(_F32),
         jnp.broadcast_to(sink.astype(_F32)[:, None], (H, K))], axis=1,
    )  # fmt: skip
    par = _vary_like(_flat(jnp.broadcast_to(rows[None], (B, H, 3, K))), qh)
    static = (
        ("block", Cp),
        ("bq", _query_tile(Cp, block_sizes.block_q)),
        ("read_norm", read_norm),
        ("cache_scale", cs),
        ("interpret", bool(interpret)),
    )
    o = _read(tokens(qh), tokens(kh), tokens(vh), entries(ck), entries(cv), cmask, fmask, par,
              static)  # fmt: skip
    return o.reshape(B, H, n, Cp, -1)[:, :, :, :C].reshape(B, H, L, -1)
