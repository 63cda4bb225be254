"""Reference twin of Hope (SPEC §3.2): a plain loop over tokens, independent of ``hope_chunked``.

``hope_chunked``, ``hope_recurrent``, ``hope_step`` and ``hope_decode_step``
(``nested_jax.core.hope.chunk``, ``.token``) are tested against :func:`hope_reference`, values and
gradients. It is written again from SPEC §3.2 and shares no code path with them: a ``lax.scan`` over
single tokens (no chunk grid, no padding, no parallel chunk stage), every weight materialised after
every token, math per (batch, head) through ``jax.vmap``, and the inner-loss weight gradients
``∂L̃/∂W`` taken by ``jax.grad`` (not the hand-derived layer signals ``x_ℓ, g_ℓ`` of
``core.hope.chunk``). Only the argument types (``HopeState``, ``HopeMemories``, ``MLPMemory``,
``HopeReadout``, from ``core.hope.state``; the rule ``HopeRule``) and the packed-row boundaries
(``core.scan.segment_starts``) are shared.

Per head, each memory is ``M_□(z) = z + W_1 σ(W_2 z)`` (``W_1 [D, h]``, ``W_2 [h, D]``). Token
``t`` reads the projection memories and builds its targets and gradients at its group's
*snapshot* ``M̄_□`` (the running memory just before the last multiple of the group's chunk size
``≤ t``, or just before the token's document start if that is later), and writes the running
memories::

    k_t = norm(M̄_k(x_t)),   v_t = M̄_v(x_t)
    η_t = eta_max·sigmoid(w_ηᵀ M̄_η(x_t) + b_η)
    α_t = sigmoid(w_αᵀ M̄_α(x_t) + b_α)   (decay=False: 1)
    q_t = norm(q_in_t)                    (adaptive_q: norm(M̄_q(x_t)))
    o_t = M_{memory,t−1}(q_t)             (read before write, running weights)
    v̂_□ = M̄_□(v_t),   G_ℓ = ∂/∂W_ℓ ½‖M̄_□(k_t) − v̂_□‖²   (jax.grad; target held fixed)
    per layer, with its input x_ℓ at the snapshot (x_1 = σ(W̄_2 k_t), x_2 = k_t):
        grad_clip c > 0: η_t ← η_t · c·tanh(‖G_ℓ‖_F / c) / ‖G_ℓ‖_F
        dgd:      u = −γ (W_{t−1} x_ℓ x_ℓᵀ + G_ℓ),  γ = η_t / (1 + η_t ‖x_ℓ‖²)  (paper: η/(1+η))
        plain GD: u = −η_t G_ℓ
        momentum: u ← μ S_{t−1} + u,  S_t = u
        W_t = α_t W_{t−1} + u

Chunk sizes 1 (the default rule's) give exact per-token Hope: every snapshot is the running
memory. The rule comes whole (``rule=``, a :class:`~nested_jax.rules.HopeRule`); the twin has no
truncated backprop, and ``remat*`` / ``chunk_updates`` (how ``hope_chunked`` schedules the same
values) mean nothing to it. Packed rows (``segment_ids``): at a document start the running
memories and the snapshots become the initial memories and the momenta zero.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.hope.state import HopeMemories, HopeReadout, HopeState, MLPMemory, check_rule
from nested_jax.core.scan import segment_starts
from nested_jax.rules import HopeRule

__all__ = ["hope_reference", "memory_apply", "l2_normalize", "dgd_layer_write"]


def memory_apply(W1, W2, z, activation: Callable = jax.nn.silu):
    """``M(z) = z + W_1 σ(W_2 z)`` for one head (SPEC §3.2).

    ``W1 [D, h]``, ``W2 [h, D]``, ``z [D]``; returns ``[D]``.
    """
    return z + W1 @ activation(W2 @ z)


def l2_normalize(z, eps: float = 1e-6):
    """``z / sqrt(‖z‖² + eps)`` for one vector ``z [D]`` (the q, k normalisation of SPEC §3.2)."""
    return z / jnp.sqrt(jnp.sum(z * z) + eps)


def dgd_layer_write(W, S, G, x, eta, alpha, *, rule: HopeRule):
    """One layer's write (SPEC §3.1 composed with §3.2) under ``rule``: returns ``(W_new, u)``.

    Args:
      W: running weight ``[o, i]`` (``W_{t−1}``).
      S: momentum ``[o, i]`` (``S_{t−1}``), read only with ``rule.momentum``.
      G: inner-loss gradient ``[o, i]`` at the snapshot (``g xᵀ`` for this layer).
      x: the layer's input ``[i]`` at the snapshot.
      eta, alpha: scalars ``η_t``, ``α_t``.
      rule: the :class:`~nested_jax.rules.HopeRule`; read: ``dgd`` (DGD, ``u = −γ (W x xᵀ + G)``,
        or plain GD, ``u = −η G``), ``step`` (``"exact"``: ``γ = η/(1 + η‖x‖²)``,
        Sherman–Morrison; ``"paper"``: ``η/(1 + η)``), ``dgd_target`` (``"gradient"``: ``u = −γ (W
        x xᵀ + G)``; ``"proximal"``: ``u = −γ G``, SPEC §3.2 Decision: ``W x`` regressed onto its
        own target ``W x − g``), ``momentum`` / ``momentum_coef`` (``u ← μ S + u``) and
        ``grad_clip`` (``c > 0`` scales the rate by ``c·tanh(‖G‖_F/c)/‖G‖_F``; 0: off).

    Returns:
      ``W_new = α W + u`` and the update ``u`` (the new momentum with ``rule.momentum``).
    """
    grad_clip = rule.grad_clip
    if grad_clip:
        nrm2 = jnp.sum(G * G)
        safe = jnp.sqrt(jnp.where(nrm2 > 0, nrm2, 1.0))
        eta = eta * jnp.where(nrm2 > 0, grad_clip * jnp.tanh(safe / grad_clip) / safe, 1.0)
    if rule.dgd:
        xx = jnp.sum(x * x) if rule.step == "exact" else 1.0
        gamma = eta / (1.0 + eta * xx)
        u = -gamma * (G if rule.dgd_target == "proximal" else jnp.outer(W @ x, x) + G)
    else:
        u = -eta * G
    if rule.momentum:
        u = rule.momentum_coef * S + u
    return alpha * W + u, u


def _per_bh(f):
    """vmap a per-(batch, head) function over batch, then heads (every argument ``[B, H, ...]``)."""
    return jax.vmap(jax.vmap(f))


def _write_memory(run, snap, mom, k, v, eta, alpha, *, rule: HopeRule, act):
    """Self-referential write of one memory for one (batch, head): target, gradient, two layers.

    ``run``, ``snap``, ``mom``: the memory's running weights, snapshot and momenta, each a pair
    ``(W1 [D, h], W2 [h, D])``. Returns ``(W1_new, W2_new, U1, U2)``."""
    (W1, W2), (W1s, W2s), (S1, S2) = run, snap, mom
    target = memory_apply(W1s, W2s, v, act)  # v̂ = M̄(v), made by the memory itself
    if rule.stop_gradient_targets:
        target = lax.stop_gradient(target)

    def inner_loss(A1, A2):
        return 0.5 * jnp.sum((memory_apply(A1, A2, k, act) - target) ** 2)

    G1, G2 = jax.grad(inner_loss, argnums=(0, 1))(W1s, W2s)
    x1, x2 = act(W2s @ k), k  # each layer's input at the snapshot
    W1n, U1 = dgd_layer_write(W1, S1, G1, x1, eta, alpha, rule=rule)
    W2n, U2 = dgd_layer_write(W2, S2, G2, x2, eta, alpha, rule=rule)
    return W1n, W2n, U1, U2


def _token(run, snap, mom, x_t, q_t, readout: HopeReadout, rule: HopeRule, act):
    """One token for every (batch, head): projections from the snapshots, read, in-order writes.

    ``run``, ``snap``, ``mom``: dicts name -> ``(W1 [B, H, D, h], W2 [B, H, h, D])``; ``x_t, q_t``
    ``[B, H, D]``. Returns ``(o_t [B, H, D], run, mom)``.
    """

    def proj(n, z):
        return _per_bh(lambda a, b, zz: memory_apply(a, b, zz, act))(*snap[n], z)

    k = _per_bh(l2_normalize)(proj("k", x_t))
    v = proj("v", x_t)
    eta = rule.eta_max * jax.nn.sigmoid(
        jnp.einsum("bhd,hd->bh", proj("eta", x_t), readout.eta_w) + readout.eta_b
    )
    if rule.decay:
        a = jnp.einsum("bhd,hd->bh", proj("alpha", x_t), readout.alpha_w) + readout.alpha_b
        alpha = jax.nn.sigmoid(a)
    else:
        alpha = jnp.ones_like(eta)
    q = _per_bh(l2_normalize)(proj("q", x_t) if rule.adaptive_q else q_t)
    o_t = _per_bh(lambda a, b, z: memory_apply(a, b, z, act))(*run["memory"], q)

    adapt = ["eta", "alpha", "memory"] + [n for n in ("k", "v") if getattr(rule, "inner_" + n)]
    if rule.adaptive_q and rule.inner_q:
        adapt.append("q")
    run, mom = dict(run), dict(mom)
    write = _per_bh(functools.partial(_write_memory, rule=rule, act=act))
    for n in adapt:
        W1, W2, U1, U2 = write(run[n], snap[n], mom[n], k, v, eta, alpha)
        run[n] = (W1, W2)
        mom[n] = (U1, U2)
    return o_t, run, mom


def _check_reference_args(rule: HopeRule, state) -> None:
    """The argument checks of :func:`hope_reference` beyond the rule's own (state, momenta, no
    truncated backprop)."""
    check_rule("hope_reference", rule)
    if rule.grad_horizon:
        raise ValueError(
            "hope_reference: rule.grad_horizon must be 0 (the twin has no truncated backprop), "
            f"got {rule.grad_horizon}"
        )
    if state is None:
        raise ValueError(
            "hope_reference: initial_state: required (Hope's memories have no zero state: they "
            "are learned); pass initial_state=hope_init_state(memories, B)"
        )
    if rule.momentum and state.momentum is None:
        raise ValueError("hope_reference: initial_state.momentum must be set when momentum=True")


def _start_state(state: HopeState, initial_memories, momentum, names):
    """``(run, mom, init)``: dicts name -> ``(W1, W2)`` ``[B, H, ...]`` of the running memories,
    the momenta (zeros without ``momentum``) and the memories a document start resets to
    (``initial_memories`` broadcast over the batch, default the running ones)."""
    as_dict = lambda mems: {n: tuple(getattr(mems, n)) for n in names}  # noqa: E731
    run = as_dict(state.memories)
    if momentum:
        mom = as_dict(state.momentum)
    else:
        mom = {n: tuple(jnp.zeros_like(w) for w in run[n]) for n in names}
    if initial_memories is None:
        return run, mom, run
    init = {
        n: tuple(jnp.broadcast_to(w, run[n][i].shape) for i, w in enumerate(m))
        for n, m in as_dict(initial_memories).items()
    }
    return run, mom, init


def _before_token(t, start, run, snap, mom, init, chunks):
    """The state token ``t`` sees: where a document starts (``start [B]``) the running memories
    and the snapshots become ``init`` and the momenta zero; then the snapshot of each memory
    whose group chunk (``chunks[name]``) starts at ``t`` is the running memory."""

    def per_row(a, b):
        """``a`` where ``start [B]`` else ``b`` (weights ``[B, H, ., .]``)."""
        return jnp.where(start[:, None, None, None], a, b)

    run = jax.tree.map(per_row, init, run)
    snap = jax.tree.map(per_row, init, snap)
    mom = jax.tree.map(lambda b: per_row(jnp.zeros_like(b), b), mom)
    for n, c in chunks.items():
        snap[n] = jax.tree.map(lambda a, b, c=c: jnp.where(t % c == 0, a, b), run[n], snap[n])
    return run, snap, mom


@functools.partial(jax.jit, static_argnames=("rule", "activation"))
def hope_reference(
    x,
    q,
    readout: HopeReadout,
    *,
    initial_state: HopeState | None = None,
    rule: HopeRule = HopeRule(),
    segment_ids=None,
    initial_memories: HopeMemories | None = None,
    activation: Callable = jax.nn.silu,
):
    """Hope token by token (SPEC §3.2), the twin of ``hope_chunked`` (same arguments and returns).

    Token ``t`` (0-based) of a group with chunk size ``C`` (``rule.chunk_memory`` for
    ``M_memory``, ``rule.chunk_other`` for k, v, η, α, q) takes its projections, targets and
    gradients at the group's snapshot, refreshed from the running memories when ``t % C == 0``;
    the read and the writes use the running memories. Differentiable (``jax.grad`` / ``jax.vjp``)
    w.r.t. every array argument; jitted, with ``rule`` and ``activation`` static.

    Args:
      x: memory inputs ``[B, T, H, D]``.
      q: ``W_q x`` ``[B, T, H, D]`` (ignored, may be None, when ``rule.adaptive_q``).
      readout: ``HopeReadout`` of ``M_η``, ``M_α`` (``*_w [H, D]``, ``*_b [H]``).
      initial_state: ``HopeState`` with weights ``[B, H, ...]`` (``hope_init_state``);
        ``initial_state.momentum`` is needed when ``rule.momentum``. Required (None raises).
      rule: the :class:`~nested_jax.rules.HopeRule` of ``hope_chunked``: chunk sizes (the
        snapshot periods; 1: exact per-token Hope), the flags of SPEC §3.2 / Table 6, ``eta_max``
        (``η_t = eta_max · sigmoid(·)``) and ``grad_clip`` (``c`` of the rate's softclamp by the
        layer gradient's Frobenius norm, 0: off). ``grad_horizon`` must be 0; ``remat*`` and
        ``chunk_updates`` are not read.
      segment_ids: optional int ``[B, T]``: where ``segment_ids[b, t] != segment_ids[b, t−1]``
        (``t ≥ 1``) a document starts: the running memories and every snapshot become
        ``initial_memories`` and the momenta zero, just before that token.
      initial_memories: ``HopeMemories`` ``[H, ...]`` or ``[B, H, ...]``; default
        ``initial_state.memories``.
      activation: the memories' elementwise ``σ``.

    Returns:
      ``(o [B, T, H, D], final HopeState)`` (``momentum`` set iff ``rule.momentum``).
    """
    state = initial_state
    _check_reference_args(rule, state)
    dtype = jnp.promote_types(jnp.result_type(x), jnp.float32)
    x = jnp.asarray(x, dtype)
    B, T, H, D = x.shape
    q = x if rule.adaptive_q else jnp.asarray(q, dtype)
    names = [n for n in HopeMemories._fields if getattr(state.memories, n) is not None]
    run, mom, init = _start_state(state, initial_memories, rule.momentum, names)
    chunks = {n: rule.chunk_memory if n == "memory" else rule.chunk_other for n in names}
    starts = jnp.zeros((B, T), bool)
    if segment_ids is not None:
        starts = segment_starts(jnp.asarray(segment_ids))

    def token(carry, inp):
        t, x_t, q_t, start = inp
        run, snap, mom = _before_token(t, start, *carry, init, chunks)
        o_t, run, mom = _token(run, snap, mom, x_t, q_t, readout, rule, activation)
        return (run, snap, mom), o_t

    tm = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731  (time-major for the scan)
    xs = (jnp.arange(T), tm(x), tm(q), tm(starts))
    (run, _, mom), o = lax.scan(token, (run, run, mom), xs)
    to_mems = lambda d: HopeMemories(**{n: MLPMemory(*d[n]) for n in names})  # noqa: E731
    return jnp.moveaxis(o, 0, 1), HopeState(to_mems(run), to_mems(mom) if rule.momentum else None)
