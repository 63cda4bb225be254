"""Hope: self-modifying Titans memories updated by Delta Gradient Descent (SPEC §3.2).

Per head, with column vectors and head dim ``D``, every memory ``M_□`` (``□ ∈ {k, v, η, α,
memory}``, plus ``q`` when ``adaptive_q``) is a 2-layer residual MLP::

    M(z) = z + W_1 σ(W_2 z),      W_2 ∈ R^{h×D},  W_1 ∈ R^{D×h},  σ elementwise (default SiLU)

The η and α memories end in a fixed (outer, not inner-adapted) readout to one scalar per head::

    η_t = eta_max·sigmoid(w_ηᵀ M_η(x_t) + b_η),      α_t = sigmoid(w_αᵀ M_α(x_t) + b_α)

so their inner loss, like every other memory's, is on the ``D``-vector ``M(z)`` (the readout
``HopeReadout`` is meta-learned by the caller). Per token (read before write)::

    k_t = norm(M_{k,t-1}(x_t)),  v_t = M_{v,t-1}(x_t),  η_t, α_t as above
    q_t = norm(q_in_t)     (q_in = W_q x from the caller; adaptive_q: norm(M_{q,t-1}(x_t)))
    o_t = M_{memory,t-1}(q_t)
    v̂_{□,t} = M_{□,t-1}(v_t)                     (stop_gradient_targets: option)
    L̃_□ = ½‖M_□(k_t) − v̂_{□,t}‖²,  e = M_□(k_t) − v̂_{□,t}
    per layer ℓ (SPEC §3.1), input x_ℓ and backpropagated signal g_ℓ = ∂L̃/∂y_ℓ:
        W_1: x = σ(W_2 k_t),  g = e;      W_2: x = k_t,  g = σ'(W_2 k_t) ⊙ (W_1ᵀ e)
        grad_clip=c>0: η_t ← η_t · c·tanh(n/c)/n,  n = ‖g‖‖x‖   (per layer softclamp)
        dgd=True:   u_t = −γ_t (W x + g) xᵀ,  γ_t = η_t / (1 + η_t ‖x‖²)  (step="paper": η/(1+η))
        dgd=False:  u_t = −η_t g xᵀ
        momentum:   S_t = μ S_{t-1} + u_t,  W_t = α_t W_{t-1} + S_t   (momentum=False: S_t = u_t)
    i.e. without momentum W_t = W_{t-1}(α_t I − γ_t x xᵀ) − γ_t g xᵀ (eq. 88 with SM γ).

Ablation flags (SPEC §3.2, Table 6): ``dgd=False`` (plain GD with retention), ``momentum``,
``decay=False`` (α_t = 1 everywhere), ``inner_k/inner_v/inner_q`` (a non-adapting memory stays at
its state; ``M_η``, ``M_α`` and ``M_memory`` always adapt). ``cms`` is the layer's business (§3.3).
:class:`HopeRule` holds the chunk sizes, these flags, ``grad_horizon`` and ``remat`` as one frozen
value; :func:`hope_chunked` takes it whole (``rule=``), as the mixer passes it through ``ops.hope``.
The short causal conv on q, k, v (SPEC §3.2) is also the layer's business.
The value types (``MLPMemory``, ``HopeMemories``, ``HopeReadout``, ``HopeState``, ``HopeRule``)
and ``hope_init_state`` / ``mlp_memory_apply`` live in :mod:`nested_jax.core.hope.state`
(``HopeRule`` in :mod:`nested_jax.rules`).

Chunked form (**Decision**, SPEC §3.2): chunk ``n`` uses the state at the end of chunk ``n−1``
(``M_{□,0}``) to produce all projections, targets and signals (``x_ℓ``, ``g_ℓ``) of its tokens in
parallel; then the chunk's updates are applied in order (``W x xᵀ`` of DGD uses the running weights
``W_{t-1}``, as in SPEC §3.2's linear formula
``M_t = M_{t-1}(α_t I − γ_t k kᵀ) − γ_t(M_0 k − v̂)kᵀ``). With the inputs and signals fixed by the
snapshot, that in-order recurrence is linear in ``(W, S)``: ``chunk_updates="scan"`` (the rule's
default) walks the chunk's tokens, ``chunk_updates="parallel"`` computes it as one
unit-lower-triangular ``c × c`` solve per memory layer and matmuls for the reads
(:mod:`nested_jax.core.hope.parallel`);
the parallel form carries the memories stacked on a leading axis (they share shapes, gates and
chunk coefficients), so each op of a chunk runs once for all of them.
Two chunk sizes: ``chunk_other`` for the projection memories (k, v, η, α, q) and
``chunk_memory`` for ``M_memory``; the larger must be a multiple of the smaller. The ``scan`` form
walks the time axis in chunks of the smaller one and refreshes the larger group's chunk-start
snapshot every ``larger/smaller`` of them. The two groups never read each other's memories (the
projection memories train on their own outputs; ``M_memory`` reads ``q`` and trains on
``k, v, η, α``), so the ``parallel`` form runs them as two scans, each over its own chunks: the
projection memories first (making ``k, v, η, α, q`` of every token), then ``M_memory``
(:mod:`nested_jax.core.hope.rows`); a chunk's snapshot is then always its group's running state.
**Decision (read):** ``o_t`` reads ``M_memory`` with its running
weights ``M_{memory,t-1}`` (exact read-before-write at any chunk size; with chunk size 1 all of this
is exactly per-token Hope). Everything is differentiable: gradients flow through the writes.

Packed rows (``segment_ids``, SPEC §0): at a document start the running memories become the
initial memories and the momenta zero, and for the rest of that chunk (per group) the initial
memories are also the snapshot, i.e. token ``t`` uses the state just before
``max(C⌊t/C⌋, document start)``. Decoding: :func:`hope_decode_step` carries the snapshots and the
position, so token-by-token decoding equals :func:`hope_chunked` row by row.

Reference twin: :func:`nested_jax.core.hope.reference.hope_reference` computes the same thing
token by token from SPEC §3.2 without this module's chunk machinery (``jax.grad`` inner gradients);
the tests compare :func:`hope_chunked` with it on values and gradients.

Shapes: ``x, q`` ``[B, T, H, D]``; ``η, α`` ``[B, T, H]``; memory weights ``w1 [B, H, D, h]``,
``w2 [B, H, h, D]`` (initial memories may omit ``B``). Arithmetic in f32 or wider.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from nested_jax.core.checks import require_initial_state
from nested_jax.core.dgd import clamped_rate, dgd_step_size
from nested_jax.core.hope.parallel import CHUNK_RESIDUAL
from nested_jax.core.hope.rows import (
    _adapting,
    _groups,
    _memory_chunk,
    _pick,
    _projection_chunk,
    _projections,
    _signals,
    _stack,
    _unstack,
)
from nested_jax.core.hope.state import (
    HOPE_STATE_CONSTRUCTOR,
    HopeMemories,
    HopeReadout,
    HopeState,
    MLPMemory,
    _names,
    check_rule,
    hope_init_state,
    mlp_memory_apply,
)
from nested_jax.core.scan import chunk, scan_remat, segment_starts, unchunk
from nested_jax.rules import HopeRule

__all__ = [
    "hope_chunked",
]


def _validate(x, q, state, readout, rule: HopeRule, name="state"):
    """Shape checks of a Hope call under ``rule`` (its ``adaptive_q`` and ``momentum``); ``name``
    is the state's argument name in the messages."""
    adaptive_q = rule.adaptive_q
    x = jnp.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"x must have shape [B, T, H, D], got {x.shape}")
    B, T, H, D = x.shape
    if not adaptive_q:
        if q is None or jnp.shape(q) != x.shape:
            raise ValueError(
                f"q must have shape [B, T, H, D]={x.shape} (adaptive_q=False), got "
                f"{None if q is None else jnp.shape(q)}"
            )
    if not isinstance(state, HopeState):
        raise ValueError(f"{name} must be a HopeState, got {type(state).__name__}")
    mems = state.memories
    if adaptive_q and mems.q is None:
        raise ValueError(f"{name}.memories.q must be an MLPMemory when adaptive_q=True, got None")
    if rule.momentum and state.momentum is None:
        raise ValueError(f"{name}.momentum must be set when momentum=True (hope_init_state)")
    hidden = None
    for n in _names(mems):
        m = getattr(mems, n)
        w1, w2 = jnp.shape(m.w1), jnp.shape(m.w2)
        if len(w1) != 4 or w1[:3] != (B, H, D):
            raise ValueError(
                f"{name}.memories.{n}.w1 must have shape [B={B}, H={H}, D={D}, h], got {w1}"
            )
        h = w1[3]
        hidden = h if hidden is None else hidden
        if w2 != (B, H, h, D):
            raise ValueError(
                f"{name}.memories.{n}.w2 must have shape [B, H, h, D]={(B, H, h, D)}, got {w2}"
            )
    for f in ("eta_w", "alpha_w"):
        if jnp.shape(getattr(readout, f)) != (H, D):
            raise ValueError(
                f"readout.{f} must have shape [H, D]={(H, D)}, got {jnp.shape(getattr(readout, f))}"
            )
    for f in ("eta_b", "alpha_b"):
        if jnp.shape(getattr(readout, f)) != (H,):
            raise ValueError(
                f"readout.{f} must have shape [H]={(H,)}, got {jnp.shape(getattr(readout, f))}"
            )
    return B, T, H, D


def _layer_update(W, S, x, g, lr, ret, rule: HopeRule):
    """One in-order update of ``W [B, H, o, i]`` (SPEC §3.1, §3.2); returns ``(W_new, S_new)``."""
    lr = clamped_rate(lr, g, x, rule.grad_clip)
    outer = g[..., :, None] * x[..., None, :]
    if rule.dgd:
        gamma = dgd_step_size(lr, x, step=rule.step)[..., None, None]
        if rule.dgd_target == "gradient":  # eq. 88: W x regressed onto −g
            Wx = jnp.einsum("bhoi,bhi->bho", W, x)
            u = -gamma * (Wx[..., :, None] * x[..., None, :] + outer)
        else:  # proximal: W x regressed onto W x − g
            u = -gamma * outer
    else:
        u = -lr[..., None, None] * outer
    if S is not None:
        u = rule.mu * S + u
    return ret[..., None, None] * W + u, (u if S is not None else None)


def _scan_updates(state: HopeState, sig, q, eta, alpha, valid_c, rule: HopeRule, act,
                  init: HopeMemories | None = None, reset_c=None):  # fmt: skip
    """A chunk's in-order updates token by token (``chunk_updates="scan"``): the same arguments
    and result as :func:`_parallel_updates`."""
    tm = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731  (time-major for the scan)
    rs = tm(reset_c) if reset_c is not None else jnp.zeros((q.shape[1],), bool)
    xs = (
        tm(q),
        tm(eta),
        tm(alpha),
        tm(valid_c),
        rs,
        {n: tuple(map(tm, s)) for n, s in sig.items()},
    )
    mems0 = {n: getattr(state.memories, n) for n in _names(state.memories)}
    moms0 = {n: (None if state.momentum is None else getattr(state.momentum, n)) for n in mems0}
    init_m = None if init is None else {n: getattr(init, n) for n in mems0}

    def step(carry, inp):
        mems, moms = carry
        q_t, eta_t, alpha_t, valid_t, reset_t, sig_t = inp
        if init_m is not None:  # a document starts here: back to the initial memories
            r = lambda a: reset_t.reshape(reset_t.shape + (1,) * (a.ndim - 1))  # noqa: E731
            mems = jax.tree.map(lambda a, b: jnp.where(r(a), a, b), init_m, mems)
            moms = jax.tree.map(lambda b: jnp.where(r(b), 0.0, b), moms)
        o_t = mlp_memory_apply(mems["memory"], q_t[:, None], act)[:, 0]  # read before write
        new_m, new_s = dict(mems), dict(moms)
        keep = lambda new, old: jnp.where(valid_t[:, None, None, None], new, old)  # noqa: E731
        for n, (x1, g1, x2, g2) in sig_t.items():
            m, s = mems[n], moms[n]
            w1, s1 = _layer_update(m.w1, None if s is None else s.w1, x1, g1, eta_t, alpha_t, rule)
            w2, s2 = _layer_update(m.w2, None if s is None else s.w2, x2, g2, eta_t, alpha_t, rule)
            new_m[n] = MLPMemory(keep(w1, m.w1), keep(w2, m.w2))
            if s is not None:
                new_s[n] = MLPMemory(keep(s1, s.w1), keep(s2, s.w2))
        return (new_m, new_s), o_t

    (mems, moms), o = lax.scan(step, (mems0, moms0), xs)
    momenta = None if state.momentum is None else HopeMemories(**moms)
    return jnp.moveaxis(o, 0, 1), HopeState(HopeMemories(**mems), momenta)


def _project(snap: HopeMemories, x_c, q_c, readout: HopeReadout, rule: HopeRule, act):
    """``k, v, η, α, q`` of a chunk's tokens from the projection snapshots (SPEC §3.2), each
    memory applied on its own (:func:`core.hope.rows._projections`)."""
    names = ["k", "v", "eta"] + ["alpha"] * rule.decay + ["q"] * rule.adaptive_q
    y = {n: mlp_memory_apply(getattr(snap, n), x_c, act) for n in names}
    return _projections(y, q_c, readout, rule)


def _snapshot(name: str, snap_proj: HopeMemories, snap_mem: MLPMemory) -> MLPMemory:
    """The chunk-start snapshot memory ``name`` takes its signals from (its group's)."""
    return snap_mem if name == "memory" else getattr(snap_proj, name)


def _chunk_body(
    state: HopeState,
    snap_proj: HopeMemories,
    snap_mem: MLPMemory,
    x_c,
    q_c,
    valid_c,
    readout: HopeReadout,
    *,
    rule: HopeRule,
    act: Callable,
    resets=None,
):
    """One chunk of the ``scan`` form: projections/targets/signals from snapshots, then the
    in-order updates token by token (:func:`_scan_updates`).

    ``resets`` (packed rows) is ``(init HopeMemories [B, ...], reset_c, fresh_proj_c,
    fresh_mem_c)`` with the flags ``[B, c]``: ``reset`` restarts the running state (memories and
    momenta) before the token; ``fresh_*`` makes the token use the initial memories instead of the
    chunk-start snapshot of that group.
    """
    k, v, eta, alpha, q = _project(snap_proj, x_c, q_c, readout, rule, act)
    init = reset_c = None
    if resets is not None:
        init, reset_c, fresh_proj, fresh_mem = resets
        k, v, eta, alpha, q = _pick(
            fresh_proj, _project(init, x_c, q_c, readout, rule, act), (k, v, eta, alpha, q)
        )
    sig = {}
    for n in _adapting(rule):
        snap = _snapshot(n, snap_proj, snap_mem)
        sig[n] = _signals(snap, k, v, act, rule.stop_gradient_targets)[0]
        if resets is not None:
            fresh = fresh_mem if n == "memory" else fresh_proj
            s_init = _signals(getattr(init, n), k, v, act, rule.stop_gradient_targets)[0]
            sig[n] = _pick(fresh, s_init, sig[n])
    return _scan_updates(state, sig, q, eta, alpha, valid_c, rule, act, init, reset_c)


def _initial(initial_memories, state: HopeState, B: int):
    """The memories a document start resets to, ``[B, H, ...]`` (default: ``state.memories``)."""
    if initial_memories is None:
        return state.memories
    init = hope_init_state(initial_memories, B).memories
    if jax.tree.map(jnp.shape, init) != jax.tree.map(jnp.shape, state.memories):
        raise ValueError(
            "initial_memories must have the structure and shapes of state.memories "
            f"(with or without B), got {jax.tree.map(jnp.shape, initial_memories)}"
        )
    return init


def _segment_flags(segment_ids, B, T, rule: HopeRule):
    """``reset, fresh_proj, fresh_mem`` ``bool [B, T]`` from packed ``segment_ids [B, T]`` (a
    document start inside the token's chunk of ``rule.chunk_other`` / ``rule.chunk_memory``)."""
    if jnp.shape(segment_ids) != (B, T):
        raise ValueError(
            f"segment_ids must have shape [B, T]={(B, T)}, got {jnp.shape(segment_ids)}"
        )
    reset = segment_starts(jnp.asarray(segment_ids))
    t = jnp.arange(T)
    last = lax.cummax(jnp.where(reset, t, -1), axis=1)  # last document start ≤ t (−1: none)
    fresh = lambda c: last >= (t // c) * c  # noqa: E731  (a start inside t's chunk)
    return reset, fresh(rule.chunk_other), fresh(rule.chunk_memory)


def _time_chunks(a, c):
    """``[B, T, ...] → [N, B, c, ...]`` (zero padded, ``N = ⌈T / c⌉``): the scan walks the chunks,
    the chunk body reads its tokens as ``[B, c, H, D]``."""
    return jnp.moveaxis(chunk(a, c), 1, 0)


def _cut(n, horizon: int, tree):
    """``tree`` with its gradient stopped after chunk ``n`` when ``horizon`` chunks end there."""
    if not horizon:
        return tree
    cut = (n + 1) % horizon == 0
    return jax.tree.map(lambda a: jnp.where(cut, lax.stop_gradient(a), a), tree)


def _scan_body(state: HopeState, readout: HopeReadout, rule: HopeRule, act, init):
    """``(carry, body)`` of the token-by-token form's chunk scan (``chunk_updates="scan"``): the
    carry is the ``HopeState`` and the larger group's snapshot, refreshed from the running
    memories every ``R = big / small`` chunks (the smaller group's snapshot is the chunk-start
    state). ``body`` takes ``(chunk index, x, q, valid, packed-row flags or None)``."""
    R = rule.big_chunk // rule.small_chunk
    memory_is_big = rule.chunk_memory > rule.chunk_other

    def proj_of(mems):
        return mems._replace(memory=None)

    big_of = (lambda m: m.memory) if memory_is_big else proj_of

    def body(carry, inp):
        st, snap_big = carry
        n, x_c, q_c, v_c, fl = inp
        refresh = (n % R) == 0
        snap_big = jax.tree.map(
            lambda new, old: jnp.where(refresh, new, old), big_of(st.memories), snap_big
        )
        if memory_is_big:
            snap_proj, snap_mem = proj_of(st.memories), snap_big
        else:
            snap_proj = snap_big if R > 1 else proj_of(st.memories)
            snap_mem = st.memories.memory
        resets = None if fl is None else (init, *fl)
        o, st = _chunk_body(
            st, snap_proj, snap_mem, x_c, q_c, v_c, readout, rule=rule, act=act, resets=resets
        )
        return (st, snap_big), o

    return (state, big_of(state.memories)), body


def _scan(body, carry, xs, rule: HopeRule, c: int):
    """``lax.scan(body, carry, xs)`` over chunks of ``c`` tokens with ``rule``'s backprop options.

    ``xs[0]`` is the chunk index ``[N]``; the carry's gradient is stopped after every
    ``grad_horizon`` tokens. With ``rule.remat``: each chunk is recomputed in the backward pass
    (``jax.checkpoint``) and only every n-th carry of the N chunks is stored (``scan_remat``;
    n = ⌈√N⌉ by default, nested blocks with ``remat_levels > 2``), so the saved states grow like
    √N (``L·N^(1/L)``) instead of N; n = 1 stores them all and skips the block's extra forward.
    The chunk's checkpoint keeps its token-sized products of the memories (``CHUNK_RESIDUAL``),
    so its backward recomputes elementwise work only, not a read of every weight per product.
    """
    horizon = rule.grad_horizon // c

    def step(carry, inp):
        carry, out = body(carry, inp)
        return _cut(inp[0], horizon, carry), out

    if not rule.remat:
        return lax.scan(step, carry, xs)
    step = jax.checkpoint(
        step, policy=jax.checkpoint_policies.save_only_these_names(CHUNK_RESIDUAL)
    )
    blocks = rule.remat_blocks(xs[0].shape[0])
    if blocks == (1,):
        return lax.scan(step, carry, xs)
    return scan_remat(step, carry, xs, remat_every=blocks)


def _scan_tokens(body, carry, tokens, rule: HopeRule, c: int):
    """:func:`_scan` of ``body`` over ``tokens`` (a tuple of ``[B, T, ...]`` arrays, or None)
    cut into chunks of ``c`` (zero padded; the body gets ``(chunk index, *chunks)``, each
    ``[B, c, ...]``); returns the final carry and the outputs back as ``[B, T, ...]``."""
    T = jax.tree.leaves(tokens)[0].shape[1]
    chunks = jax.tree.map(lambda a: _time_chunks(a, c), tokens)
    carry, out = _scan(body, carry, (jnp.arange(-(-T // c)), *chunks), rule, c)
    return carry, jax.tree.map(lambda a: unchunk(jnp.moveaxis(a, 0, 1), T), out)


def _parallel(x, q, state: HopeState, readout: HopeReadout, rule: HopeRule, act, init, flags):
    """The parallel form (``chunk_updates="parallel"``, :mod:`core.hope.rows`): the projection
    memories over chunks of ``chunk_other`` make ``k, v, η, α, q`` of every token, then
    ``M_memory`` over chunks of ``chunk_memory`` makes ``o``. ``flags = (reset, fresh_proj,
    fresh_mem)`` ``[B, T]`` for packed rows (:func:`_segment_flags`) or None.
    Returns ``(o [B, T, H, D], final HopeState)``."""
    proj, mem = _groups(_names(state.memories), rule)
    valid = jnp.ones(x.shape[:2], bool)
    resets = lambda i: None if flags is None else (flags[0], flags[i])  # noqa: E731

    def start(group):  # the group's stacked memories, momenta and reset memories
        return (_stack(m, group.names) for m in (state.memories, state.momentum, init))

    w, s, init_p = start(proj)

    def proj_step(carry, inp):
        _, x_c, q_c, v_c, fl = inp
        return _projection_chunk(carry, x_c, q_c, v_c, readout, rule, act, proj, init_p, fl)

    (w_p, s_p), kv_gates_q = _scan_tokens(proj_step, (w, s), (x, q, valid, resets(1)), rule,
                                          rule.chunk_other)  # fmt: skip
    w, s, init_m = start(mem)

    def mem_step(carry, inp):
        _, k, v, eta, alpha, q_c, v_c, fl = inp
        return _memory_chunk(carry, (k, v, eta, alpha, q_c), v_c, rule, act, mem, init_m, fl)

    (w_m, s_m), o = _scan_tokens(mem_step, (w, s), (*kv_gates_q, valid, resets(2)), rule,
                                 rule.chunk_memory)  # fmt: skip
    both = lambda p, m: HopeMemories(**_unstack(p, proj.names), **_unstack(m, mem.names))  # noqa: E731
    return o, HopeState(both(w_p, w_m), None if s is None else both(s_p, s_m))


def _chunked(x, q, state, readout, rule: HopeRule, act, segment_ids, initial_memories):
    """:func:`hope_chunked` after its checks: inputs in f32 (or wider), the packed-row flags, and
    the parallel form or the token-by-token form's scan over chunks of the smaller size (zero
    padded; ``valid`` marks the real tokens of the last chunk)."""
    x = jnp.asarray(x, jnp.promote_types(jnp.result_type(x), jnp.float32))
    B, T = x.shape[:2]
    q = x if rule.adaptive_q else jnp.asarray(q, x.dtype)
    flags = init = None
    if segment_ids is not None:
        init = _initial(initial_memories, state, B)
        flags = _segment_flags(segment_ids, B, T, rule)
    if rule.chunk_updates == "parallel":
        return _parallel(x, q, state, readout, rule, act, init, flags)
    carry, body = _scan_body(state, readout, rule, act, init)
    (state, _), o = _scan_tokens(body, carry, (x, q, jnp.ones((B, T), bool), flags), rule,
                                 rule.small_chunk)  # fmt: skip
    return o, state


def hope_chunked(
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
    """Chunk-wise Hope (SPEC §3.2 Decision) under ``rule``; chunk sizes 1 = exact per-token Hope.

    Chunks are aligned at position 0 of ``x``. Token ``t`` of a group with chunk size ``C`` uses
    the group's state just before position ``s = max(C⌊t/C⌋, start of t's document)`` as its
    snapshot (0-based ``t``).

    **Packed rows** (``segment_ids``, SPEC §0): where ``segment_ids[b, t] != segment_ids[b, t−1]``
    (``t ≥ 1``) a document starts; just before that token the running memories become
    ``initial_memories`` and the momenta zero, and for the rest of that chunk (of each group) the
    initial memories are also the snapshot that produces projections, targets and signals. So a
    document's first chunk is cut short at the next multiple of the chunk size, and its later chunks
    follow the row's grid: a document starting at row position ``p`` gets exactly what it gets
    alone when ``p`` is a multiple of both chunk sizes (always with chunk sizes 1); otherwise each
    group of memories (chunk size ``C``) treats its first ``C⌈p/C⌉ − p`` tokens as a chunk of
    their own (``hope/README.md`` §9). Position 0 is never a reset (it starts from
    ``initial_state``).

    Args:
      x: memory inputs ``[B, T, H, D]``.
      q: ``W_q x`` ``[B, T, H, D]`` (ignored, may be None, when ``rule.adaptive_q``).
      readout: ``HopeReadout`` of ``M_η``, ``M_α``.
      initial_state: ``HopeState`` (``hope_init_state(memories, B)``), weights ``[B, H, ...]``;
        with ``rule.momentum`` it needs momenta. Required: Hope's memories have no zero state
        (None raises ``ValueError``).
      rule: the :class:`~nested_jax.rules.HopeRule` (a ``HopeOptions`` is one): the chunk sizes
        ``chunk_memory`` / ``chunk_other``, the ablation flags (``dgd``, ``dgd_target``, ``step``,
        ``momentum``, ``decay``, ``inner_*``, ``adaptive_q``, ``stop_gradient_targets``), the
        bounds ``eta_max`` / ``grad_clip``, truncated backprop ``grad_horizon``, ``remat*`` and
        ``chunk_updates`` (``"scan"``: token by token; ``"parallel"``: one triangular solve per
        memory layer, :mod:`nested_jax.core.hope.parallel`; values equal up to rounding). The
        default is the paper's per-token rule.
      segment_ids: optional int ``[B, T]`` document ids of packed rows.
      initial_memories: the memories a document start resets to (``[H, ...]`` or ``[B, H, ...]``,
        structure of ``initial_state.memories``); default ``initial_state.memories``.
      activation: elementwise ``σ`` of the memories.

    Returns:
      ``(o [B, T, H, D], final HopeState)``.
    """
    rule = check_rule("hope_chunked", rule)
    state = require_initial_state("hope_chunked", initial_state, HOPE_STATE_CONSTRUCTOR)
    _validate(x, q, state, readout, rule, name="initial_state")
    return _chunked(x, q, state, readout, rule, activation, segment_ids, initial_memories)
