"""Continual use of a trained LM on a long stream: memories and CMS levels keep learning.

A recurrent-memory LM (Hope, Titans, GDN, ...) already learns at test time: its mixers write every
token into their memories, and the LM's decode cache (:class:`~nested_jax.models.lm.LMCache`)
carries those memories. This module makes that state a first-class, resumable object,
:class:`StreamState`, and adds the CMS ``online`` mode at the level of the whole LM (SPEC §3.3):

**Online CMS (dynamic evaluation at several time scales).** The parameters of CMS level ``ℓ`` of
every block (leaves under ``levels/<ℓ>`` in the parameter tree) become *fast weights* ``θ_ℓ`` that
belong to the stream. The stream is read in chunks of ``c = gcd(C^(1), …, C^(k))`` tokens on the
absolute grid of multiples of ``c``. For a chunk ``B`` with targets, at the weights in force
(the rule of :mod:`nested_jax.core.periods`)::

    L_B = Σ_{t∈B} CE(logits_t, target_t)                  (the model's next-token loss)
    A_ℓ ← A_ℓ + η ∂L_B/∂θ_ℓ                               (every chunk, every level)
    at a boundary of level ℓ (tokens consumed ≡ 0 mod C^(ℓ)):   θ_ℓ ← θ_ℓ − A_ℓ ;  A_ℓ ← 0

The gradient is the local surprise signal ``δ_t = ∂L_B/∂y_t`` at each level's output pulled back
to its weights (backprop as associative memory, SPEC §3.3), so the SGD rule of
:func:`nested_jax.core.cms.online.cms_online` is the single-layer case. The memory state entering a
chunk is a constant (gradients do not flow into earlier chunks); the logits of a chunk are
computed before its update (read before write). **Exact resumption:** a stream split into calls
whose lengths are multiples of ``c`` gives bit-identical results to one call; a call may end
mid-chunk (its partial chunk is processed and accumulated, the next call completes the grid).

Without CMS levels (or with ``periods=None``) streaming only carries the memories: the stream is
read in chunks of ``chunk`` tokens through the LM's cache path (prefill with a cache), so its
result does not depend on how the stream is split.

:func:`save_stream_state` / :func:`load_stream_state` write and read the state as an orbax
checkpoint (``nested-jax eval --stream FILE --state-out DIR``, ``nested-jax generate --state-in
DIR``). The KV caches of attention mixers hold ``capacity`` positions in all (no ring buffer); a
stream that would exceed it raises ``ValueError`` before running. The commands size it with
:func:`stream_capacity` (a saved stream keeps :data:`HEADROOM` free positions, and a continued
stream is enlarged by :func:`resize_stream` when a call needs more).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nested_jax.core.checks import check_positive_int
from nested_jax.core.periods import accumulate, apply_at_boundary, period_boundary, reset_to_slower
from nested_jax.files import write_json
from nested_jax.rules import check_periods

__all__ = [
    "StreamState",
    "fast_level_paths",
    "init_stream",
    "stream_tokens",
    "stream_model",
    "model_with_fast",
    "save_stream_state",
    "load_stream_state",
    "HEADROOM",
    "stream_capacity",
    "resize_stream",
]

# Free positions a command leaves in the decode cache of a stream it saves, so that the next
# `generate --state-in` / `eval --stream --state-in` has room without asking for it.
HEADROOM = 4096


class StreamState(NamedTuple):
    """Everything a stream carries across calls.

    Attributes:
      pos: int32 ``[]`` tokens consumed so far.
      capacity: int32 ``[]`` positions the decode cache can hold in all.
      cache: the LM's :class:`~nested_jax.models.lm.LMCache` (every mixer's memory).
      fast: ``{path: array}`` online CMS level weights (``{}`` when off).
      accum: ``{path: array}`` ``Σ η g`` since each level's last boundary (same keys as ``fast``).
    """

    pos: jax.Array
    capacity: jax.Array
    cache: Any
    fast: dict
    accum: dict


def _path_str(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def fast_level_paths(params: Any, levels_key: str = "levels") -> dict[str, int]:
    """``{path: ℓ}`` for every parameter leaf below ``<levels_key>/<ℓ>`` (CMS level ``ℓ``, 0-based).

    Args:
      params: the LM's parameter pytree (pure dict of arrays).
      levels_key: name of the container of the CMS levels (``nested_jax.layers.cms``).
    """
    from nested_jax.optim.multifreq import level_labels_by_index

    labels = level_labels_by_index(levels_key)(params)
    out = {}
    for path, lab in jax.tree_util.tree_flatten_with_path(labels, is_leaf=lambda x: x is None)[0]:
        if lab is not None:
            out[_path_str(path)] = int(lab)
    return out


def _with_fast(params: Any, fast: dict) -> Any:
    """``params`` with the leaves named in ``fast`` replaced by the fast weights."""
    if not fast:
        return params

    def swap(path, leaf):
        return fast.get(_path_str(path), leaf)

    return jax.tree_util.tree_map_with_path(swap, params)


def _check_periods(periods, levels: dict[str, int], variant=None) -> tuple[int, ...] | None:
    """``periods`` validated against the model's CMS levels (None: memories only)."""
    if periods is None:
        return None
    if not levels:
        raise ValueError("periods: the model has no CMS levels (no parameters under 'levels/<l>')")
    k = max(levels.values()) + 1
    try:
        return check_periods(periods, k, variant)
    except ValueError as err:
        raise ValueError(f"periods: {err}") from None


def init_stream(
    model_init_cache: Callable[[int, int], Any],
    params: Any,
    *,
    batch_size: int = 1,
    capacity: int,
    periods: Sequence[int] | None = None,
    levels_key: str = "levels",
) -> StreamState:
    """A fresh stream: empty memories and (``periods`` given) fast CMS weights = trained weights.

    Args:
      model_init_cache: ``model.init_cache`` of the LM.
      params: the LM's trained parameter pytree.
      batch_size: independent streams (online CMS needs 1: fast weights are per stream).
      capacity: positions the decode cache must hold (attention KV caches; ignored by purely
        recurrent mixers).
      periods: CMS level periods in tokens (online mode) or None (memories only).
      levels_key: see :func:`fast_level_paths`.
    """
    check_positive_int("capacity", capacity)
    levels = fast_level_paths(params, levels_key) if periods is not None else {}
    periods = _check_periods(periods, levels)
    if periods is not None and batch_size != 1:
        raise ValueError(f"batch_size: online CMS streams one sequence (1), got {batch_size}")
    flat = {_path_str(p): a for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    fast = {name: jnp.asarray(flat[name], jnp.float32) for name in levels}
    return StreamState(
        pos=jnp.zeros((), jnp.int32),
        capacity=jnp.asarray(capacity, jnp.int32),
        cache=model_init_cache(batch_size, capacity),
        fast=fast,
        accum=jax.tree.map(jnp.zeros_like, fast),
    )


def stream_capacity(requested: int, *, needed: int, saved: int = 0, save: bool = False) -> int:
    """Positions the decode cache of a call holds (``--capacity`` of the commands).

    Args:
      requested: ``--capacity`` (0: the default).
      needed: the position the call ends at (tokens already in the stream + this call's).
      saved: capacity of the continued stream (0: a fresh stream).
      save: whether the call saves the stream (``--state-out``).

    Returns:
      ``requested``, or by default ``max(saved, needed + HEADROOM)`` when saving and
      ``max(saved, needed)`` otherwise.

    Raises:
      ValueError: one line naming ``--capacity`` and the value it needs when ``requested`` is
        below ``needed`` or below ``saved`` (a cache is never shrunk).
    """
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise ValueError(f"--capacity: expected an int >= 0 (0: default), got {requested!r}")
    if not requested:
        return max(saved, needed + HEADROOM if save else needed)
    if requested < needed:
        raise ValueError(
            f"--capacity: {requested} positions, but this call reads up to position {needed}; "
            f"raise --capacity to at least {needed}"
        )
    if requested < saved:
        raise ValueError(
            f"--capacity: {requested} positions, but the saved stream already holds {saved}; "
            f"give at least {saved} (or leave --capacity out)"
        )
    return requested


def resize_stream(
    state: StreamState, model_init_cache: Callable[[int, int], Any], capacity: int
) -> StreamState:
    """``state`` with a decode cache of ``capacity`` positions (at least its own): the slots
    past the old capacity are appended empty, as ``model.init_cache`` makes them (zeros), so the
    stream continues exactly as in a cache built that large. Caches whose size does not depend
    on the capacity (recurrent memories) are unchanged."""
    check_positive_int("capacity", capacity)
    if capacity < int(state.capacity):
        raise ValueError(
            f"capacity: {capacity} is below the stream's {int(state.capacity)} positions"
        )
    if capacity == int(state.capacity):
        return state
    like = model_init_cache(_rows(state), capacity)

    def grow(old, new):
        if old.shape == new.shape:
            return old
        return jnp.pad(old, [(0, b - a) for a, b in zip(old.shape, new.shape, strict=True)])

    cache = jax.tree.map(grow, state.cache, like)
    return state._replace(capacity=jnp.asarray(capacity, jnp.int32), cache=cache)


def _rows(state: StreamState) -> int:
    """Independent sequences of a stream (the batch axis of its stacked per-layer caches)."""
    leaves = jax.tree.leaves(state.cache.layers)
    return int(leaves[0].shape[1]) if leaves else 1


def _token_loss(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _level_name(name: str, level: int, levels_key: str) -> str:
    """The path of the same leaf in CMS level ``level`` (``…/levels/<ℓ>/…`` rewritten)."""
    parts = name.split("/")
    i = parts.index(levels_key)
    return "/".join(parts[: i + 1] + [str(level)] + parts[i + 2 :])


def _make_chunk_fn(apply_fn, periods, lr, levels, variant, levels_key):
    """``(params, state, tokens [B, n], targets [B, n]) -> (ce [B, n], state)`` for one chunk that
    ends on the grid of ``gcd(periods)`` or is the trailing part of a call."""

    def chunk(params, st: StreamState, tokens, targets):
        def loss(fast):
            logits, cache = apply_fn(_with_fast(params, fast), tokens, st.cache)
            ce = _token_loss(logits, targets)
            return ce.sum(), (ce, cache)

        n = tokens.shape[1]
        if periods is None:
            _, (ce, cache) = loss(st.fast)
            return ce, st._replace(pos=st.pos + n, cache=cache)
        (_, (ce, cache)), grads = jax.value_and_grad(loss, has_aux=True)(st.fast)
        end = st.pos + n
        fast, accum = _level_updates(st, grads, end, periods, levels, lr, variant, levels_key)
        return ce, StreamState(end, st.capacity, cache, fast, accum)

    return chunk


def _level_updates(st: StreamState, grads, end, periods, levels, lr, variant, levels_key):
    """The fast weights after a chunk ending at token ``end`` (SPEC §3.3, :mod:`core.periods`).

    Per level ℓ: ``A_ℓ ← A_ℓ + η ∂L_B/∂θ_ℓ``; where ``end ≡ 0 (mod C^(ℓ))``: ``θ_ℓ ← θ_ℓ − A_ℓ``,
    ``A_ℓ ← 0``; ``nested`` then resets faster levels to slower ones top-down. The leaves of
    level ℓ are grouped as ``{level-1 path: array}`` so that every level's tree lines up.

    Returns:
      ``(fast, accum)`` dicts keyed like ``st.fast``.
    """
    by_level = [{} for _ in periods]  # level ℓ: {level-1 path: path}
    for name in st.fast:
        by_level[levels[name]][_level_name(name, 0, levels_key)] = name
    fire = [period_boundary(end, p) for p in periods]
    new_fast, new_acc = [], []
    for j, names in enumerate(by_level):
        # nested: only level 1 is read; every level learns from ∂L/∂θ_1 (first order, as
        # core.cms.online) at its own period.
        sig = {k: lr * grads[k if variant == "nested" else m] for k, m in names.items()}
        acc = accumulate({k: st.accum[m] for k, m in names.items()}, sig)
        w, acc = apply_at_boundary({k: st.fast[m] for k, m in names.items()}, acc, fire[j])
        new_fast.append(w)
        new_acc.append(acc)
    if variant == "nested":
        new_fast, new_acc = reset_to_slower(new_fast, new_acc, fire)
    fast = {m: new_fast[levels[m]][_level_name(m, 0, levels_key)] for m in st.fast}
    accum = {m: new_acc[levels[m]][_level_name(m, 0, levels_key)] for m in st.fast}
    return fast, accum


@functools.lru_cache(maxsize=32)
def _jitted(apply_fn, periods, lr, levels, variant, levels_key):
    """The jitted chunk step and its ``lax.scan`` over whole chunks, built once per setting (so
    repeated calls on one stream do not recompile)."""
    step = jax.jit(_make_chunk_fn(apply_fn, periods, lr, dict(levels), variant, levels_key))

    @jax.jit
    def run_whole(params, st, tok, tgt):  # [n, B, c] chunks in one lax.scan
        def body(s, xs):
            ce, s = step(params, s, *xs)
            return s, ce

        return jax.lax.scan(body, st, (tok, tgt))

    return step, run_whole


def _pieces(pos: int, length: int, c: int) -> list[tuple[int, int, int]]:
    """Split ``[0, length)`` of a stream at absolute position ``pos`` into ``(start, n_chunks,
    size)`` runs: a leading piece up to the grid of ``c``, whole chunks, a trailing piece."""
    out, i = [], 0
    lead = (-pos) % c
    if lead and length:
        n = min(lead, length)
        out.append((0, 1, n))
        i = n
    whole = (length - i) // c
    if whole:
        out.append((i, whole, c))
        i += whole * c
    if i < length:
        out.append((i, 1, length - i))
    return out


def stream_tokens(
    apply_fn: Callable,
    params: Any,
    state: StreamState,
    tokens,
    targets,
    *,
    periods: Sequence[int] | None = None,
    lr: float = 1e-3,
    variant: str = "sequential",
    chunk: int = 256,
    levels_key: str = "levels",
    progress: Callable[[int], None] | None = None,
):
    """Run ``tokens`` through the stream, updating memories (and online CMS levels).

    Args:
      apply_fn: ``(params, tokens [B, n], cache) -> (logits [B, n, V], cache)`` (e.g. from
        :func:`stream_model`).
      params: the LM's trained parameters (CMS levels are overridden by ``state.fast``).
      state: :class:`StreamState` from :func:`init_stream` or a previous call.
      tokens, targets: int ``[B, T]`` (targets = tokens shifted by one).
      periods: CMS periods in tokens when the state has fast weights, else None.
      lr: online learning rate ``η`` of every level.
      variant: the model's CMS variant (``model.cms.variant``); ``"nested"`` reads only level 1,
        feeds every level the first-order signal ``∂L/∂θ_1`` and resets faster levels to a slower
        one at its boundaries (SPEC §3.3, as :func:`nested_jax.core.cms.online.cms_online`).
      chunk: tokens per call of the LM when no CMS level is online (memories only).
      levels_key: see :func:`fast_level_paths`.
      progress: called with the number of tokens done after each jitted piece.

    Returns:
      ``(ce [B, T] float32 per-token loss before each update, new StreamState)``.
    """
    tokens, targets = np.asarray(tokens), np.asarray(targets)
    if tokens.ndim != 2 or tokens.shape != targets.shape:
        raise ValueError(
            f"tokens, targets: expected int [B, T] of equal shapes, got {tokens.shape} and "
            f"{targets.shape}"
        )
    b, t = tokens.shape
    if bool(state.fast) != (periods is not None):
        raise ValueError("periods: give them exactly when the stream state has online CMS levels")
    pos = int(state.pos)
    if pos + t > int(state.capacity):
        raise ValueError(
            f"tokens: the stream holds {int(state.capacity)} positions in all; {pos} consumed, "
            f"{t} more do not fit (start a stream with a larger capacity)"
        )
    if periods is not None:
        levels = fast_level_paths(params, levels_key)
        periods = _check_periods(periods, levels, variant)
        c = math.gcd(*periods)
    else:
        levels, c = {}, chunk
    check_positive_int("chunk (or the gcd of the CMS periods)", c)
    step, run_whole = _jitted(
        apply_fn, periods, lr, tuple(sorted(levels.items())), variant, levels_key
    )

    outs, done = [], 0
    for start, n, size in _pieces(pos if periods is not None else 0, t, c):
        tok = tokens[:, start : start + n * size]
        tgt = targets[:, start : start + n * size]
        if n == 1:
            ce, state = step(params, state, jnp.asarray(tok), jnp.asarray(tgt))
        else:
            tok, tgt = (jnp.asarray(a.reshape(b, n, size).transpose(1, 0, 2)) for a in (tok, tgt))
            state, ce = run_whole(params, state, tok, tgt)
            ce = ce.transpose(1, 0, 2).reshape(b, n * size)
        outs.append(ce)
        done += n * size
        if progress is not None:
            progress(done)
    ce = jnp.concatenate(outs, axis=1) if outs else jnp.zeros((b, 0), jnp.float32)
    return ce, state


def stream_model(model: nnx.Module) -> tuple[Callable, Any]:
    """``(apply_fn, params)`` for :func:`stream_tokens` from an nnx LM (``params`` pure dict)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state_def = jax.tree.structure(params)

    def apply_fn(p, tokens, cache):
        from nested_jax.train.step import params_to_state

        m = nnx.merge(graphdef, params_to_state(p, state_def), rest)
        return m(tokens, cache=cache)

    return apply_fn, nnx.to_pure_dict(params)


def _as_tree(state: StreamState) -> dict:
    return {
        "pos": state.pos,
        "capacity": state.capacity,
        "cache": state.cache,
        "fast": state.fast,
        "accum": state.accum,
    }


def model_with_fast(model: nnx.Module, fast: dict) -> nnx.Module:
    """A copy of the nnx LM whose CMS level weights are a stream's fast weights."""
    if not fast:
        return model
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state_def = jax.tree.structure(params)
    pure = _with_fast(nnx.to_pure_dict(params), fast)
    from nested_jax.train.step import params_to_state

    return nnx.merge(graphdef, params_to_state(pure, state_def), rest)


_META = "stream.json"


def _replicated_like(params: Any):
    """A replicated ``NamedSharding`` on the mesh of the parameters (None when not on a mesh)."""
    leaf = jax.tree.leaves(params)[0]
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return None


def save_stream_state(
    path: str | Path, state: StreamState, *, periods: Sequence[int] | None = None
) -> Path:
    """Write ``state`` to the new directory ``path``: ``state/`` (orbax) + ``stream.json`` (what
    is needed to rebuild its structure: capacity, rows, CMS periods). Nothing is overwritten."""

    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists():
        raise ValueError(f"path: {path} exists; choose a new directory (nothing is overwritten)")
    rows = _rows(state)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "state", _as_tree(state))
        ckpt.wait_until_finished()
    meta = {
        "pos": int(state.pos),
        "capacity": int(state.capacity),
        "rows": rows,
        "periods": None if periods is None else list(periods),
    }
    if jax.process_index() == 0:
        write_json(path / _META, meta)
    return path


def load_stream_state(
    path: str | Path, model_init_cache: Callable[[int, int], Any], params: Any
) -> tuple[StreamState, tuple[int, ...] | None]:
    """Read a state written by :func:`save_stream_state` for the LM (``model.init_cache`` and its
    parameters give the structure). Returns ``(state, periods)``. One-line ``ValueError`` when
    the directory is missing, unreadable or from another model."""
    import json

    import orbax.checkpoint as ocp

    from nested_jax.train.checkpoint import abstract_like

    path = Path(path).absolute()
    if not (path / _META).is_file():
        raise ValueError(f"path: no stream state at {path} (missing {_META})")
    try:
        meta = json.loads((path / _META).read_text())
        periods = None if meta["periods"] is None else tuple(meta["periods"])
        like = init_stream(
            model_init_cache,
            params,
            batch_size=meta["rows"],
            capacity=meta["capacity"],
            periods=periods,
        )
        target = abstract_like(_as_tree(like))
        sharding = _replicated_like(params)
        if sharding is not None:  # restore onto the devices of the (sharded) parameters
            target = jax.tree.map(lambda a: a.update(sharding=sharding), target)
        with ocp.StandardCheckpointer() as ckpt:
            tree = ckpt.restore(path / "state", target)
    except Exception as err:  # orbax / json raise many types for truncated or foreign files
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"path: cannot read the stream state at {path}: {first}") from None
    return StreamState(**tree), periods
