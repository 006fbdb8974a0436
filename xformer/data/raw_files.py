"""Where the raw files of a dataset come from: a local copy, else the official download.

Every dataset of the registry (``xformer.data.registry``) describes its upstream
files with a ``RawFiles`` record; the builders use the helpers below to find them::

    from xformer.data.raw_files import find_local_files, resolve_manual_dir

    root = resolve_manual_dir("ptb", None)        # e.g. "<repo>/../shared/data/ptb"
    paths = find_local_files(entry.raw, root)     # {"ptb.train.txt": Path(...), ...} or None

The manual dir (``resolve_manual_dir``) is the ``manual_dir`` argument, else
``$XFORMER_DATA_DIR/<folder>``, else ``<repo>/../shared/data/<folder>`` if it
exists.  Paths are returned as they are spelled, never with symlinks resolved
(only the location of this checkout is), so a symlinked ``shared`` or data folder
reads the same as a real one.  Inside the manual dir, ``RawFiles.subdirs`` are
searched in order; each file may also be a gzip copy ``<name>.gz``; a folder with
only some of the files is an error.

Without a local copy, ``download`` fetches the official files through the TFDS
download manager.  With no proxy configured it first checks that the host
resolves, so an offline machine fails at once (TFDS would retry for minutes) with
a message saying where to put the files (``RawFiles.help``).  ``extract`` unpacks
zip and tar archives without TensorFlow.
"""

from __future__ import annotations

import os
import shutil
import socket
import tarfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from xformer.data.errors import DataDownloadError, DataFileNotFoundError

DATA_DIR_ENV = "XFORMER_DATA_DIR"
# <repo>/xformer/data/raw_files.py -> <repo>/../shared/data (only the checkout is resolved).
SHARED_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"


# --------------------------------------------------------------------------- manual dir


def dataset_folder(name: str) -> str:
    """The folder of a dataset name: ``"wmt14_translate/de-en:1.0.0"`` -> ``"wmt14_translate"``."""
    return name.split("/", 1)[0].split(":", 1)[0]


def resolve_manual_dir(folder: str, manual_dir: str | None) -> str | None:
    """Returns the directory holding the raw files of ``folder``, or ``None``.

    Order: ``manual_dir`` if given; else ``$XFORMER_DATA_DIR/<folder>`` if the
    variable is set; else ``<repo>/../shared/data/<folder>`` if it exists; else
    ``None`` (the dataset is downloaded).  A dataset name with a config
    (``"wmt14_translate/de-en"``) names its folder by the dataset part.  Symlinks
    are not resolved.
    """
    if manual_dir:
        return os.fspath(Path(manual_dir).expanduser())
    folder = dataset_folder(folder)
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return os.fspath(Path(env).expanduser() / folder)
    shared = SHARED_DATA_DIR / folder
    if shared.is_dir():
        return os.fspath(shared)
    return None


def manual_dir_of(dl_manager: Any) -> Path | None:
    """The TFDS download manager's manual dir, or ``None`` if it is missing or empty."""
    try:
        return Path(dl_manager.manual_dir)
    except AssertionError:  # TFDS: no manual dir, or it is missing or empty.
        return None


# --------------------------------------------------------------------------- raw files


@dataclass(frozen=True)
class RawFiles:
    """The upstream files of a dataset and where they are published.

    ``url`` is either the official archive that holds ``files`` or, when it
    contains ``{file}``, the template of one URL per file.
    """

    folder: str  # manual-dir folder ($XFORMER_DATA_DIR/<folder>, ../shared/data/<folder>)
    url: str
    files: tuple[str, ...]  # in the order the builder uses them (line corpora: train, valid, test)
    subdirs: tuple[str, ...] = (".",)  # searched below the manual dir and an extracted archive

    @property
    def archive(self) -> str | None:
        """File name of the official archive (it may also sit in the manual dir), if any."""
        return None if "{file}" in self.url else self.url.rsplit("/", 1)[-1]

    def download_url(self, name: str) -> str:
        """The URL that ``name`` (a file, or the archive) is downloaded from."""
        return self.url.format(file=name) if self.archive is None else self.url

    def help(self) -> str:
        """Says where the files go to work offline."""
        files = ", ".join(self.files)
        if not any(f.endswith((".gz", "/")) for f in self.files):
            files += " (plain or .gz)"
        if self.archive is not None:
            files += f" or {self.archive}"
        subdirs = ", ".join(f"{d}/" for d in self.subdirs if d != ".")
        below = f" (the files may also sit in {subdirs} below it)" if subdirs else ""
        return (
            f"To work offline, put {files} in the manual dir{below}: the manual_dir argument / "
            f"flag, or ${DATA_DIR_ENV}/{self.folder}, or <repo>/../shared/data/{self.folder}. "
            f"Official download: {self.url.format(file='<file>')}"
        )


def _existing(path: Path) -> Path | None:
    candidates = [path] if path.name.endswith(".gz") else [path, path.with_name(path.name + ".gz")]
    return next((c for c in candidates if c.is_file()), None)


def find_local_files(raw: RawFiles, root: str | Path | None) -> dict[str, Path] | None:
    """Returns ``{file name: path}`` of a complete copy of ``raw.files`` below ``root``.

    ``None`` if there is none.  Each file may also be a ``.gz`` copy.  The
    ``raw.subdirs`` of ``root`` are searched in order; a sub-directory holding only
    some of the files is an error (a partial copy is never mixed with downloads).
    """
    if root is None:
        return None
    for sub in raw.subdirs:
        directory = Path(root) / sub
        if not directory.is_dir():
            continue
        found = {name: _existing(directory / name) for name in raw.files}
        if all(found.values()):
            return found
        if any(found.values()):
            missing = [name for name, path in found.items() if path is None]
            raise DataFileNotFoundError(
                f"Incomplete copy in {directory}: missing {', '.join(missing)}. Add them "
                f"(from {raw.url.format(file='<file>')}) or remove the files to download "
                "everything."
            )
    return None


# --------------------------------------------------------------------------- download


def _check_reachable(url: str, failure: str, help_text: str) -> None:
    # Fail fast when offline: TFDS retries a failed connection for minutes.
    if urllib.request.getproxies():
        return
    parts = urllib.parse.urlsplit(url)
    try:
        socket.getaddrinfo(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    except OSError as e:
        raise DataDownloadError(
            f"{failure} it cannot be downloaded from {url} ({parts.hostname} is unreachable: "
            f"{e}).\n{help_text}"
        ) from e


def download(dataset: str, raw: RawFiles, dl_manager: Any, root: Path | None) -> dict[str, Path]:
    """Downloads the official files with the TFDS download manager ``dl_manager``.

    Returns ``{archive name: path}`` or, for per-file URLs, ``{file name: path}``.
    Failures (also an unreachable host, checked first) raise ``DataDownloadError`` that
    says where to put the files to work offline; ``root`` is the manual dir that
    was searched.
    """
    where = f" in {root}" if root is not None else ""
    failure = f"{dataset}: no local copy found{where}, and"
    shown = raw.url.format(file="<file>")
    _check_reachable(shown, failure, raw.help())
    try:
        if raw.archive is not None:
            return {raw.archive: Path(dl_manager.download(raw.url))}
        got = dl_manager.download({name: raw.download_url(name) for name in raw.files})
    except Exception as e:
        raise DataDownloadError(f"{failure} downloading {shown} failed: {e}\n{raw.help()}") from e
    return {name: Path(path) for name, path in got.items()}


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
