"""Strict readers for raw text files, plain or gzip-compressed.

::

    from xformer.data.text import read_parallel_files, read_text_lines

    lines = read_text_lines("ptb.train.txt.gz")           # list[str], newlines removed
    en, de = read_parallel_files("val.en.gz", "val.de.gz")  # same length, else ValueError

Gzip is recognised by its magic bytes, not by the file name.  Text is decoded as
strict UTF-8: a bad byte raises ``ValueError`` naming the file and line.
"""

from __future__ import annotations

import gzip
from pathlib import Path

GZIP_MAGIC = b"\x1f\x8b"


def read_bytes(path: str | Path) -> bytes:
    """The content of a file, decompressed if it is gzip (detected by magic bytes)."""
    with open(path, "rb") as f:
        data = f.read()
    return gzip.decompress(data) if data[:2] == GZIP_MAGIC else data


def read_text_lines(path: str | Path) -> list[str]:
    """Reads a plain or gzip (detected by magic bytes) UTF-8 text file into lines.

    Decoding is strict; invalid UTF-8 raises ``ValueError`` naming the file and
    1-based line.  Every line is kept (empty ones too) and only the line
    terminator (``"\\n"`` or ``"\\r\\n"``) is removed; a missing final newline is
    fine.
    """
    data = read_bytes(path)
    try:
        text = data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        line_no = data.count(b"\n", 0, e.start) + 1
        line_start = data.rfind(b"\n", 0, e.start) + 1
        bad = data[e.start : e.end]
        raise ValueError(
            f"{path}: line {line_no} is not valid UTF-8 ({e.reason}: byte(s) {bad!r} "
            f"at column {e.start - line_start + 1})"
        ) from None
    if not text:
        return []
    lines = text.split("\n")
    last = lines.pop()  # "" if the file ends with a newline, else an unterminated line
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if last:
        lines.append(last)
    return lines


def read_parallel_files(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str]]:
    """Reads two line-aligned text files (see ``read_text_lines``).

    Raises ``ValueError`` naming both files and both line counts if they differ.
    """
    src = read_text_lines(src_path)
    tgt = read_text_lines(tgt_path)
    if len(src) != len(tgt):
        raise ValueError(
            f"Parallel files have different line counts: {src_path} has {len(src)} lines, "
            f"{tgt_path} has {len(tgt)} lines."
        )
    return src, tgt
