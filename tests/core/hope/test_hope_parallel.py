"""Hope's parallel chunk form (core.hope.parallel) against plain per-token loops (SPEC §3.1, §3.2).

1. One memory layer over one chunk: ``layer_chunk`` / ``read_running`` equal a per-token loop of
   the rule ``u = −γ(W x + g)xᵀ`` (or ``−η g xᵀ``), ``S = μS + u``, ``W = αW + S``, with padding
   at the end, packed-row resets to ``W_init`` (momentum back to zero), on values and gradients.
2. The whole Hope rule: ``hope_chunked`` equals the independent per-token twin
   ``core.hope.reference.hope_reference`` for every flag combination of the parallel form
   (dgd and its two targets, momentum, decay) at chunk sizes (1, 1), (4, 2), (8, 8) and an
   awkward T.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.dgd import dgd_step_size
from nested_jax.core.hope.chunk import hope_chunked
from nested_jax.core.hope.parallel import chunk_coefficients, layer_chunk, read_running
from nested_jax.core.hope.reference import hope_reference
from nested_jax.core.hope.state import HopeMemories, HopeReadout, MLPMemory, hope_init_state
from nested_jax.rules import HopeRule

B, H, C, O, I = 2, 2, 7, 5, 4


def _loop(W0, S0, x, g, lr, alpha, z, *, mu, dgd, target, step, valid, reset, W_init):
    """The per-token rule, one token at a time (the definition the parallel form must equal)."""
    W, S = W0, (jnp.zeros_like(W0) if S0 is None else S0)
    reads = []
    for j in range(C):
        r = reset[:, j][:, None, None, None]
        W, S = jnp.where(r, W_init, W), jnp.where(r, 0.0, S)
        reads.append(jnp.einsum("bhoi,bhi->bho", W, z[:, :, j]))
        xj, gj = x[:, :, j], g[:, :, j]
        if dgd:
            gamma = dgd_step_size(lr[:, :, j], xj, step=step)[..., None, None]
            Wx = 0.0 if target == "proximal" else jnp.einsum("bhoi,bhi->bho", W, xj)
            u = -gamma * (Wx + gj)[..., None] * xj[..., None, :]
        else:
            u = -lr[:, :, j][..., None, None] * gj[..., None] * xj[..., None, :]
        S_new = mu * S + u
        W_new = alpha[:, :, j][..., None, None] * W + S_new
        keep = valid[:, j][:, None, None, None]
        W, S = jnp.where(keep, W_new, W), jnp.where(keep, S_new, S)
    reads = _only_valid(jnp.stack(reads, 2), valid)
    return reads, W, (jnp.zeros_like(W) if S0 is None else S)  # no momentum: no S


def _layer_inputs(seed):
    rng = np.random.default_rng(seed)
    f = lambda *s, scale=1.0: jnp.asarray(scale * rng.normal(size=s), jnp.float32)  # noqa: E731
    return dict(
        W0=f(B, H, O, I, scale=0.5),
        S0=f(B, H, O, I, scale=0.1),
        W_init=f(B, H, O, I, scale=0.5),
        x=f(B, H, C, I, scale=0.6),
        g=f(B, H, C, O),
        z=f(B, H, C, I),
        lr=jnp.asarray(rng.uniform(0.1, 0.9, size=(B, H, C)), jnp.float32),
        alpha=jnp.asarray(rng.uniform(0.5, 1.0, size=(B, H, C)), jnp.float32),
    )


def _parallel(W0, S0, x, g, lr, alpha, z, *, mu, dgd, target, step, valid, reset, W_init):
    on = valid[:, None, :]
    co = chunk_coefficients(jnp.where(on, alpha, 1.0), mu, valid, reset)
    g = jnp.where(on[..., None], g, 0.0)
    lr = jnp.where(on, lr, 0.0)
    rule = HopeRule(dgd=dgd, step=step, dgd_target=target)
    U, W, S = layer_chunk(W0, S0, x, g, lr, co, rule=rule, W_init=W_init)
    reads = read_running(W0, S0, x, U, z, co, W_init)
    return _only_valid(reads, valid), W, (jnp.zeros_like(W) if S is None else S)


def _only_valid(reads, valid):
    """Reads at padded tokens are never used (with momentum a padded token cannot be a no-op in
    the unrolled form, and need not be: the chunk end is row ``n``)."""
    return jnp.where(valid[:, None, :, None], reads, 0.0)


@pytest.mark.parametrize(
    "mu, dgd, step, packed",
    [
        (0.0, True, "exact", False),
        (0.7, True, "exact", False),
        (0.7, True, "paper", True),
        (0.0, False, "exact", True),
        (0.7, False, "exact", True),
        (0.0, True, "exact", True),
        (0.7, "proximal", "exact", True),
    ],
)
def test_layer_chunk_equals_the_per_token_loop(mu, dgd, step, packed):
    a = _layer_inputs(0)
    valid = jnp.asarray([[True] * C, [True] * 5 + [False] * 2])  # row 2 padded at the end
    reset = jnp.zeros((B, C), bool)
    if packed:  # documents start at tokens 3 (row 1) and 1, 4 (row 2; 4 is before the padding)
        reset = reset.at[0, 3].set(True).at[1, 1].set(True).at[1, 4].set(True)
    target = "proximal" if dgd == "proximal" else "gradient"
    kw = dict(mu=mu, dgd=bool(dgd), target=target, step=step, valid=valid, reset=reset)
    if mu == 0.0:
        a["S0"] = None
    names = ("W0", "S0", "x", "g", "lr", "alpha", "z", "W_init")
    args = {n: a[n] for n in names}
    ref, par = (
        jax.jit(lambda args, fn=fn: fn(**args, **kw)) for fn in (_loop, _parallel)
    )  # fmt: skip
    for got, want in zip(par(args), ref(args), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

    def loss(fn):
        def f(args):
            reads, W, S = fn(**args, **kw)
            return jnp.sum(jnp.sin(reads)) + jnp.sum(jnp.cos(W)) + jnp.sum(S * S)

        return jax.jit(jax.grad(f))

    grads_par, grads_ref = loss(_parallel)(args), loss(_loop)(args)
    for n in names:
        if args[n] is None:
            continue
        want = grads_ref[n]
        np.testing.assert_allclose(grads_par[n], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# --------------------------------------------------------------------------------------------------
# the whole rule against the independent per-token twin

T, D, HID = 13, 8, 6


def _hope_inputs():
    rng = np.random.default_rng(1)

    def mem():
        return MLPMemory(
            jnp.asarray(0.3 * rng.normal(size=(H, D, HID)), jnp.float32),
            jnp.asarray(0.3 * rng.normal(size=(H, HID, D)), jnp.float32),
        )

    mems = HopeMemories(*(mem() for _ in range(5)))
    w = lambda: jnp.asarray(0.3 * rng.normal(size=(H, D)), jnp.float32)  # noqa: E731
    readout = HopeReadout(w(), jnp.full((H,), -2.0), w(), jnp.full((H,), 2.0))  # η≈0.12, α≈0.88
    x = jnp.asarray(0.5 * rng.normal(size=(B, T, H, D)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
    return mems, readout, x, q


def _assert_matches_twin(fast, twin, x, q):
    """Outputs and states within 2e-5, gradients w.r.t. x, q of Σ sin(o) within 1e-4 (scaled)."""
    (o1, s1), (o2, s2) = fast(x, q), twin(x, q)
    np.testing.assert_allclose(o1, o2, atol=2e-5 * float(jnp.max(jnp.abs(o2))))
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5 * float(jnp.max(jnp.abs(b))))
    grad = lambda fn: jax.jit(jax.grad(lambda x, q: jnp.sum(jnp.sin(fn(x, q)[0])), (0, 1)))  # noqa: E731
    for a, b in zip(grad(fast)(x, q), grad(twin)(x, q), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4 * float(jnp.max(jnp.abs(b))))


# (dgd, dgd_target, momentum, decay); the target only matters with dgd
FLAGS = [
    (True, t, m, d) for t in ("gradient", "proximal") for m in (True, False) for d in (True, False)
]
FLAGS += [(False, "gradient", m, d) for m in (True, False) for d in (True, False)]
CHUNKS = [(1, 1), (4, 2), (8, 8)]


def _case_id(flags, chunks):
    dgd, target, mom, decay = flags
    return f"dgd{int(dgd)}-{target[:4]}-mom{int(mom)}-decay{int(decay)}-c{chunks[0]}x{chunks[1]}"


CASES = [(f, c) for f in FLAGS for c in CHUNKS]
# the default suite keeps five of the flag combinations, each at one chunk setting (both targets,
# plain GD, momentum and decay both ways); the whole grid runs with -m slow
DEFAULT = {(FLAGS[i], CHUNKS[i % 3]) for i in (0, 3, 5, 6, 9)}


@pytest.mark.parametrize(
    "flags, chunks",
    [
        pytest.param(f, c, marks=() if (f, c) in DEFAULT else pytest.mark.slow, id=_case_id(f, c))
        for f, c in CASES
    ],
)
def test_chunked_equals_the_per_token_twin(flags, chunks):
    dgd, target, momentum, decay = flags
    mems, readout, x, q = _hope_inputs()
    state = hope_init_state(mems, B, momentum=momentum)
    rule = HopeRule(dgd=dgd, dgd_target=target, momentum=momentum, decay=decay,
                    momentum_coef=0.7, chunk_updates="parallel",
                    chunk_memory=chunks[0], chunk_other=chunks[1])  # fmt: skip
    fast = jax.jit(lambda x, q: hope_chunked(x, q, readout, initial_state=state, rule=rule))
    twin = jax.jit(lambda x, q: hope_reference(x, q, readout, initial_state=state, rule=rule))
    _assert_matches_twin(fast, twin, x, q)


def test_a_retention_that_underflows_to_zero_stays_finite():
    """σ of a very negative logit is exactly 0 in f32; the per-token rule then forgets W
    (``W = 0·W + S``). The parallel form takes ``log α``, so it must not turn that into NaN
    (a tiny MQAR run went NaN at step ~200 before ``chunk_coefficients`` clamped α)."""
    a = _layer_inputs(2)
    a["alpha"] = a["alpha"].at[:, :, 2].set(0.0).at[1, 0, 5].set(jax.nn.sigmoid(-120.0))
    valid, reset = jnp.ones((B, C), bool), jnp.zeros((B, C), bool)
    kw = dict(mu=0.7, dgd=True, target="gradient", step="exact", valid=valid, reset=reset)
    args = {n: a[n] for n in ("W0", "S0", "x", "g", "lr", "alpha", "z", "W_init")}
    for got, want in zip(_parallel(**args, **kw), _loop(**args, **kw), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)

    def loss(args):
        reads, W, S = _parallel(**args, **kw)
        return jnp.sum(jnp.sin(reads)) + jnp.sum(jnp.cos(W)) + jnp.sum(S * S)

    grads = jax.grad(loss)(args)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(grads))


@pytest.mark.parametrize("updates", ["scan", "parallel"])
def test_both_update_forms_take_the_proximal_target(updates):
    """``chunk_updates="scan"`` (the rule's default) and ``"parallel"`` both follow
    ``dgd_target``."""
    mems, readout, x, q = _hope_inputs()
    state = hope_init_state(mems, B, momentum=True)
    rule = HopeRule(dgd_target="proximal", momentum=True, momentum_coef=0.7, chunk_memory=4,
                    chunk_other=2, chunk_updates=updates)  # fmt: skip
    o1, _ = jax.jit(lambda: hope_chunked(x, q, readout, initial_state=state, rule=rule))()
    o2, _ = jax.jit(lambda: hope_reference(x, q, readout, initial_state=state, rule=rule))()
    np.testing.assert_allclose(o1, o2, atol=2e-5 * float(jnp.max(jnp.abs(o2))))


@pytest.mark.parametrize("updates", ["scan", "parallel"])
@pytest.mark.parametrize("chunks", [(1, 1), (4, 2)])
def test_the_bounded_step_equals_the_twin(updates, chunks):
    """``eta_max`` and the inner-gradient softclamp ``grad_clip``: the chunked forms
    scale the rate by ``c·tanh(n/c)/n`` with ``n = ‖g‖‖x‖``, the twin by the Frobenius norm of its
    ``jax.grad`` layer gradient; values and gradients agree, and the bound is active here."""
    mems, readout, x, q = _hope_inputs()
    state = hope_init_state(mems, B, momentum=True)
    rule = HopeRule(momentum=True, momentum_coef=0.7, chunk_memory=chunks[0],
                    chunk_other=chunks[1], eta_max=0.5, grad_clip=0.2,
                    chunk_updates=updates)  # fmt: skip
    fast = jax.jit(lambda x, q: hope_chunked(x, q, readout, initial_state=state, rule=rule))
    twin = jax.jit(lambda x, q: hope_reference(x, q, readout, initial_state=state, rule=rule))
    _assert_matches_twin(fast, twin, x, q)
    # the bound changes the result (the test would not see a clamp that does nothing)
    o2, _ = twin(x, q)
    unbounded = dataclasses.replace(rule, grad_clip=0.0)
    o3, _ = jax.jit(lambda: hope_reference(x, q, readout, initial_state=state, rule=unbounded))()
    assert float(jnp.max(jnp.abs(o3 - o2))) > 1e-3 * float(jnp.max(jnp.abs(o2)))


def test_three_remat_levels_change_no_value_or_gradient():
    mems, readout, x, q = _hope_inputs()
    state = hope_init_state(mems, B, momentum=True)

    def loss(levels):
        rule = HopeRule(momentum=True, chunk_memory=2, chunk_other=1, remat=True,
                        remat_levels=levels)  # fmt: skip

        def f(x, q):
            o, _ = hope_chunked(x, q, readout, initial_state=state, rule=rule)
            return jnp.sum(jnp.sin(o))

        return jax.jit(jax.value_and_grad(f, (0, 1)))

    (v2, g2), (v3, g3) = loss(2)(x, q), loss(3)(x, q)
    np.testing.assert_allclose(v3, v2, rtol=1e-6)
    for a, b in zip(g3, g2, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "chunks",
    [(4, 2), pytest.param((2, 4), marks=pytest.mark.slow)],  # ~30 s each on 2 cores
    ids=["memory-larger", "memory-smaller"],
)
def test_grad_horizon_cuts_both_chunk_groups_at_the_same_tokens(chunks):
    """The parallel form scans the projection memories and ``M_memory`` separately, each over its
    own chunks; ``grad_horizon = 4`` cuts both before tokens 4, 8 and 12. Values equal the uncut
    run; the output at t = 11 has no gradient w.r.t. the inputs before the cut at 8 and some
    after (T = 13: the last chunk of each group is padded)."""
    mems, readout, x, q = _hope_inputs()
    state = hope_init_state(mems, B, momentum=True)

    def last(horizon):
        rule = HopeRule(momentum=True, chunk_memory=chunks[0], chunk_other=chunks[1],
                        chunk_updates="parallel", grad_horizon=horizon)  # fmt: skip

        def f(x, q):
            o, _ = hope_chunked(x, q, readout, initial_state=state, rule=rule)
            return jnp.sum(jnp.sin(o[:, 11])), o

        return jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(x, q)

    (_, o_cut), (gx, gq) = last(4)
    (_, o_full), (gx_full, _) = last(0)
    np.testing.assert_array_equal(o_cut, o_full)
    for g in (gx, gq):
        np.testing.assert_array_equal(g[:, :8], 0.0)
        assert float(jnp.abs(g[:, 8:]).max()) > 1e-6
    assert float(jnp.abs(gx_full[:, :8]).max()) > 1e-6  # without the cut the gradient reaches


SEG = [[0] * 5 + [1] * 6 + [2] * 2, [0] * 13]  # document starts at 5 and 11 (row 0), none (row 1)


@pytest.mark.parametrize(
    "flags, chunks",
    [
        ({"segment_ids": True}, (4, 2)),  # packed rows, the memory group larger
        ({"segment_ids": True, "inner_k": False, "inner_v": False}, (2, 4)),  # fixed rows, resets
        # ~30 s each on 2 cores: the M_q cases run with -m slow
        pytest.param(
            {"adaptive_q": True, "inner_q": False, "segment_ids": True},
            (4, 4),  # M_q row, R = 1
            marks=pytest.mark.slow,
        ),
        pytest.param({"adaptive_q": True}, (2, 4), marks=pytest.mark.slow),  # M_q adapts
    ],
    ids=["packed", "fixed-rows", "fixed-q", "adaptive-q"],
)
def test_stacked_memories_equal_the_twin(flags, chunks):
    """The parallel form runs every memory as one row of a stacked batch
    (``core.hope.rows._stack``): packed rows restart every row, rows that do not adapt keep their
    weights (and still restart at a document start), ``M_q`` joins the stack with ``adaptive_q``;
    both chunk groups refresh their snapshots on their own schedule. Values and gradients against
    the per-token twin."""
    mems, readout, x, q = _hope_inputs()
    flags = dict(flags)
    if flags.get("adaptive_q"):
        rng = np.random.default_rng(7)
        w = lambda *s: jnp.asarray(0.3 * rng.normal(size=s), jnp.float32)  # noqa: E731
        mems = mems._replace(q=MLPMemory(w(H, D, HID), w(H, HID, D)))
    seg = jnp.asarray(SEG) if flags.pop("segment_ids", False) else None
    state = hope_init_state(mems, B, momentum=True)
    rule = HopeRule(momentum=True, momentum_coef=0.7, chunk_memory=chunks[0],
                    chunk_other=chunks[1], **flags)  # fmt: skip
    fast_rule = dataclasses.replace(rule, chunk_updates="parallel")
    kw = dict(initial_state=state, segment_ids=seg)
    fast = jax.jit(lambda x, q: hope_chunked(x, q, readout, rule=fast_rule, **kw))
    twin = jax.jit(lambda x, q: hope_reference(x, q, readout, rule=rule, **kw))
    _assert_matches_twin(fast, twin, x, q)
