"""Where load_tokenizers finds or trains its SentencePiece models: one per training corpus in a
shared data.vocab_dir, the workdir's own model whatever the split, names that earlier runs wrote
still found, and jobs that start together training a shared model once; and what a model
trains on when the split exceeds data.max_corpus_chars."""

import hashlib
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from xformer import config as config_lib
from xformer.data import translation
from xformer.data.readers import read_all, translation_source

VOCAB = 64  # one joint model: 2 x 26 letters, specials, a few words
WORDS = "the a dog cat runs jumps over under red blue small big house tree river".split()


class FakeSource:
    """A made-up split whose words depend on its name; targets are the sources in capitals."""

    def __init__(self, split: str):
        rng = np.random.default_rng(zlib.crc32(split.encode()))
        words = WORDS[: 8 if split.startswith("train[:") else len(WORDS)]
        lines = [" ".join(rng.choice(words, size=6)) for _ in range(300)]
        self.records = [{"en": line, "de": line.upper()} for line in lines]

    def __len__(self) -> int:
        return len(self.records)

    def __getitems__(self, indices):
        return [self.records[i] for i in indices]


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """The splits that load_tokenizers read (FakeSource instead of the dataset)."""
    made: list[str] = []

    def split_source(config, split):
        made.append(split)
        return FakeSource(split)

    monkeypatch.setattr(translation, "split_source", split_source)
    return made


def _config(split: str, vocab_dir: str = ""):
    config = config_lib.base_config()
    config.data.train_split, config.data.vocab_dir, config.data.vocab_size = split, vocab_dir, VOCAB
    return config


def _model_files(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".model"))


def test_a_shared_vocab_dir_keeps_one_model_per_training_slice(tmp_path, calls):
    shared = str(tmp_path / "shared")
    small, _ = translation.load_tokenizers(_config("train[:100]", shared), str(tmp_path / "a"))
    full, _ = translation.load_tokenizers(_config("train", shared), str(tmp_path / "b"))
    assert calls == ["train[:100]", "train"]  # the second run did not take the first's model
    assert small.path != full.path and len(_model_files(shared)) == 1 + 1
    pieces = [{t.sp.id_to_piece(i) for i in range(t.vocab_size)} for t in (small, full)]
    assert not any("i" in p for p in pieces[0]) and any("i" in p for p in pieces[1])  # "river"
    again, _ = translation.load_tokenizers(_config("train[:100]", shared), str(tmp_path / "c"))
    assert calls == ["train[:100]", "train"] and again.path == small.path  # loaded, not trained


def test_names_of_existing_models_are_kept(tmp_path, calls):
    """A workdir's own cache and a shared one on the default split keep the file names they had
    before the split entered the key, so runs resume and eval.py finds their models."""
    config = config_lib.base_config()
    d = config.data
    pair = f"{d.dataset.replace('/', '_')}-{d.source_lang}{d.target_lang}"
    key = hashlib.sha1(f"{pair}|{VOCAB}|{d.max_corpus_chars}".encode()).hexdigest()[:8]
    name = f"{pair}-{VOCAB}-{key}"
    own, _ = translation.load_tokenizers(_config("train[:100]"), str(tmp_path / "run"))
    assert os.path.basename(own.path) == name + ".model"
    resumed, _ = translation.load_tokenizers(
        _config("train"), str(tmp_path / "run"), train_if_missing=False
    )
    assert resumed.path == own.path and calls == ["train[:100]"]
    shared, _ = translation.load_tokenizers(_config("train", str(tmp_path / "v")), "unused")
    assert os.path.basename(shared.path) == name + ".model"


# One job of `test_jobs_sharing_a_cache_train_a_missing_model_once`: it marks that it trains
# (inside the lock) and holds the lock a second before handing SentencePiece the corpus.
JOB = """
import sys, time
from pathlib import Path
from xformer.data.tokenizer import cached_tokenizer
directory, index = sys.argv[1], sys.argv[2]

def texts():
    (Path(directory) / f"trained-by-{index}").touch()
    time.sleep(1.0)
    yield from [f"job text number {i % 37} of the shared corpus" for i in range(400)]

print(cached_tokenizer(directory, "shared", texts, 64, 10**6).path)
"""


def test_jobs_sharing_a_cache_train_a_missing_model_once(tmp_path):
    root = Path(__file__).resolve().parents[1]

    def job(index: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", JOB, str(tmp_path), str(index)],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            stdout=subprocess.PIPE,
            text=True,
        )

    first = job(0)
    deadline = time.monotonic() + 60
    while not (tmp_path / "trained-by-0").exists():  # job 0 holds the lock and trains
        assert first.poll() is None and time.monotonic() < deadline, "job 0 never trained"
        time.sleep(0.02)
    second = job(1)  # finds no model yet: it must wait for job 0's, not train its own
    paths = [p.communicate(timeout=120)[0].strip() for p in (first, second)]
    assert first.returncode == second.returncode == 0
    assert paths[0] == paths[1] and os.path.exists(paths[0])
    assert sorted(p.name for p in tmp_path.glob("trained-by-*")) == ["trained-by-0"]


def test_a_joint_model_over_its_budget_still_learns_both_languages(tmp_path, calls):
    """7,400 characters of each language, a budget of 3,000: a prefix of the text would be
    lowercase (source) only."""
    config = _config("train")
    config.data.max_corpus_chars = 3000
    tok, _ = translation.load_tokenizers(config, str(tmp_path))
    pieces = [tok.sp.id_to_piece(i) for i in range(tok.vocab_size)]
    assert any(p.isupper() for p in pieces) and any(p.islower() for p in pieces)
    text = "the red dog jumps over the big house"
    for line in (text, text.upper()):  # each language's words are known: nothing unknown
        assert tok.sp.unk_id() not in tok.sp.encode(line)


def test_a_tokenizer_corpus_is_whole_pairs_from_across_the_split(tfds_dir):
    source = translation_source("multi30k", "train[:3000]", data_dir=tfds_dir)
    records, langs = read_all(source), ("en", "de")
    everything = [r[lang] for lang in langs for r in records]
    total = sum(len(t) for t in everything if t.strip())
    assert translation.tokenizer_texts(source, langs, total) == everything  # within budget

    budget = total // 5
    texts = translation.tokenizer_texts(source, langs, budget)
    half = len(texts) // 2
    assert len(texts) == 2 * half and 0.1 * len(records) < half < 0.3 * len(records)
    chars = [sum(len(t) for t in side) for side in (texts[:half], texts[half:])]
    assert budget - 500 < sum(chars) <= budget and min(chars) > 0.4 * sum(chars)
    # Each en/de pair is a pair of the split, in dataset order, drawn from all of it.
    where = {(r["en"], r["de"]): i for i, r in enumerate(records)}
    indices = [where[pair] for pair in zip(texts[:half], texts[half:], strict=True)]
    assert indices == sorted(indices)
    assert indices[0] < 0.1 * len(records) and indices[-1] > 0.9 * len(records)
    assert translation.tokenizer_texts(source, langs, budget) == texts  # seeded


def test_a_vocabulary_smaller_than_the_texts_characters_is_one_clear_error(tmp_path):
    """SentencePiece keeps every character as a piece (its C++ check otherwise fails with an
    INTERNAL error): the size it needs is named."""
    from xformer.data.errors import DataValueError
    from xformer.data.tokenizer import train_tokenizer

    texts = [" ".join(WORDS)] * 20  # needs its letters, the word boundary, 4 special pieces
    letters = len(set("".join(WORDS)))
    with pytest.raises(DataValueError) as error:
        train_tokenizer(texts, str(tmp_path / "small.model"), vocab_size=letters)
    assert str(error.value) == (
        f"data.vocab_size={letters} is too small for the tokenizer small.model: its text has "
        f"{letters + 5} distinct characters and special pieces, one piece each: raise "
        "data.vocab_size to at least that"
    )
    assert train_tokenizer(texts, str(tmp_path / "ok.model"), vocab_size=letters + 5).vocab_size
