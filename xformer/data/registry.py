"""The one registry of datasets: translation pairs and language-modelling corpora.

::

    from xformer.data.registry import dataset_entry, make_builder

    entry = dataset_entry("ptb")   # DatasetEntry(kind="language_model", metric="perplexity", ...)
    entry.raw.files                # ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt")
    builder = make_builder("ptb", data_dir="/path/to/tfds_data")  # imports TFDS

Importing this module is cheap (no TFDS); builders are imported on first use.
Read the data with ``xformer.data.readers`` (``translation_source``,
``read_corpus``).  Translation datasets of the TFDS catalog (e.g.
``"wmt14_translate/de-en"``) are not listed here; ``translation_source`` passes
them to ``tfds.builder``.

==============  ==============  =============  ==========  ===============================
dataset         kind            tokenization   metric      records
==============  ==============  =============  ==========  ===============================
multi30k        translation     sentencepiece  bleu        caption pairs ``{"en", "de"}``
ptb, wikitext2, language_model  whitespace     perplexity  one per line (``"text"``); a
wikitext103,                                               token stream adds ``<eos>``
lm1b                                                       after every line
ptb_char        language_model  whitespace     bpc         as above; symbols are characters
enwik8          language_model  byte           bpc         1 MiB chunks (``"bytes"``)
text8           language_model  char           bpc         as enwik8; UTF-8 characters
==============  ==============  =============  ==========  ===============================

Raw files in the manual dir (``raw_files``; ``$XFORMER_DATA_DIR/<folder>`` or
``<repo>/../shared/data/<folder>``); text files may also be ``<name>.gz``::

    dataset      folder        files                            below the folder, or archive
    multi30k     multi30k      <split>.{en,de}.gz               ., raw/, data/task1/raw/
    ptb          ptb           ptb.{train,valid,test}.txt       ., data/, simple-examples/data/
                                                                or simple-examples.tgz
    ptb_char     ptb_char      ptb.char.{train,valid,test}.txt  (same as ptb)
    wikitext2    wikitext-2    wiki.{train,valid,test}.tokens   ., wikitext-2/ or wikitext-2-v1.zip
    wikitext103  wikitext-103  wiki.{train,valid,test}.tokens   ., wikitext-103/
                                                                or wikitext-103-v1.zip
    enwik8       enwik8        enwik8                           . or enwik8.zip
    text8        text8         text8                            . or text8.zip
    lm1b         lm1b          1-billion-word-language-modeling-benchmark-r13output/
                               or 1-billion-word-language-modeling-benchmark-r13output.tar.gz
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from xformer.data.raw_files import RawFiles

TRANSLATION = "translation"
LANGUAGE_MODEL = "language_model"


@dataclass(frozen=True)
class DatasetEntry:
    """What the code needs to know about a dataset.

    ``tokenization``: ``"sentencepiece"`` (translation), ``"whitespace"`` (split
    each line on whitespace, append ``<eos>``), ``"byte"`` (every byte is a token)
    or ``"char"`` (every character is a token).  ``metric``: ``"bleu"``,
    ``"perplexity"`` or ``"bpc"`` (bits per character).
    """

    name: str
    kind: str  # TRANSLATION or LANGUAGE_MODEL
    builder: str  # "<module of xformer.data.builders>:<class>", imported by `builder_class`
    splits: tuple[str, ...]
    tokenization: str
    metric: str
    raw: RawFiles  # where the upstream files are; raw.folder names the manual-dir folder

    @property
    def folder(self) -> str:
        """Manual-dir folder: ``$XFORMER_DATA_DIR/<folder>``, ``../shared/data/<folder>``."""
        return self.raw.folder

    def builder_class(self) -> type:
        """The TFDS builder class (imports TFDS)."""
        module, name = self.builder.split(":")
        return getattr(importlib.import_module(f"xformer.data.builders.{module}"), name)


_LM_SPLITS = ("train", "valid", "test")
_MULTI30K_SPLITS = ("train", "val", "test_2016_flickr", "test_2017_flickr", "test_2017_mscoco")
_SIMPLE_EXAMPLES = "http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz"
_PTB_SUBDIRS = (".", "data", "simple-examples/data")


def _lm(name: str, builder: str, tokenization: str, metric: str, raw: RawFiles) -> DatasetEntry:
    return DatasetEntry(name, LANGUAGE_MODEL, builder, _LM_SPLITS, tokenization, metric, raw)


DATASETS: dict[str, DatasetEntry] = {
    "multi30k": DatasetEntry(
        "multi30k",
        TRANSLATION,
        "multi30k:Multi30k",
        _MULTI30K_SPLITS,
        "sentencepiece",
        "bleu",
        RawFiles(
            "multi30k",
            "https://github.com/multi30k/dataset/raw/master/data/task1/raw/{file}",
            tuple(f"{split}.{lang}.gz" for split in _MULTI30K_SPLITS for lang in ("en", "de")),
            (".", "raw", "data/task1/raw"),
        ),
    ),
    "ptb": _lm(
        "ptb",
        "line_corpora:Ptb",
        "whitespace",
        "perplexity",
        RawFiles(
            "ptb",
            _SIMPLE_EXAMPLES,
            tuple(f"ptb.{split}.txt" for split in _LM_SPLITS),
            _PTB_SUBDIRS,
        ),
    ),
    "ptb_char": _lm(
        "ptb_char",
        "line_corpora:PtbChar",
        "whitespace",
        "bpc",
        RawFiles(
            "ptb_char",
            _SIMPLE_EXAMPLES,
            tuple(f"ptb.char.{split}.txt" for split in _LM_SPLITS),
            _PTB_SUBDIRS,
        ),
    ),
    "wikitext2": _lm(
        "wikitext2",
        "line_corpora:Wikitext2",
        "whitespace",
        "perplexity",
        RawFiles(
            "wikitext-2",
            "https://wikitext.smerity.com/wikitext-2-v1.zip",
            tuple(f"wiki.{split}.tokens" for split in _LM_SPLITS),
            (".", "wikitext-2"),
        ),
    ),
    "wikitext103": _lm(
        "wikitext103",
        "line_corpora:Wikitext103",
        "whitespace",
        "perplexity",
        RawFiles(
            "wikitext-103",
            "https://wikitext.smerity.com/wikitext-103-v1.zip",
            tuple(f"wiki.{split}.tokens" for split in _LM_SPLITS),
            (".", "wikitext-103"),
        ),
    ),
    "enwik8": _lm(
        "enwik8",
        "byte_streams:Enwik8",
        "byte",
        "bpc",
        RawFiles("enwik8", "http://mattmahoney.net/dc/enwik8.zip", ("enwik8",)),
    ),
    "text8": _lm(
        "text8",
        "byte_streams:Text8",
        "char",
        "bpc",
        RawFiles("text8", "http://mattmahoney.net/dc/text8.zip", ("text8",)),
    ),
    "lm1b": DatasetEntry(
        "lm1b",
        LANGUAGE_MODEL,
        "lm1b:Lm1b",
        ("train", "test"),
        "whitespace",
        "perplexity",
        RawFiles(  # the URL of the TFDS catalog entry, whose checksum file covers it
            "lm1b",
            "http://www.statmt.org/lm-benchmark/"
            "1-billion-word-language-modeling-benchmark-r13output.tar.gz",
            ("1-billion-word-language-modeling-benchmark-r13output/",),
        ),
    ),
}

# The language-modelling corpora, in registry order.
LM_CORPORA: dict[str, DatasetEntry] = {
    name: entry for name, entry in DATASETS.items() if entry.kind == LANGUAGE_MODEL
}


def dataset_entry(name: str) -> DatasetEntry:
    """Returns the registry entry of ``name``; unknown names raise ``ValueError``."""
    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; valid datasets: {', '.join(DATASETS)}")
    return DATASETS[name]


def corpus_info(name: str) -> DatasetEntry:
    """Returns the entry of language-modelling corpus ``name`` (``ValueError`` if unknown)."""
    if name not in LM_CORPORA:
        raise ValueError(f"Unknown corpus {name!r}; valid corpora: {', '.join(LM_CORPORA)}")
    return LM_CORPORA[name]


def make_builder(name: str, data_dir: str | None = None) -> Any:
    """Returns the TFDS builder of registered dataset ``name`` for ``data_dir``."""
    return dataset_entry(name).builder_class()(data_dir=data_dir)
