"""Reading the datasets: translation pairs by record, language-modelling corpora by split.

::

    from xformer.data.readers import read_all, read_corpus, translation_source

    src = translation_source("multi30k", "train", data_dir="/path/to/tfds_data")
    src[0]            # {"en": "Two young, White males are outside near many bushes.",
                      #  "de": "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche."}
    pairs = read_all(src)

    lines = read_corpus("ptb", "train", data_dir="/path/to/tfds_data")     # list[str]
    stream = read_corpus("enwik8", "valid", data_dir="/path/to/tfds_data")  # bytes

The first call prepares the dataset into ``data_dir`` as TFDS ``array_record``
files (``builder_base.prepare``; about a second for Multi30k, no TensorFlow);
later calls only open them (delete ``<data_dir>/<dataset>`` to rebuild).  The raw
files come from the ``manual_dir`` argument, else ``$XFORMER_DATA_DIR/<folder>``,
else ``<repo>/../shared/data/<folder>``, else the official download (see
``raw_files``; the datasets and their folders are listed in ``registry``).

Translation datasets of the TFDS catalog (e.g. ``"wmt14_translate/de-en"``) go
through ``tfds.builder`` and use that builder's own download / manual-dir rules.
"""

from __future__ import annotations

import importlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from xformer.data.errors import DataValueError
from xformer.data.raw_files import DATA_DIR_ENV, dataset_folder
from xformer.data.registry import DATASETS, TRANSLATION, corpus_info, make_builder

_READ_BATCH = 4096


# --------------------------------------------------------------------------- translation


@dataclass
class TranslationSource:
    """Random-access view of one split whose records are ``{lang: str}`` dicts.

    Wraps a TFDS ``ArrayRecordDataSource`` of serialized records; only the two
    supervised-key fields are parsed (``text_features``), decoded from UTF-8.
    Supports ``len``, integer indexing (also negative) and ``__getitems__``
    (batched reads); it pickles, so it can be handed to grain.
    """

    source: Any  # tfds ArrayRecordDataSource of serialized tf.train.Example records
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

    def _convert(self, record: bytes) -> dict[str, str]:
        texts = text_features(record, self.languages)
        return {lang: t.decode("utf-8") for lang, t in zip(self.languages, texts, strict=True)}

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


def _check_split(kind: str, name: str, split: str, valid: Sequence[str]) -> None:
    # "train[:10%]+val" -> ["train", "val"]
    unknown = [s for s in (p.split("[", 1)[0].strip() for p in split.split("+")) if s not in valid]
    if unknown:
        raise DataValueError(
            f"Unknown split {split!r} for {kind} {name!r}; valid splits: {', '.join(valid)}"
        )


def _translation_builder(dataset: str, data_dir: str | None) -> tuple[Any, list[str]]:
    """The builder of ``dataset`` and its known splits (``[]``: known once prepared)."""
    folder = dataset_folder(dataset)
    if folder in DATASETS:
        entry = DATASETS[folder]
        if entry.kind != TRANSLATION:
            raise ValueError(f"{folder!r} is not a translation dataset; use read_corpus")
        if dataset != folder:
            raise ValueError(f"{folder} has no configs or versions to select: {dataset!r}")
        return make_builder(folder, data_dir), list(entry.splits)
    import tensorflow_datasets as tfds

    # TFDS registers its legacy builders (wmt*, ted_*, ...) by importing their
    # packages in one loop that stops at the first ImportError (e.g. a missing
    # h5py), so make sure the translation builders are registered.
    try:
        importlib.import_module("tensorflow_datasets.translate")
    except ImportError:
        pass
    builder = tfds.builder(dataset, data_dir=data_dir, file_format="array_record")
    return builder, list(builder.info.splits.keys())


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
    ``raw_files.resolve_manual_dir`` (``manual_dir`` > ``$XFORMER_DATA_DIR`` >
    repo shared dir > download).  Unknown splits raise ``ValueError`` listing the
    valid ones.
    """
    from xformer.data.builder_base import prepare  # (imports TFDS: only when needed)

    builder, known_splits = _translation_builder(dataset, data_dir)
    if known_splits:
        _check_split("dataset", dataset, split, known_splits)
    folder = dataset_folder(dataset)
    hint = (
        ""
        if folder in DATASETS  # The builder's message says where the files go.
        else f"\nPut the raw files in the manual dir (${DATA_DIR_ENV}/{folder} or the "
        "manual_dir argument / flag), or let TFDS download them from the sources of its "
        "catalog entry."
    )
    prepare(builder, dataset, folder, manual_dir, hint=hint)
    if not known_splits:
        _check_split("dataset", dataset, split, list(builder.info.splits.keys()))

    keys = builder.info.supervised_keys
    if not (
        isinstance(keys, tuple | list) and len(keys) == 2 and all(isinstance(k, str) for k in keys)
    ):
        raise ValueError(
            f"{dataset!r} does not have (source, target) text supervised keys: {keys!r}"
        )
    source = _serialized_records(builder, split)
    return TranslationSource(
        source=source, dataset=dataset, split=split, source_lang=keys[0], target_lang=keys[1]
    )


def _serialized_records(builder: Any, split: str) -> Any:
    """The split's records as TFDS wrote them, left for ``text_features`` to parse."""
    from tensorflow_datasets.core import decode

    raw = decode.DeserializeMethod.RAW_BYTES
    return builder.as_data_source(split=split, deserialize_method=raw)


def text_features(record: bytes, keys: Sequence[str]) -> list[bytes]:
    """The byte strings of features ``keys`` of one serialized ``tf.train.Example`` record,
    which is how TFDS stores ``Text`` and scalar string features.

    Reading just these fields from the proto is about 4x faster than TFDS's general
    decoder (Multi30k's 29,000 training pairs: 0.63 s instead of 2.5 s), which was a large
    part of a small run's start-up.
    """
    from tensorflow_datasets.proto import tf_example_pb2

    features = tf_example_pb2.Example.FromString(record).features.feature
    out = []
    for key in keys:
        values = features[key].bytes_list.value if key in features else ()
        if len(values) != 1:
            raise ValueError(
                f"expected one byte string in feature {key!r} of a record, got {len(values)} "
                f"(features: {sorted(features)})"
            )
        out.append(values[0])
    return out


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


# --------------------------------------------------------------------------- language modelling


def prepare_corpus(name: str, *, data_dir: str | None = None, manual_dir: str | None = None):
    """Returns the TFDS builder of corpus ``name``, preparing it into ``data_dir`` if needed.

    ``data_dir`` ``None`` is the TFDS default (``$TFDS_DATA_DIR`` or
    ``~/tensorflow_datasets``).  Raw files are looked up with
    ``raw_files.resolve_manual_dir`` (``manual_dir`` > ``$XFORMER_DATA_DIR/<folder>``
    > repo shared dir > download).
    """
    from xformer.data.builder_base import prepare  # (imports TFDS: only when needed)

    info = corpus_info(name)
    return prepare(make_builder(name, data_dir), name, info.folder, manual_dir)


def corpus_source(
    name: str, split: str, *, data_dir: str | None = None, manual_dir: str | None = None
) -> Any:
    """The serialized records of one split of corpus ``name`` (a TFDS data source; read them
    with ``corpus_text``), preparing the corpus if needed. Unknown corpora or splits raise
    ``ValueError`` listing the valid ones.  See ``prepare_corpus`` for the directories."""
    info = corpus_info(name)
    _check_split("corpus", name, split, info.splits)
    builder = prepare_corpus(name, data_dir=data_dir, manual_dir=manual_dir)
    return _serialized_records(builder, split)


def corpus_text(name: str, source: Any) -> list[str] | bytes:
    """The lines (``"whitespace"`` corpora) or the byte string (``"byte"`` and ``"char"``
    corpora; text8 is UTF-8) of a ``corpus_source``."""
    records = read_all(source)
    if corpus_info(name).tokenization == "whitespace":
        return [text_features(r, ["text"])[0].decode("utf-8") for r in records]
    return b"".join(text_features(r, ["bytes"])[0] for r in records)


def read_corpus(
    name: str, split: str, *, data_dir: str | None = None, manual_dir: str | None = None
) -> list[str] | bytes:
    """Reads one split of corpus ``name`` (see ``registry.LM_CORPORA``): ``corpus_text`` of
    its ``corpus_source``."""
    source = corpus_source(name, split, data_dir=data_dir, manual_dir=manual_dir)
    return corpus_text(name, source)
