"""Strict readers for raw text files, plain or gzip-compressed.

::

    from xformer.data.text import read_parallel_files, read_text_lines

    lines = read_text_lines("ptb.train.txt.gz")           # list[str], newlines removed
    en, de = read_parallel_files("val.en.gz", "val.de.gz")  # same length, else ValueError

Gzip is recognised by its magic bytes, not by the file name.  Text is decoded as
strict UTF-8: a bad byte raises ``ValueError`` naming the file, line and column.

Text a user gives a model (``eval.py --input``) goes through ``read_input_lines``, whose
contract is that every line of the file is one model input and gets one output line:

* A line is what ends in ``"\n"`` (a ``"\r"`` just before it belongs to the line ending);
  a last line without ``"\n"`` counts, an empty file has no lines. Nothing else breaks a
  line: a lone ``"\r"``, form feed, vertical tab, NEL, U+2028/U+2029 and the other characters
  ``str.splitlines`` splits at are read as spaces (lone CRs are counted and logged: an old
  Mac file with CR line endings reads as one line).
* A byte-order mark at the start of the file is dropped.
* ``normalize_line``: control characters (NUL, tab, the C0 and C1 ranges, DEL) and line or
  paragraph separators become spaces; format characters (zero-width spaces and joiners,
  bidirectional marks, embeddings and isolates, soft hyphens, BOMs) are removed; runs of
  whitespace become one space and the ends are stripped. Other characters (emoji and other
  astral-plane characters, private-use and unassigned code points) are kept; the tokenizer
  maps the ones it does not know to its unknown id. A line that is empty after this (it held
  only whitespace, control or format characters) is an empty input.
* ``one_line`` is the output side: a model's output never contains a line break, so writing
  one output per line keeps the count, whatever reads the file back (``str.splitlines``
  included).
"""

from __future__ import annotations

import gzip
import re
import unicodedata
import zlib
from pathlib import Path

from absl import logging

from xformer.data.errors import DataValueError

GZIP_MAGIC = b"\x1f\x8b"


def read_bytes(path: str | Path) -> bytes:
    """The content of a file, decompressed if it is gzip (detected by magic bytes); a truncated
    or corrupt gzip file raises ``ValueError`` naming it."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] != GZIP_MAGIC:
        return data
    try:
        return gzip.decompress(data)
    except (EOFError, OSError, zlib.error) as e:  # truncated or corrupt
        raise DataValueError(f"{path}: not a complete gzip file ({e})") from None


def read_text_lines(path: str | Path) -> list[str]:
    """Reads a plain or gzip (detected by magic bytes) UTF-8 text file into lines.

    Decoding is strict; invalid UTF-8 raises ``ValueError`` naming the file and
    1-based line.  Every line is kept (empty ones too) and only the line
    terminator (``"\\n"`` or ``"\\r\\n"``) is removed; a missing final newline is
    fine.
    """
    return split_lines(decode_utf8(read_bytes(path), path))


def split_lines(text: str) -> list[str]:
    """The lines of `text`: split at ``"\\n"``, a ``"\\r"`` before it removed; a last line
    without ``"\\n"`` counts, an empty text has none."""
    if not text:
        return []
    lines = text.split("\n")
    last = lines.pop()  # "" if the file ends with a newline, else an unterminated line
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if last:
        lines.append(last)
    return lines


def decode_utf8(data: bytes, path: str | Path) -> str:
    """Strict UTF-8 decoding; a bad byte raises ``ValueError`` naming the file, the 1-based
    line and the 1-based byte column within that line."""
    try:
        return data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        line_no = data.count(b"\n", 0, e.start) + 1
        line_start = data.rfind(b"\n", 0, e.start) + 1
        bad = data[e.start : e.end]
        raise DataValueError(
            f"{path}: line {line_no} is not valid UTF-8 ({e.reason}: byte(s) {bad!r} "
            f"at column {e.start - line_start + 1})"
        ) from None


BOM = "\ufeff"
# Every character str.splitlines breaks a line at.
LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")
_AS_SPACE = ("Cc", "Zl", "Zp")  # control characters, line and paragraph separators
_REMOVED = ("Cf",)  # format characters: zero-width, bidirectional marks, soft hyphen, BOM


def _clean_char(char: str) -> str:
    category = unicodedata.category(char)
    if category in _AS_SPACE:
        return " "
    return "" if category in _REMOVED else char


def normalize_line(line: str) -> str:
    """One input line as a model reads it (the contract in the module docstring): control
    characters and separators as spaces, format characters removed, whitespace collapsed."""
    if not line.isprintable():  # fast path: printable text needs no per-character pass
        line = "".join(map(_clean_char, line))
    return " ".join(line.split())


def one_line(text: str) -> str:
    """`text` with every line break (``LINE_BREAKS``) replaced by a space."""
    return LINE_BREAKS.sub(" ", text)


def read_input_lines(path: str | Path, normalize: bool = True) -> list[str]:
    """The lines of a user's text file (plain or gzip, strict UTF-8), normalised by
    ``normalize_line``; see the module docstring for the line contract. ``normalize=False``
    keeps each line's text as written (references, scored as sacreBLEU reads them; prompts),
    with the same lines and no BOM. Raises ``ValueError`` naming the file, line and column of
    invalid UTF-8."""
    lines = split_lines(decode_utf8(read_bytes(path), path).removeprefix(BOM))
    if not normalize:
        return lines
    lone_cr = sum(line.count("\r") for line in lines)
    if lone_cr:
        logging.warning(
            "%s: %d carriage return(s) (CR) not followed by a line feed were read as spaces, not "
            "line breaks (a line ends in LF or CRLF)",
            path,
            lone_cr,
        )
    return [normalize_line(line) for line in lines]


def read_parallel_files(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str]]:
    """Reads two line-aligned text files (see ``read_text_lines``).

    Raises ``ValueError`` naming both files and both line counts if they differ.
    """
    src = read_text_lines(src_path)
    tgt = read_text_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataValueError(
            f"Parallel files have different line counts: {src_path} has {len(src)} lines, "
            f"{tgt_path} has {len(tgt)} lines."
        )
    return src, tgt
