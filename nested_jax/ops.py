"""The one dispatcher: ``op(..., impl="chunked" | "recurrent" | "pallas")`` (DESIGN.md, SPEC §0).

Layers call these functions, never a core form directly, so switching implementation is a config
value. The implementation is never switched silently (not on sequence length, not on mode): an
``impl`` value that cannot run raises ``ValueError``.

- ``"chunked"``: the WY/UT chunk form of ``nested_jax.core.associative`` (the training default).
- ``"recurrent"``: the per-token ``lax.scan`` ground truth (``chunk_size`` is ignored).
- ``"pallas"``: the seam for ``pallas_kernels/<op>/ops.py``. No kernel is wired yet, so it raises
  ``ValueError``; when a kernel lands, this module is its only importer and routes
  ``impl="pallas"`` to it.
"""

from __future__ import annotations

from nested_jax.core import associative as _assoc

IMPLS = ("chunked", "recurrent", "pallas")

__all__ = ["IMPLS", "linear_attention", "delta_rule", "gated_delta"]


def _check_impl(op: str, impl: str) -> None:
    if impl == "pallas":
        raise ValueError(
            f"{op}: impl='pallas' is not implemented yet (no kernel in pallas_kernels/{op}); "
            "use impl='chunked' or impl='recurrent'"
        )
    if impl not in ("chunked", "recurrent"):
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")


def _dispatch(op: str, impl: str, args: tuple, chunk_size: int, **kw):
    """Routes ``op`` to ``core.associative.<op>_recurrent`` or ``<op>_chunked`` by ``impl``."""
    _check_impl(op, impl)
    if impl == "recurrent":
        return getattr(_assoc, f"{op}_recurrent")(*args, **kw)
    return getattr(_assoc, f"{op}_chunked")(*args, chunk_size=chunk_size, **kw)


def linear_attention(
    q,
    k,
    v,
    g=None,
    *,
    scale=None,
    initial_state=None,
    segment_ids=None,
    chunk_size: int = 64,
    impl: str = "chunked",
):
    """(Gated) linear attention, SPEC §1.

    ``S_t = α_t S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale·q_t)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: optional ``[B, T, H]`` log decay.
      scale: multiplies q; default ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``.
      segment_ids: optional ``[B, T]`` int (state resets at segment starts).
      chunk_size: chunk length for ``impl="chunked"``.
      impl: ``"chunked"`` | ``"recurrent"`` (``"pallas"`` not yet available: ValueError).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    return _dispatch(
        "linear_attention",
        impl,
        (q, k, v, g),
        chunk_size,
        scale=scale,
        initial_state=initial_state,
        segment_ids=segment_ids,
    )


def delta_rule(
    q,
    k,
    v,
    beta,
    *,
    scale=None,
    initial_state=None,
    segment_ids=None,
    chunk_size: int = 64,
    impl: str = "chunked",
):
    """Delta rule, SPEC §1.

    ``S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ``, ``o_t = S_tᵀ (scale·q_t)``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
      scale, initial_state, segment_ids, chunk_size: as in ``linear_attention``.
      impl: ``"chunked"`` | ``"recurrent"`` (``"pallas"`` not yet available: ValueError).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    return _dispatch(
        "delta_rule",
        impl,
        (q, k, v, beta),
        chunk_size,
        scale=scale,
        initial_state=initial_state,
        segment_ids=segment_ids,
    )


def gated_delta(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    segment_ids=None,
    chunk_size: int = 64,
    impl: str = "chunked",
):
    """Gated delta rule (GDN), SPEC §1: ``S_t = α_t S_{t-1} + β_t k_t (v_t − α_t S_{t-1}ᵀ k_t)ᵀ``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log decay; beta: ``[B, T, H]``.
      scale, initial_state, segment_ids, chunk_size: as in ``linear_attention``.
      impl: ``"chunked"`` | ``"recurrent"`` (``"pallas"`` not yet available: ValueError).

    Returns:
      ``(o [B, T, H, V], final_state [B, H, K, V])``.
    """
    return _dispatch(
        "gated_delta",
        impl,
        (q, k, v, g, beta),
        chunk_size,
        scale=scale,
        initial_state=initial_state,
        segment_ids=segment_ids,
    )
