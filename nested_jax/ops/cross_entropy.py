"""Token cross-entropy over the vocabulary without the batch's ``[B, T, V]`` float32 logits.

The LM loss (SPEC §6; ``nested_jax.train.step.masked_cross_entropy``) is::

    z_t        = h_t W                      (f32 logits, W the output projection)
    nll_t      = logsumexp(z_t) − z_t[y_t]
    loss_sum   = Σ_t m_t · nll_t            (positions with m_t ≤ 0 contribute exactly 0)
    weight_sum = Σ_t m_t

Written plainly it materialises ``z`` as f32 ``[B, T, V]`` (and, in the backward pass, the
softmax and its integer / boolean helpers of the same shape): ~4 GB each for 16 sequences of 2048
tokens and a 32k vocabulary per chip. :func:`chunked_cross_entropy` walks the sequence in chunks
of ``c`` positions with ``lax.scan``; each chunk's body is under ``jax.checkpoint``, so the
backward pass recomputes the chunk's logits instead of storing them and peak memory is
``O(B · c · V)``. The per-token ``nll`` (``[B, T]`` f32, small) is reduced once at the end with
the same expression as the plain loss.

``impl``: ``"chunked"`` is the one XLA form; ``"pallas"`` is the seam for a fused kernel
(``pallas_kernels/cross_entropy``), not wired, so it raises ``ValueError``.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from nested_jax.ops._impl import check_impl as _check_impl
from nested_jax.parallel.mesh import constrain

__all__ = ["WEIGHT_LAYOUTS", "chunked_cross_entropy"]

WEIGHT_LAYOUTS = ("vd", "dv")
_EINSUM = {"vd": "btd,vd->btv", "dv": "btd,dv->btv"}


def _token_nll(hidden, weight, targets, layout):
    """``nll [B, c]`` f32 of one chunk: f32 logits ``hidden · weight`` (weight cast to the
    activation dtype), then the integer-label softmax cross-entropy ``logsumexp(z) − z_target``."""
    logits = jnp.einsum(
        _EINSUM[layout],
        hidden,
        weight.astype(hidden.dtype),
        preferred_element_type=jnp.float32,
    )
    # On a mesh: rows stay on the batch axes, the vocabulary on the tensor axis (no-op off-mesh).
    logits = constrain(logits, ("batch", None, "vocab"))
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def chunked_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    *,
    chunk_tokens: int,
    weight_layout: str,
    impl: str = "chunked",
) -> tuple[jax.Array, jax.Array]:
    """Summed masked cross-entropy ``Σ_t m_t (logsumexp(h_t W) − (h_t W)[y_t])`` and ``Σ_t m_t``.

    Equal (values and gradients, up to float summation order) to
    ``masked_cross_entropy(einsum(hidden, weight.astype(hidden.dtype),
    preferred_element_type=f32), targets, mask)`` but without the ``[B, T, V]`` logits: the
    sequence is walked in chunks of ``chunk_tokens`` positions (``T`` padded up to a multiple of
    the chunk with mask 0), each chunk's logits recomputed in the backward pass.

    Args:
      hidden: ``[B, T, d]`` final hidden states in the activation dtype (e.g. bf16).
      weight: output projection, ``[V, d]`` for ``weight_layout="vd"`` (tied embedding) or
        ``[d, V]`` for ``"dv"`` (untied head kernel); cast to ``hidden.dtype`` for the matmul,
        logits accumulated in f32.
      targets: ``int [B, T]`` token ids.
      mask: ``[B, T]`` weights (1 = count the token, 0 = padding / ignored).
      chunk_tokens: positions per chunk; ``<= 0`` or ``>= T`` = one chunk (the plain loss).
      weight_layout: ``"vd"`` or ``"dv"``.
      impl: ``"chunked"`` (``"recurrent"``, ``"pallas"``: ValueError).

    Returns:
      ``(loss_sum, weight_sum)`` f32 scalars (nats and counted weight).
    """
    chunk_tokens = _check_loss_inputs(hidden, weight, targets, mask, chunk_tokens, weight_layout)
    _check_impl("chunked_cross_entropy", impl, ("chunked",))
    if chunk_tokens <= 0 or chunk_tokens >= hidden.shape[1]:
        nll = _token_nll(hidden, weight, targets, weight_layout)
    else:
        nll = _scanned_token_nll(hidden, weight, targets, weight_layout, chunk_tokens)
    m = mask.astype(jnp.float32)
    # where(): positions outside the mask may hold inf/NaN and must not leak into the sum.
    return jnp.sum(jnp.where(m > 0, nll, 0.0) * m), jnp.sum(m)


def _check_loss_inputs(hidden, weight, targets, mask, chunk_tokens, weight_layout) -> int:
    """Validates the arguments of :func:`chunked_cross_entropy`; returns ``chunk_tokens`` as int."""
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"weight_layout: expected one of {WEIGHT_LAYOUTS}, got {weight_layout!r}")
    if hidden.ndim != 3:
        raise ValueError(f"hidden: expected shape [B, T, d], got {tuple(hidden.shape)}")
    b, t, d = hidden.shape
    w_doc = "[V, d]" if weight_layout == "vd" else "[d, V]"
    w_d = weight.shape[1 if weight_layout == "vd" else 0] if weight.ndim == 2 else None
    if weight.ndim != 2 or w_d != d:
        raise ValueError(
            f"weight: expected shape {w_doc} with d={d} (weight_layout={weight_layout!r}), "
            f"got {tuple(weight.shape)}"
        )
    if targets.shape != (b, t) or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(
            f"targets: expected int [B, T] = {(b, t)}, got {targets.dtype} {tuple(targets.shape)}"
        )
    if mask.shape != (b, t):
        raise ValueError(f"mask: expected shape [B, T] = {(b, t)}, got {tuple(mask.shape)}")
    try:
        return operator.index(chunk_tokens)
    except TypeError:
        raise ValueError(f"chunk_tokens: expected an int, got {chunk_tokens!r}") from None


def _scanned_token_nll(hidden, weight, targets, weight_layout, chunk_tokens):
    """Per-token NLL ``[B, T]`` f32 computed ``chunk_tokens`` positions at a time.

    A ``lax.scan`` over ``[n, B, c, ...]`` chunks (``T`` padded to ``n·c``) whose body is
    checkpointed, so only one chunk's ``[B, c, V]`` logits exist at a time, forward or backward.
    """
    b, t, d = hidden.shape
    c = chunk_tokens
    n = -(-t // c)
    pad = n * c - t
    # Padded positions: zero hidden (finite logits), target 0; the caller's mask drops them.
    hp = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    yp = jnp.pad(targets, ((0, 0), (0, pad)))
    # [B, n·c, ...] -> [n, B, c, ...]: the scan walks the chunk axis.
    hs = jnp.swapaxes(hp.reshape(b, n, c, d), 0, 1)
    ys = jnp.swapaxes(yp.reshape(b, n, c), 0, 1)

    # The weight enters the body in its own dtype (the cast is inside): its gradient is
    # accumulated over the chunks in that dtype (f32 for f32 parameters).
    # prevent_cse=False: inside lax.scan the recomputation cannot be merged with the forward.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk(h, y):
        return _token_nll(h, weight, y, weight_layout)

    def body(carry, xs):
        return carry, chunk(*xs)

    _, nlls = jax.lax.scan(body, None, (hs, ys))  # [n, B, c]
    return jnp.swapaxes(nlls, 0, 1).reshape(b, n * c)[:, :t]
