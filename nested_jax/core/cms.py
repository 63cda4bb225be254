"""Continuum Memory System (CMS): MLP levels updated at several periods (SPEC §3.3, paper §7.1).

**Levels.** Each level is a residual MLP on row vectors ``x ∈ R^d`` (kernels stored row-major
like Flax ``Dense`` kernels, so a Transformer FFN can be copied into a level, SPEC §3.4)::

    plain  (w_gate is None):  MLP(x) = x + σ(x W_up) W_down                 (SPEC §3.2 form)
    gated  (SwiGLU):          MLP(x) = x + (σ(x W_gate) ⊙ x W_up) W_down

with ``W_up, W_gate ∈ R^{d×h}``, ``W_down ∈ R^{h×d}``, ``σ`` = SiLU. In column form the plain level
is SPEC §3.2's ``M(z) = z + W_1 σ(W_2 z)`` with ``W_1 = W_downᵀ``, ``W_2 = W_upᵀ``.

**Variants** for ``k`` levels with periods ``C^(1) < … < C^(k)`` (tokens; level 1 is the fastest):

- ``sequential``: ``y = MLP_k(… MLP_1(x))``.
- ``independent`` (head-wise): ``y = Σ_ℓ w_ℓ MLP_ℓ(x)`` with ``w = softmax(mix_logits)``
  (learned, outer parameters; ``Σ w_ℓ = 1``, so the residual ``x`` passes with weight 1).
- ``nested``: only the fastest level computes the output, ``y = MLP_1(x)``; the slower levels are
  its (meta-learned) initial states. **Reading (documented decision):** level ℓ's *context* is
  one period of level ℓ+1. At the end of each period of level ℓ+1, level ℓ+1 applies its own
  update and then level ℓ is reset to level ℓ+1's (new) state (top-down, so a boundary of level
  ``m`` cascades to all faster levels). The slowest level is never reset. Requires
  ``C^(ℓ) | C^(ℓ+1)`` so a context holds whole periods of the faster level. Level ℓ+1's update
  signal is the first-order meta-gradient: the gradient of the loss w.r.t. the fast weights
  (``∂θ_ℓ/∂θ_ℓ,0 ≈ I``, as first-order MAML/Reptile), accumulated over level ℓ+1's period with its
  own rate. The given per-level parameters are the states at the start of the stream.

**Online update mode** (:func:`cms_online`; test time / continual learning). Local surprise:
``δ_t = ∂L_t/∂y_t`` where ``y_t`` is the CMS output at token ``t`` and ``L_t`` the model's
next-token loss at ``t`` (a per-token loss, so the signal does not depend on how tokens are
grouped). Level ℓ's per-token signal ``g_t^(ℓ)`` is ``∂L_t/∂θ_ℓ`` obtained from ``δ_t`` by
``jax.vjp`` of the CMS forward at the current weights; it is accumulated over the level's period
``B_j^(ℓ)`` and applied only at its boundary (token count a multiple of ``C^(ℓ)``)::

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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.checks import check_positive_int
from nested_jax.core.dgd import dgd_step_size
from nested_jax.core.scan import scan_remat

__all__ = [
    "CMSLevel",
    "CMSState",
    "VARIANTS",
    "cms_init_levels",
    "cms_level_apply",
    "cms_mix_weights",
    "cms_forward",
    "cms_initial_state",
    "cms_online",
    "surprise_from_loss",
    "check_periods",
]

VARIANTS = ("sequential", "nested", "independent")
_INNER = ("sgd", "dgd")


class CMSLevel(NamedTuple):
    """Parameters of one CMS level (a residual MLP; SPEC §3.3).

    Leaves may carry leading batch dims ``[..., ·]`` (online states are ``[B, ...]``).
    """

    w_up: Any  # [..., d, h]
    w_down: Any  # [..., h, d]
    w_gate: Any = None  # [..., d, h] for a SwiGLU level, None for the plain level


class CMSState(NamedTuple):
    """Online CMS state carried across calls (SPEC §0: states are pytrees)."""

    levels: tuple  # CMSLevel per level, leaves [B, ...]: the current weights of each stream
    accum: tuple  # CMSLevel per level, f32 [B, ...]: Σ η g since the level's last boundary
    pos: Any  # int32 []: tokens seen so far (shared by all rows)


# ----------------------------------------------------------------------------------------------
# validation


def _check_variant(variant) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def check_periods(periods, k: int | None = None, variant: str | None = None) -> tuple[int, ...]:
    """Validate CMS periods ``C^(1) < … < C^(k)`` (SPEC §3.3) and return them as a tuple.

    Shared by the online core, the pretrain optimizer wrapper and LM streaming.

    Args:
      periods: a non-empty tuple/list of positive ints, strictly increasing.
      k: the number of levels, when known (one period per level).
      variant: ``"nested"`` also needs each period to divide the next.
    """
    if not isinstance(periods, (tuple, list)) or not periods:
        raise ValueError(f"periods must be a non-empty tuple of positive ints, got {periods!r}")
    periods = tuple(periods)
    for p in periods:
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"periods must be positive ints, got {periods!r}")
    if any(b <= a for a, b in zip(periods, periods[1:], strict=False)):
        raise ValueError(f"periods must be strictly increasing (C^(1) < … < C^(k)), got {periods}")
    if k is not None and len(periods) != k:
        raise ValueError(f"periods must have one entry per level ({k}), got {len(periods)}")
    if variant == "nested" and any(b % a for a, b in zip(periods, periods[1:], strict=False)):
        raise ValueError(
            f"periods for variant='nested' must each divide the next (a level's context is whole "
            f"periods of the faster level), got {periods}"
        )
    return periods


def _check_levels(levels, d: int | None = None, batch: int | None = None) -> int:
    """Validates the level tuple; returns the model width ``d``."""
    if isinstance(levels, CMSLevel) or not isinstance(levels, (tuple, list)) or not levels:
        raise ValueError("levels must be a non-empty tuple of CMSLevel")
    lead = () if batch is None else (batch,)
    for i, lv in enumerate(levels):
        if not isinstance(lv, CMSLevel):
            raise ValueError(f"levels[{i}] must be a CMSLevel, got {type(lv).__name__}")
        up = jnp.shape(lv.w_up)
        n = len(lead)
        if len(up) != n + 2 or up[:n] != lead:
            raise ValueError(f"levels[{i}].w_up must have shape {(*lead, 'd', 'h')}, got {up}")
        dd, h = up[n:]
        if d is None:
            d = dd
        if dd != d:
            raise ValueError(f"levels[{i}].w_up must have shape {(*lead, d, 'h')}, got {up}")
        if jnp.shape(lv.w_down) != (*lead, h, d):
            raise ValueError(
                f"levels[{i}].w_down must have shape {(*lead, h, d)}, got {jnp.shape(lv.w_down)}"
            )
        if lv.w_gate is not None and jnp.shape(lv.w_gate) != (*lead, d, h):
            raise ValueError(
                f"levels[{i}].w_gate must be None or have shape {(*lead, d, h)}, "
                f"got {jnp.shape(lv.w_gate)}"
            )
    return d


def _check_x(x, d: int):
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[-1] != d:
        raise ValueError(f"x must have shape [B, T, d={d}], got {x.shape}")
    return x


def _check_mix(mix_logits, k: int, variant: str):
    if variant != "independent":
        if mix_logits is not None:
            raise ValueError(f"mix_logits is only used by variant='independent', got {variant!r}")
        return None
    if mix_logits is None:
        return jnp.zeros((k,), jnp.float32)
    mix_logits = jnp.asarray(mix_logits)
    if mix_logits.shape != (k,):
        raise ValueError(f"mix_logits must have shape [k={k}], got {mix_logits.shape}")
    return mix_logits


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
# forward


def cms_init_levels(
    key,
    d_model: int,
    d_hidden: int,
    num_levels: int,
    *,
    gated: bool = False,
    init_scale: float = 1.0,
    same_init: bool = False,
    dtype=jnp.float32,
) -> tuple:
    """Random initial CMS levels (outer parameters; SPEC §3.3).

    ``W_up, W_gate ~ N(0, s²/d)``, ``W_down ~ N(0, s²/h)`` with ``s = init_scale``.

    Args:
      key: PRNG key.
      d_model: ``d``; d_hidden: ``h``; num_levels: ``k``.
      gated: SwiGLU levels (adds ``w_gate``).
      same_init: every level gets the same weights (e.g. a nested CMS whose levels all start from
        one meta-learned state, or an FFN copied into every level).
      dtype: parameter dtype.

    Returns:
      tuple of ``k`` :class:`CMSLevel`.
    """
    keys = jax.random.split(key, num_levels)

    def one(kk):
        k1, k2, k3 = jax.random.split(kk, 3)
        up = jax.random.normal(k1, (d_model, d_hidden), dtype) * (init_scale / math.sqrt(d_model))
        down = jax.random.normal(k2, (d_hidden, d_model), dtype) * (
            init_scale / math.sqrt(d_hidden)
        )
        gate = (
            jax.random.normal(k3, (d_model, d_hidden), dtype) * (init_scale / math.sqrt(d_model))
            if gated
            else None
        )
        return CMSLevel(up, down, gate)

    if same_init:
        lv = one(keys[0])
        return tuple(lv for _ in range(num_levels))
    return tuple(one(kk) for kk in keys)


def _linear(a, w, tap):
    # a [..., t, i] @ w [..., i, o]; ``tap`` (zeros) is a handle whose cotangent is ∂L/∂(a w).
    z = jnp.einsum("...ti,...io->...to", a, w)
    return z if tap is None else z + tap


def _level_apply(lv: CMSLevel, x, taps=None):
    """One level on ``x [..., t, d]``; returns ``(y, layer inputs per linear)``."""
    t_up, t_gate, t_down = (None, None, None) if taps is None else taps
    u = _linear(x, lv.w_up, t_up)
    if lv.w_gate is None:
        hid = jax.nn.silu(u)
        ins = (x, None, hid)
    else:
        gt = _linear(x, lv.w_gate, t_gate)
        hid = jax.nn.silu(gt) * u
        ins = (x, x, hid)
    y = x + _linear(hid, lv.w_down, t_down)
    return y, ins


def cms_level_apply(level: CMSLevel, x):
    """One CMS level ``MLP(x) = x + σ(x W_up) W_down`` (SwiGLU when ``w_gate`` is set; SPEC §3.3).

    Args:
      level: :class:`CMSLevel` (leaves may carry leading batch dims matching ``x``'s).
      x: ``[..., T, d]``.

    Returns:
      ``[..., T, d]``.
    """
    return _level_apply(level, x)[0]


def cms_mix_weights(mix_logits):
    """Weights of the ``independent`` variant: ``w = softmax(mix_logits)`` (``Σ w = 1``; SPEC §3.3).

    Args:
      mix_logits: ``[k]``.

    Returns:
      ``[k]`` f32 weights.
    """
    return jax.nn.softmax(jnp.asarray(mix_logits, jnp.float32), axis=-1)


def _apply(levels, x, variant, mix_logits, taps=None):
    """CMS forward with optional taps; returns ``(y, per-level layer inputs)``."""
    k = len(levels)
    taps = (None,) * k if taps is None else taps
    if variant == "sequential":
        ins, h = [], x
        for lv, tp in zip(levels, taps, strict=True):
            h, i = _level_apply(lv, h, tp)
            ins.append(i)
        return h, tuple(ins)
    if variant == "nested":
        y, i = _level_apply(levels[0], x, taps[0])
        return y, (i,) + (None,) * (k - 1)
    w = cms_mix_weights(mix_logits)
    ys, ins = [], []
    for lv, tp in zip(levels, taps, strict=True):
        yl, i = _level_apply(lv, x, tp)
        ys.append(yl)
        ins.append(i)
    y = sum(w[j].astype(x.dtype) * ys[j] for j in range(k))
    return y, tuple(ins)


def cms_forward(levels, x, *, variant: str = "sequential", mix_logits=None):
    """CMS output with fixed weights (SPEC §3.3; also the ``pretrain``-mode forward).

    ``sequential``: ``y = MLP_k(… MLP_1(x))``; ``nested``: ``y = MLP_1(x)`` (slower levels are its
    initial states); ``independent``: ``y = Σ_ℓ softmax(mix_logits)_ℓ MLP_ℓ(x)``.

    Args:
      levels: tuple of ``k`` :class:`CMSLevel` (``w_up [d, h]``, ``w_down [h, d]``).
      x: ``[B, T, d]``.
      variant: ``"sequential" | "nested" | "independent"``.
      mix_logits: ``[k]`` for ``independent`` (None = uniform); must be None otherwise.

    Returns:
      ``y [B, T, d]`` in ``x``'s dtype.
    """
    _check_variant(variant)
    d = _check_levels(levels)
    x = _check_x(x, d)
    mix_logits = _check_mix(mix_logits, len(levels), variant)
    return _apply(tuple(levels), x, variant, mix_logits)[0].astype(x.dtype)


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
        z = jnp.zeros(t + (h,), x_c.dtype)
        taps.append((z, None if lv.w_gate is None else z, jnp.zeros_like(x_c)))
    return tuple(taps)


def _apply_boundaries(lv, acc, fire, variant):
    """Levels whose period ends apply ``θ ← θ − accum`` and clear it; ``nested`` then resets."""

    def sel(f, a, b):
        return jax.tree.map(lambda u, v: jnp.where(f, u, v), a, b)

    new_lv, out_acc = [], []
    for j in range(len(lv)):
        applied = jax.tree.map(lambda w, a: (w - a).astype(w.dtype), lv[j], acc[j])
        new_lv.append(sel(fire[j], applied, lv[j]))
        out_acc.append(sel(fire[j], jax.tree.map(jnp.zeros_like, acc[j]), acc[j]))
    if variant == "nested":
        for j in range(len(lv) - 2, -1, -1):  # top-down: a slow boundary cascades to faster ones
            new_lv[j] = sel(fire[j + 1], new_lv[j + 1], new_lv[j])
            out_acc[j] = sel(fire[j + 1], jax.tree.map(jnp.zeros_like, out_acc[j]), out_acc[j])
    return tuple(new_lv), tuple(out_acc)


def _validate_online(
    levels,
    x,
    periods,
    delta_fn,
    delta,
    side,
    variant,
    lr,
    inner,
    mix_logits,
    initial_state,
    remat_every,
):
    """Trace-time checks of :func:`cms_online`; returns the normalised inputs."""
    _check_variant(variant)
    if inner not in _INNER:
        raise ValueError(f"inner must be one of {_INNER}, got {inner!r}")
    if (delta_fn is None) == (delta is None):
        raise ValueError("give exactly one of delta_fn (callable) or delta (array [B, T, d])")
    if delta_fn is not None and not callable(delta_fn):
        raise ValueError(f"delta_fn must be callable, got {type(delta_fn).__name__}")
    x = jnp.asarray(x)
    if x.ndim != 3:
        raise ValueError(f"x must have shape [B, T, d], got {x.shape}")
    B, T, _ = x.shape
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
    periods = check_periods(periods, k, variant)
    mix_logits = _check_mix(mix_logits, k, variant)
    lrs = _per_level("lr", lr, k)
    if delta is not None:
        delta = jnp.asarray(delta)
        if delta.shape != x.shape:
            raise ValueError(f"delta must have shape [B, T, d] = {x.shape}, got {delta.shape}")
    if side is not None:
        for leaf in jax.tree.leaves(side):
            if jnp.ndim(leaf) < 2 or jnp.shape(leaf)[:2] != (B, T):
                raise ValueError(
                    f"side leaves must have shape [B={B}, T={T}, ...], got {jnp.shape(leaf)}"
                )
    if remat_every is not None:
        check_positive_int("remat_every (or None)", remat_every)
    return x, state, periods, mix_logits, lrs, delta


def cms_online(
    levels,
    x,
    *,
    periods: Sequence[int],
    delta_fn: Callable | None = None,
    delta=None,
    side: Any = None,
    variant: str = "sequential",
    lr=1e-2,
    inner: str = "sgd",
    mix_logits=None,
    initial_state: CMSState | None = None,
    remat_every: int | None = None,
):
    """CMS in ``online`` mode: each level learns from the local surprise at its own period.

    SPEC §3.3 (module docstring for the exact rules). Per chunk of ``c = gcd(periods)`` tokens:
    ``y = CMS(levels; x_chunk)`` at the current weights; ``δ = delta_fn(y, side_chunk)`` (or the
    given ``delta``); per-layer signals by ``jax.vjp``; each level adds ``Σ_t η_ℓ g_t^(ℓ)`` (SGD)
    or the summed DGD directions to its accumulator; a level whose period ends with the chunk
    applies ``θ_ℓ ← θ_ℓ − accum_ℓ`` and clears it; ``nested`` then resets faster levels. Output
    at token ``t`` uses the weights in force before ``t`` (read before write). Tokens past the end
    of ``x`` never trigger a boundary; their partial accumulation stays in the state.
    Differentiable w.r.t. ``levels``, ``x``, ``lr``, ``mix_logits`` (through all updates).

    Args:
      levels: tuple of ``k`` :class:`CMSLevel` (unbatched ``w_up [d, h]``…): the initial weights,
        broadcast to every row. Ignored when ``initial_state`` is given (its levels are used).
      x: ``[B, T, d]`` CMS inputs (any ``T``; need not be a multiple of any period).
      periods: ``(C^(1), …, C^(k))`` positive, strictly increasing ints (``nested``: each divides
        the next).
      delta_fn: ``(y [B, c, d], side_chunk) -> δ [B, c, d]``, the local surprise ``∂L_t/∂y_t``
        (see :func:`surprise_from_loss`). Exactly one of ``delta_fn`` / ``delta``.
      delta: precomputed ``δ [B, T, d]`` (e.g. from a frozen pass; then not the surprise of the
        updated weights).
      side: optional pytree of ``[B, T, ...]`` arrays (targets, loss masks), chunked with ``x``
        and handed to ``delta_fn`` (padded slots are zeros; their δ is masked anyway).
      variant: ``"sequential" | "nested" | "independent"``.
      lr: ``η``: a scalar or one scalar per level.
      inner: ``"sgd"`` or ``"dgd"`` (per layer, SPEC §3.1, ``γ = η/(1+η‖a‖²)``).
      mix_logits: ``[k]`` for ``independent`` (outer parameters, not updated online).
      initial_state: :class:`CMSState` from a previous call (or :func:`cms_initial_state`).
      remat_every: checkpoint the chunk scan every n chunks (``scan_remat``) to bound the memory of
        differentiating through a long stream.

    Returns:
      ``(y [B, T, d], CMSState)``, ``y`` in ``x``'s dtype (accumulators are f32).
    """
    x, state, periods, mix_logits, lrs, delta = _validate_online(
        levels,
        x,
        periods,
        delta_fn,
        delta,
        side,
        variant,
        lr,
        inner,
        mix_logits,
        initial_state,
        remat_every,
    )
    B, T, d = x.shape
    k = len(periods)
    if T == 0:
        return x, state

    c = math.gcd(*periods)
    # Chunks lie on the absolute grid of multiples of c: a stream resumed at pos % c = off starts
    # at slot ``off`` of its first chunk (the leading slots are masked), so every boundary stays
    # at a chunk end whatever the call lengths. A fresh stream has off = 0 (static).
    if initial_state is None:
        off = 0
        n = -(-T // c)
    else:
        off = state.pos % c
        n = -(-(T + c - 1) // c)
    L = n * c

    def place(a):
        a = jnp.asarray(a)
        buf = jnp.zeros((B, L) + a.shape[2:], a.dtype)
        start = (0, off) + (0,) * (a.ndim - 2)
        return lax.dynamic_update_slice(buf, a, start)

    def to_chunks(a):  # [B, L, ...] -> [n, B, c, ...]
        a = a.reshape((B, n, c) + a.shape[2:])
        return jnp.moveaxis(a, 1, 0)

    slots = jnp.arange(L)
    valid = (slots >= off) & (slots < off + T)  # [L]
    xs = {
        "x": to_chunks(place(x)),
        "valid": valid.reshape(n, c),
        "j": jnp.arange(n),
        "delta": None if delta is None else to_chunks(place(delta)),
        "side": None if side is None else jax.tree.map(lambda a: to_chunks(place(a)), side),
    }
    grid0 = state.pos - off  # absolute position of slot 0 (a multiple of c)
    periods_arr = [jnp.asarray(p, jnp.int32) for p in periods]

    def step(carry, inp):
        lv, acc = carry
        x_c, val = inp["x"], inp["valid"]
        vm = val[None, :, None].astype(x_c.dtype)

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

        new_acc = []
        for j in range(k):
            src = 0 if variant == "nested" else j
            ins_j = tuple(None if a is None else a * vm for a in ins[src])
            u = _level_update(inner, lrs[j], ins_j, lv[src], gtaps[src])
            new_acc.append(jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc[j], u))

        end_abs = grid0 + (inp["j"] + 1) * c
        complete = (inp["j"] + 1) * c <= off + T
        fire = [complete & (end_abs % p == 0) for p in periods_arr]

        return _apply_boundaries(lv, new_acc, fire, variant), y

    carry0 = (tuple(state.levels), tuple(state.accum))
    if remat_every is None:
        (lv_f, acc_f), ys = lax.scan(step, carry0, xs)
    else:
        (lv_f, acc_f), ys = scan_remat(step, carry0, xs, remat_every)
    ys = jnp.moveaxis(ys, 0, 1).reshape((B, L, d))
    y = lax.dynamic_slice_in_dim(ys, off, T, axis=1).astype(x.dtype)
    return y, CMSState(levels=lv_f, accum=acc_f, pos=state.pos + T)
