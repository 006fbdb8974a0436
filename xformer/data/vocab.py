"""Vocabularies for the language-modelling corpora, built from the training split.

::

    from xformer.data.readers import read_corpus
    from xformer.data.registry import corpus_info
    from xformer.data.vocab import build_vocab

    info = corpus_info("ptb")
    vocab = build_vocab(info, read_corpus("ptb", "train"))   # WordVocab, 10,000 tokens
    ids = vocab.encode(read_corpus("ptb", "valid"))          # int32 stream, <eos> per line

* ``WordVocab`` (whitespace corpora): the train tokens plus ``<eos>``, ids by
  descending train frequency (ties: first appearance), so that adaptive-softmax
  cutoffs split frequent from rare tokens.  A token outside the vocabulary maps to
  ``<unk>`` if the vocabulary has it, else it is an error.
* ``ByteVocab`` (enwik8): the 256 byte values; id = byte.
* ``CharVocab`` (text8): the train characters, ids by descending frequency (ties:
  code point).

Every vocabulary has ``size``, ``encode(data) -> np.ndarray[int32]`` and ``decode(ids)``.
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from xformer.data.errors import DataValueError

if TYPE_CHECKING:
    from xformer.data.registry import DatasetEntry

EOS = "<eos>"
UNK = "<unk>"
_LINES_PER_CHUNK = 8192  # bounds the temporary token lists when encoding large corpora


def _token_chunks(lines: Sequence[str]) -> Iterable[list[str]]:
    """Yields the token stream (``<eos>`` after every line) in chunks of lines."""
    separator = f" {EOS}\n"
    for start in range(0, len(lines), _LINES_PER_CHUNK):
        chunk = lines[start : start + _LINES_PER_CHUNK]
        yield (separator.join(chunk) + separator).split()


def _by_frequency(counts: Mapping) -> list:
    # Counters and dicts keep insertion order and `sorted` is stable, so ties keep it.
    return [key for key, _ in sorted(counts.items(), key=lambda item: -item[1])]


class SymbolVocab:
    """A table of symbols, ``symbols[i]`` has id ``i``, saved one symbol per line in id order."""

    separator = ""  # `decode` joins symbols with it

    def __init__(self, symbols: Sequence[str]) -> None:
        self.symbols: tuple[str, ...] = tuple(symbols)

    @property
    def size(self) -> int:
        return len(self.symbols)

    def __len__(self) -> int:
        return len(self.symbols)

    def decode(self, ids: Iterable[int]) -> str:
        """Returns the symbols of ``ids``, joined by ``separator``."""
        return self.separator.join(self.symbols[i] for i in ids)

    @staticmethod
    def _to_line(symbol: str) -> str:
        return symbol

    @staticmethod
    def _from_line(line: str) -> str:
        return line

    def save(self, path: str | Path) -> None:
        """Writes one symbol per line, in id order (UTF-8)."""
        lines = "".join(f"{self._to_line(s)}\n" for s in self.symbols)
        tmp = Path(f"{path}.tmp.{os.getpid()}")  # (jobs sharing a vocab_dir may write at once)
        tmp.write_text(lines, encoding="utf-8")
        os.replace(tmp, path)  # never a half-written vocabulary under its real name

    @classmethod
    def load(cls, path: str | Path) -> SymbolVocab:
        """Reads a file written by ``save``."""
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        return cls([cls._from_line(line) for line in lines])


class WordVocab(SymbolVocab):
    """Whitespace tokens of a corpus plus ``<eos>``; ``tokens[i]`` has id ``i``."""

    separator = " "

    def __init__(self, tokens: Sequence[str]) -> None:
        super().__init__(tokens)
        self.tokens = self.symbols
        self._ids = {token: i for i, token in enumerate(self.tokens)}
        if len(self._ids) != len(self.tokens):
            raise ValueError("vocabulary tokens are not unique")
        bad = [t for t in self.tokens if not t or t != "".join(t.split())]
        if bad:
            raise ValueError(f"vocabulary tokens must be non-empty without whitespace: {bad[:5]}")
        if EOS not in self._ids:
            raise ValueError(f"vocabulary has no {EOS}")
        self.eos_id: int = self._ids[EOS]
        self.unk_id: int | None = self._ids.get(UNK)

    @classmethod
    def build(cls, lines: Sequence[str], max_size: int = 0) -> WordVocab:
        """Builds the vocabulary of ``lines`` (the training split).

        With ``max_size`` > 0 only the most frequent tokens are kept so that the
        size is at most ``max_size``; if tokens are dropped, ``<eos>`` and
        ``<unk>`` are kept, ``<unk>`` counted as every dropped token, so that ids
        stay in descending frequency (adaptive softmax's clusters rely on it).
        """
        counts: collections.Counter[str] = collections.Counter()
        for tokens in _token_chunks(lines):
            counts.update(tokens)
        counts.setdefault(EOS, 0)  # no lines at all
        ordered = _by_frequency(counts)
        if max_size and len(ordered) > max_size:
            if max_size < 2:
                raise ValueError(f"max_size must be at least 2 ({EOS}, {UNK}), got {max_size}")
            others = [t for t in ordered if t not in (EOS, UNK)]
            kept = set(others[: max_size - 2])
            counts[UNK] += sum(counts[t] for t in others[max_size - 2 :])
            if UNK not in ordered:
                ordered.append(UNK)
            ordered = _by_frequency({t: counts[t] for t in ordered if t in kept or t in (EOS, UNK)})
        return cls(ordered)

    def __contains__(self, token: str) -> bool:
        return token in self._ids

    def encode_lines(self, lines: Sequence[str]) -> np.ndarray:
        """Returns the int32 id stream of ``lines``, ``<eos>`` after every line."""
        missing = -1 if self.unk_id is None else self.unk_id
        parts = []
        for tokens in _token_chunks(lines):
            ids = np.fromiter(
                map(self._ids.get, tokens, itertools.repeat(missing)),
                dtype=np.int32,
                count=len(tokens),
            )
            if self.unk_id is None and (ids < 0).any():
                token = tokens[int(np.argmax(ids < 0))]
                raise DataValueError(
                    f"token {token!r} is not in the vocabulary, which has no {UNK} (it holds "
                    "the training split's tokens: train on a larger split, or set "
                    f"data.vocab_size to keep the most frequent ones and add {UNK})"
                )
            parts.append(ids)
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    encode = encode_lines

    def unknown_tokens(self, lines: Sequence[str]) -> collections.Counter[str]:
        """{token: occurrences} of the whitespace tokens of ``lines`` outside the vocabulary
        (``encode_lines`` maps them to ``<unk>``)."""
        counts: collections.Counter[str] = collections.Counter()
        for tokens in _token_chunks(lines):
            counts.update(t for t in tokens if t not in self._ids)
        return counts

    def __repr__(self) -> str:
        return f"WordVocab(size={self.size}, unk={self.unk_id is not None})"


class ByteVocab:
    """The 256 byte values; the id of a byte is its value."""

    size = 256

    def __len__(self) -> int:
        return self.size

    def encode(self, data: bytes) -> np.ndarray:
        """Returns the int32 id stream of ``data`` (every byte is a token)."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> bytes:
        """Returns the bytes of ``ids``."""
        ids = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids))
        if ids.size and not (0 <= ids.min() and ids.max() < 256):
            raise ValueError("byte ids must be in [0, 256)")
        return ids.astype(np.uint8).tobytes()

    def __repr__(self) -> str:
        return "ByteVocab(size=256)"


def _code_points(text: str | bytes) -> np.ndarray:
    if isinstance(text, str):
        text = text.encode("utf-8")
    if text.isascii():  # text8: one byte per character
        return np.frombuffer(text, dtype=np.uint8)
    return np.frombuffer(text.decode("utf-8").encode("utf-32-le"), dtype=np.uint32)


class CharVocab(SymbolVocab):
    """The characters of a text; ``chars[i]`` has id ``i``. Saved as decimal code points (a
    character may be whitespace)."""

    def __init__(self, chars: Sequence[str]) -> None:
        super().__init__(chars)
        self.chars = self.symbols
        if len(set(self.chars)) != len(self.chars) or any(len(c) != 1 for c in self.chars):
            raise ValueError("CharVocab needs distinct single characters")
        codes = np.array([ord(c) for c in self.chars], dtype=np.int64)
        # id of every code point up to the largest one; the extra last entry (-1)
        # stands for all larger code points.
        self._table = np.full(int(codes.max(initial=-1)) + 2, -1, dtype=np.int32)
        self._table[codes] = np.arange(len(codes), dtype=np.int32)

    @classmethod
    def build(cls, text: str | bytes) -> CharVocab:
        """Builds the vocabulary of ``text`` (the training split; bytes are UTF-8).

        Ids are by descending frequency, ties by code point.
        """
        counts = np.bincount(_code_points(text))
        present = np.flatnonzero(counts)
        order = present[np.argsort(-counts[present], kind="stable")]
        return cls([chr(c) for c in order])

    @staticmethod
    def _to_line(symbol: str) -> str:
        return str(ord(symbol))

    @staticmethod
    def _from_line(line: str) -> str:
        return chr(int(line))

    def _ids(self, codes: np.ndarray) -> np.ndarray:
        """The id of each code point (-1: not in the vocabulary)."""
        last = len(self._table) - 1  # (the entry of every larger code point)
        if last <= np.iinfo(codes.dtype).max:  # else every code is below it (ASCII's uint8)
            codes = np.minimum(codes, last)
        return self._table[codes]

    def encode(self, text: str | bytes) -> np.ndarray:
        """Returns the int32 id stream of ``text`` (bytes are decoded as UTF-8)."""
        codes = _code_points(text)
        ids = self._ids(codes)
        if (ids < 0).any():
            char = chr(codes[int(np.argmax(ids < 0))])
            raise DataValueError(f"character {char!r} is not in the vocabulary")
        return ids

    def unknown_chars(self, text: str) -> collections.Counter[str]:
        """{character: occurrences} of the characters of ``text`` outside the vocabulary."""
        codes = _code_points(text)
        ids = self._ids(codes)
        missing, counts = np.unique(codes[ids < 0], return_counts=True)
        return collections.Counter({chr(c): int(n) for c, n in zip(missing, counts, strict=True)})

    def __repr__(self) -> str:
        return f"CharVocab(size={self.size})"


Vocab = WordVocab | ByteVocab | CharVocab


def build_vocab(info: DatasetEntry, train_data: Sequence[str] | bytes, max_size: int = 0) -> Vocab:
    """Builds the vocabulary of a corpus from its training split (see ``read_corpus``).

    ``max_size`` (word vocabularies only, 0 = all) keeps the most frequent tokens.
    """
    if info.tokenization == "whitespace":
        return WordVocab.build(train_data, max_size=max_size)
    if max_size:
        raise ValueError(f"max_size applies to word vocabularies, not {info.name!r}")
    if info.tokenization == "byte":
        return ByteVocab()
    if info.tokenization == "char":
        return CharVocab.build(train_data)
    raise ValueError(f"unknown tokenization {info.tokenization!r} of {info.name!r}")
