"""Reference twin of the linear associative memories (SPEC §1): float64 numpy, token by token.

The recurrent forms (``*_recurrent``, a ``lax.scan`` of the step) and through them the chunked
WY/UT forms of ``nested_jax.core.associative.forms`` are tested against
:func:`associative_reference`. It is written from the SPEC text and shares no code with them: a
plain Python loop over batch, head and token in float64, the state one ``[K, V]`` matrix, segment
resets by comparing neighbouring ids. Values only (numpy: no gradients).

Per head, column vectors, ``S ∈ R^{K×V}``, ``α_t = e^{g_t}``::

    linear_attention   S_t = α_t S_{t-1} + k_t v_tᵀ                       (α_t = 1 when g is None)
    delta_rule         S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ
    gated_delta        S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ
    read               o_t = S_tᵀ (scale · q_t)

``gated_delta`` is FLA's ``naive_recurrent_gated_delta_rule`` (decay first, then the residual
write).
"""

from __future__ import annotations

import numpy as np

__all__ = ["associative_reference"]

KINDS = ("linear_attention", "delta_rule", "gated_delta")


def _check(kind, q, k, v, g, beta):
    if kind not in KINDS:
        raise ValueError(f"associative_reference: kind must be one of {KINDS}, got {kind!r}")
    if q.ndim != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            "associative_reference: q, k: [B, T, H, K] and v: [B, T, H, V], got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    needs = {"gated_delta": ("g", "beta"), "delta_rule": ("beta",), "linear_attention": ()}[kind]
    for name in needs:
        if {"g": g, "beta": beta}[name] is None:
            raise ValueError(f"associative_reference: {name}: required for kind={kind!r}")
    for name, gate in (("g", g), ("beta", beta)):
        if gate is not None and gate.shape != q.shape[:3]:
            raise ValueError(
                f"associative_reference: {name}: expected [B, T, H] = {q.shape[:3]}, "
                f"got {gate.shape}"
            )


def associative_reference(
    q, k, v, g=None, beta=None, *, kind="gated_delta", scale=None, initial_state=None,
    segment_ids=None,
):  # fmt: skip
    """Token-by-token linear attention, delta rule or gated delta rule (SPEC §1), in float64.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
      g: ``[B, T, H]`` log decay (``gated_delta``; optional for ``linear_attention``; unused by
        ``delta_rule``).
      beta: ``[B, T, H]`` write strength (``delta_rule``, ``gated_delta``).
      kind: ``"linear_attention"``, ``"delta_rule"`` or ``"gated_delta"``.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: ``[B, H, K, V]``; zero when None.
      segment_ids: optional ``[B, T]`` integers: before every token whose id differs from the
        previous token's, the state is set back to ``initial_state`` (SPEC §0, packed rows).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``, both float64.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    g = None if g is None else np.asarray(g, np.float64)
    beta = None if beta is None else np.asarray(beta, np.float64)
    _check(kind, q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    s0 = np.zeros((B, H, K, V)) if initial_state is None else np.asarray(initial_state, np.float64)
    S, o = s0.copy(), np.zeros((B, T, H, V))
    for b in range(B):
        for t in range(T):
            if segment_ids is not None and t > 0 and segment_ids[b, t] != segment_ids[b, t - 1]:
                S[b] = s0[b]
            for h in range(H):
                S[b, h] = _token(kind, S[b, h], k[b, t, h], v[b, t, h],
                                 None if g is None else g[b, t, h],
                                 None if beta is None else beta[b, t, h])  # fmt: skip
                o[b, t, h] = S[b, h].T @ (scale * q[b, t, h])
    return o, S


def _token(kind, S, k_t, v_t, g_t, beta_t):
    """One token's write to one head's ``S [K, V]``."""
    if kind == "delta_rule":
        return S + beta_t * np.outer(k_t, v_t - S.T @ k_t)
    decayed = S if g_t is None else np.exp(g_t) * S
    if kind == "linear_attention":
        return decayed + np.outer(k_t, v_t)
    return decayed + beta_t * np.outer(k_t, v_t - decayed.T @ k_t)
