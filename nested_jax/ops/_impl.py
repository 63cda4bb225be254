"""The ``impl`` vocabulary every op shares and its one check (SPEC §0)."""

from __future__ import annotations

IMPLS = ("chunked", "recurrent", "pallas")


def check_impl(op: str, impl: str, available: tuple[str, ...] = ("chunked", "recurrent")) -> None:
    """Raises ``ValueError`` unless ``impl`` is one of ``available``.

    ``"pallas"`` is the seam for ``pallas_kernels/<op>``: until a kernel is wired it raises with a
    message that says so, so an implementation is never switched silently.
    """
    if impl in available:
        return
    if impl == "pallas":
        raise ValueError(
            f"{op}: impl='pallas' is not implemented yet (no kernel in pallas_kernels/{op}); "
            f"use one of {available}"
        )
    if impl in IMPLS:  # a known form this op does not have (e.g. no per-token CMS)
        raise ValueError(f"{op}: impl={impl!r} has no form for this op; use one of {available}")
    raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
