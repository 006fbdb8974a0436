"""Text of a translation dataset's splits and the tokenizers trained on its training split."""

import os

import ml_collections

from xformer.data.encoded_cache import cached_pairs
from xformer.data.pipeline import EncodedPairs
from xformer.data.readers import read_all, translation_source
from xformer.data.tokenizer import Tokenizer, cached_tokenizer


def split_text(config: ml_collections.ConfigDict, split: str) -> tuple[list[str], list[str]]:
    """(source lines, target lines) of a split, every pair in dataset order."""
    d = config.data
    source = translation_source(
        d.dataset, split, data_dir=d.data_dir or None, manual_dir=d.manual_dir or None
    )
    records = read_all(source)
    return [r[d.source_lang] for r in records], [r[d.target_lang] for r in records]


def vocab_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
    return config.data.vocab_dir or os.path.join(workdir, "vocab")


def load_tokenizers(
    config: ml_collections.ConfigDict, workdir: str, *, train_if_missing: bool = True
) -> tuple[Tokenizer, Tokenizer]:
    """SentencePiece models for source and target (the same object when data.vocab='joint')."""
    d = config.data
    cache = vocab_dir(config, workdir)
    texts: dict[str, list[str]] = {}

    def train_texts(langs):
        def texts_fn():
            if not texts:
                texts[d.source_lang], texts[d.target_lang] = split_text(config, d.train_split)
            for lang in langs:
                yield from texts[lang]

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
    source = translation_source(
        d.dataset, split, data_dir=d.data_dir or None, manual_dir=d.manual_dir or None
    )
    cache_dir = os.path.join(vocab_dir(config, workdir), "encoded")
    return cached_pairs(source, (d.source_lang, d.target_lang), (src_tok, tgt_tok), cache_dir)
