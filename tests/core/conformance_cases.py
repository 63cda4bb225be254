"""Every memory of ``nested_jax.core`` as one conformance case (SPEC §0), for ``test_conformance``.

The adapters at the top are the only code of the suite that calls ``nested_jax.core``: one block
per memory, each a few lines, so a change of a core signature is a change of that block only.
Every adapter has one of these shapes (``seq``: dict of per-token arrays ``[B, T, ...]``, time on
axis 1; ``params``: the memory's outer parameters, a pytree, maybe empty; ``state``: the carried
state or None; ``chunk``: the chunk setting of the chunked form; ``t0``: tokens seen before the
call, which only the Proteus schedules read)::

    recurrent(seq, params, state, t0)               -> (o [B, T, ...], final state)
    chunked / twin(seq, params, state, chunk, t0)   -> (o, final state)
    step(state, tok, params, t)                     -> (o_t, state)   tok: seq at 0-based t
    decode(seq, params, state, chunk, t0)           -> (o, final state) at positions t0, t0 + 1, …
    packed(seq, params, state, chunk, segment_ids)  -> (o, final state) of packed rows
    initial(state, seq, params)                     -> the concrete state a step scan carries

The cases below (``CASES``) say which forms a memory has and how its forms relate (which chunk
settings equal the per-token rule, where a prefix may end without moving the chunk grid).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nested_jax import core
from nested_jax.core.hola.decode import hola_recurrent as hola_recurrent_form
from nested_jax.core.hola.reference import hola_reference
from nested_jax.core.hope.decode import HopeDecodeState, hope_decode
from nested_jax.core.hope.proteus import proteus_hope_packed
from nested_jax.core.hope.reference import hope_reference
from nested_jax.core.titans import reference as titans_reference
from nested_jax.core.titans.memory import (
    TitansMemorySpec,
    titans_memory_init_cache,
    titans_memory_sequence,
    titans_memory_step,
)
from nested_jax.rules import CMSRule, HolaRule, HopeRule, ProteusRule, TitansRule

NO_SCHEDULE = ProteusRule()  # E = 1: the plain memory


def _time_major(tree):
    return jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), tree)


def _batch_major(tree):
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), tree)


def scan_tokens(step, state, seq, t0):
    """``step(state, tok, t) -> (o_t, state)`` over the tokens of ``seq`` at positions t0, …"""
    T = jax.tree.leaves(seq)[0].shape[1]

    def body(st, inp):
        t, tok = inp
        o_t, st = step(st, tok, t)
        return st, o_t

    positions = t0 + jnp.arange(T, dtype=jnp.int32)
    state, o = lax.scan(body, state, (positions, _time_major(seq)))
    return _batch_major(o), state


# ==================================================================================================
# Adapters: linear attention, delta rule, gated delta rule (SPEC §1; FLA-style plain keywords)
# ==================================================================================================

LINEAR_GATES = {"linear_attention": ("g",), "delta_rule": ("beta",), "gated_delta": ("g", "beta")}


def _linear_args(rule, x):
    return (x["q"], x["k"], x["v"], *(x[n] for n in LINEAR_GATES[rule]))


def linear_forms(rule: str) -> dict:
    """The step, recurrent, chunked, packed and decode adapters of one linear rule."""
    step_fn = getattr(core, f"{rule}_step")
    recurrent_fn = getattr(core, f"{rule}_recurrent")
    chunked_fn = getattr(core, f"{rule}_chunked")

    def step(state, tok, params, t):
        return step_fn(state, *_linear_args(rule, tok))

    def recurrent(seq, params, state, t0):
        return recurrent_fn(*_linear_args(rule, seq), initial_state=state)

    def chunked(seq, params, state, chunk, t0):
        return chunked_fn(*_linear_args(rule, seq), initial_state=state, chunk_size=chunk)

    def packed(seq, params, state, chunk, segment_ids):
        return chunked_fn(
            *_linear_args(rule, seq), initial_state=state, chunk_size=chunk,
            segment_ids=segment_ids,
        )  # fmt: skip

    def decode(seq, params, state, chunk, t0):
        return scan_tokens(lambda st, tok, t: step(st, tok, params, t), state, seq, t0)

    return dict(step=step, recurrent=recurrent, chunked=chunked, packed=packed, decode=decode)


# ==================================================================================================
# Adapters: Titans matrix memory, L_M = 1 (SPEC §2, §0.1)
# ==================================================================================================

TITANS_LINEAR = TitansRule(read_before_write=False, grad_clip=0.0)  # 0.0: no softclamp


def titans_rule(rule: TitansRule, chunk) -> TitansRule:
    return dataclasses.replace(rule, memory_chunk=chunk)


def _titans_args(x):
    return (x["q"], x["k"], x["v"], x["theta"], x["eta"], x["alpha"])


def titans_linear_step(state, tok, params, t):
    return core.titans_linear_step(state, *_titans_args(tok), rule=TITANS_LINEAR)


def titans_linear_recurrent(seq, params, state, t0):
    return core.titans_linear_recurrent(*_titans_args(seq), initial_state=state, rule=TITANS_LINEAR)


def titans_linear_chunked(seq, params, state, chunk, t0):
    return core.titans_linear_chunked(
        *_titans_args(seq), initial_state=state, rule=titans_rule(TITANS_LINEAR, chunk)
    )


def titans_linear_packed(seq, params, state, chunk, segment_ids):
    return core.titans_linear_chunked(
        *_titans_args(seq), initial_state=state, rule=titans_rule(TITANS_LINEAR, chunk),
        segment_ids=segment_ids,
    )  # fmt: skip


def titans_linear_twin(seq, params, state, chunk, t0):
    y, (w, s) = titans_reference.chunk_rule(
        *_titans_args(seq), initial_state=((state.M,), (state.S,)),
        rule=titans_rule(TITANS_LINEAR, chunk), residual=False,
    )  # fmt: skip
    return y, core.TitansLinearState(w[0], s[0])


def titans_linear_decode(seq, params, state, chunk, t0):
    """The step with the surprise taken at the chunk-start memory (the anchor, refreshed at every
    multiple of ``chunk``): the chunked form token by token; ``t0`` a multiple of ``chunk``."""

    def step(carry, tok, t):
        st, anchor = carry
        anchor = jnp.where(t % chunk == 0, st.M, anchor)
        o_t, st = core.titans_linear_step(st, *_titans_args(tok), anchor=anchor, rule=TITANS_LINEAR)
        return o_t, (st, anchor)

    o, (state, _) = scan_tokens(step, (state, state.M), seq, t0)
    return o, state


# ==================================================================================================
# Adapters: Titans MLP memory, L_M = 2, residual (SPEC §2)
# ==================================================================================================

TITANS_MLP = TitansRule(read_before_write=False, grad_clip=10.0)


def titans_mlp_step(state, tok, params, t):
    return core.titans_mlp_step(state, *_titans_args(tok), rule=TITANS_MLP)


def titans_mlp_recurrent(seq, params, state, t0):
    return core.titans_mlp_recurrent(*_titans_args(seq), initial_state=state, rule=TITANS_MLP)


def titans_mlp_chunked(seq, params, state, chunk, t0):
    return core.titans_mlp_chunked(
        *_titans_args(seq), initial_state=state, rule=titans_rule(TITANS_MLP, chunk)
    )


def titans_mlp_packed(seq, params, state, chunk, segment_ids):
    return core.titans_mlp_chunked(
        *_titans_args(seq), initial_state=state, rule=titans_rule(TITANS_MLP, chunk),
        segment_ids=segment_ids,
    )  # fmt: skip


def titans_mlp_twin(seq, params, state, chunk, t0):
    y, (w, s) = titans_reference.chunk_rule(
        *_titans_args(seq), initial_state=state, rule=titans_rule(TITANS_MLP, chunk), residual=True
    )
    return y, core.TitansMLPState(w, s)


def _titans_spec(state, chunk, schedule=NO_SCHEDULE) -> TitansMemorySpec:
    w = state.weights
    dims = (w[0].shape[-2], *(a.shape[-1] for a in w))
    return TitansMemorySpec(dims=dims, rule=titans_rule(TITANS_MLP, chunk), proteus=schedule)


def titans_memory_decode(seq, params, state, chunk, t0, schedule=NO_SCHEDULE):
    """The layer's decode (chunk buffering) from ``state`` at position ``t0``, a multiple of
    ``chunk``: the cache holds the chunk-start state and an empty buffer. The state returned is
    the cache's chunk-start state with its buffered tokens written by the chunked rule (what a
    full chunk would commit), so it compares with the sequence form's final state."""
    spec = _titans_spec(state, chunk, schedule)
    B, H = state.weights[0].shape[:2]
    cache = titans_memory_init_cache(spec, B, H)._replace(
        weights=state.weights, momentum=state.momentum, n=jnp.int32(0), t=jnp.int32(t0)
    )
    unused = tuple(w[0] for w in state.weights)  # M_0 is read only by a cache that has not started

    def step(c, tok, t):
        return titans_memory_step(c, *_titans_args(tok), spec=spec, initial_weights=unused)

    o, cache = scan_tokens(step, cache, seq, t0)
    state = core.TitansMLPState(cache.weights, cache.momentum)
    n = jax.tree.leaves(seq)[0].shape[1] % chunk  # tokens buffered after the last full chunk
    if n:
        buffered = dict(zip(("q", "k", "v", "theta", "eta", "alpha"), cache[2:8], strict=True))
        buffered = jax.tree.map(lambda a: a[:, :n], buffered)
        t_start = t0 + jax.tree.leaves(seq)[0].shape[1] - n
        if schedule.enabled:
            state = proteus_titans_chunked(buffered, params, state, chunk, t_start)[1]
        else:
            state = titans_mlp_chunked(buffered, params, state, chunk, t_start)[1]
    return o, state


# ==================================================================================================
# Adapters: Hope (SPEC §3.2); chunk = (chunk_memory, chunk_other)
# ==================================================================================================

# remat off: it changes no value or gradient (test_hope_parallel) and halves the compile time
HOPE_RULE = HopeRule(
    momentum=True, momentum_coef=0.7, eta_max=1.0, grad_clip=0.0, remat=False,
    chunk_updates="parallel",
)  # fmt: skip


def hope_rule(chunk) -> HopeRule:
    return dataclasses.replace(HOPE_RULE, chunk_memory=chunk[0], chunk_other=chunk[1])


def hope_step(state, tok, params, t):
    return core.hope_step(state, tok["x"], tok["q"], params, rule=HOPE_RULE)


def hope_recurrent(seq, params, state, t0):
    return core.hope_recurrent(seq["x"], seq["q"], params, initial_state=state, rule=HOPE_RULE)


def hope_chunked(seq, params, state, chunk, t0):
    return core.hope_chunked(seq["x"], seq["q"], params, initial_state=state, rule=hope_rule(chunk))


def hope_packed(seq, params, state, chunk, segment_ids):
    return core.hope_chunked(
        seq["x"], seq["q"], params, initial_state=state, segment_ids=segment_ids,
        rule=hope_rule(chunk),
    )  # fmt: skip


def hope_twin(seq, params, state, chunk, t0):
    return hope_reference(
        seq["x"], seq["q"], params, initial_state=state, rule=hope_rule(chunk),
    )  # fmt: skip


def hope_decode_from(seq, params, state, chunk, t0, schedule=NO_SCHEDULE):
    """The cached token loop from ``state`` at position ``t0`` (a multiple of both chunk sizes,
    so the snapshots are the running memories)."""
    ds = HopeDecodeState(state, state.memories, jnp.int32(t0))
    o, ds = hope_decode(
        seq["x"], seq["q"], params, rule=hope_rule(chunk), schedule=schedule, initial_state=ds,
    )  # fmt: skip
    return o, ds.state


# ==================================================================================================
# Adapters: HOLA (SPEC §5); chunk = the state path's chunk_size, blocks and window in HOLA_RULE
# ==================================================================================================

HOLA_RULE = HolaRule(window=3, block_size=4, eviction="beta_e", read_norm="rmsnorm")


def _hola_args(x):
    return (x["q"], x["k"], x["v"], x["g"], x["beta"])


def hola_initial(state, seq, params):
    if state is not None:
        return state
    B, _, H, K = seq["q"].shape
    V = seq["v"].shape[-1]
    return core.init_hola_state(B, H, K, V, HOLA_RULE.window, HOLA_RULE.block_size)


def hola_step(state, tok, params, t):
    return core.hola_decode_step(state, *_hola_args(tok), params, rule=HOLA_RULE)


def hola_recurrent(seq, params, state, t0):
    return hola_recurrent_form(*_hola_args(seq), params, rule=HOLA_RULE, initial_state=state)


def hola_chunked(seq, params, state, chunk, t0):
    return core.hola_forward(
        *_hola_args(seq), params, rule=HOLA_RULE, initial_state=state, chunk_size=chunk
    )


def hola_packed(seq, params, state, chunk, segment_ids):
    return core.hola_forward(
        *_hola_args(seq), params, rule=HOLA_RULE, initial_state=state, segment_ids=segment_ids,
        chunk_size=chunk,
    )  # fmt: skip


def hola_twin(seq, params, state, chunk, t0):
    """Float64 NumPy twin (values only; it starts from the empty state)."""
    out = hola_reference(*_hola_args(seq), params, rule=HOLA_RULE)
    return out["o"], out["S"]


def hola_decode(seq, params, state, chunk, t0):
    return scan_tokens(lambda st, tok, t: hola_step(st, tok, params, t), state, seq, t0)


# ==================================================================================================
# Adapters: CMS online mode (SPEC §3.3); one stream per row, the state carries the position
# ==================================================================================================

CMS_RULE = CMSRule(periods=(2, 4), variant="nested", online_lr=0.1, online_inner="dgd")


def _cms_surprise(y, target):
    """Per-token ½‖y − target‖², so ``δ_t = y_t − target_t``."""
    return 0.5 * jnp.sum(jnp.square(y - target), axis=-1)


CMS_DELTA = core.surprise_from_loss(_cms_surprise)


def cms_chunked(seq, params, state, chunk, t0):
    """``cms_online`` (chunks of ``gcd(periods)`` inside; ``chunk`` is not a free knob)."""
    return core.cms_online(
        None, seq["x"], rule=CMS_RULE, delta_fn=CMS_DELTA, side=seq["target"],
        initial_state=state,
    )  # fmt: skip


def cms_step(state, tok, params, t):
    o, state = cms_chunked(jax.tree.map(lambda a: a[:, None], tok), params, state, None, t)
    return o[:, 0], state


# ==================================================================================================
# Adapters: Proteus (SPEC §4) around GDN, the Titans MLP memory and Hope
# ==================================================================================================

SCHEDULE = ProteusRule(blocks=3, context_len=12)  # Δ = 4: blocks open at t = 1, 5, 9


def proteus_gdn_step(state, tok, params, t):
    return core.proteus_gated_delta_step(
        state, *_linear_args("gated_delta", tok), t=t + 1, schedule=SCHEDULE
    )


def proteus_gdn_recurrent(seq, params, state, t0):
    return core.proteus_gated_delta_recurrent(
        *_linear_args("gated_delta", seq), initial_state=state, t0=t0, schedule=SCHEDULE
    )


def proteus_gdn_chunked(seq, params, state, chunk, t0):
    return core.proteus_gated_delta_chunked(
        *_linear_args("gated_delta", seq), initial_state=state, t0=t0, chunk_size=chunk,
        schedule=SCHEDULE,
    )  # fmt: skip


def proteus_gdn_decode(seq, params, state, chunk, t0):
    return scan_tokens(lambda st, tok, t: proteus_gdn_step(st, tok, params, t), state, seq, t0)


def proteus_titans_step(state, tok, params, t):
    return core.proteus_titans_mlp_step(
        state, *_titans_args(tok), t=t + 1, rule=TITANS_MLP, schedule=SCHEDULE
    )


def proteus_titans_recurrent(seq, params, state, t0):
    return core.proteus_titans_mlp_recurrent(
        *_titans_args(seq), initial_state=state, t0=t0, rule=TITANS_MLP, schedule=SCHEDULE
    )


def proteus_titans_chunked(seq, params, state, chunk, t0):
    return core.proteus_titans_mlp_chunked(
        *_titans_args(seq), initial_state=state, t0=t0, rule=titans_rule(TITANS_MLP, chunk),
        schedule=SCHEDULE,
    )  # fmt: skip


def proteus_titans_packed(seq, params, state, chunk, segment_ids):
    """The layer's sequence form on packed rows (schedule at row positions, whole-state reset),
    with ``reset_state`` the initial state, as the layer passes it."""
    return titans_memory_sequence(
        *_titans_args(seq), spec=_titans_spec(state, chunk, SCHEDULE), initial_state=state,
        segment_ids=segment_ids, reset_state=state,
    )  # fmt: skip


def proteus_titans_packed_default_reset(seq, params, state, chunk, segment_ids):
    """:func:`proteus_titans_packed` with ``reset_state`` left at its documented default (None:
    the initial state)."""
    return titans_memory_sequence(
        *_titans_args(seq), spec=_titans_spec(state, chunk, SCHEDULE), initial_state=state,
        segment_ids=segment_ids,
    )  # fmt: skip


def proteus_titans_decode(seq, params, state, chunk, t0):
    return titans_memory_decode(seq, params, state, chunk, t0, SCHEDULE)


def _hope_scan_rule(chunk) -> HopeRule:
    """:func:`hope_rule` with the token-by-token chunk updates: the plain Hope case runs the
    parallel ones (``HOPE_RULE``), so both update forms meet the twin."""
    return dataclasses.replace(hope_rule(chunk), chunk_updates="scan")


def proteus_hope_step(state, tok, params, t):
    return core.proteus_hope_step(
        state, tok["x"], tok["q"], params, t=t + 1, schedule=SCHEDULE, rule=HOPE_RULE
    )


def proteus_hope_recurrent(seq, params, state, t0):
    return core.proteus_hope_recurrent(
        seq["x"], seq["q"], params, initial_state=state, t0=t0, schedule=SCHEDULE, rule=HOPE_RULE
    )


def proteus_hope_chunked(seq, params, state, chunk, t0):
    return core.proteus_hope_chunked(
        seq["x"], seq["q"], params, initial_state=state, t0=t0, schedule=SCHEDULE,
        rule=_hope_scan_rule(chunk),
    )  # fmt: skip


def proteus_hope_twin(seq, params, state, chunk, t0):
    return core.proteus_hope_chunked(
        seq["x"], seq["q"], params, initial_state=state, t0=t0, schedule=SCHEDULE,
        rule=hope_rule(chunk), backbone=hope_reference,
    )  # fmt: skip


def proteus_hope_packed_rows(seq, params, state, chunk, segment_ids):
    return proteus_hope_packed(
        seq["x"], seq["q"], params, initial_state=state, segment_ids=segment_ids,
        schedule=SCHEDULE, rule=_hope_scan_rule(chunk),
    )  # fmt: skip


def proteus_hope_decode(seq, params, state, chunk, t0):
    return hope_decode_from(seq, params, state, chunk, t0, SCHEDULE)


# ==================================================================================================
# Inputs (NumPy RNG: jax.random would compile a kernel per shape)
# ==================================================================================================


class Shape(NamedTuple):
    B: int
    T: int
    H: int
    K: int
    V: int


class Inputs(NamedTuple):
    seq: dict  # per-token arrays [B, T, ...]
    params: Any  # outer parameters (pytree)
    state: Any  # initial state (pytree) or None


def _f32(a):
    return jnp.asarray(a, jnp.float32)


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def linear_inputs(s: Shape, seed=0) -> Inputs:
    """Unit-norm keys (as the layers feed them), O(1) values, decays in [−0.5, 0], β in [0, 1]."""
    r = np.random.default_rng(seed)
    seq = dict(
        q=r.normal(size=(s.B, s.T, s.H, s.K)),
        k=_unit(r.normal(size=(s.B, s.T, s.H, s.K))),
        v=r.normal(size=(s.B, s.T, s.H, s.V)),
        g=-r.uniform(0.0, 0.5, size=(s.B, s.T, s.H)),
        beta=r.uniform(0.0, 1.0, size=(s.B, s.T, s.H)),
    )
    state = r.normal(size=(s.B, s.H, s.K, s.V))
    return Inputs(jax.tree.map(_f32, seq), (), _f32(state))


def _titans_seq(s: Shape, r) -> dict:
    seq = dict(
        q=_unit(r.normal(size=(s.B, s.T, s.H, s.K))),
        k=_unit(r.normal(size=(s.B, s.T, s.H, s.K))),
        v=r.normal(size=(s.B, s.T, s.H, s.V)),
        theta=r.uniform(0.05, 0.9, size=(s.B, s.T, s.H)),
        eta=r.uniform(0.05, 0.95, size=(s.B, s.T, s.H)),
        alpha=r.uniform(0.01, 0.3, size=(s.B, s.T, s.H)),
    )
    return jax.tree.map(_f32, seq)


def titans_linear_inputs(s: Shape, seed=1) -> Inputs:
    r = np.random.default_rng(seed)
    seq = _titans_seq(s, r)
    M = 0.2 * r.normal(size=(s.B, s.H, s.K, s.V))
    S = 0.1 * r.normal(size=(s.B, s.H, s.K, s.V))
    return Inputs(seq, (), core.TitansLinearState(_f32(M), _f32(S)))


TITANS_HIDDEN = 6


def titans_mlp_inputs(s: Shape, seed=2) -> Inputs:
    """``M(z) = z + W_1ᵀ σ(W_0ᵀ z)`` (K = V, hidden 6), random weights and momenta per row."""
    r = np.random.default_rng(seed)
    seq = _titans_seq(s, r)
    dims = (s.K, TITANS_HIDDEN, s.V)
    pairs = list(zip(dims[:-1], dims[1:], strict=True))
    w = tuple(_f32(a**-0.5 * r.normal(size=(s.B, s.H, a, b))) for a, b in pairs)
    m = tuple(_f32(0.1 * r.normal(size=(s.B, s.H, a, b))) for a, b in pairs)
    return Inputs(seq, (), core.TitansMLPState(w, m))


HOPE_HIDDEN = 3


def hope_inputs(s: Shape, seed=3) -> Inputs:
    """Five memories ``0.3·N(0, 1)`` of hidden size 3, zero momenta (``hope_init_state``), a
    readout with η ≈ 0.12 and α ≈ 0.88; ``x`` and ``q`` of head dim ``D = K = V``."""
    r = np.random.default_rng(seed)
    D, h = s.K, HOPE_HIDDEN

    def mem():
        return core.MLPMemory(
            _f32(0.3 * r.normal(size=(s.H, D, h))), _f32(0.3 * r.normal(size=(s.H, h, D)))
        )

    mems = core.HopeMemories(*(mem() for _ in range(5)))
    w = lambda: _f32(0.3 * r.normal(size=(s.H, D)))  # noqa: E731
    readout = core.HopeReadout(w(), jnp.full((s.H,), -2.0), w(), jnp.full((s.H,), 2.0))
    seq = dict(
        x=_f32(0.5 * r.normal(size=(s.B, s.T, s.H, D))), q=_f32(r.normal(size=(s.B, s.T, s.H, D)))
    )
    return Inputs(seq, readout, core.hope_init_state(mems, s.B, momentum=True))


def hola_inputs(s: Shape, seed=4) -> Inputs:
    """GDN inputs with unit q, k; cache-path scales near 1, sink and gate logits O(1) (the
    gate at 0.5, not the layer's −4, so that the cache read weighs in the output)."""
    r = np.random.default_rng(seed)
    seq = linear_inputs(s, seed).seq
    seq["q"] = _f32(_unit(np.asarray(seq["q"])))
    params = core.HolaReadParams(
        _f32(1.0 + 0.1 * r.normal(size=(s.H, s.K))),
        _f32(1.0 + 0.1 * r.normal(size=(s.H, s.K))),
        _f32(r.normal(size=(s.H,))),
        jnp.full((s.H,), 0.5, jnp.float32),
    )
    return Inputs(seq, params, None)


CMS_HIDDEN = 6


def cms_inputs(s: Shape, seed=5) -> Inputs:
    """Two plain levels ``x + W_down σ(W_up x)`` of width ``d = K``, hidden 6; targets for the
    surprise; the stream state at position 0 (each row a copy of the levels)."""
    r = np.random.default_rng(seed)
    d, h = s.K, CMS_HIDDEN
    levels = tuple(
        core.CMSLevel(
            _f32(0.5 / d**0.5 * r.normal(size=(d, h))), _f32(0.5 / h**0.5 * r.normal(size=(h, d)))
        )
        for _ in CMS_RULE.periods
    )
    seq = dict(
        x=_f32(0.5 * r.normal(size=(s.B, s.T, d))), target=_f32(0.5 * r.normal(size=(s.B, s.T, d)))
    )
    return Inputs(seq, (), core.cms_initial_state(levels, s.B))


# ==================================================================================================
# The cases
# ==================================================================================================


def _same(x):
    return x


@dataclass(frozen=True)
class Case:
    """One memory and its forms (adapters above; None where the memory has no such form).

    Attributes:
      name: the test id.
      shape: ``(B, T, H, K, V)`` of its inputs; make: ``shape -> Inputs``.
      chunk: the chunk setting of the chunked form, one that does not divide ``T``.
      chunks_exact: the chunked form equals the recurrent one at any chunk (the linear rules,
        HOLA's state path); otherwise only at ``unit_chunk``.
      unit_chunk: the chunk setting at which the chunked form is the per-token rule (None: none).
      grid: a prefix ending at a multiple of ``grid`` leaves the chunked form's chunk grid in place
        (the split and decode tests cut there).
      positional: the forms read absolute positions ``t0`` (the Proteus schedule).
      docs: the packed rows, one tuple of document lengths per row (each sums to ``T``); few
        distinct lengths, since every length (and start, for ``positional``) of a document run
        alone is one more compile.
      twin_grads: the twin is differentiable (HOLA's NumPy twin is values only).
      twin_state: the part of the final state the twin returns.
      packed_state: the state the packed rows and the documents alone start from.
      packed_grad_state: the part of the initial state's gradient that is the sum over a row's
        documents (Hope resets momenta to zero, not to the initial momenta).
      packed_final: the part of the packed rows' final state that is per row (HOLA's ``pos`` is
        shared by the batch: row 0's last-document length).
    """

    name: str
    shape: Shape
    make: Callable[[Shape], Inputs]
    chunk: Any
    recurrent: Callable | None = None
    chunked: Callable | None = None
    step: Callable | None = None
    twin: Callable | None = None
    decode: Callable | None = None
    packed: Callable | None = None
    initial: Callable = lambda state, seq, params: state  # noqa: E731
    chunks_exact: bool = False
    unit_chunk: Any = None
    grid: int = 1
    positional: bool = False
    # starts at 6 and 7 (two in one chunk of 4), 12 (a chunk start); one-token documents
    docs: tuple = ((6, 1, 6), (6, 6, 1))
    twin_grads: bool = True
    twin_state: Callable = _same
    packed_state: Callable = _same
    packed_grad_state: Callable = _same
    packed_final: Callable = _same

    @property
    def split(self) -> int:
        """Where the decode and split tests cut: the last multiple of ``grid`` that leaves at
        least three tokens after it."""
        return (self.shape.T - 3) // self.grid * self.grid


LINEAR_SHAPE = Shape(B=2, T=37, H=2, K=4, V=6)
LINEAR_DOCS = ((16, 5, 16), (5, 16, 16))  # starts 16 (a chunk start) and 21 in one chunk of 8
SMALL = Shape(B=2, T=13, H=2, K=4, V=6)
SQUARE = Shape(B=2, T=13, H=2, K=4, V=4)  # K = V: residual MLP memories, Hope's head dim
PROTEUS_DOCS = ((5, 8), (5, 8))  # one compile per (length, start) alone: same rows
# Hope restarts neither chunk grid at a document start (its first chunk is cut short at the next
# multiple of the chunk size), so a document equals its run alone only when it starts on the grid
# of both chunk sizes: test_packed_rows_equal_documents_alone[hope-unaligned] records the rest.
HOPE_DOCS = ((4, 4, 5), (4, 4, 5))
PROTEUS_HOPE_DOCS = ((4, 9), (4, 9))


def _linear_case(rule: str) -> Case:
    return Case(
        name=rule, shape=LINEAR_SHAPE, make=linear_inputs, chunk=8, chunks_exact=True,
        unit_chunk=1, docs=LINEAR_DOCS, **linear_forms(rule),
    )  # fmt: skip


CASES = [
    _linear_case("linear_attention"),
    _linear_case("delta_rule"),
    _linear_case("gated_delta"),
    Case(
        name="titans_linear",
        shape=SMALL,
        make=titans_linear_inputs,
        chunk=4,
        unit_chunk=1,
        grid=4,
        step=titans_linear_step,
        recurrent=titans_linear_recurrent,
        chunked=titans_linear_chunked,
        twin=titans_linear_twin,
        decode=titans_linear_decode,
        packed=titans_linear_packed,
    ),
    Case(
        name="titans_mlp",
        shape=SQUARE,
        make=titans_mlp_inputs,
        chunk=4,
        unit_chunk=1,
        grid=4,
        step=titans_mlp_step,
        recurrent=titans_mlp_recurrent,
        chunked=titans_mlp_chunked,
        twin=titans_mlp_twin,
        decode=titans_memory_decode,
        packed=titans_mlp_packed,
    ),
    Case(
        name="hope",
        shape=SQUARE,
        make=hope_inputs,
        chunk=(4, 2),
        unit_chunk=(1, 1),
        grid=4,
        step=hope_step,
        recurrent=hope_recurrent,
        chunked=hope_chunked,
        twin=hope_twin,
        decode=hope_decode_from,
        packed=hope_packed,
        docs=HOPE_DOCS,
        packed_grad_state=lambda st: st.memories,
    ),
    Case(
        name="hola",
        shape=SMALL,
        make=hola_inputs,
        chunk=8,
        chunks_exact=True,
        unit_chunk=1,
        initial=hola_initial,
        step=hola_step,
        recurrent=hola_recurrent,
        chunked=hola_chunked,
        twin=hola_twin,
        twin_grads=False,
        twin_state=lambda st: st.S,
        decode=hola_decode,
        packed=hola_packed,
        packed_final=lambda st: st._replace(pos=None),
    ),
    Case(
        name="cms_online",
        shape=SMALL,
        make=cms_inputs,
        chunk=None,
        step=cms_step,
        chunked=cms_chunked,
    ),
    Case(
        name="proteus_gated_delta",
        shape=SMALL,
        make=linear_inputs,
        chunk=4,
        chunks_exact=True,
        unit_chunk=1,
        positional=True,
        step=proteus_gdn_step,
        recurrent=proteus_gdn_recurrent,
        chunked=proteus_gdn_chunked,
        decode=proteus_gdn_decode,
    ),
    Case(
        name="proteus_titans_mlp",
        shape=SQUARE,
        make=titans_mlp_inputs,
        chunk=4,
        unit_chunk=1,
        grid=4,
        positional=True,
        docs=PROTEUS_DOCS,
        step=proteus_titans_step,
        recurrent=proteus_titans_recurrent,
        chunked=proteus_titans_chunked,
        decode=proteus_titans_decode,
        packed=proteus_titans_packed,
    ),
    Case(
        name="proteus_hope",
        shape=SQUARE,
        make=hope_inputs,
        chunk=(4, 2),
        unit_chunk=(1, 1),
        grid=4,
        positional=True,
        docs=PROTEUS_HOPE_DOCS,
        step=proteus_hope_step,
        recurrent=proteus_hope_recurrent,
        chunked=proteus_hope_chunked,
        twin=proteus_hope_twin,
        decode=proteus_hope_decode,
        packed=proteus_hope_packed_rows,
        packed_grad_state=lambda st: st.memories,
    ),
]
