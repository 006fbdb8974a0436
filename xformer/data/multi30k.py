"""TFDS builder for Multi30k task 1 (English-German image-caption translation).

Each example is one aligned caption pair ``{"en": str, "de": str}``; supervised
keys are ``("en", "de")``.  Splits and sizes::

    train 29000, val 1014, test_2016_flickr 1000, test_2017_flickr 1000,
    test_2017_mscoco 461

Records are stored in file order (TFDS shuffling is disabled), so record ``i`` of
a split is line ``i`` of ``<split>.en.gz`` / ``<split>.de.gz``.  Every line is
kept, including empty ones; only the line terminator (``\\n`` or ``\\r\\n``) is
removed.  The files are decoded as strict UTF-8 and a split whose two language
files have different line counts is rejected.

Preparing the data (the builder writes ``array_record`` files by default, which
is what ``as_data_source`` needs; TensorFlow is not required):

* Local copy (works offline): put the upstream files ``<split>.{en,de}.gz``
  (https://github.com/multi30k/dataset, ``data/task1/raw/``) into a directory
  and pass it as the TFDS manual dir.  The files may sit directly in that
  directory, in ``raw/`` or in ``data/task1/raw/`` below it.  Through
  ``xformer.data.sources.translation_source`` the manual dir is the ``manual_dir``
  argument, else ``$XFORMER_DATA_DIR/multi30k``, else ``<repo>/../shared/data/multi30k``.
* Automatic download: with no local copy, the 10 files are downloaded from
  ``https://github.com/multi30k/dataset/raw/master/data/task1/raw/<split>.<lang>.gz``
  and checked against known SHA-256 digests.

The prepared files live in ``<data_dir>/multi30k/1.0.0`` and are reused as they
are; delete that folder to rebuild from other raw files.

Direct use::

    import tensorflow_datasets as tfds
    from xformer.data.multi30k import Multi30k

    builder = Multi30k(data_dir="/path/to/tfds_data")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir="/path/to/multi30k")
    )
    source = builder.as_data_source("test_2016_flickr")  # values are bytes
"""

from __future__ import annotations

import hashlib
import logging
import socket
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds
from etils import epath

from xformer.data.sources import read_parallel_files

logger = logging.getLogger(__name__)

LANGUAGES: tuple[str, str] = ("en", "de")
SPLITS: tuple[str, ...] = (
    "train",
    "val",
    "test_2016_flickr",
    "test_2017_flickr",
    "test_2017_mscoco",
)
SPLIT_SIZES: dict[str, int] = {
    "train": 29000,
    "val": 1014,
    "test_2016_flickr": 1000,
    "test_2017_flickr": 1000,
    "test_2017_mscoco": 461,
}
URL_TEMPLATE = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{file}"
# Sub-directories of the manual dir that are searched for the files, in order.
MANUAL_SUBDIRS: tuple[str, ...] = (".", "raw", "data/task1/raw")

# SHA-256 of the upstream .gz files (multi30k/dataset, data/task1/raw).
_SHA256: dict[str, str] = {
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2017_flickr.en.gz": "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074",
    "test_2017_flickr.de.gz": "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee",
    "test_2017_mscoco.en.gz": "aab300bfb4427697987e02cd0aacd44bfe8aa50456231b6474c08038bbed2b58",
    "test_2017_mscoco.de.gz": "799e4854c25d601cb6cb6be29eabe5667734c61ace2f495e03e429031a0bc338",
}

_CITATION = """\
@inproceedings{elliott-etal-2016-multi30k,
  title = {Multi30{K}: Multilingual {E}nglish-{G}erman Image Descriptions},
  author = {Elliott, Desmond and Frank, Stella and Sima'an, Khalil and Specia, Lucia},
  booktitle = {Proceedings of the 5th Workshop on Vision and Language},
  year = {2016},
  pages = {70--74},
}
"""


def file_names() -> list[str]:
    """Returns the names of the 10 upstream files, e.g. ``"train.en.gz"``."""
    return [f"{split}.{lang}.gz" for split in SPLITS for lang in LANGUAGES]


def find_local_files(manual_dir: str | Path | None) -> dict[str, Path] | None:
    """Returns ``{file name: path}`` for a complete local copy, else ``None``.

    ``manual_dir`` and its ``raw/`` and ``data/task1/raw/`` sub-directories are
    searched.  A directory holding only some of the files is an error (a partial
    copy is never silently mixed with downloaded files).
    """
    if manual_dir is None:
        return None
    root = Path(manual_dir).expanduser()
    names = file_names()
    for sub in MANUAL_SUBDIRS:
        directory = root / sub
        if not directory.is_dir():
            continue
        present = [name for name in names if (directory / name).is_file()]
        if len(present) == len(names):
            return {name: directory / name for name in names}
        if present:
            missing = sorted(set(names) - set(present))
            raise FileNotFoundError(
                f"Incomplete Multi30k copy in {directory}: missing {', '.join(missing)}. "
                f"Add the missing files (from {URL_TEMPLATE.format(file='<split>.<lang>.gz')}) "
                "or remove the directory to download everything."
            )
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Multi30k(tfds.core.GeneratorBasedBuilder):
    """Multi30k task 1, English-German (WMT16 multimodal translation)."""

    name = "multi30k"
    # TFDS 4.9.10 computes `code_path` for builders that live in a package via
    # `importlib_resources`, which it does not install on Python >= 3.9.  The
    # path is only used to look for a checksums file next to this module.
    code_path = epath.Path(__file__)
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: raw (untokenized) en-de task 1 data."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = f"""\
    Optional. Place the 10 files <split>.<lang>.gz for splits {", ".join(SPLITS)}
    and languages en, de (from {URL_TEMPLATE.format(file="")}) in the manual dir
    (directly, or in raw/ or data/task1/raw/ below it). Without them the files
    are downloaded.
    """

    def __init__(self, *, file_format: str | None = None, **kwargs: Any) -> None:
        # array_record (random access, no TensorFlow needed) unless told otherwise.
        super().__init__(file_format=file_format or "array_record", **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=(
                "Multi30k task 1: English image captions from Flickr30k with "
                "professional German translations, one caption pair per example."
            ),
            features=tfds.features.FeaturesDict({lang: tfds.features.Text() for lang in LANGUAGES}),
            supervised_keys=LANGUAGES,
            homepage="https://github.com/multi30k/dataset",
            citation=_CITATION,
            # Keep file order: record i of a split == line i of its files.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        try:
            manual_dir = dl_manager.manual_dir
        except AssertionError:  # TFDS: manual dir missing or empty.
            manual_dir = None
        paths = find_local_files(manual_dir)
        if paths is None:
            paths = self._download(dl_manager, manual_dir)
        else:
            logger.info("Reading Multi30k from local copy %s", paths["train.en.gz"].parent)
            modified = [str(p) for name, p in paths.items() if _sha256(p) != _SHA256[name]]
            if modified:
                logger.warning(
                    "Using local Multi30k files that differ from upstream (SHA-256): %s",
                    ", ".join(modified),
                )
        # Read everything up front (about 4 MB of text) so that bad files fail
        # with a clean error before TFDS starts writing.
        pairs = {
            split: read_parallel_files(
                str(paths[f"{split}.{LANGUAGES[0]}.gz"]), str(paths[f"{split}.{LANGUAGES[1]}.gz"])
            )
            for split in SPLITS
        }
        return {split: self._generate_examples(*pair) for split, pair in pairs.items()}

    def _download(
        self, dl_manager: tfds.download.DownloadManager, manual_dir: Path | None
    ) -> dict[str, Path]:
        urls = {name: URL_TEMPLATE.format(file=name) for name in file_names()}
        where = f" in {manual_dir}" if manual_dir is not None else ""
        help_text = (
            f"To work offline, put the files {', '.join(file_names())} in a directory "
            "and pass it as the manual dir (manual_dir argument / data flag), or set "
            "XFORMER_DATA_DIR so that $XFORMER_DATA_DIR/multi30k holds them."
        )
        upstream = URL_TEMPLATE.format(file="<split>.<lang>.gz")
        # Fail fast when offline: TFDS retries a failed connection for ~3.5 minutes.
        host = urllib.parse.urlsplit(URL_TEMPLATE).hostname
        if not urllib.request.getproxies():
            try:
                socket.getaddrinfo(host, 443)
            except OSError as e:
                raise RuntimeError(
                    f"Multi30k: no local copy found{where}, and it cannot be downloaded from "
                    f"{upstream} ({host} is unreachable: {e}).\n{help_text}"
                ) from e
        try:
            downloaded = dl_manager.download(urls)
        except Exception as e:
            raise RuntimeError(
                f"Multi30k: no local copy found{where}, and downloading from {upstream} "
                f"failed: {e}\n{help_text}"
            ) from e
        paths = {name: Path(path) for name, path in downloaded.items()}
        for name, path in paths.items():
            got = _sha256(path)
            if got != _SHA256[name]:
                raise ValueError(
                    f"Downloaded {urls[name]} ({path}) has SHA-256 {got}, expected "
                    f"{_SHA256[name]}. Delete it and retry, or use a local copy."
                )
        return paths

    def _generate_examples(self, en_lines: list[str], de_lines: list[str]):
        for i, (en, de) in enumerate(zip(en_lines, de_lines, strict=True)):
            yield i, {"en": en, "de": de}
