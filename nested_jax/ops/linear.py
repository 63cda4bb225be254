"""The linear-memory rules behind one door: linear attention, delta rule, gated delta (SPEC §1).

Layers call these functions, never a core form directly, so switching implementation is a config
value. The implementation is never switched silently (not on sequence length, not on mode): an
``impl`` value that cannot run raises ``ValueError``.

- ``"chunked"``: the WY/UT chunk form of ``nested_jax.core.associative.forms`` (the training
  default).
  Inside a mesh whose ``seq`` axis has more than one device, ``gated_delta`` and ``delta_rule``
  run context-parallel (``nested_jax.core.context``: each device takes ``T / P`` tokens and the
  devices fold their state maps; the same values and gradients); the other rules see the whole
  sequence (XLA gathers it).
- ``"recurrent"``: the per-token ``lax.scan`` ground truth (``chunk_size`` is ignored).
- ``"pallas"``: ``pallas_kernels/gated_delta`` for ``gated_delta``, ``delta_rule`` (``g = 0``)
  and the backbone of ``proteus_gated_delta``, with ``chunk_size`` as its chunk (a multiple of 8):
  the Mosaic kernel in a program lowered for TPU (an ahead-of-time compile on a CPU host
  included), the Pallas interpreter on any other platform, and inside a mesh one kernel call per
  (batch, heads) shard under ``jax.shard_map`` (``ops._pallas``); ``linear_attention`` has no
  kernel yet and raises ``ValueError``. This module is the kernels' only importer (``ops.hola``
  reaches the kernel through :func:`gated_delta`).

The single-token steps (``linear_attention_step``, ``delta_rule_step``, ``gated_delta_step``,
the core's, importable from here) are the decode forms; ``proteus_key_rows`` is the Proteus
key-row gate of the linear rules (SPEC §4), which turns each rule into its Proteus form from a zero
state (the layers' path); ``proteus_gated_delta`` is the Proteus GDN that continues any state at a
static ``t0`` (``core.associative.proteus``, which takes the rule whole as ``schedule``); the
schedule is a :class:`ProteusRule` (``ProteusOptions.rule()``), importable from here too.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from nested_jax.core.associative import forms as _assoc
from nested_jax.core.associative.forms import delta_rule_step as delta_rule_step
from nested_jax.core.associative.forms import gated_delta_step as gated_delta_step
from nested_jax.core.associative.forms import linear_attention_step as linear_attention_step
from nested_jax.core.associative.proteus import (
    proteus_gated_delta_chunked,
    proteus_gated_delta_recurrent,
)
from nested_jax.core.context import gated_delta_context_parallel as _gated_delta_context
from nested_jax.core.proteus import proteus_active_blocks, proteus_block_ids
from nested_jax.ops._impl import check_impl as _check_impl
from nested_jax.ops._pallas import pallas_per_shard
from nested_jax.ops._shard import mesh_axis_size, per_shard
from nested_jax.ops._state import pin_head_state
from nested_jax.rules import ProteusRule
from pallas_kernels.gated_delta import BlockSizes as _GdnBlocks
from pallas_kernels.gated_delta import gated_delta_pallas as _gated_delta_pallas

__all__ = [
    "linear_attention",
    "delta_rule",
    "gated_delta",
    "proteus_key_rows",
    "proteus_gated_delta",
]


def _dispatch(op: str, impl: str, args: tuple, chunk_size: int, **kw):
    """Routes ``op`` to ``core.associative.forms.<op>_recurrent`` or ``<op>_chunked`` by ``impl``;
    the final state ``[B, H, K, V]`` comes back pinned to ``("batch", "heads", None, None)``.
    ``impl="pallas"`` routes the delta rules to ``pallas_kernels.gated_delta``."""
    if impl == "pallas" and op in ("gated_delta", "delta_rule"):
        o, state = _pallas_delta(op, args, chunk_size, **kw)
        return o, pin_head_state(state)
    _check_impl(op, impl)
    if impl == "chunked" and op in ("gated_delta", "delta_rule") and mesh_axis_size("seq") > 1:
        o, state = _context_delta(op, args, chunk_size, **kw)
        return o, pin_head_state(state)
    if impl == "recurrent":
        o, state = getattr(_assoc, f"{op}_recurrent")(*args, **kw)
    else:
        o, state = getattr(_assoc, f"{op}_chunked")(*args, chunk_size=chunk_size, **kw)
    return o, pin_head_state(state)


_SEQ = ("batch", None, "heads", None)  # q, k, v, o: [B, T, H, D]
_PALLAS_LOGICAL = {
    "q": _SEQ,
    "k": _SEQ,
    "v": _SEQ,
    "g": ("batch", None, "heads"),
    "beta": ("batch", None, "heads"),
    "initial_state": ("batch", "heads", None, None),
    "segment_ids": ("batch", None),
}


_SEQ_SPLIT = ("batch", "seq", "heads", None)  # the same, tokens over the seq axis
_CONTEXT_LOGICAL = {
    **{n: _SEQ_SPLIT for n in ("q", "k", "v")},
    "g": ("batch", "seq", "heads"),
    "beta": ("batch", "seq", "heads"),
    "initial_state": ("batch", "heads", None, None),
    "segment_ids": ("batch", "seq"),
}


def _with_zero_decay(op: str, args: tuple) -> tuple:
    """``(q, k, v, g, beta)``: the delta rule is the gated rule with ``g = 0``."""
    if op == "delta_rule":
        q, k, v, beta = args
        return q, k, v, jnp.zeros(beta.shape, jnp.float32), beta
    return args


# From this many devices on the seq axis the devices' state maps are folded by the log-depth
# prefix (ppermute rounds) rather than an all-gather of every map: the gather holds P maps per
# device, which dominates the temporaries on a slice (memory per device in docs/RESULTS.md,
# "Context parallelism: two folds"); below it the two use about the same memory and the gather
# was the faster on CPU devices.
PREFIX_FOLD_FROM = 16


def _context_delta(op: str, args: tuple, chunk_size: int, *, scale=None, **arrays):
    """The chunked delta rules with context parallelism: inside a mesh whose ``seq`` axis has
    ``P > 1`` devices, each device takes ``T / P`` tokens of every sequence and the devices fold
    their state maps (:func:`nested_jax.core.context.gated_delta_context_parallel`; equal to the
    single-device chunked rule; the prefix fold from :data:`PREFIX_FOLD_FROM` devices on).
    ``arrays``: ``initial_state`` and ``segment_ids``."""
    q, k, v, g, beta = _with_zero_decay(op, args)
    B, T, H, K = q.shape
    P = mesh_axis_size("seq")
    if T % P:
        raise ValueError(
            f"{op}: the sequence length T = {T} of q must be divisible by the mesh's seq axis "
            f"({P} devices) for context parallelism"
        )

    fold = "prefix" if P >= PREFIX_FOLD_FROM else "gather"

    def local(ops):
        return _gated_delta_context(
            **ops, axis_name="seq", scale=scale, chunk_size=chunk_size, fold=fold
        )

    operands = dict(q=q, k=k, v=v, g=g, beta=beta, **arrays)
    out_logical = (_SEQ_SPLIT, _CONTEXT_LOGICAL["initial_state"])
    out_shapes = ((B, T, H, v.shape[-1]), (B, H, K, v.shape[-1]))
    return per_shard(local, operands, _CONTEXT_LOGICAL, out_logical, out_shapes)


def _pallas_delta(op: str, args: tuple, chunk_size: int, *, scale=None, **arrays):
    """The Pallas gated delta kernel (``delta_rule``: ``g = 0``): the Mosaic kernel in a program
    lowered for TPU, the Pallas interpreter on any other platform, and under a mesh one call per
    (batch, heads) shard (:func:`nested_jax.ops._pallas.pallas_per_shard`; the kernel is
    independent per batch row and head).

    ``arrays``: ``initial_state`` and ``segment_ids`` (either may be None)."""
    q, k, v, g, beta = _with_zero_decay(op, args)
    B, T, H, K = q.shape
    V = v.shape[-1]
    kernel = functools.partial(
        _gated_delta_pallas, scale=scale, block_sizes=_GdnBlocks(chunk=chunk_size)
    )
    operands = dict(q=q, k=k, v=v, g=g, beta=beta, **arrays)
    out_logical = (_SEQ, _PALLAS_LOGICAL["initial_state"])
    return pallas_per_shard(
        kernel, operands, _PALLAS_LOGICAL, out_logical, ((B, T, H, V), (B, H, K, V))
    )


def linear_attention(
    q,
    k,
    v,
    g=None,
    *,
    scale=None,
    initial_state=None,
    segment_ids=None,
    chunk_size: int = 64,
    impl: str = "chunked",
):
    """(Gated) linear attention, SPEC §1.

    ``S_t = α_t S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale·q_t)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: optional ``[B, T, H]`` log decay.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``.
      segment_ids: optional ``[B, T]`` int (state resets at segment starts).
      chunk_size: chunk length for ``impl="chunked"``.
      impl: ``"chunked"`` | ``"recurrent"`` (``"pallas"`` not yet available: ValueError).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    return _dispatch(
        "linear_attention",
        impl,
        (q, k, v, g),
        chunk_size,
        scale=scale,
        initial_state=initial_state,
        segment_ids=segment_ids,
    )


def delta_rule(
    q,
    k,
    v,
    beta,
    *,
    scale=None,
    initial_state=None,
    segment_ids=None,
    chunk_size: int = 64,
    impl: str = "chunked",
):
    """Delta rule, SPEC §1.

    ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ (scale·q_t)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
      scale, initial_state, segment_ids, chunk_size: as in ``linear_attention``.
      impl: ``"chunked"`` | ``"recurrent"`` | ``"pallas"`` (``chunk_size`` a multiple of 8).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    return _dispatch(
        "delta_rule",
        impl,
        (q, k, v, beta),
        chunk_size,
        scale=scale,
        initial_state=initial_state,
        segment_ids=segment_ids,
    )


def gated_delta(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    segment_ids=None,
    chunk_size: int = 64,
    impl: str = "chunked",
):
    """Gated delta rule (GDN), SPEC §1: ``S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      scale, initial_state, segment_ids, chunk_size: as in ``linear_attention``.
      impl: ``"chunked"`` | ``"recurrent"`` | ``"pallas"`` (``chunk_size`` a multiple of 8).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    return _dispatch(
        "gated_delta",
        impl,
        (q, k, v, g, beta),
        chunk_size,
        scale=scale,
        initial_state=initial_state,
        segment_ids=segment_ids,
    )


# ``gated_delta_chunked``'s contract by the Pallas kernel: the backbone that HOLA's state path
# (``ops.hola``) and ``proteus_gated_delta`` take for ``impl="pallas"``.
pallas_gated_delta = functools.partial(gated_delta, impl="pallas")


def proteus_key_rows(q, k, positions, *, rule: ProteusRule):
    """Proteus key-row gate of the linear rules (SPEC §4): ``(g_t ⊙ q_t, g_t ⊙ k_t)``.

    ``g_t`` opens the first ``k(t) = min(E, 1 + ⌊(t−1)/Δ⌋)`` of ``E = rule.blocks`` contiguous
    blocks of key rows at the 1-based position ``t = positions + 1`` (``Δ = ⌊N/E⌋``,
    ``N = rule.context_len``). With a state that starts at zero (and resets to zero), running a
    linear rule on the gated ``q, k`` is its Proteus form (``nested_jax.layers.deltanet`` says why).

    Args:
      q, k: ``[B, T, H, K]``; positions: int ``[B, T]`` 0-based.
      rule: :class:`ProteusRule` (``E ≤ K``); ``E = 1`` returns ``q, k`` themselves (no gate).

    Returns:
      ``(q, k)`` with locked key rows set to zero, same shapes and dtypes.
    """
    if not rule.enabled:
        return q, k
    b, t, _, kd = q.shape
    active = proteus_active_blocks(positions + 1, rule.context_len, rule.blocks)  # [B, T]
    ids = jnp.asarray(proteus_block_ids(kd, rule.blocks))
    is_open = (ids < active[..., None])[:, :, None, :]  # [B, T, 1, K]
    zero = jnp.zeros((), q.dtype)
    return jnp.where(is_open, q, zero), jnp.where(is_open, k, zero)


def proteus_gated_delta(
    q,
    k,
    v,
    g,
    beta,
    *,
    rule: ProteusRule,
    scale=None,
    initial_state=None,
    t0=0,
    chunk_size: int = 64,
    impl: str = "chunked",
):
    """GDN with Proteus key-row blocks continuing any state (SPEC §1, §4;
    ``core.associative.proteus``).

    At the 1-based position ``t = t0 + i + 1`` the mask ``g_t`` opens the first
    ``k(t) = min(E, 1 + ⌊(t−1)/Δ⌋)`` of ``E = rule.blocks`` key-row blocks of ``S``::

        S̃ = g_t ⊙ S_{t-1} ;  S_t = where(g_t, α_t S̃ + β_t k_t (v_t − α_t S̃ᵀk_t)ᵀ, S_{t-1})
        o_t = S_tᵀ (g_t ⊙ scale · q_t)

    Unlike :func:`proteus_key_rows` (a zero start) locked rows of a nonzero ``initial_state`` keep
    their bits and a block opening inside the call starts from them.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      rule: :class:`ProteusRule` ``(E, N)`` (``E ≤ K``); ``E = 1`` is :func:`gated_delta` itself.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``; zero when None.
      t0: tokens already seen: a Python int (every ``impl``) or, for ``"recurrent"``, an integer
        array ``[]`` / ``[B]``.
      chunk_size: chunk length of ``"chunked"`` / ``"pallas"`` (``"pallas"``: a multiple of 8).
      impl: ``"chunked"`` (``proteus_gated_delta_chunked``) | ``"recurrent"``
        (``proteus_gated_delta_recurrent``) | ``"pallas"`` (the chunk form with the Pallas kernel
        as its backbone: the injection tokens that restore newly opened rows are ordinary tokens).
        No ``segment_ids``: packed rows take the layers' :func:`proteus_key_rows` path.

    Returns:
      ``(o [B, T, H, V] in v's dtype, final_state [B, H, K, V] f32)``.
    """
    if not isinstance(rule, ProteusRule):
        raise ValueError(f"proteus_gated_delta: rule must be a ProteusRule, got {rule!r}")
    if not rule.enabled:
        return gated_delta(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
            impl=impl,
        )  # fmt: skip
    _check_impl("proteus_gated_delta", impl, ("chunked", "recurrent", "pallas"))
    if impl == "recurrent":
        o, state = proteus_gated_delta_recurrent(
            q, k, v, g, beta, schedule=rule, scale=scale, initial_state=initial_state, t0=t0
        )
    else:
        backbone = pallas_gated_delta if impl == "pallas" else _assoc.gated_delta_chunked
        o, state = proteus_gated_delta_chunked(
            q, k, v, g, beta, schedule=rule, scale=scale, initial_state=initial_state, t0=t0,
            chunk_size=chunk_size, backbone=backbone,
        )  # fmt: skip
    return o, pin_head_state(state)
