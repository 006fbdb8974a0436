"""Language-modelling corpora for Transformer-XL, as TFDS ``array_record`` datasets.

::

    from xformer.data.lm_corpora import LM_CORPORA, read_corpus

    lines = read_corpus("ptb", "train", data_dir="/path/to/tfds_data")   # list[str]
    stream = read_corpus("enwik8", "valid", data_dir="/path/to/tfds_data")  # bytes

========================  ===========  ==========  ========================================
corpus                    tokens       metric      records
========================  ===========  ==========  ========================================
``ptb``, ``wikitext2``,   whitespace   perplexity  one per line (``"text"``); a token
``wikitext103``, ``lm1b``                          stream adds ``<eos>`` after every line
``ptb_char``              whitespace   bpc         as above; symbols are characters, ``_``
                                                   marks word boundaries
``enwik8``                byte         bpc         1 MiB chunks of the byte stream
                                                   (``"bytes"``); every byte is a token
``text8``                 char         bpc         as enwik8; every character is a token
========================  ===========  ==========  ========================================

Records keep the stream order (TFDS shuffling is disabled), except for ``lm1b``,
which keeps the TFDS catalog's layout (its sentences are shuffled upstream anyway).
Lines are decoded as strict UTF-8 and kept as they are (empty ones too); only the
terminator is removed.  ``ptb.char.*`` files end with a lone space after the last
newline, which therefore makes one more (blank) line, as in the usual readers.

enwik8 and text8 are split as in the Transformer-XL preparation scripts: the last
5,000,000 of the 100,000,000 bytes (text8: characters) are ``test``, the 5,000,000
before them ``valid``, the rest ``train``.  The held-out parts are defined as
1/20 of the stream each (``stream_split_bounds``), which is exactly that for the
official files and keeps the same proportions for a smaller file (tests).

Where the raw files come from (first match wins):

1. the manual dir: the ``manual_dir`` argument, else ``$XFORMER_DATA_DIR/<folder>``,
   else ``<repo>/../shared/data/<folder>`` if it exists (``sources.resolve_manual_dir``);
   it holds the extracted files or the official archive;
2. the official archive, downloaded by TFDS into ``<data_dir>/downloads``.  With no
   proxy configured, an unresolvable host fails at once with a message saying where
   the files go (TFDS would retry for minutes).

Manual dir contents (text files may also be gzip-compressed, ``<name>.gz``)::

    corpus       folder        files                            below the folder, or archive
    ptb          ptb           ptb.{train,valid,test}.txt       ., data/, simple-examples/data/
                                                                or simple-examples.tgz
    ptb_char     ptb_char      ptb.char.{train,valid,test}.txt  (same as ptb)
    wikitext2    wikitext-2    wiki.{train,valid,test}.tokens   ., wikitext-2/
                                                                or wikitext-2-v1.zip
    wikitext103  wikitext-103  wiki.{train,valid,test}.tokens   ., wikitext-103/
                                                                or wikitext-103-v1.zip
    enwik8       enwik8        enwik8                           . or enwik8.zip
    text8        text8         text8                            . or text8.zip
    lm1b         lm1b          1-billion-word-language-modeling-benchmark-r13output/
                               or 1-billion-word-language-modeling-benchmark-r13output.tar.gz

Only the corpus files of an archive are extracted, into a temporary folder that is
removed once they are read (TFDS's extractor needs TensorFlow); the lm1b archive is
extracted once into ``<data_dir>/downloads/extracted/lm1b``.  The prepared files
live in ``<data_dir>/<corpus>/<version>`` and are reused as they are; delete that
folder to rebuild from other raw files.  No step needs TensorFlow (see ``Lm1b``).
"""

from __future__ import annotations

import gzip
import logging
import shutil
import socket
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.datasets.lm1b import lm1b_dataset_builder as tfds_lm1b

from xformer.data.sources import DATA_DIR_ENV, read_all, read_text_lines, resolve_manual_dir

logger = logging.getLogger(__name__)

SPLITS: tuple[str, ...] = ("train", "valid", "test")
CHUNK_BYTES = 1 << 20  # bytes per record of enwik8 / text8
STREAM_SIZE = 100_000_000  # bytes in enwik8, characters in text8


@dataclass(frozen=True)
class CorpusInfo:
    """What a training script needs to know about a corpus.

    ``tokenization``: ``"whitespace"`` (split each line on whitespace, append
    ``<eos>``), ``"byte"`` (every byte is a token) or ``"char"`` (every character
    is a token).  ``metric``: ``"perplexity"`` or ``"bpc"`` (bits per character).
    """

    name: str
    tokenization: str
    metric: str
    splits: tuple[str, ...]


LM_CORPORA: dict[str, CorpusInfo] = {
    "ptb": CorpusInfo("ptb", "whitespace", "perplexity", SPLITS),
    "ptb_char": CorpusInfo("ptb_char", "whitespace", "bpc", SPLITS),
    "wikitext2": CorpusInfo("wikitext2", "whitespace", "perplexity", SPLITS),
    "wikitext103": CorpusInfo("wikitext103", "whitespace", "perplexity", SPLITS),
    "enwik8": CorpusInfo("enwik8", "byte", "bpc", SPLITS),
    "text8": CorpusInfo("text8", "char", "bpc", SPLITS),
    "lm1b": CorpusInfo("lm1b", "whitespace", "perplexity", ("train", "test")),
}


def corpus_info(name: str) -> CorpusInfo:
    """Returns the registry entry of ``name``; unknown names raise ``ValueError``."""
    if name not in LM_CORPORA:
        raise ValueError(f"Unknown corpus {name!r}; valid corpora: {', '.join(LM_CORPORA)}")
    return LM_CORPORA[name]


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


# --------------------------------------------------------------------------- raw files


@dataclass(frozen=True)
class RawFiles:
    """Where the upstream files of a corpus are and what they are called."""

    folder: str  # manual-dir folder name ($XFORMER_DATA_DIR/<folder>, ../shared/data/<folder>)
    url: str  # official archive
    files: tuple[str, ...]  # line corpora: the train, valid, test files; streams: the one file
    subdirs: tuple[str, ...]  # searched below the manual dir and the extracted archive
    description: str

    @property
    def archive(self) -> str:
        """File name of the official archive (may also sit in the manual dir)."""
        return self.url.rsplit("/", 1)[-1]

    def help(self) -> str:
        """Says where the files go to work offline."""
        subdirs = ", ".join(f"{d}/" for d in self.subdirs if d != ".")
        below = f" (the files may also sit in {subdirs} below it)" if subdirs else ""
        return (
            f"To work offline, put {', '.join(self.files)} (plain or .gz) or {self.archive} "
            f"in the manual dir{below}: the manual_dir argument / flag, or "
            f"${DATA_DIR_ENV}/{self.folder}, or <repo>/../shared/data/{self.folder}. "
            f"Official download: {self.url}"
        )


_SIMPLE_EXAMPLES = "http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz"
_PTB_SUBDIRS = (".", "data", "simple-examples/data")

RAW_FILES: dict[str, RawFiles] = {
    "ptb": RawFiles(
        "ptb",
        _SIMPLE_EXAMPLES,
        ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"),
        _PTB_SUBDIRS,
        "Penn Treebank, word level, as preprocessed by Mikolov (10k vocabulary).",
    ),
    "ptb_char": RawFiles(
        "ptb_char",
        _SIMPLE_EXAMPLES,
        ("ptb.char.train.txt", "ptb.char.valid.txt", "ptb.char.test.txt"),
        _PTB_SUBDIRS,
        "Penn Treebank, character level (Mikolov): space-separated characters, '_' between words.",
    ),
    "wikitext2": RawFiles(
        "wikitext-2",
        "https://wikitext.smerity.com/wikitext-2-v1.zip",
        ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"),
        (".", "wikitext-2"),
        "WikiText-2 v1, tokenized (Merity et al. 2016).",
    ),
    "wikitext103": RawFiles(
        "wikitext-103",
        "https://wikitext.smerity.com/wikitext-103-v1.zip",
        ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"),
        (".", "wikitext-103"),
        "WikiText-103 v1, tokenized (Merity et al. 2016).",
    ),
    "enwik8": RawFiles(
        "enwik8",
        "http://mattmahoney.net/dc/enwik8.zip",
        ("enwik8",),
        (".",),
        "First 100M bytes of an English Wikipedia XML dump (Hutter Prize).",
    ),
    "text8": RawFiles(
        "text8",
        "http://mattmahoney.net/dc/text8.zip",
        ("text8",),
        (".",),
        "First 100M characters of Wikipedia cleaned to lower-case a-z and single spaces.",
    ),
}


def find_raw_files(raw: RawFiles, root: str | Path | None) -> list[Path] | None:
    """Returns the paths of ``raw.files`` below ``root`` (in that order), else ``None``.

    Each file may also be a ``.gz`` copy.  The ``raw.subdirs`` of ``root`` are
    searched in order; a sub-directory holding only some of the files is an error.
    """
    if root is None:
        return None
    for sub in raw.subdirs:
        directory = Path(root) / sub
        if not directory.is_dir():
            continue
        found = [_existing(directory / name) for name in raw.files]
        if all(found):
            return found
        if any(found):
            missing = [name for name, path in zip(raw.files, found, strict=True) if not path]
            raise FileNotFoundError(
                f"Incomplete copy in {directory}: missing {', '.join(missing)}. Add them "
                f"(from {raw.url}) or remove the files to use the archive / download."
            )
    return None


def _existing(path: Path) -> Path | None:
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.is_file():
            return candidate
    return None


def _manual_dir(dl_manager: tfds.download.DownloadManager) -> Path | None:
    try:
        return Path(dl_manager.manual_dir)
    except AssertionError:  # TFDS: no manual dir, or it is missing or empty.
        return None


def _check_reachable(name: str, url: str, where: str, help_text: str) -> None:
    # Fail fast when offline: TFDS retries a failed connection for minutes.
    if urllib.request.getproxies():
        return
    parts = urllib.parse.urlsplit(url)
    try:
        socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    except OSError as e:
        raise RuntimeError(
            f"{name}: no local copy found{where}, and it cannot be downloaded from {url} "
            f"({parts.hostname} is unreachable: {e}).\n{help_text}"
        ) from e


def _download(
    name: str, url: str, dl_manager: tfds.download.DownloadManager, where: str, help_text: str
) -> Path:
    _check_reachable(name, url, where, help_text)
    try:
        return Path(dl_manager.download(url))
    except Exception as e:
        raise RuntimeError(
            f"{name}: no local copy found{where}, and downloading {url} failed: {e}\n{help_text}"
        ) from e


def extract(archive: Path, dest: Path, keep: Callable[[str], bool] = lambda name: True) -> None:
    """Extracts the regular files of a zip or tar(.gz) archive whose name ``keep`` accepts.

    (TFDS's own extractor needs TensorFlow.)  Absolute names and names with ``..``
    are skipped; a leading ``./`` is dropped.
    """

    def write(name: str, src: IO[bytes]) -> None:
        parts = PurePosixPath(name).parts
        if not keep(name) or name.startswith("/") or ".." in parts:
            return
        target = dest.joinpath(*[p for p in parts if p != "."])
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)

    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                if not info.is_dir():
                    with z.open(info) as src:
                        write(info.filename, src)
    else:
        with tarfile.open(archive) as tar:
            for member in tar:
                if member.isfile():
                    write(member.name, tar.extractfile(member))


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


# --------------------------------------------------------------------------- builders


class LmCorpusBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base of the corpus builders; a subclass sets ``name`` and ``RAW``."""

    RAW: ClassVar[RawFiles]
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    # TFDS 4.9.10 finds `code_path` via `importlib_resources` otherwise (see multi30k.py).
    code_path = epath.Path(__file__)

    def __init__(self, *, file_format: str | None = None, **kwargs: Any) -> None:
        # array_record (random access, no TensorFlow needed) unless told otherwise.
        super().__init__(file_format=file_format or "array_record", **kwargs)

    @property
    def MANUAL_DOWNLOAD_INSTRUCTIONS(self) -> str:  # noqa: N802 (TFDS attribute name)
        return "Optional. " + self.RAW.help()

    @property
    def corpus(self) -> CorpusInfo:
        """The registry entry of this corpus."""
        return LM_CORPORA[self.name]

    def _info(self) -> tfds.core.DatasetInfo:
        if self.corpus.tokenization == "whitespace":
            features = {"text": tfds.features.Text()}
        else:
            features = {"bytes": tfds.features.Tensor(shape=(), dtype=np.object_)}
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.RAW.description,
            features=tfds.features.FeaturesDict(features),
            homepage=self.RAW.url,
            disable_shuffling=True,  # record i follows record i-1 in the stream
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        root = _manual_dir(dl_manager)
        paths = find_raw_files(self.RAW, root)
        if paths is not None:
            logger.info("Reading %s from %s", self.name, paths[0].parent)
            return self._read_splits(paths)
        if root is not None and (root / self.RAW.archive).is_file():
            archive = root / self.RAW.archive
        else:
            where = f" in {root}" if root is not None else ""
            archive = _download(self.name, self.RAW.url, dl_manager, where, self.RAW.help())
        logger.info("Reading %s from %s", self.name, archive)
        # Everything is read before the temporary copy goes away.
        Path(dl_manager.download_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dl_manager.download_dir) as tmp:
            extract(
                archive, Path(tmp), keep=lambda name: PurePosixPath(name).name in self.RAW.files
            )
            paths = find_raw_files(self.RAW, tmp)
            if paths is None:
                raise FileNotFoundError(f"{archive} does not hold {', '.join(self.RAW.files)}.")
            try:
                return self._read_splits(paths)
            except ValueError as e:  # bad text: say which archive the temporary file was in
                raise ValueError(f"{archive}: {e}") from None

    def _read_splits(self, paths: list[Path]) -> dict[str, Any]:
        if self.corpus.tokenization == "whitespace":
            return {
                split: self._generate_examples(lines=read_text_lines(str(path)))
                for split, path in zip(SPLITS, paths, strict=True)
            }
        return {
            split: self._generate_examples(stream=part)
            for split, part in self._split_stream(paths[0]).items()
        }

    def _split_stream(self, path: Path) -> dict[str, bytes]:
        data = _read_bytes(path)
        units: bytes | str = data
        if self.corpus.tokenization == "char":  # split by characters, store UTF-8
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

    def _generate_examples(self, lines: list[str] | None = None, stream: bytes | None = None):
        if lines is not None:
            for i, line in enumerate(lines):
                yield i, {"text": line}
        else:
            for i, start in enumerate(range(0, len(stream), CHUNK_BYTES)):
                yield i, {"bytes": stream[start : start + CHUNK_BYTES]}


class Ptb(LmCorpusBuilder):
    """Penn Treebank, word level (Mikolov's ``simple-examples``)."""

    name = "ptb"
    RAW = RAW_FILES["ptb"]


class PtbChar(LmCorpusBuilder):
    """Penn Treebank, character level (Mikolov's ``simple-examples``)."""

    name = "ptb_char"
    RAW = RAW_FILES["ptb_char"]


class Wikitext2(LmCorpusBuilder):
    """WikiText-2 v1, tokenized."""

    name = "wikitext2"
    RAW = RAW_FILES["wikitext2"]


class Wikitext103(LmCorpusBuilder):
    """WikiText-103 v1, tokenized."""

    name = "wikitext103"
    RAW = RAW_FILES["wikitext103"]


class Enwik8(LmCorpusBuilder):
    """enwik8: the first 10^8 bytes of an English Wikipedia dump, byte level."""

    name = "enwik8"
    RAW = RAW_FILES["enwik8"]


class Text8(LmCorpusBuilder):
    """text8: 10^8 characters of cleaned Wikipedia text, character level."""

    name = "text8"
    RAW = RAW_FILES["text8"]


class Lm1b(tfds_lm1b.Builder, skip_registration=True):
    """The TFDS catalog ``lm1b`` builder, prepared without TensorFlow.

    The catalog builder lists its files with ``tf.io.gfile.glob``, which needs
    TensorFlow; this subclass lists them with ``pathlib`` and also accepts a local
    copy (the extracted ``1-billion-word-language-modeling-benchmark-r13output/``
    folder or its ``.tar.gz``) in the manual dir.  Name, version, features,
    download checksum and record layout are the catalog's, so the prepared files
    are the same as ``tfds.builder("lm1b")`` would write.
    """

    name = "lm1b"
    URL = tfds_lm1b._DOWNLOAD_URL
    # Metadata and download checksums of the catalog entry.
    code_path = epath.Path(tfds_lm1b.__file__)
    pkg_dir_path = code_path.parent

    def __init__(self, *, file_format: str | None = None, **kwargs: Any) -> None:
        super().__init__(file_format=file_format or "array_record", **kwargs)

    @property
    def MANUAL_DOWNLOAD_INSTRUCTIONS(self) -> str:  # noqa: N802 (TFDS attribute name)
        return "Optional. " + self.help()

    @classmethod
    def help(cls) -> str:
        """Says where the files go to work offline."""
        archive = cls.URL.rsplit("/", 1)[-1]
        return (
            f"To work offline, put {tfds_lm1b._TOP_LEVEL_DIR}/ (extracted) or {archive} in "
            f"the manual dir: the manual_dir argument / flag, or ${DATA_DIR_ENV}/lm1b, or "
            f"<repo>/../shared/data/lm1b. Official download: {cls.URL}"
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        root = _manual_dir(dl_manager)
        archive = root / self.URL.rsplit("/", 1)[-1] if root is not None else None
        if root is not None and (root / tfds_lm1b._TOP_LEVEL_DIR).is_dir():
            base = root
        else:
            if archive is None or not archive.is_file():
                where = f" in {root}" if root is not None else ""
                archive = _download(self.name, self.URL, dl_manager, where, self.help())
            # Kept: the catalog's example generator reads the files while writing.
            base = Path(dl_manager.download_dir) / "extracted" / "lm1b"
            if not (base / tfds_lm1b._TOP_LEVEL_DIR).is_dir():
                partial = base.with_name("lm1b.incomplete")
                for stale in (partial, base):
                    shutil.rmtree(stale, ignore_errors=True)
                extract(archive, partial)
                partial.rename(base)
        files = {
            "train": sorted(base.glob(tfds_lm1b._TRAIN_FILE_FORMAT)),
            "test": sorted(base.glob(tfds_lm1b._HELDOUT_FILE_FORMAT)),
        }
        empty = [split for split, paths in files.items() if not paths]
        if empty:
            raise FileNotFoundError(f"No lm1b {' / '.join(empty)} files found below {base}.")
        return {split: self._generate_examples(files=paths) for split, paths in files.items()}


_BUILDERS: dict[str, type[tfds.core.DatasetBuilder]] = {
    cls.name: cls for cls in (Ptb, PtbChar, Wikitext2, Wikitext103, Enwik8, Text8, Lm1b)
}


# --------------------------------------------------------------------------- reading


def prepare_corpus(
    name: str, *, data_dir: str | None = None, manual_dir: str | None = None
) -> tfds.core.DatasetBuilder:
    """Returns the builder of corpus ``name``, preparing it into ``data_dir`` if needed.

    ``data_dir`` ``None`` is the TFDS default (``$TFDS_DATA_DIR`` or
    ``~/tensorflow_datasets``).  Raw files are looked up with ``resolve_manual_dir``
    (``manual_dir`` > ``$XFORMER_DATA_DIR/<folder>`` > repo shared dir > download).
    """
    corpus_info(name)
    builder = _BUILDERS[name](data_dir=data_dir)
    # (`builder.is_prepared()` logs a warning when the directory does not exist.)
    if (builder.data_path / "dataset_info.json").exists():
        return builder
    folder = RAW_FILES[name].folder if name in RAW_FILES else name
    resolved = resolve_manual_dir(folder, manual_dir)
    config = tfds.download.DownloadConfig(manual_dir=resolved)
    try:
        builder.download_and_prepare(download_config=config)
    except RuntimeError as e:
        searched = resolved or f"(none; set the manual_dir argument / flag or ${DATA_DIR_ENV})"
        raise RuntimeError(
            f"Could not prepare {name!r} in {builder.data_dir_root}; manual dir: {searched}.\n{e}"
        ) from e
    return builder


def read_corpus(
    name: str, split: str, *, data_dir: str | None = None, manual_dir: str | None = None
) -> list[str] | bytes:
    """Reads one split of corpus ``name`` (see ``LM_CORPORA``), preparing it if needed.

    Returns the lines (``"whitespace"`` corpora) or the byte string (``"byte"``
    and ``"char"`` corpora; text8 is UTF-8).  Unknown corpora or splits raise
    ``ValueError`` listing the valid ones.  See ``prepare_corpus`` for the
    directories.
    """
    info = corpus_info(name)
    if split not in info.splits:
        raise ValueError(
            f"Unknown split {split!r} for corpus {name!r}; valid splits: {', '.join(info.splits)}"
        )
    builder = prepare_corpus(name, data_dir=data_dir, manual_dir=manual_dir)
    records = read_all(builder.as_data_source(split=split))
    if info.tokenization == "whitespace":
        return [r["text"].decode("utf-8") for r in records]
    return b"".join(r["bytes"] for r in records)
