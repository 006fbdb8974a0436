"""Flat token ids (RaggedIds) and the on-disk cache of an encoded translation split."""

import itertools
import os
import shutil
import threading

import numpy as np
import pytest

from xformer.data import encoded_cache, translation
from xformer.data.pipeline import EncodedPairs, RaggedIds
from xformer.data.readers import read_all, translation_source
from xformer.data.tokenizer import train_tokenizer

LANGS = ("en", "de")


def test_ragged_ids_hold_each_sequence_and_join():
    rng = np.random.default_rng()
    seqs = [rng.integers(0, 60_000, n).astype(np.int32) for n in rng.integers(0, 9, 50)]
    seqs[3] = np.zeros(0, np.int32)  # empty sequences keep their place
    cut = [0, 7, 7, 31, 50]  # includes an empty part
    parts = [RaggedIds.from_sequences(seqs[a:b], np.uint16) for a, b in itertools.pairwise(cut)]
    for ragged in (RaggedIds.from_sequences(seqs), RaggedIds.concatenate(parts, np.uint16)):
        assert len(ragged) == len(seqs)
        np.testing.assert_array_equal(ragged.lengths, [len(s) for s in seqs])
        for i, seq in enumerate(seqs):
            assert ragged[i].dtype == np.int32
            np.testing.assert_array_equal(ragged[i], seq)
    empty = RaggedIds.concatenate([])
    assert len(empty) == 0 and len(empty.ids) == 0
    with pytest.raises(ValueError, match="offsets end at 5, ids hold 4"):
        RaggedIds(np.zeros(4, np.int32), np.array([0, 2, 5]))


@pytest.fixture(scope="module")
def split_and_tokenizers(tfds_dir, tmp_path_factory):
    """A 2,000-pair slice of Multi30k and two different joint tokenizers trained on it."""
    source = translation_source("multi30k", "train[:2000]", data_dir=tfds_dir)
    records = read_all(source)
    texts = [r[lang] for r in records for lang in LANGS]
    folder = tmp_path_factory.mktemp("spm")
    tokenizers = [train_tokenizer(texts, str(folder / f"{n}.model"), n) for n in (300, 350)]
    return source, records, tokenizers


def _assert_pairs_equal(have: EncodedPairs, want: EncodedPairs):
    assert len(have) == len(want)
    for side in ("src", "tgt"):
        np.testing.assert_array_equal(getattr(have, side).ids, getattr(want, side).ids)
        np.testing.assert_array_equal(getattr(have, side).offsets, getattr(want, side).offsets)


def test_a_cached_split_is_the_text_encoded_and_is_encoded_once(
    split_and_tokenizers, tmp_path, monkeypatch
):
    source, records, (tok, _) = split_and_tokenizers
    src, tgt = ([r[lang] for r in records] for lang in LANGS)
    direct = EncodedPairs.from_text(src, tgt, tok, tok)

    first = translation.cached_pairs(source, LANGS, (tok, tok), str(tmp_path))
    _assert_pairs_equal(first, direct)
    (entry,) = [p for p in os.listdir(tmp_path) if not p.endswith(".lock")]
    assert entry.startswith("multi30k-train_2000_-")

    def no_encoding(*args):
        raise AssertionError("encoded again")

    monkeypatch.setattr(translation, "_encode", no_encoding)
    again = translation.cached_pairs(source, LANGS, (tok, tok), str(tmp_path))
    ids = again.src.ids  # a read-only view of the mapped file
    assert isinstance(ids.base, np.memmap) and not ids.flags.writeable and ids.dtype == np.uint16
    _assert_pairs_equal(again, direct)
    # The other direction is another entry, with the sides swapped.
    monkeypatch.undo()
    swapped = translation.cached_pairs(source, LANGS[::-1], (tok, tok), str(tmp_path))
    _assert_pairs_equal(swapped, EncodedPairs(direct.tgt, direct.src))


def test_new_data_or_a_new_tokenizer_makes_a_new_entry(split_and_tokenizers, tfds_dir, tmp_path):
    source, _, (tok, other_tok) = split_and_tokenizers
    cache = str(tmp_path / "cache")

    def entries():
        return sorted(p for p in os.listdir(cache) if not p.endswith(".lock"))

    translation.cached_pairs(source, LANGS, (tok, tok), cache)
    translation.cached_pairs(source, LANGS, (other_tok, other_tok), cache)
    assert len(entries()) == 2
    copy = tmp_path / "tfds"
    shutil.copytree(os.path.join(tfds_dir, "multi30k"), copy / "multi30k")
    copied = translation_source("multi30k", "train[:2000]", data_dir=str(copy))
    translation.cached_pairs(copied, LANGS, (tok, tok), cache)  # same file size and time
    assert len(entries()) == 3
    (train_file,) = (copy / "multi30k").glob("*/multi30k-train.array_record*")
    os.utime(train_file, (1, 1))  # as if the dataset were prepared again
    translation.cached_pairs(copied, LANGS, (tok, tok), cache)
    assert len(entries()) == 4


def test_jobs_starting_together_encode_once_and_a_failed_save_leaves_nothing(
    split_and_tokenizers, tmp_path, monkeypatch
):
    source, _, (tok, _) = split_and_tokenizers
    encode, calls = translation._encode, []

    def slow_encode(*args):
        calls.append(1)
        threading.Event().wait(0.5)  # the other job reaches the lock meanwhile
        return encode(*args)

    monkeypatch.setattr(translation, "_encode", slow_encode)
    results = [None, None]

    def job(i):
        results[i] = translation.cached_pairs(source, LANGS, (tok, tok), str(tmp_path / "a"))

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    _assert_pairs_equal(results[0], results[1])

    def failing_dump(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(encoded_cache.json, "dump", failing_dump)
    with pytest.raises(OSError, match="disk full"):
        translation.cached_pairs(source, LANGS, (tok, tok), str(tmp_path / "b"))
    assert [p for p in os.listdir(tmp_path / "b") if not p.endswith(".lock")] == []


def test_a_read_only_cache_dir_encodes_in_memory(split_and_tokenizers, tmp_path, monkeypatch):
    source, records, (tok, _) = split_and_tokenizers
    src, tgt = ([r[lang] for r in records] for lang in LANGS)
    monkeypatch.setattr(encoded_cache.os, "access", lambda path, mode: False)
    pairs = translation.cached_pairs(source, LANGS, (tok, tok), str(tmp_path))
    _assert_pairs_equal(pairs, EncodedPairs.from_text(src, tgt, tok, tok))
    assert os.listdir(tmp_path) == []


def test_a_language_modelling_stream_is_encoded_once(tfds_dir, tmp_path, monkeypatch):
    from test_language_modeling import tiny_config

    from xformer.data.readers import read_corpus
    from xformer.tasks import language_modeling, make_task

    task = make_task(tiny_config(tfds_dir), str(tmp_path))
    direct = task.vocab.encode_lines(read_corpus("ptb", "valid", data_dir=tfds_dir))
    np.testing.assert_array_equal(task.stream("valid"), direct)

    def no_reading(*args):
        raise AssertionError("read again")

    monkeypatch.setattr(language_modeling, "corpus_text", no_reading)
    again = make_task(tiny_config(tfds_dir), str(tmp_path), train_if_missing=False)
    stream = again.stream("valid")
    assert isinstance(stream.base, np.memmap) and stream.dtype == np.int32
    np.testing.assert_array_equal(stream, direct)
    (entry,) = [p for p in os.listdir(tmp_path / "vocab" / "encoded") if not p.endswith(".lock")]
    assert entry.startswith("ptb-valid-")
