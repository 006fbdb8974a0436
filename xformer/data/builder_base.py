"""What every TFDS builder of this package shares, and preparing a dataset once.

``BaseBuilder`` is the base of the builders in ``xformer.data.builders``: a subclass
sets ``name`` (its registry key), ``_features()`` and ``_split_generators``, and
reads the raw files with ``raw_paths``::

    class Ptb(BaseBuilder):
        name = "ptb"

        def _split_generators(self, dl_manager):
            with self.raw_paths(dl_manager) as paths:   # {file name: path}, checked
                ...

``prepare(builder, ...)`` writes a builder's ``array_record`` files unless
``<data_path>/dataset_info.json`` already exists (delete ``<data_dir>/<dataset>``
to rebuild from other raw files).  Nothing here needs TensorFlow.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import tensorflow_datasets as tfds
from etils import epath

from xformer import locks
from xformer.data import checksums, raw_files, registry
from xformer.data.errors import DataDownloadError, DataFileNotFoundError, DataValueError
from xformer.data.raw_files import DATA_DIR_ENV, RawFiles

logger = logging.getLogger(__name__)


class LocalFirst:
    """Mixin for TFDS builders: ``array_record`` by default, a local copy before a download.

    ``raw`` is the dataset's ``RawFiles`` entry of the registry (looked up by the
    builder's ``name``); it also supplies TFDS's manual-download instructions.
    """

    name: str

    def __init__(self, *, file_format: str | None = None, **kwargs: Any) -> None:
        # array_record (random access, no TensorFlow needed) unless told otherwise.
        super().__init__(file_format=file_format or "array_record", **kwargs)

    @property
    def raw(self) -> RawFiles:
        """Where the upstream files of this dataset are."""
        return registry.dataset_entry(self.name).raw

    @property
    def MANUAL_DOWNLOAD_INSTRUCTIONS(self) -> str:  # noqa: N802 (TFDS attribute name)
        return "Optional. " + self.raw.help()


class _LocalDatasetInfo(tfds.core.DatasetInfo):
    """The DatasetInfo of a dataset that TFDS's bucket of prepared datasets does not hold."""

    def initialize_from_bucket(self) -> None:
        # TFDS's version asks gs://tfds-data for this name's metadata whenever a builder is made
        # for a data_dir not yet prepared, and leaves an empty /tmp/tmp*tfds folder each time.
        pass


class BaseBuilder(LocalFirst, tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base of the builders of the registry's datasets.

    Records keep the order of the raw files (TFDS shuffling is disabled); the
    class docstring is the dataset description.  (This base is not registered
    with TFDS; its concrete subclasses are, under their registry names.)
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    # TFDS 4.9.10 computes `code_path` for builders that live in a package via
    # `importlib_resources`, which it does not install on Python >= 3.9.  The
    # path is only used to look for a TFDS checksums file next to the module.
    code_path = epath.Path(__file__)
    HOMEPAGE: str | None = None  # default: the official download
    CITATION = ""
    SUPERVISED_KEYS: tuple[str, str] | None = None

    def _features(self) -> dict[str, Any]:
        raise NotImplementedError

    def _info(self) -> tfds.core.DatasetInfo:
        return _LocalDatasetInfo(
            builder=self,
            description=inspect.cleandoc(type(self).__doc__ or ""),
            features=tfds.features.FeaturesDict(self._features()),
            supervised_keys=self.SUPERVISED_KEYS,
            homepage=self.HOMEPAGE or self.raw.url.format(file=""),
            citation=self.CITATION,
            disable_shuffling=True,  # record i follows record i-1 in the files
        )

    @contextlib.contextmanager
    def raw_paths(self, dl_manager: tfds.download.DownloadManager) -> Iterator[dict[str, Path]]:
        """Yields ``{file name: path}`` of ``raw.files``, checked against ``checksums``.

        In order: a complete local copy in the manual dir; the official archive in
        the manual dir; the official download.  Local files that differ from
        upstream log a warning, downloaded ones raise ``ValueError``.  Archive
        members are extracted into a temporary folder that is removed after the
        ``with`` block, so read everything inside it.
        """
        raw = self.raw
        root = raw_files.manual_dir_of(dl_manager)
        paths = raw_files.find_local_files(raw, root)
        if paths is not None:
            logger.info("Reading %s from %s", self.name, next(iter(paths.values())).parent)
            checksums.verify(self.name, raw, paths, downloaded=False)
            yield paths
            return
        if raw.archive is not None and root is not None and (root / raw.archive).is_file():
            archive, downloaded = root / raw.archive, False
        else:
            paths = raw_files.download(self.name, raw, dl_manager, root)
            if raw.archive is None:  # one download per file
                checksums.verify(self.name, raw, paths, downloaded=True)
                yield paths
                return
            archive, downloaded = paths[raw.archive], True
        logger.info("Reading %s from %s", self.name, archive)
        Path(dl_manager.download_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dl_manager.download_dir) as tmp:
            wanted = set(raw.files)
            raw_files.extract(archive, Path(tmp), keep=lambda n: PurePosixPath(n).name in wanted)
            paths = raw_files.find_local_files(raw, tmp)
            if paths is None:
                raise DataFileNotFoundError(f"{archive} does not hold {', '.join(raw.files)}.")
            checksums.verify(self.name, raw, paths, downloaded=downloaded, origin=archive)
            try:
                yield paths
            except ValueError as e:  # bad text: say which archive the temporary file was in
                raise DataValueError(f"{archive}: {e}") from None


# --------------------------------------------------------------------------- prepare once


def prepare(
    builder: tfds.core.DatasetBuilder,
    name: str,
    folder: str,
    manual_dir: str | None,
    *,
    hint: str = "",
) -> tfds.core.DatasetBuilder:
    """Prepares ``builder`` into its ``data_dir`` unless that was done before; returns it.

    ``name`` is the dataset as the user named it (for messages); the raw files are
    looked up with ``raw_files.resolve_manual_dir(folder, manual_dir)``.  Bad or
    incomplete local files raise ``ValueError`` / ``FileNotFoundError`` naming
    them; any other failure becomes a ``RuntimeError`` that names the manual dir,
    followed by ``hint``: a ``DataDownloadError`` when the download failed.
    """
    # (`builder.is_prepared()` logs a warning when the directory does not exist.)
    if (builder.data_path / "dataset_info.json").exists():
        return builder
    path = os.fspath(builder.data_path)
    if "://" in path:  # an object store has no file locks
        return _download_and_prepare(builder, name, folder, manual_dir, hint)

    def on_wait(holder: dict) -> None:
        logger.info("waiting for %s, which is preparing %s", locks.describe(holder), path)

    # Jobs that share a data_dir and start together prepare it once: the others wait, then load.
    with locks.waiting(path + ".lock", on_wait):
        if (builder.data_path / "dataset_info.json").exists():  # prepared while we waited
            builder.info.read_from_directory(builder.data_path)
            return builder
        return _download_and_prepare(builder, name, folder, manual_dir, hint)


def _download_and_prepare(
    builder: tfds.core.DatasetBuilder, name: str, folder: str, manual_dir: str | None, hint: str
) -> tfds.core.DatasetBuilder:
    resolved = raw_files.resolve_manual_dir(folder, manual_dir)
    config = tfds.download.DownloadConfig(manual_dir=resolved)
    try:
        builder.download_and_prepare(download_config=config)
    except (ValueError, FileNotFoundError):
        raise  # Bad or incomplete local files: the message names them.
    except Exception as e:
        searched = resolved or f"(none; set the manual_dir argument / flag or ${DATA_DIR_ENV})"
        if _missing_importlib_resources(e):
            hint += (
                "\nTFDS 4.9.10 needs `importlib_resources` to prepare catalog datasets but "
                "does not declare it (tensorflow/datasets#11212): pip install importlib_resources"
            )
        error = DataDownloadError if isinstance(e, DataDownloadError) else RuntimeError
        raise error(
            f"Could not prepare {name!r} in {builder.data_dir_root}; manual dir: {searched}.\n"
            f"{e}{hint}"
        ) from e
    return builder


def _missing_importlib_resources(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, ModuleNotFoundError) and error.name == "importlib_resources":
            return True
        error = error.__cause__ or error.__context__
    return False
