"""Continuum Memory System (CMS): MLP levels updated at several periods (SPEC §3.3, paper §7.1).

**Levels and variants** (``sequential`` / ``independent`` / ``nested``, with the nested-reset
decision): the docstring of :mod:`nested_jax.core.cms.levels`, where they are defined.

**Online update mode** (:func:`cms_online`; test time / continual learning). Local surprise:
``δ_t = ∂L_t/∂y_t`` where ``y_t`` is the CMS output at token ``t`` and ``L_t`` the model's
next-token loss at ``t`` (a per-token loss, so the signal does not depend on how tokens are
grouped). Level ℓ's per-token signal ``g_t^(ℓ)`` is ``∂L_t/∂θ_ℓ`` obtained from ``δ_t`` by
``jax.vjp`` of the CMS forward at the current weights; it is accumulated over the level's period
``B_j^(ℓ)`` and applied only at its boundary (token count a multiple of ``C^(ℓ)``;
:mod:`nested_jax.core.periods`)::

    sgd:  θ_ℓ ← θ_ℓ − Σ_{t∈B_j} η_ℓ g_t^(ℓ)
    dgd:  W ← W − Σ_{t∈B_j} γ_t a_t (a_t W + g_t)ᵀ,   γ_t = η_ℓ / (1 + η_ℓ ‖a_t‖²)   (per layer)

For DGD (SPEC §3.1, per layer, ``a_t`` the layer input, ``g_t = ∂L_t/∂(a_t W)`` its
back-propagated output signal) the per-token DGD direction is taken at the level's weights of the
period (fixed until the boundary) and summed, as the SPEC §3.3 equation sums signals; with period
1 this is exactly per-token DGD (``dgd_update``). Tokens are processed in chunks of
``c = gcd(C^(1..k))`` in a ``lax.scan``: all boundaries fall on chunk ends, so every token of a
chunk sees the same weights and the chunk's forward, δ and gradients are computed in parallel.
Every batch row is an independent stream with its own level weights (the given levels are
broadcast at the start). The state carries the accumulators and the token position, so a stream
split over several calls gives the same result as one call.

**Pretrain mode** (outer optimizer steps every ``C^(ℓ)`` steps): ``nested_jax.optim.multifreq``.

Modules: this one holds the online mode (``CMSState``, ``cms_initial_state``, ``cms_online``,
``surprise_from_loss``); ``cms.levels`` holds the levels, their checks and the fixed-weight forward
(``CMSLevel``, ``VARIANTS``, ``cms_forward``, ...); ``check_periods`` is in :mod:`nested_jax.rules`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.cms.levels import (
    CMSLevel,
    _apply,
    _check_levels,
    _check_mix,
    _check_x,
)
from nested_jax.core.dgd import dgd_step_size
from nested_jax.core.periods import accumulate, apply_at_boundary, period_boundary, reset_to_slower
from nested_jax.core.scan import cast_like, scan_remat, zeros_typed
from nested_jax.rules import CMSRule, check_periods

__all__ = [
    "CMSState",
    "cms_initial_state",
    "cms_online",
    "surprise_from_loss",
]


class CMSState(NamedTuple):
    """Online CMS state carried across calls (SPEC §0: states are pytrees)."""

    levels: tuple  # CMSLevel per level, leaves [B, ...]: the current weights of each stream
    accum: tuple  # CMSLevel per level, f32 [B, ...]: Σ η g since the level's last boundary
    pos: Any  # int32 []: tokens seen so far (shared by all rows)


def _per_level(name: str, value, k: int) -> list:
    if isinstance(value, (tuple, list)):
        if len(value) != k:
            raise ValueError(f"{name} as a sequence must have one entry per level ({k})")
        vals = list(value)
    else:
        vals = [value] * k
    out = []
    for v in vals:
        v = jnp.asarray(v)
        if v.ndim != 0:
            raise ValueError(f"{name} must be a scalar or a sequence of {k} scalars, got {v.shape}")
        out.append(v)
    return out


# ----------------------------------------------------------------------------------------------
# online mode


def surprise_from_loss(loss_fn: Callable, *, stop_gradient: bool = False) -> Callable:
    """A ``delta_fn`` from a per-token loss: ``δ_t = ∂L_t/∂y_t`` (SPEC §3.3 local surprise).

    Args:
      loss_fn: ``(y [B, c, d], side) -> L [B, c]`` per-token losses (e.g. the next-token
        cross-entropy of ``head(y)`` against the targets in ``side``; token ``t``'s loss must depend
        on ``y_t`` only). A scalar return is used as is (then it should be a sum over tokens).
      stop_gradient: cut the outer gradient through ``δ``'s dependence on ``y`` (a first-order
        meta-gradient). Default False: the online writes are differentiated exactly (second
        order through the loss), as the rest of the library differentiates through its writes.

    Returns:
      ``delta_fn(y, side) -> δ [B, c, d]`` = ``∂(Σ_t L_t)/∂y``.
    """

    def delta_fn(y, side):
        def total(yy):
            return jnp.sum(loss_fn(yy, side))

        return jax.grad(total)(lax.stop_gradient(y) if stop_gradient else y)

    return delta_fn


def cms_initial_state(levels, batch: int) -> CMSState:
    """The online state at the start of a stream: each row's levels = ``levels``, no accumulation.

    Args:
      levels: tuple of :class:`CMSLevel` (unbatched).
      batch: ``B``.

    Returns:
      :class:`CMSState` with leaves ``[B, ...]`` and ``pos = 0``.
    """
    _check_levels(levels)

    def bcast(a):
        return jnp.broadcast_to(a, (batch,) + jnp.shape(a))

    lv = tuple(jax.tree.map(bcast, tuple(levels)))
    acc = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)), lv)
    return CMSState(levels=lv, accum=acc, pos=jnp.zeros([], jnp.int32))


def _layer_update(kind, lr, a, w, g):
    """``Σ_t`` of one layer's per-token update for kernel ``w [B, i, o]`` (SPEC §3.3, §3.1)."""
    f32 = jnp.promote_types(a.dtype, jnp.float32)
    a, g, wc = a.astype(f32), g.astype(f32), w.astype(f32)
    lr = lr.astype(f32)
    if kind == "sgd":
        return lr * jnp.einsum("bti,bto->bio", a, g)
    gamma = dgd_step_size(lr, a)  # [B, t]
    resid = jnp.einsum("bti,bio->bto", a, wc) + g  # a W + g (the DGD residual, SPEC §3.1)
    return jnp.einsum("bti,bto->bio", a, gamma[..., None] * resid)


def _level_update(kind, lr, ins, lv, gtaps):
    ups = {}
    for name, a, g in zip(("w_up", "w_gate", "w_down"), ins, gtaps, strict=True):
        w = getattr(lv, name)
        ups[name] = None if w is None else _layer_update(kind, lr, a, w, g)
    return CMSLevel(**ups)


def _zero_taps(levels, x_c, variant):
    t = x_c.shape[:-1]
    taps = []
    for j, lv in enumerate(levels):
        if variant == "nested" and j > 0:
            taps.append(None)
            continue
        h = lv.w_up.shape[-1]
        # typed like x_c: under jax.shard_map the vjp of an invariant tap would psum the
        # per-row signals over the devices (the transpose of its implicit broadcast)
        z = zeros_typed(x_c[..., :1], t + (h,))
        taps.append((z, None if lv.w_gate is None else z, jnp.zeros_like(x_c)))
    return tuple(taps)


def _apply_boundaries(lv, acc, fire, variant):
    """Levels whose period ends apply ``θ ← θ − accum`` and clear it; ``nested`` then resets the
    faster levels top-down (:mod:`nested_jax.core.periods`)."""
    done = [apply_at_boundary(w, a, f) for w, a, f in zip(lv, acc, fire, strict=True)]
    new_lv, new_acc = [w for w, _ in done], [a for _, a in done]
    if variant == "nested":
        new_lv, new_acc = reset_to_slower(new_lv, new_acc, fire)
    return tuple(new_lv), tuple(new_acc)


def _check_modes(rule, delta_fn, delta):
    """Trace-time checks of :func:`cms_online`'s rule and source of ``δ`` (the rule checked its
    own fields when it was built)."""
    if not isinstance(rule, CMSRule):
        raise ValueError(f"rule must be a CMSRule, got {type(rule).__name__}")
    if (delta_fn is None) == (delta is None):
        raise ValueError("give exactly one of delta_fn (callable) or delta (array [B, T, d])")
    if delta_fn is not None and not callable(delta_fn):
        raise ValueError(f"delta_fn must be callable, got {type(delta_fn).__name__}")


def _validate_levels(levels, x, rule, mix_logits, initial_state):
    """Trace-time checks of ``x``, the levels (or carried state) against the rule's periods,
    the mixing logits and the rule's ``η``.

    Returns:
      ``(x, state, mix_logits, lrs)`` normalised (``state`` fresh from ``levels`` when
      ``initial_state`` is None; ``lrs`` one scalar per level).
    """
    x = jnp.asarray(x)
    if x.ndim != 3:
        raise ValueError(f"x must have shape [B, T, d], got {x.shape}")
    B = x.shape[0]
    if initial_state is None:
        d = _check_levels(levels)
        k = len(levels)
        state = cms_initial_state(tuple(levels), B)
    else:
        if not isinstance(initial_state, CMSState):
            raise ValueError("initial_state must be a CMSState")
        d = _check_levels(initial_state.levels, batch=B)
        k = len(initial_state.levels)
        state = initial_state
    x = _check_x(x, d)
    check_periods(rule.periods, k, rule.variant)
    mix_logits = _check_mix(mix_logits, k, rule.variant)
    return x, state, mix_logits, _per_level("online_lr", rule.online_lr, k)


def _check_signal(delta, side, shape):
    """Trace-time checks of the precomputed ``δ`` and the ``side`` inputs; returns ``δ`` as an
    array (or None)."""
    B, T, _ = shape
    if delta is not None:
        delta = jnp.asarray(delta)
        if delta.shape != shape:
            raise ValueError(f"delta must have shape [B, T, d] = {shape}, got {delta.shape}")
    if side is not None:
        for leaf in jax.tree.leaves(side):
            if jnp.ndim(leaf) < 2 or jnp.shape(leaf)[:2] != (B, T):
                raise ValueError(
                    f"side leaves must have shape [B={B}, T={T}, ...], got {jnp.shape(leaf)}"
                )
    return delta


def _chunk_grid(pos, T: int, c: int, resumed: bool):
    """``(off, n)``: the call's tokens start at slot ``off`` of ``n`` chunks of ``c`` tokens.

    Chunks lie on the absolute grid of multiples of ``c``: a stream resumed at ``pos % c = off``
    starts at slot ``off`` of its first chunk (the leading slots are masked), so every boundary
    stays at a chunk end whatever the call lengths. A fresh stream has ``off = 0`` (static).
    """
    if not resumed:
        return 0, -(-T // c)
    return pos % c, -(-(T + c - 1) // c)


def _chunk_inputs(x, delta, side, off, n: int, c: int) -> dict:
    """The scan's inputs: ``x``, ``δ`` and ``side`` (``[B, T, ...]``) placed from slot ``off`` of
    ``n·c`` zero slots and cut into ``[n, B, c, ...]`` chunks, with the ``valid [n, c]`` slot mask
    and the chunk index ``j [n]``."""
    B, T = x.shape[:2]
    L = n * c

    def place(a):
        a = jnp.asarray(a)
        buf = zeros_typed(a[:, :1], (B, L) + a.shape[2:])  # sharded like the update it receives
        start = (0, off) + (0,) * (a.ndim - 2)
        return lax.dynamic_update_slice(buf, a, start)

    def to_chunks(a):  # [B, L, ...] -> [n, B, c, ...]
        a = a.reshape((B, n, c) + a.shape[2:])
        return jnp.moveaxis(a, 1, 0)

    slots = jnp.arange(L)
    valid = (slots >= off) & (slots < off + T)  # [L]
    return {
        "x": to_chunks(place(x)),
        "valid": valid.reshape(n, c),
        "j": jnp.arange(n),
        "delta": None if delta is None else to_chunks(place(delta)),
        "side": None if side is None else jax.tree.map(lambda a: to_chunks(place(a)), side),
    }


def _surprise_signals(lv, inp, vm, delta_fn, variant, mix_logits):
    """One chunk at its weights: ``y``, every layer's input ``a`` and output signal ``g``.

    ``y = CMS(lv; x_chunk)``; ``δ = delta_fn(y, side_chunk)`` (or the given ``δ``), zeroed on the
    slots outside the call (``vm [1, c, 1]``); ``g = ∂⟨δ, y⟩/∂(a W)`` per layer by ``jax.vjp``
    through zero taps added to each layer's output.

    Returns:
      ``(y [B, c, d], ins, gtaps)``: per level (``nested``: level 1 only) the layer inputs and
      output signals.
    """
    x_c = inp["x"]

    def fwd(taps):
        return _apply(lv, x_c, variant, mix_logits, taps)

    y, vjp_fn, ins = jax.vjp(fwd, _zero_taps(lv, x_c, variant), has_aux=True)
    if delta_fn is not None:
        dl = delta_fn(y, inp["side"])
        if jnp.shape(dl) != y.shape:
            raise ValueError(f"delta_fn must return δ of shape {y.shape}, got {jnp.shape(dl)}")
    else:
        dl = inp["delta"]
    dl = jnp.asarray(dl, y.dtype) * vm
    (gtaps,) = vjp_fn(dl)
    return y, ins, gtaps


def _accumulate_levels(lv, acc, ins, gtaps, vm, inner, lrs, variant) -> list:
    """``A_ℓ ← A_ℓ + Σ_t`` (SGD or DGD) over the chunk's valid tokens, every level; ``nested``
    levels all learn from level 1's signals (the only level read)."""
    new_acc = []
    for j in range(len(acc)):
        src = 0 if variant == "nested" else j
        ins_j = tuple(None if a is None else a * vm for a in ins[src])
        u = _level_update(inner, lrs[j], ins_j, lv[src], gtaps[src])
        new_acc.append(accumulate(acc[j], u))
    return new_acc


def _chunk_step(rule, lrs, *, delta_fn, mix_logits, c, grid0, end):
    """The ``lax.scan`` body over chunks: ``((levels, accum), inp) -> ((levels, accum), y)``.

    ``rule``: the ``CMSRule`` (periods, variant, inner optimizer); ``lrs``: its rates, one
    scalar per level.
    ``grid0``: absolute position of slot 0 (a multiple of ``c``); ``end``: slots before the call's
    end (``off + T``). Level ℓ fires at a chunk whose absolute end is a multiple of ``C^(ℓ)``,
    only if the chunk is complete (tokens past the call never trigger a boundary).
    """

    variant = rule.variant

    def step(carry, inp):
        lv, acc = carry
        vm = inp["valid"][None, :, None].astype(inp["x"].dtype)
        y, ins, gtaps = _surprise_signals(lv, inp, vm, delta_fn, variant, mix_logits)
        new_acc = _accumulate_levels(lv, acc, ins, gtaps, vm, rule.online_inner, lrs, variant)
        consumed = (inp["j"] + 1) * c  # slots up to this chunk's end
        complete = consumed <= end
        fire = [complete & period_boundary(grid0 + consumed, p) for p in rule.periods]
        return _apply_boundaries(lv, new_acc, fire, variant), y

    return step


def cms_online(
    levels,
    x,
    *,
    rule=CMSRule(),
    delta_fn: Callable | None = None,
    delta=None,
    side: Any = None,
    mix_logits=None,
    initial_state: CMSState | None = None,
):
    """CMS in ``online`` mode: each level learns from the local surprise at its own period.

    SPEC §3.3 (module docstring for the exact rules). Per chunk of ``c = gcd(periods)`` tokens:
    ``y = CMS(levels; x_chunk)`` at the current weights; ``δ = delta_fn(y, side_chunk)`` (or the
    given ``delta``); per-layer signals by ``jax.vjp``; each level adds ``Σ_t η_ℓ g_t^(ℓ)`` (SGD)
    or the summed DGD directions to its accumulator; a level whose period ends with the chunk
    applies ``θ_ℓ ← θ_ℓ − accum_ℓ`` and clears it; ``nested`` then resets faster levels. Output
    at token ``t`` uses the weights in force before ``t`` (read before write). Tokens past the end
    of ``x`` never trigger a boundary; their partial accumulation stays in the state.
    Differentiable w.r.t. ``levels``, ``x``, ``mix_logits`` (through all updates; the rates are
    the rule's static floats).

    Args:
      levels: tuple of ``k`` :class:`CMSLevel` (unbatched ``w_up [d, h]``…): the initial weights,
        broadcast to every row. Ignored when ``initial_state`` is given (its levels are used).
      x: ``[B, T, d]`` CMS inputs (any ``T``; need not be a multiple of any period).
      rule: ``CMSRule``: ``periods`` ``(C^(1), …, C^(k))`` in tokens, one per level (positive,
        strictly increasing; ``nested``: each divides the next), ``variant``
        (``"sequential" | "nested" | "independent"``), ``online_lr`` (``η``: one float or one per
        level), ``online_inner`` (``"sgd"`` or ``"dgd"``: per layer, SPEC §3.1,
        ``γ = η/(1+η‖a‖²)``) and ``remat_every`` (checkpoint the chunk scan every n chunks with
        ``scan_remat`` to bound the memory of differentiating through a long stream; None: no
        checkpoints). A config section that extends the rule (``CMSOptions``) is one too.
      delta_fn: ``(y [B, c, d], side_chunk) -> δ [B, c, d]``, the local surprise ``∂L_t/∂y_t``
        (see :func:`surprise_from_loss`). Exactly one of ``delta_fn`` / ``delta``.
      delta: precomputed ``δ [B, T, d]`` (e.g. from a frozen pass; then not the surprise of the
        updated weights).
      side: optional pytree of ``[B, T, ...]`` arrays (targets, loss masks), chunked with ``x``
        and handed to ``delta_fn`` (padded slots are zeros; their δ is masked anyway).
      mix_logits: ``[k]`` for ``independent`` (outer parameters, not updated online).
      initial_state: :class:`CMSState` from a previous call (or :func:`cms_initial_state`).

    Returns:
      ``(y [B, T, d], CMSState)``, ``y`` in ``x``'s dtype (accumulators are f32).
    """
    _check_modes(rule, delta_fn, delta)
    x, state, mix_logits, lrs = _validate_levels(levels, x, rule, mix_logits, initial_state)
    delta = _check_signal(delta, side, x.shape)
    B, T, d = x.shape
    if T == 0:
        return x, state
    c = math.gcd(*rule.periods)
    off, n = _chunk_grid(state.pos, T, c, resumed=initial_state is not None)
    xs = _chunk_inputs(x, delta, side, off, n, c)
    step = _chunk_step(
        rule, lrs, delta_fn=delta_fn, mix_logits=mix_logits, c=c, grid0=state.pos - off,
        end=off + T,
    )  # fmt: skip
    carry0 = (tuple(state.levels), tuple(state.accum))
    # each row's weights are updated from that row's x: the carry is typed like x's rows (under
    # jax.shard_map / on Explicit meshes levels broadcast from shared weights are not)
    carry0 = jax.tree.map(lambda a: cast_like(a, x[:, 0, 0]), carry0)
    if rule.remat_every is None:
        (lv_f, acc_f), ys = lax.scan(step, carry0, xs)
    else:
        (lv_f, acc_f), ys = scan_remat(step, carry0, xs, rule.remat_every)
    ys = jnp.moveaxis(ys, 0, 1).reshape((B, n * c, d))
    y = lax.dynamic_slice_in_dim(ys, off, T, axis=1).astype(x.dtype)
    return y, CMSState(levels=lv_f, accum=acc_f, pos=state.pos + T)
