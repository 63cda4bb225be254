"""Language-modelling metrics: masked loss sums aggregated across batches, bits/byte, perplexity.

Aggregate by summing :func:`masked_loss_sums` over batches (and processes), then convert once:
``bits_per_byte = nats / (ln 2 * bytes)`` and ``perplexity = exp(nats / tokens)``. Summing first and
dividing last weights every scored token equally, whatever the batch padding.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def masked_loss_sums(per_token_loss, loss_mask, targets, token_bytes) -> dict:
    """Sums of a batch's scored losses, tokens and text bytes (jittable).

    ``nats = sum(loss * mask)``, ``tokens = sum(mask)``,
    ``bytes = sum(mask * token_bytes[targets])``.

    Args:
      per_token_loss: float[B, T], negative log-likelihood (nats) of each target.
      loss_mask: float or bool [B, T]; 1 where the target is scored.
      targets: int[B, T] target ids, each in ``[0, len(token_bytes))``.
      token_bytes: int[V], UTF-8 bytes per token id (``tokenizer.token_bytes``).

    Returns:
      ``{"nats": f32[], "tokens": f32[], "bytes": f32[]}`` (add these across batches).
    """
    per_token_loss = jnp.asarray(per_token_loss)
    if per_token_loss.ndim != 2:
        raise ValueError(f"per_token_loss: expected [B, T], got shape {per_token_loss.shape}")
    for name, x in (("loss_mask", loss_mask), ("targets", targets)):
        if jnp.shape(x) != per_token_loss.shape:
            raise ValueError(
                f"{name}: expected shape {per_token_loss.shape} (like per_token_loss), "
                f"got {jnp.shape(x)}"
            )
    if jnp.ndim(token_bytes) != 1:
        raise ValueError(f"token_bytes: expected [V], got shape {jnp.shape(token_bytes)}")
    mask = jnp.asarray(loss_mask, jnp.float32)
    nbytes = jnp.asarray(token_bytes, jnp.float32)[jnp.asarray(targets)]
    # where(): a masked-out position may hold inf/NaN (e.g. padding logits) and must not leak.
    loss = jnp.where(mask > 0, per_token_loss.astype(jnp.float32), 0.0)
    return {
        "nats": jnp.sum(loss * mask),
        "tokens": jnp.sum(mask),
        "bytes": jnp.sum(mask * nbytes),
    }


def _check_total(name: str, value: float) -> float:
    value = float(np.asarray(value))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a finite value >= 0, got {value}")
    return value


def bits_per_byte(total_nats, total_bytes) -> float:
    """``total_nats / (ln 2 * total_bytes)``: cross-entropy in bits per UTF-8 byte of text."""
    nats = float(np.asarray(total_nats))
    nbytes = _check_total("total_bytes", total_bytes)
    if nbytes == 0:
        raise ValueError("total_bytes: must be > 0")
    return nats / (math.log(2.0) * nbytes)


def perplexity(total_nats, total_tokens) -> float:
    """``exp(total_nats / total_tokens)``: per-token perplexity (inf if it overflows)."""
    nats = float(np.asarray(total_nats))
    ntok = _check_total("total_tokens", total_tokens)
    if ntok == 0:
        raise ValueError("total_tokens: must be > 0")
    mean = nats / ntok
    return math.exp(mean) if mean < 700 else math.inf


def summarize(sums: dict) -> dict:
    """Summed :func:`masked_loss_sums` → ``{"loss", "perplexity", "bits_per_byte", ...}``.

    ``loss`` is the mean nats per scored token.
    """
    nats, tokens, nbytes = (float(np.asarray(sums[k])) for k in ("nats", "tokens", "bytes"))
    return {
        "loss": nats / tokens if tokens > 0 else math.nan,
        "perplexity": perplexity(nats, tokens) if tokens > 0 else math.nan,
        "bits_per_byte": bits_per_byte(nats, nbytes) if nbytes > 0 else math.nan,
        "tokens": tokens,
        "bytes": nbytes,
    }
