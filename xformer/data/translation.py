"""A translation dataset's splits: their text, the tokenizers trained on the training split and
the split's token ids (encoded once, then memory-mapped: data/encoded_cache.py)."""

import os
from collections.abc import Sequence

import ml_collections
import numpy as np

from xformer.data.encoded_cache import cached_arrays, file_digest, record_files
from xformer.data.errors import DataValueError
from xformer.data.pipeline import EncodedPairs, RaggedIds
from xformer.data.readers import TranslationSource, read_all, translation_source
from xformer.data.tokenizer import Tokenizer, cached_tokenizer

_CHUNK = 16384  # pairs read at a time: bounds the text held in memory
_SIDES = ("src", "tgt")


def split_source(config: ml_collections.ConfigDict, split: str) -> TranslationSource:
    d = config.data
    return translation_source(
        d.dataset, split, data_dir=d.data_dir or None, manual_dir=d.manual_dir or None
    )


def split_text(config: ml_collections.ConfigDict, split: str) -> tuple[list[str], list[str]]:
    """(source lines, target lines) of a split, every pair in dataset order."""
    d = config.data
    records = read_all(split_source(config, split))
    return [r[d.source_lang] for r in records], [r[d.target_lang] for r in records]


def tokenizer_texts(
    source: TranslationSource, langs: Sequence[str], max_chars: int, seed: int = 0
) -> list[str]:
    """The sentences a SentencePiece model of `langs` trains on: whole pairs drawn in a seeded
    random order until their non-blank texts in `langs` would pass max_chars characters, put
    back in dataset order; every sentence of langs[0], then of langs[1].

    A split within the budget is used whole, in dataset order. A larger one gives each language
    its share of the pairs drawn, from across the split (its first max_chars characters would
    be one language and, in a corpus of concatenated sources, one source)."""
    order = np.random.default_rng(seed).permutation(len(source))

    def drawn():  # (index, record) in the drawn order, read a chunk at a time in file order
        for start in range(0, len(order), _CHUNK):
            indices = order[start : start + _CHUNK]
            read = np.sort(indices)
            records = dict(zip(read.tolist(), source.__getitems__(read.tolist()), strict=True))
            yield from ((i, records[i]) for i in indices.tolist())

    chosen, total = [], 0
    for i, record in drawn():
        chars = sum(len(record[lang]) for lang in langs if record[lang].strip())
        if total + chars > max_chars:
            break
        total += chars
        chosen.append((i, record))
    chosen.sort(key=lambda pair: pair[0])
    return [record[lang] for lang in langs for _, record in chosen]


def vocab_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
    return config.data.vocab_dir or os.path.join(workdir, "vocab")


def load_tokenizers(
    config: ml_collections.ConfigDict, workdir: str, *, train_if_missing: bool = True
) -> tuple[Tokenizer, Tokenizer]:
    """SentencePiece models for source and target (the same object when data.vocab='joint')."""
    d = config.data
    cache = vocab_dir(config, workdir)

    def train_texts(langs):
        def texts_fn():
            source = split_source(config, d.train_split)
            return tokenizer_texts(source, langs, d.max_corpus_chars)

        return texts_fn

    name = d.dataset.replace("/", "_")
    # A shared vocab_dir also serves runs on other slices of the dataset, which need their own
    # models; a workdir's own cache holds the one its run trained, under the name it had.
    corpus = d.train_split if d.vocab_dir and d.train_split != "train" else ""
    if d.vocab == "joint":
        pair = f"{name}-{d.source_lang}{d.target_lang}"
        tok = cached_tokenizer(
            cache,
            pair,
            train_texts([d.source_lang, d.target_lang]),
            d.vocab_size,
            d.max_corpus_chars,
            train_if_missing,
            corpus,
        )
        return tok, tok
    src, tgt = (
        cached_tokenizer(
            cache,
            f"{name}-{lang}",
            train_texts([lang]),
            d.vocab_size,
            d.max_corpus_chars,
            train_if_missing,
            corpus,
        )
        for lang in (d.source_lang, d.target_lang)
    )
    return src, tgt


def encoded_split(
    config: ml_collections.ConfigDict,
    split: str,
    src_tok: Tokenizer,
    tgt_tok: Tokenizer,
    workdir: str,
) -> EncodedPairs:
    """Every pair of a split as token ids, cached in `<vocab_dir>/encoded` (encoded_cache)."""
    d = config.data
    cache_dir = os.path.join(vocab_dir(config, workdir), "encoded")
    langs, tokenizers = (d.source_lang, d.target_lang), (src_tok, tgt_tok)
    return cached_pairs(split_source(config, split), langs, tokenizers, cache_dir)


def cached_pairs(
    source: TranslationSource,
    languages: tuple[str, str],
    tokenizers: tuple[Tokenizer, Tokenizer],
    cache_dir: str,
) -> EncodedPairs:
    """Every pair of `source` as (source language, target language) ids, each side ending with
    EOS, in dataset order, through `cached_arrays`."""
    fingerprint = {
        "files": record_files(source.source),
        "languages": list(languages),
        "tokenizers": [file_digest(t.path) for t in tokenizers],
    }

    def encode() -> dict[str, np.ndarray]:
        pairs = _encode(source, languages, tokenizers)
        return {
            f"{side}_{part}": getattr(ragged, part)
            for side, ragged in zip(_SIDES, (pairs.src, pairs.tgt), strict=True)
            for part in ("ids", "offsets")
        }

    arrays = cached_arrays(cache_dir, f"{source.dataset}-{source.split}", fingerprint, encode)
    pairs = EncodedPairs(
        *(RaggedIds(arrays[f"{side}_ids"], arrays[f"{side}_offsets"]) for side in _SIDES)
    )
    if len(pairs) != len(source):
        raise DataValueError(
            f"{cache_dir} holds {len(pairs)} pairs of {source.dataset} {source.split}, the split "
            f"has {len(source)}: delete its entry to encode it again"
        )
    return pairs


def _encode(
    source: TranslationSource, languages: Sequence[str], tokenizers: Sequence[Tokenizer]
) -> EncodedPairs:
    dtype = np.uint16 if max(t.vocab_size for t in tokenizers) <= 2**16 else np.int32
    parts: tuple[list, list] = ([], [])
    for start in range(0, len(source), _CHUNK):
        records = source.__getitems__(range(start, min(start + _CHUNK, len(source))))
        for side, lang, tok in zip(parts, languages, tokenizers, strict=True):
            side.append(RaggedIds.from_sequences(tok.encode([r[lang] for r in records]), dtype))
    return EncodedPairs(*(RaggedIds.concatenate(side, dtype) for side in parts))
