"""TFDS builders for enwik8 and text8: one byte / character stream, split 90:5:5.

Each record is a 1 MiB chunk of the split's stream, ``{"bytes": bytes}``, in
stream order.  enwik8 is tokenized by byte, text8 by character (its text is
UTF-8).  The splits are those of the Transformer-XL preparation scripts: the last
5,000,000 of the 100,000,000 bytes (text8: characters) are ``test``, the
5,000,000 before them ``valid``, the rest ``train``.  The held-out parts are
defined as 1/20 of the stream each (``stream_split_bounds``), which is exactly
that for the official files and keeps the same proportions for a smaller file
(tests).

Raw files: ``enwik8`` / ``text8`` (plain or ``.gz``) or the official
``enwik8.zip`` / ``text8.zip`` in the manual dir, else the zip is downloaded
(see ``xformer.data.registry``).  Read them with
``xformer.data.readers.read_corpus("enwik8", "valid")`` (returns ``bytes``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from xformer.data.builder_base import BaseBuilder
from xformer.data.registry import dataset_entry
from xformer.data.text import read_bytes

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # bytes per record
STREAM_SIZE = 100_000_000  # bytes in enwik8, characters in text8


def stream_split_bounds(n: int) -> dict[str, tuple[int, int]]:
    """Returns ``{split: (start, end)}`` of a byte / character stream of length ``n``.

    ``valid`` and ``test`` are the last two twentieths (5M + 5M of the official
    100M), ``train`` is the rest.
    """
    held_out = n // 20
    return {
        "train": (0, n - 2 * held_out),
        "valid": (n - 2 * held_out, n - held_out),
        "test": (n - held_out, n),
    }


class ByteStream(BaseBuilder, skip_registration=True):
    """Base of the stream corpora; the registry's tokenization says bytes or characters."""

    def _features(self) -> dict[str, Any]:
        return {"bytes": tfds.features.Tensor(shape=(), dtype=np.object_)}

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        with self.raw_paths(dl_manager) as paths:
            parts = self._split_stream(paths[self.raw.files[0]])
        return {split: self._generate_examples(part) for split, part in parts.items()}

    def _split_stream(self, path: Path) -> dict[str, bytes]:
        data = read_bytes(path)
        units: bytes | str = data
        if dataset_entry(self.name).tokenization == "char":  # split by characters, store UTF-8
            try:
                units = data.decode("utf-8", errors="strict")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}: not valid UTF-8 at byte {e.start} ({e.reason})"
                ) from None
        if len(units) != STREAM_SIZE:
            logger.warning(
                "%s has %d %s, not %d; splitting it in the same 90:5:5 proportion.",
                path,
                len(units),
                "characters" if isinstance(units, str) else "bytes",
                STREAM_SIZE,
            )
        parts = {s: units[a:b] for s, (a, b) in stream_split_bounds(len(units)).items()}
        return {s: p.encode("utf-8") if isinstance(p, str) else p for s, p in parts.items()}

    def _generate_examples(self, stream: bytes):
        for i, start in enumerate(range(0, len(stream), CHUNK_BYTES)):
            yield i, {"bytes": stream[start : start + CHUNK_BYTES]}


class Enwik8(ByteStream):
    """enwik8: the first 10^8 bytes of an English Wikipedia XML dump (Hutter Prize), bytes."""

    name = "enwik8"


class Text8(ByteStream):
    """text8: the first 10^8 characters of Wikipedia cleaned to lower-case a-z and single
    spaces, characters."""

    name = "text8"
