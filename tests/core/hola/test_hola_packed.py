"""HOLA packed rows (SPEC §0 packed sequences, SPEC §5): a row of several documents gives every
document exactly the outputs and gradients it gets alone — own GDN state and scores, own block grid,
own cache (no entry of an earlier document is read or competes for a slot), sink always visible."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nested_jax.core.hola.decode import (
    HolaReadParams,
    HolaState,
    hola_decode_step,
    init_hola_state,
)
from nested_jax.core.hola.forward import gdn_residuals, hola_forward
from nested_jax.core.hola.reference import hola_reference
from nested_jax.rules import HolaRule

H, K, V, C = 2, 6, 5, 8
# Two rows of T = 30: starts at 5, 18, 19 (mid-block, twice in one block) and at 8 (on a block
# boundary), 11, 19; documents of length 1, 3, 5, exactly C and longer than C; both rows end with a
# document of 11 tokens (so one shared HolaState.pos describes both last documents).
LENGTHS = ((5, 13, 1, 11), (8, 3, 8, 11))
T = 30
T_DOC = max(max(r) for r in LENGTHS)  # documents alone: one batch, padded after the document
SEQ = ("q", "k", "v", "g", "beta")
PAR = ("gamma_q", "gamma_k", "sink_logit", "gate_logit")
_FAST_COMPILE = {"xla_backend_optimization_level": 0}  # these programs run once: compile time rules


def fast_jit(fn):
    """``jax.jit(fn)`` compiled at the first call's shapes with XLA's cheapest backend pass."""
    compiled = []

    def call(*args):
        if not compiled:
            compiled.append(jax.jit(fn).lower(*args).compile(_FAST_COMPILE))
        return compiled[0](*args)

    return call


def _l2(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def make_inputs(seed, B=2, T=T):
    rng = np.random.default_rng(seed)
    f = np.float32
    return dict(
        q=_l2(rng.normal(size=(B, T, H, K))).astype(f),
        k=_l2(rng.normal(size=(B, T, H, K))).astype(f),
        v=rng.normal(size=(B, T, H, V)).astype(f),
        g=-rng.uniform(0.01, 0.5, size=(B, T, H)).astype(f),
        beta=rng.uniform(0.0, 1.0, size=(B, T, H)).astype(f),
    )


def make_params(seed=1):
    rng = np.random.default_rng(seed)
    f = np.float32
    return dict(
        gamma_q=rng.uniform(0.5, 2.0, size=(H, K)).astype(f),
        gamma_k=rng.uniform(0.5, 2.0, size=(H, K)).astype(f),
        sink_logit=rng.normal(size=(H,)).astype(f),
        gate_logit=np.full((H,), 1.0, f),  # σ ≈ 0.73: the cache path dominates the output
    )


def segment_ids():
    ids = [np.repeat(np.arange(len(r)) + 10 * i, r) for i, r in enumerate(LENGTHS)]
    return jnp.asarray(np.stack(ids), jnp.int32)


def documents():
    """``[(row, start, length)]`` of every document, in row order."""
    out = []
    for b, row in enumerate(LENGTHS):
        starts = np.cumsum((0,) + row[:-1])
        out += [(b, int(s), n) for s, n in zip(starts, row, strict=True)]
    return out


def alone_batch(x, fill_seed=99):
    """Every document as its own row of ``T_DOC`` tokens, followed by random filler (causality:
    the filler cannot change the document's outputs, and a zero cotangent keeps it out of the
    gradients)."""
    filler = make_inputs(fill_seed, B=len(documents()), T=T_DOC)
    out = {n: filler[n].copy() for n in SEQ}
    for i, (b, s, n) in enumerate(documents()):
        for name in SEQ:
            out[name][i, :n] = x[name][b, s : s + n]
    return out


def to_alone(a):
    """``[2, T, ...]`` row array -> ``[n_docs, T_DOC, ...]`` (zeros after each document)."""
    out = np.zeros((len(documents()), T_DOC) + a.shape[2:], a.dtype)
    for i, (b, s, n) in enumerate(documents()):
        out[i, :n] = a[b, s : s + n]
    return out


def hola(*args, window, eviction="beta_e", **kw):
    """``hola_forward`` over the flat ``(q, k, v, g, β, γ_q, γ_k, s, λ)`` of these tests (so a
    ``jax.vjp`` gives one gradient per parameter), block size ``C``."""
    rule = HolaRule(window=window, block_size=C, eviction=eviction)
    return hola_forward(*args[: len(SEQ)], HolaReadParams(*args[len(SEQ) :]), rule=rule, **kw)


@functools.cache
def _vjp_fn(eviction, window, packed):
    fwd = functools.partial(hola, window=window, eviction=eviction, chunk_size=4)
    seg = segment_ids() if packed else None

    def run(args, r):
        o, vjp = jax.vjp(lambda *a: fwd(*a, segment_ids=seg)[0], *args)
        return o, vjp(r)

    return fast_jit(run)


def _assert_close(got, ref, what, rel=2e-5):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = max(float(np.abs(ref).max()), 1e-3)
    np.testing.assert_allclose(got / scale, ref / scale, atol=rel, rtol=0, err_msg=what)


@pytest.mark.parametrize(
    "eviction,window",
    [("cumulative_attention", 2)]
    + [
        # test_conformance.py: packed[hola] (beta_e, window 3, blocks of 4), values and grads
        pytest.param("beta_e", 3, marks=pytest.mark.slow)
    ]
    + [
        pytest.param(e, w, marks=pytest.mark.slow)  # ~35 s each on 2 cores
        for e, w in (("beta_e", 16), ("recency", 3), ("e", 5))
    ],
)
def test_packed_row_equals_documents_alone_values_and_vjp(eviction, window):
    """w = 2, 3, 5 (< most documents: the per-document block grid and selection matter) and
    w = 16 (> every document). Outputs, and jax.vjp gradients w.r.t. q, k, v, g, β and the four
    cache parameters, of the packed row == those of each document run alone."""
    x, p = make_inputs(3), make_params()
    r = np.random.default_rng(4).normal(size=(2, T, H, V)).astype(np.float32)
    o_p, g_p = _vjp_fn(eviction, window, True)([x[n] for n in SEQ] + [p[n] for n in PAR], r)
    xa = alone_batch(x)
    o_a, g_a = _vjp_fn(eviction, window, False)(
        [xa[n] for n in SEQ] + [p[n] for n in PAR], to_alone(r)
    )
    real = to_alone(np.ones((2, T), bool))
    np.testing.assert_allclose(
        to_alone(np.asarray(o_p))[real], np.asarray(o_a)[real], atol=2e-5, rtol=1e-5
    )
    for i, name in enumerate(SEQ):
        _assert_close(to_alone(np.asarray(g_p[i]))[real], np.asarray(g_a[i])[real], name)
    for i, name in enumerate(PAR):
        _assert_close(g_p[len(SEQ) + i], g_a[len(SEQ) + i], name)
        assert np.abs(np.asarray(g_p[len(SEQ) + i])).max() > 0, name


@functools.cache
def _fwd(eviction, window=3, packed=True):
    fwd = functools.partial(hola, window=window, eviction=eviction, chunk_size=4)
    seg = segment_ids() if packed else None
    return fast_jit(lambda *a: fwd(*a, segment_ids=seg))


def _assert_states_close(a, b):
    for name, xa, xb in zip(HolaState._fields, a, b, strict=True):
        xa, xb = np.asarray(xa), np.asarray(xb)
        assert xa.shape == xb.shape and xa.dtype == xb.dtype, name
        if xa.dtype.kind in "biu":
            np.testing.assert_array_equal(xa, xb, err_msg=name)
        else:
            np.testing.assert_allclose(xa, xb, atol=2e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("eviction", ["beta_e", "cumulative_attention"])
def test_packed_row_matches_reference_and_returns_the_last_document_state(eviction):
    """Packed forward == the float64 token-by-token reference with segment_ids (independent code:
    explicit per-document visible sets); the returned state == the last documents run alone (an
    unpadded call), so decoding can continue them; its cache == the reference's."""
    x, p = make_inputs(5), make_params()
    args = [x[n] for n in SEQ] + [p[n] for n in PAR]
    o, st = _fwd(eviction)(*args)
    rule = HolaRule(window=3, block_size=C, eviction=eviction)
    params = HolaReadParams(*args[len(SEQ) :])
    ref = hola_reference(
        *args[: len(SEQ)], params, rule=rule, segment_ids=np.asarray(segment_ids())
    )
    np.testing.assert_allclose(np.asarray(o), ref["o"], atol=2e-5, rtol=1e-5)
    last = {n: a[:, T - 11 :] for n, a in x.items()}
    _, st_alone = _fwd(eviction, packed=False)(*[last[n] for n in SEQ], *args[len(SEQ) :])
    _assert_states_close(st, st_alone)
    pos, val = np.asarray(st.cache_pos), np.asarray(st.cache_valid)
    assert [[list(pos[b, h][val[b, h]]) for h in range(H)] for b in range(2)] == ref["last_cache"]
    # Decoding continues the last documents exactly like continuing them alone.
    step = fast_jit(functools.partial(hola_decode_step, rule=rule))
    nxt = make_inputs(6, T=1)
    o1, _ = step(st, *[nxt[n][:, 0] for n in SEQ], params)
    o2, _ = step(st_alone, *[nxt[n][:, 0] for n in SEQ], params)
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), atol=2e-5, rtol=1e-5)


def test_one_document_row_equals_the_unpacked_forward():
    """Constant segment_ids (T = 32 = 4 blocks, w = 4): the packed scan gives the unpacked
    forward's outputs and state; the row ends on a block boundary, so the last block is merged
    into the returned cache (the mid-block end is checked against the last documents above)."""
    x, p = make_inputs(7, T=32), make_params()
    args = [x[n] for n in SEQ] + [p[n] for n in PAR]
    fwd = functools.partial(hola, window=4, chunk_size=16)
    o, st = fast_jit(fwd)(*args)
    seg = jnp.full((2, 32), 3, jnp.int32)
    o_s, st_s = fast_jit(lambda *a: fwd(*a, segment_ids=seg))(*args)
    np.testing.assert_allclose(np.asarray(o_s), np.asarray(o), atol=2e-5, rtol=1e-5)
    _assert_states_close(st_s, st)
    assert int(st_s.pos) == 32 and int(st_s.cache_valid.sum()) == 2 * H * 4


def test_gdn_residuals_restart_from_zero_at_segment_starts():
    """Segment-masked WY/UT residual pass == the recurrence with S := 0 at each start (chunk 16;
    starts mid-chunk, on a chunk start and two in one chunk; a β = 0 token)."""
    Tl = 45
    x = make_inputs(8, T=Tl)
    x["beta"][1, 20] = 0.0
    seg = np.zeros((2, Tl), np.int32)
    for b, starts in enumerate(((7, 16, 30, 33), (1, 44))):
        for s in starts:
            seg[b, s:] += 1
    fn = fast_jit(lambda k, v, g, b, s: gdn_residuals(k, v, g, b, segment_ids=s, chunk_size=16))
    e, S_T = fn(x["k"], x["v"], x["g"], x["beta"], jnp.asarray(seg))
    S = np.zeros((2, H, K, V))
    e_ref = np.zeros((2, Tl, H, V))
    for t in range(Tl):
        restart = (seg[:, t] != seg[:, t - 1]) if t else np.zeros(2, bool)
        S = np.where(restart[:, None, None, None], 0.0, S)
        a = np.exp(x["g"][:, t])[..., None, None]
        kt, vt, bt = x["k"][:, t], x["v"][:, t], x["beta"][:, t]
        et = vt - np.einsum("bhk,bhkv->bhv", kt, a * S)
        S = a * S + bt[..., None, None] * kt[..., :, None] * et[..., None, :]
        e_ref[:, t] = et
    np.testing.assert_allclose(np.asarray(e), e_ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(S_T), S, atol=2e-5, rtol=1e-5)


def test_segment_ids_validation_names_the_argument():
    x, p = make_inputs(0), make_params()
    args = [x[n] for n in SEQ] + [p[n] for n in PAR]
    kw = dict(window=3)
    with pytest.raises(ValueError, match=r"hola_forward: segment_ids must have shape \[B, T\]"):
        hola(*args, segment_ids=jnp.zeros((2, T - 1), jnp.int32), **kw)
    with pytest.raises(ValueError, match="segment_ids must have an integer dtype"):
        hola(*args, segment_ids=jnp.zeros((2, T), jnp.float32), **kw)
    with pytest.raises(ValueError, match="segment_ids cannot be combined with initial_state"):
        hola(
            *args, segment_ids=segment_ids(), initial_state=init_hola_state(2, H, K, V, 3, C), **kw
        )
    with pytest.raises(ValueError, match="gdn_residuals: segment_ids must have shape"):
        gdn_residuals(x["k"], x["v"], x["g"], x["beta"], segment_ids=jnp.zeros((2,), jnp.int32))
