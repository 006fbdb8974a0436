"""SentencePiece tokenizers trained on a training split and cached on disk.

Ids: 0 = padding, 1 = unknown, 2 = BOS (first decoder input), 3 = EOS.
"""

import hashlib
import os
import re
import tempfile
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm
from absl import logging

from xformer import locks
from xformer.data.errors import DataFileNotFoundError, DataValueError

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


class Tokenizer:
    """Text <-> int32 ids. `encode` appends EOS; `decode` stops at the first EOS."""

    def __init__(self, model_path: str):
        self.path = model_path
        self.sp = spm.SentencePieceProcessor(model_file=model_path)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        ids = self.sp.encode(list(texts))
        return [np.asarray([*x, EOS_ID], np.int32) for x in ids]

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                out.append(i)
        return self.sp.decode(out)


def train_tokenizer(
    texts: Iterable[str], model_path: str, vocab_size: int, max_chars: int = 10_000_000
) -> Tokenizer:
    """Train a unigram SentencePiece model on `texts` (up to max_chars characters)."""

    def limited():
        total = 0
        for text in texts:
            if text.strip():
                total += len(text)
                if total > max_chars:
                    return
                yield text

    os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(model_path))) as tmp:
        prefix = os.path.join(tmp, "spm")
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=limited(),
                model_prefix=prefix,
                vocab_size=vocab_size,
                model_type="unigram",
                character_coverage=1.0,
                hard_vocab_limit=False,  # small corpora may not support the full size
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                num_threads=os.cpu_count() or 1,
                minloglevel=2,
            )
        except RuntimeError as e:  # SentencePiece's check of the size, a C++ assertion
            needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
            if not needed:
                raise
            raise DataValueError(
                f"data.vocab_size={vocab_size} is too small for the tokenizer "
                f"{os.path.basename(model_path)}: its text has {needed[1]} distinct characters "
                "and special pieces, one piece each: raise data.vocab_size to at least that"
            ) from None
        os.replace(prefix + ".model", model_path)  # atomic: a reader never sees a partial file
    return Tokenizer(model_path)


def cached_tokenizer(
    cache_dir: str,
    name: str,
    texts_fn,
    vocab_size: int,
    max_chars: int,
    train_if_missing: bool = True,
    corpus: str = "",
) -> Tokenizer:
    """Load `<cache_dir>/<name>-<vocab_size>-<key>.model`, training it from texts_fn() if
    absent. The key hashes name, vocab_size, max_chars and `corpus` (when not empty: what the
    texts are, e.g. a split slice, for models that differ in nothing else)."""
    fields = [name, str(vocab_size), str(max_chars)] + ([corpus] if corpus else [])
    key = hashlib.sha1("|".join(fields).encode()).hexdigest()[:8]
    path = os.path.join(cache_dir, f"{name}-{vocab_size}-{key}.model")
    if os.path.exists(path):
        return Tokenizer(path)
    if not train_if_missing:
        raise DataFileNotFoundError(
            f"no tokenizer {path}: train.py writes it when a run starts, and a workdir with "
            "checkpoints needs the one it was trained with (put it back, or use a new workdir)"
        )

    def on_wait(holder: dict) -> None:
        logging.info("waiting for %s, which is training %s", locks.describe(holder), path)

    # Jobs that share cache_dir and start together train it once: the others wait, then load.
    with locks.waiting(path + ".lock", on_wait):
        if os.path.exists(path):
            return Tokenizer(path)
        return train_tokenizer(texts_fn(), path, vocab_size, max_chars)
