"""Random-access sources of parallel text, and strict readers for text files.

Translation datasets are read through TFDS as ``array_record`` files (no
TensorFlow needed)::

    from xformer.data.sources import read_all, translation_source

    src = translation_source("multi30k", "train", data_dir="/path/to/tfds_data")
    src[0]            # {"en": "Two young, White males are outside near many bushes.",
                      #  "de": "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche."}
    pairs = read_all(src)

The first call prepares the dataset into ``data_dir`` (about a second for
Multi30k); later calls only open the prepared files (delete
``<data_dir>/<dataset>`` to rebuild).  Where the raw files come from:

1. ``manual_dir`` argument (e.g. from a ``--data.manual_dir`` flag), else
2. ``$XFORMER_DATA_DIR/<dataset>`` (e.g. ``$XFORMER_DATA_DIR/multi30k``), else
3. ``<repo>/../shared/data/<dataset>`` if that directory exists, else
4. download from upstream (Multi30k:
   ``https://github.com/multi30k/dataset/raw/master/data/task1/raw/<split>.<lang>.gz``).

For Multi30k the directory must hold ``<split>.{en,de}.gz`` directly or in
``raw/``.  Other TFDS catalog translation datasets (e.g.
``"wmt14_translate/de-en"``) go through ``tfds.builder`` and use that builder's
own download / manual-dir rules.
"""

from __future__ import annotations

import gzip
import importlib
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_DIR_ENV = "XFORMER_DATA_DIR"
_GZIP_MAGIC = b"\x1f\x8b"
_READ_BATCH = 4096


# --------------------------------------------------------------------------- text files


def read_text_lines(path: str) -> list[str]:
    """Reads a plain or gzip (detected by magic bytes) UTF-8 text file into lines.

    Decoding is strict; invalid UTF-8 raises ``ValueError`` naming the file and
    1-based line.  Every line is kept (empty ones too) and only the line
    terminator (``"\\n"`` or ``"\\r\\n"``) is removed; a missing final newline is
    fine.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == _GZIP_MAGIC:
        data = gzip.decompress(data)
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


def read_parallel_files(src_path: str, tgt_path: str) -> tuple[list[str], list[str]]:
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


# --------------------------------------------------------------------------- TFDS sources


def _repo_shared_data_dir() -> Path:
    # <repo>/xformer/data/sources.py -> <repo>/../shared/data
    return Path(__file__).resolve().parents[3] / "shared" / "data"


def _dataset_folder(name: str) -> str:
    # "wmt14_translate/de-en:1.0.0" -> "wmt14_translate"
    return name.split("/", 1)[0].split(":", 1)[0]


def resolve_manual_dir(name: str, manual_dir: str | None) -> str | None:
    """Returns the directory holding the raw files of dataset ``name``, or ``None``.

    Order: ``manual_dir`` if given; else ``$XFORMER_DATA_DIR/<name>`` if the
    variable is set; else ``<repo>/../shared/data/<name>`` if it exists; else
    ``None`` (the dataset is downloaded).  ``name`` may carry a config
    (``"wmt14_translate/de-en"``): only the dataset part names the folder.
    """
    if manual_dir:
        return os.fspath(Path(manual_dir).expanduser())
    folder = _dataset_folder(name)
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return os.fspath(Path(env).expanduser() / folder)
    shared = _repo_shared_data_dir() / folder
    if shared.is_dir():
        return os.fspath(shared)
    return None


@dataclass
class TranslationSource:
    """Random-access view of one split whose records are ``{lang: str}`` dicts.

    Wraps a TFDS ``ArrayRecordDataSource``; only the two supervised-key fields
    are returned, decoded from UTF-8.  Supports ``len``, integer indexing (also
    negative) and ``__getitems__`` (batched reads); it pickles, so it can be
    handed to grain.
    """

    source: Any  # tfds ArrayRecordDataSource; its records have bytes values
    dataset: str
    split: str
    source_lang: str
    target_lang: str

    @property
    def languages(self) -> tuple[str, str]:
        """``(source_lang, target_lang)``, the dataset's supervised keys."""
        return (self.source_lang, self.target_lang)

    def __len__(self) -> int:
        return len(self.source)

    def _convert(self, record: dict[str, Any]) -> dict[str, str]:
        return {lang: _to_str(record[lang]) for lang in self.languages}

    def __getitem__(self, index: int) -> dict[str, str]:
        n = len(self)
        i = operator.index(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} out of range for {self.split!r} ({n} records)")
        return self._convert(self.source[i])

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, str]]:
        n = len(self)
        keys = [i + n if i < 0 else i for i in (int(j) for j in indices)]
        bad = [i for i in keys if not 0 <= i < n]
        if bad:
            raise IndexError(f"indices {bad[:5]} out of range for {self.split!r} ({n} records)")
        if not keys:
            return []
        return [self._convert(r) for r in self.source.__getitems__(keys)]

    def __iter__(self):
        for start in range(0, len(self), _READ_BATCH):
            yield from self.__getitems__(range(start, min(start + _READ_BATCH, len(self))))

    def __repr__(self) -> str:
        return (
            f"TranslationSource(dataset={self.dataset!r}, split={self.split!r}, "
            f"{self.source_lang}->{self.target_lang}, len={len(self)})"
        )


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _to_str(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, str):
        return value
    if hasattr(value, "item"):  # numpy scalar / 0-d array
        return _to_str(value.item())
    raise TypeError(f"expected a text value, got {type(value).__name__}")


def _split_names(split: str) -> list[str]:
    # "train[:10%]+val" -> ["train", "val"]
    return [part.split("[", 1)[0].strip() for part in split.split("+")]


def _check_split(dataset: str, split: str, valid: Sequence[str]) -> None:
    unknown = [s for s in _split_names(split) if s not in valid]
    if unknown:
        raise ValueError(
            f"Unknown split {split!r} for dataset {dataset!r}; valid splits: {', '.join(valid)}"
        )


def _make_builder(dataset: str, data_dir: str | None):
    import tensorflow_datasets as tfds

    if _dataset_folder(dataset) == "multi30k":
        from xformer.data.multi30k import Multi30k

        if dataset != "multi30k":
            raise ValueError(f"Multi30k has no configs or versions to select: {dataset!r}")
        return Multi30k(data_dir=data_dir)
    # TFDS registers its legacy builders (wmt*, ted_*, ...) by importing their
    # packages in one loop that stops at the first ImportError (e.g. a missing
    # h5py), so make sure the translation builders are registered.
    try:
        importlib.import_module("tensorflow_datasets.translate")
    except ImportError:
        pass
    return tfds.builder(dataset, data_dir=data_dir, file_format="array_record")


def translation_source(
    dataset: str,
    split: str,
    *,
    data_dir: str | None = None,
    manual_dir: str | None = None,
) -> TranslationSource:
    """Returns a random-access source for ``split`` of translation ``dataset``.

    ``dataset`` is ``"multi30k"`` (en-de) or a TFDS catalog translation dataset
    such as ``"wmt14_translate/de-en"``.  Records are ``{src_lang: str,
    tgt_lang: str}`` with the languages taken from the dataset's supervised keys
    (``TranslationSource.languages``).  The dataset is prepared into
    ``data_dir`` (``None``: TFDS default, ``$TFDS_DATA_DIR`` or
    ``~/tensorflow_datasets``) on first use; raw files are looked up with
    ``resolve_manual_dir`` (``manual_dir`` > ``$XFORMER_DATA_DIR`` > repo shared
    dir > download).  Unknown splits raise ``ValueError`` listing the valid ones.
    """
    import tensorflow_datasets as tfds

    builder = _make_builder(dataset, data_dir)
    known_splits = _known_splits(builder)
    if known_splits:
        _check_split(dataset, split, known_splits)

    # (`builder.is_prepared()` logs a warning when the directory does not exist.)
    if not (builder.data_path / "dataset_info.json").exists():
        resolved = resolve_manual_dir(dataset, manual_dir)
        config = tfds.download.DownloadConfig(manual_dir=resolved)
        try:
            builder.download_and_prepare(download_config=config)
        except (ValueError, FileNotFoundError):
            raise  # Bad or incomplete local files: the message names them.
        except Exception as e:
            searched = resolved or f"(none; set the manual_dir argument / flag or ${DATA_DIR_ENV})"
            hint = (
                ""
                if dataset == "multi30k"  # The builder's message says where files go.
                else f"\nPut the raw files in the manual dir (${DATA_DIR_ENV}/"
                f"{_dataset_folder(dataset)} or the manual_dir argument / flag), or let TFDS "
                "download them from the sources of its catalog entry."
            )
            if _missing_importlib_resources(e):
                hint += (
                    "\nTFDS 4.9.10 needs `importlib_resources` to prepare catalog datasets but "
                    "does not declare it (tensorflow/datasets#11212): "
                    "pip install importlib_resources"
                )
            raise RuntimeError(
                f"Could not prepare {dataset!r} in {builder.data_dir_root}; "
                f"manual dir: {searched}.\n{e}{hint}"
            ) from e
        if not known_splits:
            known_splits = _known_splits(builder)
            _check_split(dataset, split, known_splits)

    keys = builder.info.supervised_keys
    if not (isinstance(keys, tuple | list) and len(keys) == 2 and all(map(_is_str, keys))):
        raise ValueError(
            f"{dataset!r} does not have (source, target) text supervised keys: {keys!r}"
        )
    source = builder.as_data_source(split=split)
    return TranslationSource(
        source=source, dataset=dataset, split=split, source_lang=keys[0], target_lang=keys[1]
    )


def _missing_importlib_resources(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, ModuleNotFoundError) and error.name == "importlib_resources":
            return True
        error = error.__cause__ or error.__context__
    return False


def _known_splits(builder: Any) -> list[str]:
    from xformer.data import multi30k

    if isinstance(builder, multi30k.Multi30k):
        return list(multi30k.SPLITS)
    return list(builder.info.splits.keys())


def read_all(source: Any, batch_size: int = _READ_BATCH) -> list[dict[str, Any]]:
    """Reads every record of a random-access source, in order.

    Uses ``source.__getitems__`` in batches of ``batch_size`` when available
    (one array_record read per batch, several times faster than single-record
    reads); falls back to ``source[i]``.
    """
    n = len(source)
    if not hasattr(source, "__getitems__"):
        return [source[i] for i in range(n)]
    out: list[dict[str, Any]] = []
    for start in range(0, n, batch_size):
        out.extend(source.__getitems__(list(range(start, min(start + batch_size, n)))))
    return out
