"""Tokenizers behind one protocol: byte-level, locally trained SentencePiece BPE, tokenizer.json.

Every tokenizer exposes ``token_bytes``: the number of UTF-8 bytes each token id stands for (0 for
control tokens). Bits per byte of a model is then ``sum(nats) / (ln 2 * sum(token_bytes[targets]))``
over the scored targets, the same quantity whichever tokenizer is used.

Document separator: the pipeline prepends ``bos_id`` to every document (when it is not ``None``),
so the first real token of each document is predicted from a context that says "new document".
"""

from __future__ import annotations

import hashlib
import io
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from nested_jax.data.config import DataConfig
from nested_jax.data.corpus import DataError, one_line, resolve_data_dir, write_cache_bytes
from nested_jax.files import as_path


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the evaluations need from a tokenizer."""

    vocab_size: int  # number of token ids (embedding rows needed)
    token_bytes: np.ndarray  # int32[vocab_size]: UTF-8 bytes per token id, 0 for control tokens
    bos_id: int | None  # document separator prepended to every document (None: no separator)
    eos_id: int | None  # end-of-text id (for generation stops); may equal bos_id
    fingerprint: str  # stable identity of the vocabulary, keys the token-array cache

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _as_id_list(ids: Iterable[int]) -> list[int]:
    return [
        int(i) for i in np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).ravel()
    ]


class ByteTokenizer:
    """UTF-8 bytes: ids 0..255 are bytes, id 256 is the document separator (vocab_size 257).

    One extra id (rather than reusing a byte such as NUL) keeps every byte sequence encodable and
    makes document starts unambiguous. ``token_bytes[256] = 0``: the separator carries no text.
    """

    SEP_ID = 256

    def __init__(self) -> None:
        self.vocab_size = 257
        self.bos_id = self.SEP_ID
        self.eos_id = self.SEP_ID
        self.fingerprint = "byte-v1"
        tb = np.ones((self.vocab_size,), np.int32)
        tb[self.SEP_ID] = 0
        self.token_bytes = tb

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of ``text`` as ids."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; separator and out-of-range ids dropped, bad UTF-8 replaced."""
        return bytes(i for i in _as_id_list(ids) if 0 <= i < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model (BPE from :func:`train_sentencepiece`, or any ``.model`` bytes)."""

    def __init__(self, model_proto: bytes) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = int(self._sp.get_piece_size())
        bos, eos = int(self._sp.bos_id()), int(self._sp.eos_id())
        self.bos_id = bos if bos >= 0 else None
        self.eos_id = eos if eos >= 0 else None
        self.fingerprint = "spm-" + hashlib.sha256(model_proto).hexdigest()[:16]
        self.model_proto = model_proto
        tb = np.zeros((self.vocab_size,), np.int32)
        for i in range(self.vocab_size):
            if self._sp.is_control(i) or self._sp.is_unknown(i):
                continue
            if self._sp.is_byte(i):
                tb[i] = 1
            else:
                # "▁" is SentencePiece's escaped space; identity normalisation keeps all else.
                tb[i] = len(self._sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
        self.token_bytes = tb

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected str, got {type(text).__name__}")
        return list(self._sp.encode(text))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; control tokens decode to nothing."""
        return self._sp.decode(_as_id_list(ids))


def _sentences(docs: Sequence[str]) -> Iterable[str]:
    # SentencePiece trains on lines; "\n" itself is a user-defined piece so it survives encoding.
    for doc in docs:
        yield from doc.split("\n")


def train_sentencepiece(
    docs: Sequence[str], vocab_size: int, cache_dir: str | Path | None = None
) -> SentencePieceTokenizer:
    """Train a byte-fallback BPE SentencePiece model on ``docs`` (deterministic), cached by content.

    Settings make ``decode(encode(x)) == x`` for any text without U+2581: identity normalisation,
    no dummy prefix, whitespace kept, newline as a user-defined piece, byte fallback for rare
    characters, single-threaded training on every line (no sampling) so the model is reproducible.

    Args:
      docs: training documents (the train split only, so validation text stays unseen).
      vocab_size: number of pieces (>= 300: 256 byte pieces + controls + merges).
      cache_dir: folder for ``spm_bpe_<vocab>_<hash>.model``; ``None`` trains in memory only.

    Returns:
      The trained :class:`SentencePieceTokenizer`.
    """
    import sentencepiece as spm

    if vocab_size < 300:
        raise ValueError(f"vocab_size: sentencepiece needs >= 300, got {vocab_size}")
    if not docs:
        raise DataError("cannot train a tokenizer on an empty document list")
    h = hashlib.sha256(f"spm-bpe-v1|{vocab_size}|{len(docs)}|".encode())
    for d in docs:
        h.update(hashlib.sha256(d.encode("utf-8")).digest())
    path = None
    if cache_dir is not None:
        path = as_path(cache_dir) / f"spm_bpe_{vocab_size}_{h.hexdigest()[:16]}.model"
        if path.is_file():
            try:
                return SentencePieceTokenizer(path.read_bytes())
            except Exception as e:  # sentencepiece raises RuntimeError/OSError on bad protos
                raise DataError(f"{path}: unreadable tokenizer cache; delete it to retrain") from e
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(_sentences(docs)),
            model_writer=buf,
            vocab_size=vocab_size,
            model_type="bpe",
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            byte_fallback=True,
            character_coverage=1.0,
            split_digits=True,
            user_defined_symbols=["\n"],
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=1 << 16,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(f"data.vocab_size: sentencepiece training failed ({one_line(e)})") from e
    proto = buf.getvalue()
    if path is not None:
        write_cache_bytes(path, proto)
    return SentencePieceTokenizer(proto)


def _gpt2_byte_alphabet() -> dict[str, int]:
    """Inverse of the byte→printable-character map used by byte-level BPE (GPT-2 convention).

    Printable Latin-1 bytes map to themselves; the other 68 bytes map, in byte order, to U+0100 on.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` library."""

    _BOS_NAMES = ("<|endoftext|>", "<s>", "<bos>", "[BOS]", "<|begin_of_text|>", "[CLS]")
    _EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[EOS]", "<|end_of_text|>", "[SEP]")

    def __init__(self, path: str | Path, raw: bytes | None = None) -> None:
        """Loads ``path``, or the file's bytes `raw` when given (then `path` only names it)."""
        from tokenizers import Tokenizer as _HF
        from tokenizers import decoders

        path = Path(path).expanduser()
        if raw is None:
            if not path.is_file():
                raise DataError(f"{path}: tokenizer.json not found (data.tokenizer)")
            raw = path.read_bytes()
        try:
            self._tok = _HF.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises Exception subclasses from Rust
            raise DataError(f"{path}: not a valid tokenizer.json ({one_line(e)})") from e
        self.path = path
        self.raw = raw  # the file's bytes, saved into training workdirs
        self.fingerprint = "hf-" + hashlib.sha256(raw).hexdigest()[:16]
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.bos_id = self._first_id(self._BOS_NAMES)
        self.eos_id = self._first_id(self._EOS_NAMES)
        if self.bos_id is None:
            self.bos_id = self.eos_id
        special = {int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        alphabet = _gpt2_byte_alphabet() if byte_level else {}
        tb = np.zeros((self.vocab_size,), np.int32)
        for i in range(self.vocab_size):
            tok = self._tok.id_to_token(i)
            if tok is None or i in special:
                continue
            if byte_level and all(c in alphabet for c in tok):
                tb[i] = len(tok)
            elif _BYTE_PIECE.match(tok):
                tb[i] = 1
            elif "\u2581" in tok:
                tb[i] = len(tok.replace("\u2581", " ").encode("utf-8"))
            else:
                # Approximate for other decoders (e.g. WordPiece "##" joins): decoded length.
                tb[i] = len(self._tok.decode([i], skip_special_tokens=False).encode("utf-8"))
        self.token_bytes = tb

    def _first_id(self, names: Sequence[str]) -> int | None:
        for name in names:
            i = self._tok.token_to_id(name)
            if i is not None:
                return int(i)
        return None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without the tokenizer's template specials."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens dropped)."""
        return self._tok.decode(_as_id_list(ids), skip_special_tokens=True)


def build_tokenizer(cfg: DataConfig, train_docs: Sequence[str]) -> Tokenizer:
    """The tokenizer named by ``cfg.tokenizer``; SentencePiece is trained on ``train_docs`` only.

    SentencePiece models are cached under ``<data_dir>/tokenizers`` keyed by the training text.
    """
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "sentencepiece":
        cache = resolve_data_dir(cfg.data_dir) / "tokenizers"
        return train_sentencepiece(train_docs, cfg.vocab_size, cache_dir=cache)
    return HFTokenizer(cfg.tokenizer)
