"""The TFDS catalog ``lm1b`` builder (One Billion Word Benchmark), prepared without TensorFlow.

Records are the catalog's: one sentence per record (``{"text": str}``), splits
``train`` and ``test``, in the catalog's layout (its sentences are shuffled
upstream anyway).  The catalog's ``test`` is all 50 held-out shards, not the
benchmark's test set (``news.en.heldout-00000-of-00050``) of published results.
Read it with ``xformer.data.readers.read_corpus("lm1b", "test")``.

Raw files: the extracted ``1-billion-word-language-modeling-benchmark-r13output/``
folder or its ``.tar.gz`` in the manual dir (``$XFORMER_DATA_DIR/lm1b``, ...),
else the archive is downloaded; an archive is extracted once into
``<data_dir>/downloads/extracted/lm1b`` (the catalog's example generator reads
the files while writing).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.datasets.lm1b import lm1b_dataset_builder as tfds_lm1b

from xformer.data import raw_files
from xformer.data.builder_base import LocalFirst


class Lm1b(LocalFirst, tfds_lm1b.Builder, skip_registration=True):
    """The TFDS catalog ``lm1b`` builder with TensorFlow-free file listing and a local copy.

    The catalog builder lists its files with ``tf.io.gfile.glob``, which needs
    TensorFlow; this subclass lists them with ``pathlib`` and also accepts a local
    copy in the manual dir.  Name, version, features, download checksum (the
    registry's URL is the catalog's ``_DOWNLOAD_URL``) and record layout are the
    catalog's, so the prepared files are the same as ``tfds.builder("lm1b")``
    would write.
    """

    name = "lm1b"
    # Metadata and download checksums of the catalog entry.
    code_path = epath.Path(tfds_lm1b.__file__)
    pkg_dir_path = code_path.parent

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        root = raw_files.manual_dir_of(dl_manager)
        if root is not None and (root / tfds_lm1b._TOP_LEVEL_DIR).is_dir():
            base = root
        else:
            archive = root / self.raw.archive if root is not None else None
            if archive is None or not archive.is_file():
                (archive,) = raw_files.download(self.name, self.raw, dl_manager, root).values()
            base = Path(dl_manager.download_dir) / "extracted" / "lm1b"
            if not (base / tfds_lm1b._TOP_LEVEL_DIR).is_dir():
                partial = base.with_name("lm1b.incomplete")
                for stale in (partial, base):
                    shutil.rmtree(stale, ignore_errors=True)
                raw_files.extract(archive, partial)
                partial.rename(base)
        files = {
            "train": sorted(base.glob(tfds_lm1b._TRAIN_FILE_FORMAT)),
            "test": sorted(base.glob(tfds_lm1b._HELDOUT_FILE_FORMAT)),
        }
        empty = [split for split, paths in files.items() if not paths]
        if empty:
            raise FileNotFoundError(f"No lm1b {' / '.join(empty)} files found below {base}.")
        return {split: self._generate_examples(files=paths) for split, paths in files.items()}
