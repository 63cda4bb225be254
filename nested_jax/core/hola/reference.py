"""Reference twin of HOLA (SPEC §5): brute force in float64 numpy, token by token.

``hola_forward``, ``hola_decode_step`` and ``gdn_residuals`` (``nested_jax.core.hola.forward``,
``nested_jax.core.hola.cache``) are tested against :func:`hola_reference`. It is written from the
SPEC text and shares no code with them: explicit GDN recurrence, explicit visible sets, explicit
softmax with the sink, and (for the fixed-score evictions) the persistent cache recomputed from
scratch after each block as the global top-w over *all* tokens seen so far. With ``segment_ids``
every document is run as if alone (SPEC §0): the state, the cache and the block count restart at
its first token, and the cache only ever holds its own tokens. Values only (numpy: no gradients).

Per head (SPEC §5)::

    e_t = v_t − α_t S_{t−1}ᵀ k_t,   S_t = α_t S_{t−1} + β_t k_t e_tᵀ,   m_t = β_t ‖e_t‖   (α = e^g)
    A_n = top-w by m over (A_{n−1} ∪ block n)                       (ties → earlier position)
    V_t = A_{n−1} ∪ {tokens of block n at positions ≤ t} ∪ {sink}
    o_t = S_tᵀ (scale·q_t) + σ(λ) Σ_{j∈V_t} softmax_j(cache_scale · q̃_tᵀ k̃_j) v_j
"""

from __future__ import annotations

import numpy as np

from nested_jax.rules import HolaRule

EPS = 1e-6


def _norm(x, gamma, read_norm):
    if read_norm == "l2":
        return x / np.sqrt(np.sum(x * x) + EPS)
    return gamma * x / np.sqrt(np.mean(x * x) + EPS)


def hola_reference(q, k, v, g, beta, params, *, rule=HolaRule(), segment_ids=None):
    """Token-by-token HOLA (SPEC §5), the twin of ``hola_forward``.

    Args:
      q, k: ``[B, T, H, K]`` (the state path uses them as given: unit-norm in the layers).
      v: ``[B, T, H, V]``.
      g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      params: ``HolaReadParams(gamma_q, gamma_k, sink_logit, gate_logit)`` (or any 4-sequence of
        them): ``[H, K]`` RMSNorm scales of the cache read (``read_norm="rmsnorm"``), ``[H]`` sink
        logit and pre-sigmoid gate ``λ``.
      rule: ``HolaRule``: ``window`` (w), ``block_size`` (C), ``eviction`` (``beta_e``, ``e``,
        ``beta_v``, ``recency`` or ``cumulative_attention``), ``read_norm`` (``rmsnorm`` or
        ``l2``), ``scale`` (state read) and ``cache_scale`` (logits), None for ``K**-0.5``.
      segment_ids: optional int ``[B, T]`` document ids of packed rows.

    Returns a dict with ``o``, ``o_state``, ``o_cache`` ``[B,T,H,V]``, ``score`` ``[B,T,H]``
    (insertion score: β‖e‖, ‖e‖, β‖v‖, document position or 0), ``e`` ``[B,T,H,V]``, ``S``
    ``[B,H,K,V]``, ``caches``: a list over completed blocks of ``[B][H]`` lists of the cache's
    absolute positions (selection order; without ``segment_ids`` only), and ``last_cache``:
    ``[B][H]`` lists of the final cache's positions inside the row's last document.
    """
    q, k, v, g, beta, gamma_q, gamma_k, sink_logit, gate_logit = (
        np.asarray(a, np.float64) for a in (q, k, v, g, beta, *params)
    )
    B, T, H, K = q.shape
    V = v.shape[-1]
    W, C, eviction, read_norm = rule.window, rule.block_size, rule.eviction, rule.read_norm
    sc = K**-0.5 if rule.scale is None else rule.scale
    cs = K**-0.5 if rule.cache_scale is None else rule.cache_scale
    o_state = np.zeros((B, T, H, V))
    o_cache = np.zeros((B, T, H, V))
    score = np.zeros((B, T, H))
    e_all = np.zeros((B, T, H, V))
    S_out = np.zeros((B, H, K, V))
    n_done = T // C
    caches = [[[None] * H for _ in range(B)] for _ in range(n_done)]
    last_cache = [[None] * H for _ in range(B)]
    seg = np.zeros((B, T), int) if segment_ids is None else np.asarray(segment_ids)
    for b in range(B):
        for h in range(H):
            mass = np.zeros(T)  # cumulative attention received
            for t in range(T):
                if t == 0 or seg[b, t] != seg[b, t - 1]:  # a document starts: empty state
                    S = np.zeros((K, V))
                    cache = []  # absolute positions in A_{n-1}
                    d0 = t
                a = np.exp(g[b, t, h])
                e = v[b, t, h] - a * S.T @ k[b, t, h]
                S = a * S + beta[b, t, h] * np.outer(k[b, t, h], e)
                e_all[b, t, h] = e
                o_state[b, t, h] = S.T @ (sc * q[b, t, h])
                score[b, t, h] = _insertion_score(eviction, beta[b, t, h], e, v[b, t, h], t - d0)
                n = (t - d0) // C  # block of the document
                visible = list(cache) + list(range(d0 + n * C, t + 1))
                qn = _norm(q[b, t, h], gamma_q[h], read_norm)
                keys = [_norm(k[b, j, h], gamma_k[h], read_norm) for j in visible]
                p = _softmax_with_sink([cs * qn @ kj for kj in keys], sink_logit[h])
                o_cache[b, t, h] = sum(p[i] * v[b, j, h] for i, j in enumerate(visible))
                for i, j in enumerate(visible):
                    mass[j] += p[i]
                if (t - d0) % C == C - 1:
                    cache = _evict(eviction, cache, d0, n * C, t, W, mass, score[b, :, h])
                    if segment_ids is None:
                        caches[n][b][h] = list(cache)
            S_out[b, h] = S
            last_cache[b][h] = [j - d0 for j in cache]
    gate = 1.0 / (1.0 + np.exp(-gate_logit))
    o = o_state + gate[None, None, :, None] * o_cache
    return dict(
        o=o, o_state=o_state, o_cache=o_cache, score=score, e=e_all, S=S_out, caches=caches,
        last_cache=last_cache,
    )  # fmt: skip


def _insertion_score(eviction, beta, e, v, doc_position):
    """A token's fixed eviction score: β‖e‖, ‖e‖, β‖v‖, its document position, or 0 (SPEC §5)."""
    return {
        "beta_e": beta * np.linalg.norm(e),
        "e": np.linalg.norm(e),
        "beta_v": beta * np.linalg.norm(v),
        "recency": float(doc_position),
        "cumulative_attention": 0.0,
    }[eviction]


def _softmax_with_sink(logits, sink_logit):
    """Softmax over the visible keys' logits plus the sink's (whose value is zero); the sink's
    probability is dropped, so the returned weights sum to less than one."""
    z = np.array(list(logits) + [sink_logit])
    p = np.exp(z - z.max())
    return (p / p.sum())[:-1]


def _evict(eviction, cache, d0, block_start, t, window, mass, score):
    """The cache after the block ending at ``t`` (document start ``d0``, block start
    ``d0 + block_start``): the ``window`` positions to keep, in selection order (SPEC §5).

    ``cumulative_attention`` ranks the old cache and the block by attention received so far;
    ``recency`` keeps the newest; the fixed scores rank every token of the document so far.
    """
    if eviction == "cumulative_attention":
        cand = list(cache) + list(range(d0 + block_start, t + 1))
        return sorted(cand, key=lambda j: (-mass[j], j))[:window]
    if eviction == "recency":
        return sorted(range(d0, t + 1), key=lambda j: -j)[:window]
    return sorted(range(d0, t + 1), key=lambda j: (-score[j], j))[:window]
