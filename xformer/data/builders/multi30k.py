"""TFDS builder for Multi30k task 1 (English-German image-caption translation).

Each example is one aligned caption pair ``{"en": str, "de": str}``; supervised
keys are ``("en", "de")``.  Splits and sizes::

    train 29000, val 1014, test_2016_flickr 1000, test_2017_flickr 1000,
    test_2017_mscoco 461

Record ``i`` of a split is line ``i`` of ``<split>.en.gz`` / ``<split>.de.gz``.
Every line is kept, including empty ones; only the line terminator (``\\n`` or
``\\r\\n``) is removed.  The files are decoded as strict UTF-8 and a split whose
two language files have different line counts is rejected.

Raw files (see ``xformer.data.raw_files``): the upstream ``<split>.{en,de}.gz``
(https://github.com/multi30k/dataset, ``data/task1/raw/``) in the manual dir,
directly or in ``raw/`` or ``data/task1/raw/`` below it; without them the 10
files are downloaded from
``https://github.com/multi30k/dataset/raw/master/data/task1/raw/<split>.<lang>.gz``
and checked against ``xformer.data.checksums``.

Usually read through ``xformer.data.readers.translation_source("multi30k", split)``;
direct use::

    import tensorflow_datasets as tfds
    from xformer.data.builders.multi30k import Multi30k

    builder = Multi30k(data_dir="/path/to/tfds_data")
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir="/path/to/multi30k")
    )
    source = builder.as_data_source("test_2016_flickr")  # values are bytes
"""

from __future__ import annotations

from typing import Any

import tensorflow_datasets as tfds

from xformer.data.builder_base import BaseBuilder
from xformer.data.registry import DATASETS
from xformer.data.text import read_parallel_files

LANGUAGES: tuple[str, str] = ("en", "de")
SPLITS: tuple[str, ...] = DATASETS["multi30k"].splits
SPLIT_SIZES: dict[str, int] = {
    "train": 29000,
    "val": 1014,
    "test_2016_flickr": 1000,
    "test_2017_flickr": 1000,
    "test_2017_mscoco": 461,
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
    return list(DATASETS["multi30k"].raw.files)


class Multi30k(BaseBuilder):
    """Multi30k task 1: English image captions from Flickr30k with professional German
    translations, one caption pair per example (WMT16 multimodal translation)."""

    name = "multi30k"
    RELEASE_NOTES = {"1.0.0": "Initial release: raw (untokenized) en-de task 1 data."}
    HOMEPAGE = "https://github.com/multi30k/dataset"
    CITATION = _CITATION
    SUPERVISED_KEYS = LANGUAGES

    def _features(self) -> dict[str, Any]:
        return {lang: tfds.features.Text() for lang in LANGUAGES}

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        # Read everything up front (about 4 MB of text) so that bad files fail
        # with a clean error before TFDS starts writing.
        with self.raw_paths(dl_manager) as paths:
            pairs = {
                split: read_parallel_files(*(paths[f"{split}.{lang}.gz"] for lang in LANGUAGES))
                for split in SPLITS
            }
        return {split: self._generate_examples(*pair) for split, pair in pairs.items()}

    def _generate_examples(self, en_lines: list[str], de_lines: list[str]):
        for i, (en, de) in enumerate(zip(en_lines, de_lines, strict=True)):
            yield i, {"en": en, "de": de}
