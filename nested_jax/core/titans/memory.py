"""The Titans memory of one mixer (SPEC §2, §4): sequence form with Proteus and exact decoding.

The rule itself lives in :mod:`nested_jax.core.titans.mlp` (``L_M = 1`` is the matrix memory);
this module composes it the way a layer runs it, as pure functions of arrays and a
:class:`TitansMemorySpec` (static, hashable: the memory's ``dims``, its rule, a
:class:`~nested_jax.rules.TitansRule` passed whole to every form, and its Proteus schedule):

- :func:`titans_memory_sequence`: ``(y [B, T, H, D], final state)`` of a whole row: the
  chunked (``titans_mlp_chunked``) or recurrent (``titans_mlp_recurrent``) rule, packed rows
  (``segment_ids``: exact reset to ``reset_state`` at a document start), truncated backprop
  (``spec.rule.grad_horizon``) and the Proteus schedule (``spec.proteus``, a ``ProteusRule``
  with ``blocks = E > 1``, below).
- :func:`titans_memory_step`: one token with chunk buffering, equal to row ``t`` of the sequence
  form (chunks aligned at position 0), and :func:`titans_memory_init_cache` /
  :func:`titans_memory_start` for its :class:`MemoryCache`.

**Decode.** The chunked rule takes all surprises of a chunk at the chunk-start weights ``W⁰``, so
token ``t`` of a chunk depends on ``(W⁰, S⁰)`` and on the chunk's earlier tokens. The cache keeps
``(W⁰, S⁰)`` plus a buffer of the chunk's tokens; a step writes its token into slot ``n``, re-runs
the (causal) chunk over the buffer, reads row ``n`` and commits the chunk's final state when slot
``b − 1`` is filled. Chunk 1 (or the recurrent rule) is the per-token ``titans_mlp_step``.

**Proteus** (SPEC §4, ``E = proteus.blocks``, ``N = proteus.context_len``, ``Δ = N // E``): the
memory coordinates (key rows for ``L_M = 1``, hidden units for ``L_M ≥ 2``) open block by block at
the 1-based row position ``t``. The sequence form runs one memory call per span of constant mask
(``proteus_spans``) from the gated state ``g ⊙ (M, S)`` and puts the locked coordinates back,
``M ← where(g, M_cand, M)`` (``proteus_gated_update``), as ``proteus_titans_mlp_chunked`` does; on
packed rows the whole state resets at a document start (``run_proteus_spans_packed``). Decoding
gates each chunk's buffer with the mask of its first token, which needs ``b | Δ`` (the forward's
chunk grid restarts at every span), checked by :func:`titans_memory_init_cache`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from nested_jax.core.checks import require_initial_state
from nested_jax.core.proteus import (
    proteus_active_blocks,
    proteus_block_len,
    proteus_chunk_constant,
    proteus_gate,
    proteus_gated_update,
    proteus_spans,
    run_proteus_spans,
    run_proteus_spans_packed,
)
from nested_jax.core.titans.chunk import titans_mlp_chunked
from nested_jax.core.titans.mlp import titans_mlp_recurrent, titans_mlp_state, titans_mlp_step
from nested_jax.core.titans.net import MLP_STATE_CONSTRUCTOR, TitansMLPState
from nested_jax.core.titans.proteus import proteus_titans_mlp_masks, proteus_titans_mlp_step
from nested_jax.rules import ProteusRule, TitansRule

__all__ = [
    "TitansMemorySpec",
    "MemoryCache",
    "titans_memory_sequence",
    "titans_memory_masks",
    "titans_memory_gate_inputs",
    "titans_memory_init_cache",
    "titans_memory_start",
    "titans_memory_step",
]


@dataclass(frozen=True)
class TitansMemorySpec:
    """Static options of one Titans memory (SPEC §2, §4); frozen and hashable (a jit static).

    Attributes:
      dims: ``(d_0 = K, d_1, …, d_L = V)``, ``L = L_M`` layers (``L = 1``: matrix memory).
      rule: the memory rule, a :class:`TitansRule` (a config's ``TitansOptions`` is one), passed
        whole to the forms: chunk ``memory_chunk`` (ignored by the recurrent rule, whose decode
        chunk is 1), ``read_before_write``, ``per_chunk_gates`` (non-causal: cannot decode),
        ``grad_clip``, ``activation``, ``grad_horizon``, ``remat``. Default ``TitansRule()``, the
        paper's rule.
      proteus: the Proteus schedule, a :class:`ProteusRule` ``(E, N)`` (``E = 1``, the
        default: the plain memory, bit for bit).
    """

    dims: tuple[int, ...]
    rule: TitansRule = TitansRule()
    proteus: ProteusRule = ProteusRule()

    def __post_init__(self):
        # A list would make the spec unhashable (no longer a valid jit static).
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        if len(self.dims) < 2 or min(self.dims) < 1:
            raise ValueError(f"TitansMemorySpec.dims: need (K, ..., V) >= 1, got {self.dims}")
        if not isinstance(self.rule, TitansRule):
            raise ValueError(f"TitansMemorySpec.rule: must be a TitansRule, got {self.rule!r}")
        if not isinstance(self.proteus, ProteusRule):
            raise ValueError(
                f"TitansMemorySpec.proteus: must be a ProteusRule, got {self.proteus!r}"
            )

    @property
    def n_layers(self) -> int:
        """``L_M = len(dims) − 1``."""
        return len(self.dims) - 1


class MemoryCache(NamedTuple):
    """Decode state of one memory: the state at the current chunk start and the chunk's buffer.

    Attributes:
      weights, momentum: tuples of ``[B, H, d_l, d_{l+1}]`` f32, ``(M, S)`` at the chunk start.
      q, k: ``[B, b, H, D]``; v: ``[B, b, H, D]``; theta, eta, alpha: ``[B, b, H]`` (the buffered
        tokens of the current chunk, f32; slots ``≥ n`` are stale and never read).
      n: int32 scalar, number of tokens of the current chunk already processed (``−1``: not
        started, the weights are placeholders; see :func:`titans_memory_start`).
      t: int32 scalar, tokens consumed so far (the Proteus position of the next token is t + 1).
    """

    weights: tuple
    momentum: tuple
    q: jax.Array
    k: jax.Array
    v: jax.Array
    theta: jax.Array
    eta: jax.Array
    alpha: jax.Array
    n: jax.Array
    t: jax.Array


def _decode_chunk(spec: TitansMemorySpec, recurrent: bool) -> int:
    """The decode buffer length: the recurrent rule is the chunk-1 rule."""
    return 1 if recurrent else spec.rule.memory_chunk


# --------------------------------------------------------------------------------------------------
# Sequence form
# --------------------------------------------------------------------------------------------------


def _run_rule(state, xs, spec, recurrent, segment_ids, reset_state):
    """One call of the plain rule on ``xs = (q, k, v, θ, η, α)``: ``(y, final state)``."""
    form = titans_mlp_recurrent if recurrent else titans_mlp_chunked
    return form(
        *xs, initial_state=state, rule=spec.rule, segment_ids=segment_ids, reset_state=reset_state
    )


def titans_memory_masks(spec: TitansMemorySpec, active) -> TitansMLPState:
    """Open coordinates of the weights and the momentum with ``active`` blocks open (SPEC §4).

    Args:
      spec: the memory's options (``dims``, ``proteus.blocks``).
      active: open blocks ``k(t)``, a Python int or int32 ``[B]``.

    Returns:
      ``TitansMLPState(masks, masks)`` (``proteus_titans_mlp_masks``: key rows for ``L_M = 1``,
      hidden units for ``L_M ≥ 2``), bool masks broadcastable to ``[B, H, d_l, d_{l+1}]``.
    """
    masks = proteus_titans_mlp_masks(active, spec.dims, spec.proteus.blocks)
    return TitansMLPState(masks, masks)


def titans_memory_gate_inputs(spec: TitansMemorySpec, active, xs):
    """Masks (:func:`titans_memory_masks`) and the inputs ``xs = (q, k, …)`` ``[B, T, H, D]``
    with q, k zeroed on locked key rows for the matrix memory (``L_M = 1``).

    Why q and k: ``(g ⊙ M)ᵀ q = Mᵀ (g ⊙ q)``, and the masked key keeps the surprise
    ``k (Mᵀk − v)ᵀ`` on open rows only. The MLP memory needs no input mask (a locked hidden unit
    of the gated weights is silent since ``σ(0) = 0``).

    Returns:
      ``(mask tree, list of inputs)``.
    """
    tree = titans_memory_masks(spec, active)
    if spec.n_layers == 1:
        rows = tree.weights[0][..., 0]  # static: [K]; traced: [B, 1, K]
        rows = rows if rows.ndim == 1 else rows[:, :, None, :]
        q, k, *rest = xs
        zero = lambda a: jnp.where(rows, a, jnp.zeros((), a.dtype))  # noqa: E731
        xs = [zero(q), zero(k), *rest]
    return tree, list(xs)


def _proteus_sequence(state, xs, spec, recurrent, segment_ids, reset_state):
    """Proteus sequence form at row positions ``t = 1 … T`` (SPEC §4).

    One rule call per span of constant mask from the gated state, ``proteus_gated_update`` puts
    the locked coordinates back (``proteus_titans_mlp_chunked`` / ``_recurrent``, which this
    equals without ``segment_ids``); spans of one length run as one ``lax.scan``. Packed rows:
    the schedule follows the row position and the whole state resets at a document start.
    """
    spans = proteus_spans(xs[0].shape[1], 0, spec.proteus.context_len, spec.proteus.blocks)
    e = spec.proteus.blocks

    def span_fn(st, mem_in, seg, active):
        tree, mem_in = titans_memory_gate_inputs(spec, active, mem_in)
        rs = None if reset_state is None else proteus_gate(reset_state, tree)
        y, cand = _run_rule(proteus_gate(st, tree), mem_in, spec, recurrent, seg, rs)
        return y, proteus_gated_update(st, cand, tree)

    def open_fn(st, mem_in, seg):
        return _run_rule(st, mem_in, spec, recurrent, seg, reset_state)

    if segment_ids is None:
        return run_proteus_spans(
            lambda st, p, k: span_fn(st, p, None, k), lambda st, p: open_fn(st, p, None),
            state, tuple(xs), spans, e,
        )  # fmt: skip
    if reset_state is None:  # the rule's default, as without Proteus: a document restarts here
        reset_state = state
    return run_proteus_spans_packed(
        span_fn, open_fn, lambda active: titans_memory_masks(spec, active), state, reset_state,
        tuple(xs), segment_ids, spans, e,
    )  # fmt: skip


def titans_memory_sequence(
    q, k, v, theta, eta, alpha, *, spec: TitansMemorySpec,
    initial_state: TitansMLPState | None = None, recurrent: bool = False, segment_ids=None,
    reset_state: TitansMLPState | None = None,
):  # fmt: skip
    """A whole row of the Titans memory (SPEC §2), Proteus-gated when ``spec.proteus.enabled`` (§4).

    Per token (``titans_mlp``): ``S_t = η_t S_{t-1} − θ_t ∇ℓ(M; k_t, v_t)``,
    ``M_t = (1 − α_t) M_{t-1} + S_t``, ``y_t = M_t(q_t)``, with the surprise taken at the chunk
    start (chunked) or at ``M_{t-1}`` (``recurrent``).

    Args:
      q, k, v: ``[B, T, H, D]``; theta, eta, alpha: ``[B, T, H]``.
      spec: static options.
      initial_state: ``TitansMLPState`` ``[B, H, d_l, d_{l+1}]`` (``titans_mlp_state(weights,
        B)``); required (None raises ``ValueError``: the memory has no zero state).
      recurrent: the per-token rule (``titans_mlp_recurrent``) instead of the chunked one.
      segment_ids: optional ``[B, T]`` int: exact reset to ``reset_state`` at document starts.
      reset_state: the state a document start resets to (default: the rule's, i.e.
        ``initial_state``).

    Returns:
      ``(y [B, T, H, D], final TitansMLPState f32)``.
    """
    state = require_initial_state("titans_memory_sequence", initial_state, MLP_STATE_CONSTRUCTOR)
    xs = (q, k, v, theta, eta, alpha)
    if spec.proteus.enabled:
        return _proteus_sequence(state, xs, spec, recurrent, segment_ids, reset_state)
    return _run_rule(state, xs, spec, recurrent, segment_ids, reset_state)


# --------------------------------------------------------------------------------------------------
# Decode: chunk buffering
# --------------------------------------------------------------------------------------------------


def titans_memory_init_cache(
    spec: TitansMemorySpec, batch_size: int, num_heads: int, *, recurrent: bool = False
) -> MemoryCache:
    """Decode state at position 0, with ``n = −1`` ("not started") and zero placeholder weights.

    Placeholders, because an LM shell builds caches from static attributes only (on a
    layer-stacked module); the first :func:`titans_memory_step` substitutes ``M_0``. The errors
    name the config fields a user sets (``TitansOptions`` is the layer's ``spec``).

    Raises:
      ValueError: ``per_chunk_gates`` (the pooled gates look at later tokens of the chunk), or
        Proteus with a decode chunk that does not divide ``Δ = N // E``.
    """
    if spec.rule.per_chunk_gates:
        raise ValueError(
            "ModelConfig.titans.per_chunk_gates: per-chunk gates pool over later tokens of the "
            "chunk, so the model cannot decode token by token; use per_chunk_gates=false"
        )
    chunk = _decode_chunk(spec, recurrent)
    ws = tuple(
        jnp.zeros((batch_size, num_heads, a, b), jnp.float32)
        for a, b in zip(spec.dims[:-1], spec.dims[1:], strict=True)
    )
    n, e = spec.proteus.context_len, spec.proteus.blocks
    if spec.proteus.enabled and not proteus_chunk_constant(chunk, n, e):
        raise ValueError(
            f"TitansOptions.memory_chunk: decoding with Proteus needs memory_chunk to "
            f"divide the block length Δ = context_len // blocks = {proteus_block_len(n, e)} (the "
            f"forward's chunk grid restarts every Δ tokens), got {chunk}"
        )
    zk = jnp.zeros((batch_size, chunk, num_heads, spec.dims[0]), jnp.float32)
    zv = jnp.zeros((batch_size, chunk, num_heads, spec.dims[-1]), jnp.float32)
    g = jnp.zeros((batch_size, chunk, num_heads), jnp.float32)
    i0 = jnp.zeros((), jnp.int32)
    return MemoryCache(ws, ws, zk, zk, zv, g, g, g, jnp.full((), -1, jnp.int32), i0)


def titans_memory_start(cache: MemoryCache, initial_weights: tuple) -> MemoryCache:
    """``cache`` with ``(M_0, 0)`` substituted if it has not started (``n < 0``); ``n ≥ 0``.

    Args:
      cache: a :class:`MemoryCache`.
      initial_weights: the learned ``M_0``, tuple of ``[H, d_l, d_{l+1}]``.
    """
    fresh = cache.n < 0
    st = titans_mlp_state(initial_weights, cache.q.shape[0])
    w = jax.tree.map(lambda a, o: jnp.where(fresh, a, o), st.weights, cache.weights)
    s = jax.tree.map(lambda o: jnp.where(fresh, 0.0, o), cache.momentum)
    return cache._replace(weights=w, momentum=s, n=jnp.maximum(cache.n, 0))


def _step_token(cache: MemoryCache, xs, spec):
    """Chunk 1: the per-token rule (Proteus: ``proteus_titans_mlp_step`` at ``t + 1``)."""
    st = TitansMLPState(cache.weights, cache.momentum)
    if spec.proteus.enabled:
        y, st = proteus_titans_mlp_step(
            st, *xs, t=cache.t + 1, rule=spec.rule, schedule=spec.proteus
        )
    else:
        y, st = titans_mlp_step(st, *xs, rule=spec.rule)
    return y, cache._replace(weights=st.weights, momentum=st.momentum, t=cache.t + 1)


def _step_chunk(cache: MemoryCache, xs, spec, chunk: int, commit):
    """Chunk ``b > 1``: buffer the token in slot ``n``, re-run the chunk, read row ``n``."""
    n = cache.n
    put = lambda buf, a: jax.lax.dynamic_update_index_in_dim(buf, a, n, 1)  # noqa: E731
    bufs = [put(buf, a) for buf, a in zip(cache[2:8], xs, strict=True)]
    st0 = TitansMLPState(cache.weights, cache.momentum)
    st, run_bufs, tree = st0, bufs, None
    if spec.proteus.enabled:
        # The chunk lies inside one Proteus span (b divides Δ, checked by init_cache): gate the
        # chunk-start state with the mask of the chunk's first token.
        b = xs[0].shape[0]
        first = jnp.broadcast_to(cache.t - n + 1, (b,))
        active = proteus_active_blocks(first, spec.proteus.context_len, spec.proteus.blocks)
        tree, run_bufs = titans_memory_gate_inputs(spec, active, bufs)
        st = proteus_gate(st, tree)
    # Later slots hold stale tokens: rows ≤ n of the dual form never read them, and the final
    # state is used only when every slot is filled by the current chunk.
    # One chunk of b tokens: no later chunk start to cut the gradient at (grad_horizon) and
    # nothing to save by recomputing it in the backward pass (remat); values unchanged.
    rule = dataclasses.replace(spec.rule, remat=False, grad_horizon=0)
    ys, new = titans_mlp_chunked(*run_bufs, initial_state=st, rule=rule)
    if spec.proteus.enabled:
        new = proteus_gated_update(st0, new, tree)
    y = jax.lax.dynamic_index_in_dim(ys, n, 1, keepdims=False)
    full = n == chunk - 1 if commit is None else commit
    pick = lambda a, b: jnp.where(full, a, b)  # noqa: E731
    w = jax.tree.map(pick, new.weights, cache.weights)
    s = jax.tree.map(pick, new.momentum, cache.momentum)
    n_new = jnp.where(full, 0, n + 1).astype(jnp.int32)
    return y, MemoryCache(w, s, *bufs, n_new, cache.t + 1)


def titans_memory_step(
    state: MemoryCache, q, k, v, theta, eta, alpha, *, spec: TitansMemorySpec,
    initial_weights: tuple, recurrent: bool = False, commit=None,
):  # fmt: skip
    """One decode token, equal to row ``t`` of :func:`titans_memory_sequence` (SPEC §2, §4).

    Args:
      state: the decode state, a :class:`MemoryCache` (from :func:`titans_memory_init_cache`
        with the same ``recurrent``; a fresh one starts from ``M_0``).
      q, k, v: ``[B, H, D]``; theta, eta, alpha: ``[B, H]`` (computed in f32).
      spec: static options.
      initial_weights: the learned ``M_0``, tuple of ``[H, d_l, d_{l+1}]``.
      recurrent: the per-token rule (decode chunk 1).
      commit: optional bool scalar: close the chunk after this token (MAC segment ends; the
        caller guarantees the chunk is then full). Default: close when slot ``b − 1`` is filled.

    Returns:
      ``(y [B, H, D] f32, cache)``.
    """
    cache = state
    chunk = _decode_chunk(spec, recurrent)
    if cache.q.shape[1] != chunk:
        raise ValueError(
            f"titans_memory_step: the cache buffers {cache.q.shape[1]} tokens, the decode chunk "
            f"is {chunk} (build the cache with titans_memory_init_cache and the same impl)"
        )
    xs = tuple(a.astype(jnp.float32) for a in (q, k, v, theta, eta, alpha))
    cache = titans_memory_start(cache, initial_weights)
    if chunk == 1:
        return _step_token(cache, xs, spec)
    return _step_chunk(cache, xs, spec, chunk, commit)
