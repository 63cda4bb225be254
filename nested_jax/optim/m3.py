"""M3 (Multi-scale Momentum Muon, Nested Learning Algorithm 1) as an optax transformation.

SPEC §3.5. Per parameter, with gradient ``g`` and step ``t = 1, 2, …``::

    M1 ← M1 + β1 g ;   V ← V + β2 g² ;   B ← B + g                 (additive, Algorithm 1)
    O1 = NS(M1)
    direction = (O1 + α · O2) / (√V + ε)                          (scale_by_m3 returns this)
    if t % slow_every == 0 (after the direction):  M2 ← M2 + β3 B ;  B ← 0 ;  O2 = NS(M2)

so step ``t`` uses the ``O2`` of the last slow step strictly before it (``O2 = 0`` before the
first). ``m3()`` chains the direction with decoupled weight decay and ``−lr`` and sends everything
that is not a matrix (and embeddings, by default) to AdamW.

``NS`` is the Muon Newton–Schulz orthogonalisation over the **last two axes** (leading axes are a
batch, e.g. scanned layers): ``X = G / (‖G‖_F + ε_ns)``, transpose if rows > cols, ``ns_steps``
iterations of ``X ← aX + b(XXᵀ)X + c(XXᵀ)²X``, transpose back.

Why Algorithm 1 is not scale-invariant: NS returns (nearly) orthogonal matrices whatever the size
of its input, so ``RMS(O1 + α O2)`` is a constant (≈ ``(1 + α)/√max(m, n)`` for an ``m × n``
matrix, ``min(m, n)`` singular values ≈ 1), while ``√V = √(β2 Σ g²)`` has the units of the
gradient. Multiplying every gradient by ``c > 0`` therefore multiplies the step by ``1/c``: the
step is ``∝ lr / |g|`` (large when gradients are small, e.g. near a minimum or with a small
loss scale; small when they are large), so the usable learning rate depends on the gradient scale
of the problem and does not transfer from AdamW or Muon.

Scale-invariant variant, ``normalize="rms"`` (**not the paper's**; default ``"none"`` is
Algorithm 1 bit for bit). Same state and recurrence; only the direction changes. Per matrix
(the last two axes; a leaf with ``ndim < 2`` counts as one matrix), with ``ρ = target_rms``::

    O1 = NS(M1 / ‖M1‖_F) ;   O2 = NS(M2 / ‖M2‖_F)      (NS sees a unit-norm input: ε_ns is relative)
    ν  = √V / RMS(√V)         RMS(√V) = √mean(V)        (dimensionless second moment)
    D  = (O1 + α · O2) / (ν + ε)                        (= Algorithm 1's direction · RMS(√V))
    direction = ρ · D / RMS(D)                          (RMS(direction) = ρ for every matrix)

(``0/0`` is read as 0: an all-zero ``V`` or ``D`` gives a zero direction.) With
``g → c g`` for every step: ``M1, M2, B → c·``, ``V → c² V``, so ``M / ‖M‖_F``, ``ν`` and hence
``O1, O2, D`` and the direction are unchanged (exactly, up to float rounding; with ``c`` a power
of two, bit for bit). It keeps Algorithm 1's *direction* — the orthogonalised fast + slow momenta,
preconditioned coordinate-wise by ``√V`` — and fixes its *size*: each matrix moves by
``lr · ρ`` in RMS per step, like Moonlight's Muon (Liu et al. 2025, "Muon is Scalable for LLM
Training": NS output times ``0.2 · √max(m, n)`` so its RMS matches AdamW's typical 0.2–0.4) and
AdaMuon (RMS-aligned rescaling of the preconditioned orthogonal direction). With ``ρ = 0.2`` the
M3 matrices and the AdamW leaves of :func:`m3` take steps of comparable RMS, so one learning
rate in AdamW's range serves both branches.

``ε`` choice: with an absolute ``ε`` the invariance would only hold where ``√V ≫ ε / c``
(``g → 10⁻³ g`` turns ``ε = 10⁻⁸`` into ``10⁻⁵`` in gradient units, enough to move coordinates
with small ``V`` by more than the rounding); dividing ``√V`` by its per-matrix RMS first makes
``ε`` (same default ``1e-8``) a fraction of the typical ``√V`` instead, and handing NS the
unit-Frobenius matrix makes ``ns_eps`` relative in the same way. Normalising after the division
(not ``O / RMS(O)`` before it) is what lets ``ν`` keep its coordinate-wise preconditioning.

What the variant does not change: Algorithm 1's additive momenta never forget (``M1 = β1 Σ g``
over all steps), so ``O1`` keeps pointing along the sum of every past gradient. In Algorithm 1
the growing ``√V ∝ √t`` shrinks the step like ``1/√t``; the variant's step RMS is ``lr · ρ`` at
every ``t``, so only the learning-rate schedule decays it, and at a constant rate the additive
momenta overshoot (``nested-jax bench optim``'s toy regression: the additive variant is about as
far from AdamW / Muon as Algorithm 1 at its best rate). ``accumulate="ema", normalize="rms"``
(neither is the paper's; SPEC §3.5 names ``"ema"`` as the non-paper reading) is the combination
that behaves as a drop-in for AdamW / Muon.

Decisions / options:

- ``accumulate="additive"`` (default) is the paper's Algorithm 1. ``accumulate="ema"`` is **not
  the paper's**: ``M1 ← β1 M1 + (1−β1) g``, ``V ← β2 V + (1−β2) g²`` with Adam's bias correction
  ``V / (1 − β2^t)`` in the denominator, ``M2 ← β3 M2 + (1−β3) B / slow_every`` (``B`` is still
  the plain sum over the period, so ``B / slow_every`` is its mean gradient). NS is scale
  invariant, so the momenta need no bias correction.
- Leaves with fewer than two dimensions are not orthogonalised in :func:`scale_by_m3`
  (``NS(M) := M`` for them; the rest of the rule is unchanged). :func:`m3` routes them to AdamW.
- ``normalize="rms"``'s ``ν, D`` are per matrix over the last two axes (stacked layers
  ``[L, m, n]`` are normalised layer by layer); for leaves with ``ndim < 2`` over the whole leaf.
  It combines with either ``accumulate`` (the EMA bias correction cancels in ``ν``).
- The moments are stored in ``state_dtype`` (float32 by default, also for bf16 parameters:
  additive sums of ``g²`` lose everything in bf16); the updates take each gradient leaf's dtype.
- ``init`` derives its zeros from the parameters, so the state shards like them even when ``init``
  is jitted on a GSPMD (Auto) mesh; ``update`` keeps the layout too (tested on 8 devices, Auto and
  Explicit meshes; under Explicit, NS gathers the two matrix axes and reshards back).
- The slow step is a ``lax.cond`` on the step count, so one compiled ``update`` serves every step
  and the second Newton–Schulz only runs on slow steps.
- Under ``optax.inject_hyperparams`` every numeric argument (``slow_every`` and ``ns_steps`` too)
  becomes a traced hyperparameter; both are handled (``ns_steps`` then runs as a ``fori_loop``).
  Pass callables that are not schedules (``m3_mask``, ``weight_decay_mask``) via ``static_args``.
"""

from __future__ import annotations

import functools
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from nested_jax.core.periods import accumulate as accumulate_period
from nested_jax.core.periods import period_boundary

__all__ = [
    "M3State",
    "newton_schulz",
    "scale_by_m3",
    "m3",
    "default_m3_mask",
    "m3_from_config",
]

_ACCUMULATE = ("additive", "ema")
_NORMALIZE = ("none", "rms")


class M3State(NamedTuple):
    """State of :func:`scale_by_m3` (SPEC §3.5); the five trees are shaped like the parameters."""

    count: jax.Array  # int32 [], steps taken
    m1: Any  # fast momentum M1
    m2: Any  # slow momentum M2
    v: Any  # second moment V
    slow_buffer: Any  # B: gradients summed since the last slow step
    o2: Any  # cached NS(M2) (M2 itself for leaves with ndim < 2)


def _is_static_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def newton_schulz(
    G,
    ns_steps=5,
    ns_coeffs=(3.4445, -4.7750, 2.0315),
    eps=1e-8,
):
    """Muon's Newton–Schulz orthogonalisation over the last two axes (SPEC §3.5).

    ``X = G / (‖G‖_F + ε)`` (per matrix), transposed when rows > cols, then ``ns_steps`` times
    ``X ← aX + b(XXᵀ)X + c(XXᵀ)²X``, transposed back. ``NS(0) = 0``.

    Args:
      G: ``[..., rows, cols]``; leading axes are independent matrices.
      ns_steps: number of iterations (Python int, or an int array under ``inject_hyperparams``).
      ns_coeffs: ``(a, b, c)``.
      eps: added to the Frobenius norm.

    Returns:
      ``[..., rows, cols]`` float32 (at least) array.
    """
    G = jnp.asarray(G)
    if G.ndim < 2:
        raise ValueError(f"G must have shape [..., rows, cols], got {G.shape}")
    if len(ns_coeffs) != 3:
        raise ValueError(f"ns_coeffs must be (a, b, c), got {ns_coeffs!r}")
    if _is_static_int(ns_steps) and ns_steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {ns_steps}")
    X = G.astype(jnp.promote_types(G.dtype, jnp.float32))
    spec = _explicit_matrix_spec(X)
    if spec is not None:
        # Explicit-sharding meshes refuse matmuls over sharded contracting axes; gather the two
        # matrix axes (leading/batch axes stay sharded) and restore the layout at the end.
        X = jax.sharding.reshard(X, P(*spec[:-2], None, None))
    a, b, c = (jnp.asarray(x, X.dtype) for x in ns_coeffs)
    transpose = X.shape[-2] > X.shape[-1]
    if transpose:
        X = jnp.swapaxes(X, -1, -2)
    norm = jnp.sqrt(jnp.sum(jnp.square(X), axis=(-2, -1), keepdims=True))
    X = X / (norm + eps)

    def iterate(_, X):
        A = X @ jnp.swapaxes(X, -1, -2)  # [.., r, r] with r = min(rows, cols)
        B = b * A + c * (A @ A)
        return a * X + B @ X

    if _is_static_int(ns_steps):
        for i in range(int(ns_steps)):
            X = iterate(i, X)
    else:  # traced step count (inject_hyperparams): a while loop
        X = lax.fori_loop(0, jnp.asarray(ns_steps, jnp.int32), iterate, X)
    if transpose:
        X = jnp.swapaxes(X, -1, -2)
    if spec is not None:
        X = jax.sharding.reshard(X, P(*spec))
    return X


def _explicit_matrix_spec(X):
    """The PartitionSpec of ``X`` when an Explicit mesh axis shards its last two axes, else None."""
    try:
        sharding = jax.typeof(X).sharding
        spec = tuple(sharding.spec)
    except (AttributeError, TypeError):
        return None
    spec = spec + (None,) * (X.ndim - len(spec))
    if spec[-2] is None and spec[-1] is None:
        return None
    return spec


def _acc(fn, state, g):
    # Keep each state leaf's dtype: hyperparameters injected as f32 arrays would otherwise promote
    # bf16 state (state_dtype=None) to f32, changing the state's type between steps.
    return jax.tree.map(lambda m, x: fn(m, x).astype(m.dtype), state, g)


def _matrix_axes(x) -> tuple[int, ...]:
    """The axes one "matrix" spans: the last two, or all of them for ``ndim < 2``."""
    return tuple(range(max(0, x.ndim - 2), x.ndim))


def _safe_div(num, den):
    """``num / den`` with ``0`` where ``den == 0`` (only ``0/0`` occurs there in M3)."""
    pos = den > 0
    return jnp.where(pos, num / jnp.where(pos, den, 1), 0)


def _rms(x, axes):
    return jnp.sqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=True))


def _unit_frobenius(x):
    """``x / ‖x‖_F`` per matrix (last two axes) in at least float32; ``0`` stays ``0``."""
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
    return _safe_div(x, norm)


def _rms_direction(o, v, eps, target_rms):
    """``normalize="rms"``: ``ρ · D / RMS(D)`` with ``D = o / (√V / RMS(√V) + ε)`` per matrix.

    Args:
      o: ``O1 + α O2``, shaped like the parameter.
      v: second moment ``V`` (bias-corrected for ``"ema"``), same shape.
      eps: ``ε``, relative to ``RMS(√V)``.
      target_rms: ``ρ``.

    Returns:
      the direction, same shape, float32 (at least); per-matrix RMS ``ρ`` (0 where ``D = 0``).
    """
    dt = jnp.promote_types(jnp.result_type(o, v), jnp.float32)
    o, v = o.astype(dt), v.astype(dt)
    axes = _matrix_axes(v)
    root = jnp.sqrt(v)
    nu = _safe_div(root, jnp.sqrt(jnp.mean(v, axis=axes, keepdims=True)))
    d = _safe_div(o, nu + jnp.asarray(eps, dt))
    return jnp.asarray(target_rms, dt) * _safe_div(d, _rms(d, axes))


def _check_m3_options(accumulate, normalize, target_rms, slow_every, ns_steps, ns_coeffs):
    """Trace-time checks of :func:`scale_by_m3`'s options (``ValueError`` naming the option)."""
    if accumulate not in _ACCUMULATE:
        raise ValueError(f"accumulate must be one of {_ACCUMULATE}, got {accumulate!r}")
    if normalize not in _NORMALIZE:
        raise ValueError(f"normalize must be one of {_NORMALIZE}, got {normalize!r}")
    if isinstance(target_rms, bool) or (
        isinstance(target_rms, (int, float, np.integer, np.floating)) and not target_rms > 0
    ):
        raise ValueError(f"target_rms must be a positive number, got {target_rms!r}")
    if _is_static_int(slow_every) and slow_every < 1:
        raise ValueError(f"slow_every must be a positive int, got {slow_every}")
    elif not _is_static_int(slow_every) and not isinstance(slow_every, (jax.Array, np.ndarray)):
        raise ValueError(f"slow_every must be a positive int, got {slow_every!r}")
    if _is_static_int(ns_steps) and ns_steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {ns_steps}")
    if len(ns_coeffs) != 3:
        raise ValueError(f"ns_coeffs must be (a, b, c), got {ns_coeffs!r}")


def _zero_state(params, state_dtype) -> M3State:
    """:class:`M3State` at step 0: zeros in ``state_dtype`` (None: each parameter's dtype)."""

    def zeros(p):
        # Derived from p (not a bare constant) so that a jitted init in GSPMD/Auto mode keeps the
        # parameter's sharding (a constant zeros_like would come out replicated there).
        dt = state_dtype if state_dtype is not None else p.dtype
        return jnp.where(jnp.isfinite(p), jnp.abs(p) * 0, 0).astype(dt)

    z = lambda: jax.tree.map(zeros, params)
    return M3State(count=jnp.zeros([], jnp.int32), m1=z(), m2=z(), v=z(), slow_buffer=z(), o2=z())


def _orthogonalize(x, *, rms: bool, ns_steps, ns_coeffs, ns_eps):
    """``NS`` of a momentum leaf, in its dtype: ``newton_schulz(x)`` (``rms``: of ``x / ‖x‖_F``,
    so ``ns_eps`` is relative); leaves with ``ndim < 2`` are returned as they are."""
    if x.ndim < 2:
        return x  # vectors/scalars: no orthogonalisation (documented)
    y = _unit_frobenius(x) if rms else x
    return newton_schulz(y, ns_steps, ns_coeffs, ns_eps).astype(x.dtype)


def _fast_moments(m1, v, g, count, beta1, beta2, ema: bool):
    """Every step: ``M1 ← M1 + β1 g``, ``V ← V + β2 g²`` (Algorithm 1), or their EMAs.

    Returns:
      ``(M1, V, v_corr)``: ``v_corr = 1 − β2^t`` (Adam's bias correction of the EMA ``V``), None
      for ``"additive"``.
    """
    if ema:
        m1 = _acc(lambda m, x: beta1 * m + (1 - beta1) * x, m1, g)
        v = _acc(lambda m, x: beta2 * m + (1 - beta2) * x * x, v, g)
        return m1, v, 1.0 - jnp.asarray(beta2, jnp.float32) ** count.astype(jnp.float32)
    m1 = _acc(lambda m, x: m + beta1 * x, m1, g)
    v = _acc(lambda m, x: m + beta2 * x * x, v, g)
    return m1, v, None


def _slow_step(carry, *, ns, beta3, slow_every, ema: bool):
    """The slow step, ``(M2, B, O2) -> (M2', 0, NS(M2'))`` with ``M2' = M2 + β3 B`` (Algorithm 1)
    or ``β3 M2 + (1−β3) B / slow_every`` (``"ema"``); ``ns`` is :func:`_orthogonalize` bound."""
    m2, b, _ = carry
    if ema:
        m2 = _acc(
            lambda m, x: beta3 * m + (1 - beta3) * x / jnp.asarray(slow_every, x.dtype), m2, b
        )
    else:
        m2 = _acc(lambda m, x: m + beta3 * x, m2, b)
    return m2, jax.tree.map(jnp.zeros_like, b), jax.tree.map(ns, m2)


def _direction(u, o1, o2, v, v_corr, alpha, eps, target_rms):
    """One leaf's direction ``(O1 + α O2) / (√V + ε)`` (``V / v_corr`` for ``"ema"``), or the
    ``normalize="rms"`` direction when ``target_rms`` is not None; in ``u``'s dtype."""
    v = v / v_corr.astype(v.dtype) if v_corr is not None else v
    if target_rms is not None:  # scale-invariant variant (module docstring)
        return _rms_direction(o1 + alpha * o2, v, eps, target_rms).astype(u.dtype)
    return ((o1 + alpha * o2) / (jnp.sqrt(v) + eps)).astype(u.dtype)


def scale_by_m3(
    beta1=0.9,
    beta2=0.999,
    beta3=0.9,
    alpha=1.0,
    eps=1e-8,
    slow_every=100,
    ns_steps=5,
    ns_coeffs=(3.4445, -4.7750, 2.0315),
    accumulate: str = "additive",
    *,
    ns_eps=1e-8,
    state_dtype: Any = "float32",
    normalize: str = "none",
    target_rms=0.2,
) -> optax.GradientTransformation:
    """The M3 direction ``(NS(M1) + α NS(M2)) / (√V + ε)`` (SPEC §3.5, paper Algorithm 1).

    Chain with ``optax.scale_by_learning_rate(lr)`` (or use :func:`m3`) to descend. See the module
    docstring for the full recurrence, the ``"ema"`` option (not the paper's), the handling of
    leaves with fewer than two dimensions (no orthogonalisation) and the derivation of
    ``normalize="rms"``.

    Algorithm 1's direction (``normalize="none"``) scales like ``1/c`` under ``g → c g``, so its
    usable learning rate depends on the gradient scale. ``normalize="rms"`` returns
    ``ρ · D / RMS(D)`` per matrix, ``D = (NS(M1/‖M1‖) + α NS(M2/‖M2‖)) / (√V/RMS(√V) + ε)``: the
    same direction with RMS exactly ``ρ = target_rms``, unchanged under ``g → c g``.

    Args:
      beta1: ``β1``, fast momentum rate.
      beta2: ``β2``, second-moment rate.
      beta3: ``β3``, slow momentum rate.
      alpha: ``α``, weight of the slow direction ``O2``.
      eps: ``ε`` added to ``√V``.
      slow_every: period of the slow step (positive int).
      ns_steps: Newton–Schulz iterations.
      ns_coeffs: Newton–Schulz ``(a, b, c)``.
      accumulate: ``"additive"`` (Algorithm 1) or ``"ema"``.
      ns_eps: ``ε`` of the Newton–Schulz normalisation.
      state_dtype: dtype of ``m1, m2, v, slow_buffer, o2`` (``None``: each parameter's dtype).
      normalize: ``"none"`` (Algorithm 1, default) or ``"rms"`` (scale-invariant: per-matrix RMS
        ``target_rms``, ``ε`` and ``ns_eps`` relative; not the paper's).
      target_rms: ``ρ``, the per-matrix RMS of the direction with ``normalize="rms"`` (ignored
        otherwise); ``0.2`` matches AdamW's typical update RMS (Moonlight's Muon scaling).

    Returns:
      ``optax.GradientTransformation`` with state :class:`M3State`; the update is the direction (not
      yet scaled by ``−lr``), leaf dtypes equal to the gradients'.
    """
    _check_m3_options(accumulate, normalize, target_rms, slow_every, ns_steps, ns_coeffs)
    sdt = None if state_dtype is None else jnp.dtype(state_dtype)
    ema = accumulate == "ema"
    rms = normalize == "rms"
    ns = functools.partial(
        _orthogonalize, rms=rms, ns_steps=ns_steps, ns_coeffs=ns_coeffs, ns_eps=ns_eps
    )

    def init_fn(params):
        return _zero_state(params, sdt)

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        g = jax.tree.map(lambda u, m: u.astype(m.dtype), updates, state.m1)
        m1, v, v_corr = _fast_moments(state.m1, state.v, g, count, beta1, beta2, ema)
        buf = accumulate_period(state.slow_buffer, g)  # B ← B + g (core.periods)
        o1 = jax.tree.map(ns, m1)
        direction = functools.partial(
            _direction, v_corr=v_corr, alpha=alpha, eps=eps, target_rms=target_rms if rms else None
        )
        new_updates = jax.tree.map(direction, updates, o1, state.o2, v)
        # One compiled update for every step: the slow step is a branch on the traced count. A
        # lax.cond, not core.periods' where-select, so the second NS runs only on slow steps.
        is_slow = period_boundary(count, slow_every)
        slow = functools.partial(_slow_step, ns=ns, beta3=beta3, slow_every=slow_every, ema=ema)
        m2, buf, o2 = lax.cond(is_slow, slow, lambda c: c, (state.m2, buf, state.o2))
        return new_updates, M3State(count=count, m1=m1, m2=m2, v=v, slow_buffer=buf, o2=o2)

    return optax.GradientTransformation(init_fn, update_fn)


_EMBED_RE = re.compile(r"embed", re.IGNORECASE)


def _path_names(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def default_m3_mask(params):
    """Default M3 routing of :func:`m3`: ``True`` for leaves with ``ndim ≥ 2`` whose path does not
    contain ``"embed"`` (case-insensitive; SPEC §3.5 sends embeddings to AdamW by default).

    Args:
      params: parameter pytree.

    Returns:
      pytree of bools like ``params``.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, p: bool(jnp.ndim(p) >= 2 and not _EMBED_RE.search(_path_names(path))), params
    )


def m3(
    learning_rate,
    beta1=0.9,
    beta2=0.999,
    beta3=0.9,
    alpha=1.0,
    eps=1e-8,
    slow_every=100,
    ns_steps=5,
    ns_coeffs=(3.4445, -4.7750, 2.0315),
    accumulate: str = "additive",
    weight_decay=0.0,
    weight_decay_mask=None,
    adam_b1=0.9,
    adam_b2=0.999,
    adam_eps=1e-8,
    adam_learning_rate=None,
    adam_weight_decay=None,
    m3_mask: Any = None,
    ns_eps=1e-8,
    state_dtype: Any = "float32",
    normalize: str = "none",
    target_rms=0.2,
) -> optax.GradientTransformationExtraArgs:
    """M3 for matrices, AdamW for everything else (SPEC §3.5), via ``optax.partition``.

    Matrices (``m3_mask``): ``u = −lr · (direction + weight_decay · θ)`` with the direction of
    :func:`scale_by_m3` (decoupled weight decay, as AdamW). Other leaves:
    ``optax.adamw(adam_learning_rate or learning_rate, adam_b1, adam_b2, adam_eps,
    weight_decay=adam_weight_decay or weight_decay)``.

    Args:
      learning_rate: float, array or ``optax`` schedule.
      beta1, beta2, beta3, alpha, eps, slow_every, ns_steps, ns_coeffs, accumulate, ns_eps,
        state_dtype, normalize, target_rms: as in :func:`scale_by_m3`. With the default
        ``normalize="none"`` (Algorithm 1) the M3 step scales like ``lr / |g|``, so its learning
        rate has to be tuned per problem (often far below AdamW's); with ``normalize="rms"`` every
        M3 matrix moves by ``lr · target_rms`` in RMS per step and a learning rate in AdamW's
        range serves both branches.
      weight_decay: decoupled decay of the M3 leaves (and of the AdamW leaves unless
        ``adam_weight_decay`` is given).
      weight_decay_mask: optional mask (pytree of bools or callable) for the decay, as in optax.
      adam_b1, adam_b2, adam_eps: AdamW moments for the non-matrix leaves.
      adam_learning_rate: AdamW learning rate (default: ``learning_rate``).
      adam_weight_decay: AdamW decay (default: ``weight_decay``).
      m3_mask: pytree of bools (``True`` = M3) or ``params -> pytree of bools``; default
        :func:`default_m3_mask` (``ndim ≥ 2`` and not an embedding).

    Returns:
      ``optax.GradientTransformationExtraArgs``; works under ``optax.inject_hyperparams`` (pass
      ``m3_mask``/``weight_decay_mask`` callables via ``static_args``).
    """
    direction = scale_by_m3(
        beta1, beta2, beta3, alpha, eps, slow_every, ns_steps, ns_coeffs, accumulate,
        ns_eps=ns_eps, state_dtype=state_dtype, normalize=normalize, target_rms=target_rms,
    )  # fmt: skip
    m3_chain = optax.chain(
        direction,
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )
    adam = optax.adamw(
        learning_rate if adam_learning_rate is None else adam_learning_rate,
        b1=adam_b1,
        b2=adam_b2,
        eps=adam_eps,
        weight_decay=weight_decay if adam_weight_decay is None else adam_weight_decay,
        mask=weight_decay_mask,
    )
    labels = _route_labels(default_m3_mask if m3_mask is None else m3_mask)
    return optax.partition({"m3": m3_chain, "adam": adam}, labels)


def _route_labels(mask):
    """``params -> pytree of "m3" | "adam"`` from ``m3_mask`` (pytree of bools or callable)."""

    def labels(params):
        flags = mask(params) if callable(mask) else mask
        return jax.tree.map(lambda f: "m3" if f else "adam", flags)

    return labels


_CONFIG_KEYS = (
    "beta1",
    "beta2",
    "beta3",
    "alpha",
    "eps",
    "slow_every",
    "ns_steps",
    "ns_coeffs",
    "accumulate",
    "ns_eps",
    "normalize",
    "target_rms",
    "adam_lr_scale",
)


def _decay_matrices(params):
    # Like the AdamW factory of the training config: decay matrices only (ndim ≥ 2).
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def m3_from_config(cfg, learning_rate) -> optax.GradientTransformation:
    """Optimizer factory for the training config (``optimizer.name: m3``; SPEC §3.5).

    Signature of ``nested_jax.train.optimizer.OPTIMIZERS`` entries. Reads from ``cfg`` (duck-typed,
    so ``optim`` does not import ``train``): ``weight_decay`` (decoupled, on ``ndim ≥ 2`` leaves of
    both branches), ``b1, b2, eps`` (the AdamW branch), and ``extra`` with any of the
    :func:`scale_by_m3` keys ``beta1, beta2, beta3, alpha, eps, slow_every, ns_steps, ns_coeffs,
    accumulate, ns_eps, normalize, target_rms`` (``extra["eps"]`` is M3's ε; ``cfg.eps`` stays
    Adam's). ``extra: {normalize: rms}`` selects the scale-invariant variant; an unknown key or a
    bad value raises ``ValueError`` naming ``optimizer.extra`` and the key.
    ``extra: {adam_lr_scale: s}`` runs the AdamW branch (embeddings, norms, biases) at ``s ×`` the
    M3 schedule (same warmup and decay shape): Algorithm 1's learning rates are far below Adam's
    (its step scales like lr/|g|), so sharing one rate starves those parameters.

    Args:
      cfg: an ``OptimizerConfig``-like object.
      learning_rate: float or optax schedule (shared by both branches).

    Returns:
      :func:`m3` transformation.
    """
    extra = dict(getattr(cfg, "extra", None) or {})
    unknown = sorted(set(extra) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"optimizer.extra: unknown m3 option(s) {unknown}; allowed: {list(_CONFIG_KEYS)}"
        )
    if "ns_coeffs" in extra:
        extra["ns_coeffs"] = tuple(extra["ns_coeffs"])
    adam_lr = None
    if "adam_lr_scale" in extra:
        scale = extra.pop("adam_lr_scale")
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            raise ValueError(f"optimizer.extra.adam_lr_scale must be a number > 0, got {scale!r}")
        adam_lr = (
            (lambda step: scale * learning_rate(step))
            if callable(learning_rate)
            else scale * learning_rate
        )
    try:
        return m3(
            learning_rate,
            adam_learning_rate=adam_lr,
            weight_decay=cfg.weight_decay,
            weight_decay_mask=_decay_matrices,
            adam_b1=cfg.b1,
            adam_b2=cfg.b2,
            adam_eps=cfg.eps,
            **extra,
        )
    except ValueError as err:  # "normalize must be one of ..." → "optimizer.extra.normalize ..."
        raise ValueError(f"optimizer.extra.{err}") from None
