"""What defines a run's data: the exact tokenizer and a fingerprint of the corpus.

A training workdir keeps both (``nested_jax.train.workdir``), so evaluation, generation and a
resumed run tokenise with the tokenizer the model was trained with, and a corpus that changed
since is reported instead of being silently re-tokenised (a SentencePiece model trained on a
different text maps the same ids to different pieces: the model's outputs would be garbage with
no error).

The record (a JSON-able dict, :func:`data_spec`)::

    {"version": 1,
     "tokenizer": {"kind": "byte" | "sentencepiece" | "tokenizer.json", "fingerprint": str,
                   "vocab_size": int, "file": "tokenizer.model" | "tokenizer.json" | None},
     "corpus": {"source": data.corpus, "sha256": str, "documents": int, "bytes": int}}

A generated-task run (``data.task``, :mod:`nested_jax.data.task_source`) records the task instead
of a text: ``tokenizer`` is ``{"kind": "task", ..., "file": None, "task": data.task, "options":
data.task_options}`` and ``corpus`` is ``{"source": data.task, "task", "options", "sha256",
"documents": 0, "bytes": 0}`` (:func:`~nested_jax.data.task_source.task_record`), so a resume on
another task or other options is refused like a changed corpus.

plus the tokenizer file's bytes (:func:`tokenizer_payload`), which :func:`tokenizer_from_payload`
turns back into the same tokenizer (same fingerprint, checked).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from nested_jax.data.config import DataConfig
from nested_jax.data.corpus import DataError
from nested_jax.data.task_source import TaskTokenizer
from nested_jax.data.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
)

SPEC_VERSION = 1
# Where each tokenizer kind's file goes inside a workdir.
TOKENIZER_FILES = {"sentencepiece": "tokenizer.model", "tokenizer.json": "tokenizer.json"}


def corpus_fingerprint(docs: Sequence[str]) -> dict:
    """``{"sha256", "documents", "bytes"}`` of the documents in corpus order.

    The hash covers every document's bytes and the document boundaries, so adding, removing,
    editing or reordering a file changes it.
    """
    h = hashlib.sha256(b"corpus-v1")
    total = 0
    for d in docs:
        raw = d.encode("utf-8")
        total += len(raw)
        h.update(len(raw).to_bytes(8, "little"))
        h.update(hashlib.sha256(raw).digest())
    return {"sha256": h.hexdigest(), "documents": len(docs), "bytes": total}


def tokenizer_payload(tokenizer: Tokenizer) -> tuple[str, bytes | None]:
    """``(kind, file bytes)`` that rebuild `tokenizer` (``None`` bytes for the byte tokenizer)."""
    if isinstance(tokenizer, ByteTokenizer):
        return "byte", None
    if isinstance(tokenizer, SentencePieceTokenizer):
        return "sentencepiece", tokenizer.model_proto
    if isinstance(tokenizer, HFTokenizer):
        return "tokenizer.json", tokenizer.raw
    if isinstance(tokenizer, TaskTokenizer):
        return "task", None  # rebuilt from the record's task, options and vocab_size
    raise ValueError(f"tokenizer: cannot save a {type(tokenizer).__name__} into a workdir")


def tokenizer_from_payload(meta: dict, payload: bytes | None, where: str) -> Tokenizer:
    """The tokenizer described by the ``tokenizer`` record `meta`, rebuilt from its file bytes.

    Raises:
      DataError: the bytes are missing or do not rebuild the recorded tokenizer (``where`` names
        the file in the message).
    """
    kind = meta.get("kind")
    if kind == "byte":
        tok: Tokenizer = ByteTokenizer()
    elif kind == "task":
        try:
            tok = TaskTokenizer(meta["task"], meta["vocab_size"], meta.get("options"))
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: unreadable task tokenizer record ({e!r})") from None
    elif payload is None:
        raise DataError(f"{where}: missing (the {kind} tokenizer this run was trained with)")
    elif kind == "sentencepiece":
        try:
            tok = SentencePieceTokenizer(payload)
        except Exception as e:  # sentencepiece raises RuntimeError / OSError on bad protos
            raise DataError(f"{where}: not a SentencePiece model ({type(e).__name__})") from e
    elif kind == "tokenizer.json":
        tok = HFTokenizer(where, raw=payload)
    else:
        raise DataError(f"{where}: unknown tokenizer kind {kind!r}")
    if tok.fingerprint != meta.get("fingerprint"):
        raise DataError(
            f"{where}: tokenizer fingerprint {tok.fingerprint} differs from the recorded "
            f"{meta.get('fingerprint')} (the file was changed)"
        )
    return tok


def data_spec(cfg: DataConfig, tokenizer: Tokenizer, corpus: dict) -> dict:
    """The record of a run's data (module docstring).

    Args:
      cfg: the data config (``corpus``, or ``task`` for a generated task, is kept as the
        source's name).
      tokenizer: the run's tokenizer.
      corpus: :func:`corpus_fingerprint` of the corpus (a task run: its
        :func:`~nested_jax.data.task_source.task_record`).
    """
    kind, _ = tokenizer_payload(tokenizer)
    record = {
        "kind": kind,
        "fingerprint": tokenizer.fingerprint,
        "vocab_size": int(tokenizer.vocab_size),
        "file": TOKENIZER_FILES.get(kind),
    }
    if isinstance(tokenizer, TaskTokenizer):
        record.update(task=tokenizer.task, options=tokenizer.options)
    source = cfg.task if cfg.task else cfg.corpus
    return {"version": SPEC_VERSION, "tokenizer": record, "corpus": {"source": source, **corpus}}


def describe_corpus(corpus: dict) -> str:
    """``"1234 documents, 4.02 MB (sha256 ab12cd34)"`` for a ``corpus`` record
    (``"task formal:parity {options} (sha256 ab12cd34)"`` for a generated task's)."""
    if "task" in corpus:
        options = corpus.get("options") or {}
        shown = f"{corpus['task']} {options}" if options else corpus["task"]
        return f"task {shown} (sha256 {corpus['sha256'][:8]})"
    return (
        f"{corpus['documents']} documents, {corpus['bytes'] / 1e6:.2f} MB "
        f"(sha256 {corpus['sha256'][:8]})"
    )


def corpus_changed(saved: dict, current: dict) -> bool:
    """Whether two ``corpus`` records describe different text (the source path may differ)."""
    return saved["sha256"] != current["sha256"]
