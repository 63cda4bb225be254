"""The arguments of the lm-evaluation-harness model ``--model nested_jax``
(:mod:`nested_jax.eval.harness`): its model arguments (:func:`parse_model_args` ->
:class:`HarnessOptions`) and the generation keywords of a request (``_gen_options``), each bad
value a one-line :class:`HarnessArgumentError`. Standard library only (no ``lm_eval`` import)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["MODEL_NAME", "HarnessArgumentError", "HarnessOptions", "parse_model_args"]

MODEL_NAME = "nested_jax"


class HarnessArgumentError(ValueError):
    """A bad model argument or generation keyword (one line naming it)."""


@dataclasses.dataclass(frozen=True)
class HarnessOptions:
    """The model arguments of ``--model nested_jax`` (lm_eval passes them as strings).

    Attributes:
      workdir: the training workdir (required).
      batch_size: requests per model call (rounded up to a multiple of the batch shards).
      max_length: context limit of a bounded (global softmax attention) model; 0 = the run's
        ``data.seq_len``. Not used by streaming models.
      chunk: tokens per model call when an input is read in pieces (streaming, prefill).
      max_gen_toks: generated ids when a request does not say (``generate_until``).
      gen_block: decode steps between checks of the stop strings.
    """

    workdir: str
    batch_size: int = 8
    max_length: int = 0
    chunk: int = 256
    max_gen_toks: int = 256
    gen_block: int = 32


_MINIMA = {"batch_size": 1, "max_length": 0, "chunk": 1, "max_gen_toks": 1, "gen_block": 1}


# Given by lm_eval itself to every model (``--batch_size`` default 1, ``--device`` default
# cuda:0): accepted, the device ignored (JAX places the run on its own devices).
_LM_EVAL_ARGS = ("max_batch_size", "device")


def _as_int(name: str, value: Any, minimum: int) -> int:
    """``value`` (an int or its decimal string) as an int ``>= minimum``; one-line error else."""
    number = value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        number = int(value.strip())
    if isinstance(number, bool) or not isinstance(number, int) or number < minimum:
        raise HarnessArgumentError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return number


def parse_model_args(args: dict[str, Any]) -> HarnessOptions:
    """:class:`HarnessOptions` from lm_eval's model arguments (strings, or values lm_eval already
    converted; ``None`` means the default). ``max_batch_size`` and ``device`` are accepted and
    ignored. One-line :class:`HarnessArgumentError` (a ``ValueError``) naming a missing
    ``workdir``, an unknown key or a bad value."""
    known = {f.name for f in dataclasses.fields(HarnessOptions)}
    unknown = sorted(k for k in args if k not in known and k not in _LM_EVAL_ARGS)
    if unknown:
        raise HarnessArgumentError(
            f"{unknown[0]}: unknown model argument of {MODEL_NAME}; known: "
            f"{', '.join(sorted(known))}"
        )
    workdir = args.get("workdir")
    if workdir is None or not str(workdir).strip():
        raise HarnessArgumentError(
            f"workdir: required model argument of {MODEL_NAME} (--model_args workdir=DIR)"
        )
    values: dict[str, Any] = {"workdir": str(workdir)}
    for name, minimum in _MINIMA.items():
        value = args.get(name)
        if name == "batch_size" and isinstance(value, str) and value.startswith("auto"):
            raise HarnessArgumentError("batch_size: 'auto' is not supported; give an integer")
        if value is not None:
            values[name] = _as_int(name, value, minimum)
    return HarnessOptions(**values)


def _gen_options(gen_kwargs: dict, default_max: int) -> tuple[list[str], int]:
    """``(until strings, max_gen_toks)`` of a greedy request; sampling and unknown keys raise."""
    kw = dict(gen_kwargs or {})
    until = kw.pop("until", None)
    until = [] if until is None else [until] if isinstance(until, str) else list(until)
    if not all(isinstance(u, str) for u in until):
        raise HarnessArgumentError(f"until: expected a string or a list of strings, got {until!r}")
    max_gen = _as_int("max_gen_toks", kw.pop("max_gen_toks", default_max), 0)
    if kw.pop("do_sample", False) or float(kw.pop("temperature", 0.0) or 0.0) > 0:
        raise HarnessArgumentError(
            "do_sample: nested_jax generates greedily (do_sample=False, temperature=0)"
        )
    for ignored in ("top_k", "top_p"):  # no effect on greedy decoding
        kw.pop(ignored, None)
    if kw:
        raise HarnessArgumentError(
            f"{sorted(kw)[0]}: unsupported generation keyword; known: until, max_gen_toks, "
            "do_sample, temperature, top_k, top_p"
        )
    return [u for u in until if u], max_gen
