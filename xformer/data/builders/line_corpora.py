"""TFDS builders for the line-based language-modelling corpora: PTB, PTB-char, WikiText-2/103.

Each record is one line of the split's file, ``{"text": str}``, in file order;
tokens are the whitespace-separated words and a token stream adds ``<eos>`` after
every line (``xformer.data.vocab``).  Lines are decoded as strict UTF-8 and kept
as they are (empty ones too); only the terminator is removed.  ``ptb.char.*``
files end with a lone space after the last newline, which therefore makes one
more (blank) line, as in the usual readers.

Raw files (manual-dir folder, file names, official archive): see the registry
entries in ``xformer.data.registry``; the manual dir may hold the files (plain or
``.gz``) or the archive, else the archive is downloaded.  Read them with
``xformer.data.readers.read_corpus("ptb", "train")``.
"""

from __future__ import annotations

from typing import Any

import tensorflow_datasets as tfds

from xformer.data.builder_base import BaseBuilder
from xformer.data.registry import dataset_entry
from xformer.data.text import read_text_lines


class LineCorpus(BaseBuilder, skip_registration=True):
    """Base of the line corpora: split ``i`` of the registry entry is ``raw.files[i]``."""

    def _features(self) -> dict[str, Any]:
        return {"text": tfds.features.Text()}

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        splits = dataset_entry(self.name).splits
        with self.raw_paths(dl_manager) as paths:
            lines = {
                split: read_text_lines(paths[name])
                for split, name in zip(splits, self.raw.files, strict=True)
            }
        return {split: self._generate_examples(split_lines) for split, split_lines in lines.items()}

    def _generate_examples(self, lines: list[str]):
        for i, line in enumerate(lines):
            yield i, {"text": line}


class Ptb(LineCorpus):
    """Penn Treebank, word level, as preprocessed by Mikolov (10k vocabulary)."""

    name = "ptb"


class PtbChar(LineCorpus):
    """Penn Treebank, character level (Mikolov): space-separated characters, '_' between words."""

    name = "ptb_char"


class Wikitext2(LineCorpus):
    """WikiText-2 v1, tokenized (Merity et al. 2016)."""

    name = "wikitext2"


class Wikitext103(LineCorpus):
    """WikiText-103 v1, tokenized (Merity et al. 2016)."""

    name = "wikitext103"
