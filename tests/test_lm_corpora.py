"""Tests for the language-modelling corpora (read_corpus, the LM builders) and vocabularies."""

import concurrent.futures
import gzip
import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from xformer.data import checksums, raw_files
from xformer.data.builders.byte_streams import CHUNK_BYTES, stream_split_bounds
from xformer.data.errors import DataDownloadError, DataValueError
from xformer.data.readers import prepare_corpus, read_corpus
from xformer.data.registry import LM_CORPORA, corpus_info
from xformer.data.vocab import EOS, UNK, ByteVocab, CharVocab, WordVocab, build_vocab

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# Published statistics: tokens with one <eos> per line, and vocabulary sizes.
REAL = {
    "ptb": ("ptb", "ptb.{}.txt.gz", {"train": 929_589, "valid": 73_760, "test": 82_430}, 10_000),
    "wikitext2": (
        "wikitext-2",
        "wiki.{}.tokens.gz",
        {"train": 2_088_628, "valid": 217_646, "test": 245_569},
        33_278,
    ),
    "ptb_char": ("ptb_char", "ptb.char.{}.txt.gz", None, 50),
}
URLS = {
    "ptb": "http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz",
    "ptb_char": "http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz",
    "wikitext2": "https://wikitext.smerity.com/wikitext-2-v1.zip",
    "wikitext103": "https://wikitext.smerity.com/wikitext-103-v1.zip",
    "enwik8": "http://mattmahoney.net/dc/enwik8.zip",
    "text8": "http://mattmahoney.net/dc/text8.zip",
    "lm1b": "http://www.statmt.org/lm-benchmark/"
    "1-billion-word-language-modeling-benchmark-r13output.tar.gz",
}
LM1B_TOP = "1-billion-word-language-modeling-benchmark-r13output"


@pytest.fixture(scope="session")
def lm_data_dir(tmp_path_factory) -> str:
    """One TFDS data_dir for the real corpora, shared by the session."""
    return str(tmp_path_factory.mktemp("lm_tfds"))


def _lines_oracle(data: bytes) -> list[str]:
    """Lines of a UTF-8 text without their newline (an unterminated last line is kept)."""
    lines = data.decode("utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def _no_network(monkeypatch) -> None:
    def fail(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr(raw_files.socket, "getaddrinfo", fail)
    monkeypatch.setattr(raw_files.urllib.request, "getproxies", dict)


# --------------------------------------------------------------------------- registry


def test_registry():
    assert set(LM_CORPORA) == {
        "ptb",
        "ptb_char",
        "wikitext2",
        "wikitext103",
        "enwik8",
        "text8",
        "lm1b",
    }
    metrics = {name: info.metric for name, info in LM_CORPORA.items()}
    assert [n for n, m in metrics.items() if m == "bpc"] == ["ptb_char", "enwik8", "text8"]
    assert corpus_info("enwik8").tokenization == "byte"
    assert corpus_info("text8").tokenization == "char"
    assert corpus_info("lm1b").splits == ("train", "test")
    assert corpus_info("ptb").splits == ("train", "valid", "test")


def test_unknown_corpus_or_split_lists_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="valid corpora: ptb, ptb_char, wikitext2"):
        read_corpus("wikitext-2", "train", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="valid splits: train, valid, test") as info:
        read_corpus("ptb", "validation", data_dir=str(tmp_path))
    assert "'validation'" in str(info.value)
    with pytest.raises(ValueError, match="valid splits: train, test"):
        read_corpus("lm1b", "valid", data_dir=str(tmp_path))


def test_stream_split_bounds_match_transformer_xl():
    # Transformer-XL: test = last 5M, valid = the 5M before, train = first 90M.
    assert stream_split_bounds(100_000_000) == {
        "train": (0, 90_000_000),
        "valid": (90_000_000, 95_000_000),
        "test": (95_000_000, 100_000_000),
    }
    assert stream_split_bounds(0) == {"train": (0, 0), "valid": (0, 0), "test": (0, 0)}


# --------------------------------------------------------------------------- real data


@pytest.mark.parametrize(  # fast: PTB (the others take as long, through the same builder)
    "name", [n if n == "ptb" else pytest.param(n, marks=pytest.mark.slow) for n in REAL]
)
def test_real_corpus(name, lm_data_dir):
    folder, pattern, expected_tokens, vocab_size = REAL[name]
    root = SHARED / folder
    if not root.is_dir():
        pytest.skip(f"local copy not found at {root}")
    data = {
        s: read_corpus(name, s, data_dir=lm_data_dir, manual_dir=str(root))
        for s in ("train", "valid", "test")
    }
    for split, lines in data.items():
        assert lines == _lines_oracle(gzip.decompress((root / pattern.format(split)).read_bytes()))
    vocab = build_vocab(corpus_info(name), data["train"])
    assert isinstance(vocab, WordVocab) and vocab.size == vocab_size
    ids = {split: vocab.encode(lines) for split, lines in data.items()}
    counts = {s: sum(len(line.split()) + 1 for line in lines) for s, lines in data.items()}
    assert {s: len(x) for s, x in ids.items()} == counts
    if expected_tokens is not None:
        assert counts == expected_tokens
    for split in ("valid", "test"):  # no token outside the training vocabulary
        assert {t for line in data[split] for t in line.split()} <= set(vocab.tokens)
    # ids by descending train frequency; the stream round-trips.
    freq = np.bincount(ids["train"], minlength=vocab.size)
    assert (np.diff(freq) <= 0).all() and freq.min() > 0
    assert ids["train"].dtype == np.int32
    assert (
        vocab.decode(ids["valid"][:200]).split()
        == (f" {EOS} ".join(data["valid"]) + f" {EOS}").split()[:200]
    )
    assert (ids["test"] == vocab.eos_id).sum() == len(data["test"])
    if name == "ptb_char":
        assert "_" in vocab and vocab.unk_id is None
    else:
        assert vocab.unk_id is not None


# --------------------------------------------------------------------------- tiny upstream files


def _enwik8_like(n: int) -> bytes:
    """n bytes of XML-ish UTF-8 whose valid split starts inside a multi-byte character."""
    unit = "<page>\n  <title>Zürich</title> 10 € & 𝄞 [[naïve]]\n</page>\n".encode()
    for size in range(n, n + 64):
        data = (unit * (size // len(unit) + 1))[:size]
        if data[size - 2 * (size // 20)] & 0xC0 == 0x80:  # a UTF-8 continuation byte
            return data
    raise AssertionError("no size found")


def test_enwik8_from_zip_round_trips_bytes(tmp_path):
    data = _enwik8_like(2_500_000)  # train spans 3 chunks of 1 MiB
    manual = tmp_path / "enwik8"
    manual.mkdir()
    with zipfile.ZipFile(manual / "enwik8.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", data)
    n, k = len(data), len(data) // 20
    expected = {"train": data[: n - 2 * k], "valid": data[n - 2 * k : n - k], "test": data[n - k :]}
    got = {
        s: read_corpus("enwik8", s, data_dir=str(tmp_path / "tfds"), manual_dir=str(manual))
        for s in expected
    }
    assert got == expected
    with pytest.raises(UnicodeDecodeError):
        got["valid"].decode("utf-8")  # the split point cuts a character, bytes survive
    source = prepare_corpus("enwik8", data_dir=str(tmp_path / "tfds")).as_data_source("train")
    assert len(source) == 3 and len(source[0]["bytes"]) == CHUNK_BYTES
    vocab = build_vocab(corpus_info("enwik8"), got["train"])
    ids = vocab.encode(got["valid"])
    assert vocab.size == 256 and ids.dtype == np.int32 and len(ids) == k
    assert (ids == np.frombuffer(expected["valid"], np.uint8)).all()
    assert vocab.decode(ids) == expected["valid"]
    assert (ids == ord("\n")).sum() == expected["valid"].count(b"\n") > 0


def test_text8_from_extracted_file(tmp_path):
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz      ", np.uint8)
    text = letters[rng.integers(0, len(letters), 4000)].tobytes()
    manual = tmp_path / "text8"
    manual.mkdir()
    (manual / "text8").write_bytes(text)
    got = {
        s: read_corpus("text8", s, data_dir=str(tmp_path / "tfds"), manual_dir=str(manual))
        for s in ("train", "valid", "test")
    }
    assert got == {"train": text[:3600], "valid": text[3600:3800], "test": text[3800:]}
    vocab = build_vocab(corpus_info("text8"), got["train"])
    assert isinstance(vocab, CharVocab) and vocab.size == 27 and vocab.chars[0] == " "
    ids = vocab.encode(got["test"])
    assert ids.dtype == np.int32 and vocab.decode(ids) == text[3800:].decode()


def test_wikitext103_from_zip(tmp_path):
    files = {
        "train": " \n = Ünïcode = \n \n the cat sat on the <unk> . \n the end \n",
        "valid": " \n the dog sat \n",
        "test": " = T = \n the cat \n",
    }
    manual = tmp_path / "manual"
    manual.mkdir()
    with zipfile.ZipFile(manual / "wikitext-103-v1.zip", "w") as z:
        for split, text in files.items():
            z.writestr(f"wikitext-103/wiki.{split}.tokens", text.encode())
    data = {
        s: read_corpus("wikitext103", s, data_dir=str(tmp_path / "tfds"), manual_dir=str(manual))
        for s in files
    }
    assert data == {s: _lines_oracle(t.encode()) for s, t in files.items()}
    vocab = build_vocab(corpus_info("wikitext103"), data["train"])
    assert vocab.tokens[:3] == (EOS, "the", "=")  # 5, 3 and 2 times
    ids = vocab.encode(data["valid"])  # "dog" is unknown -> <unk>
    assert vocab.decode(ids) == f"{EOS} the {UNK} sat {EOS}"


def test_jobs_that_start_together_prepare_a_corpus_once(tmp_path):
    """Two readers of a fresh data_dir at once (a job array's first start): one prepares it
    while the other waits for its lock, then reads what it wrote (TFDS refused to rename the
    second preparation onto the first, and the waiter's builder must reload its splits)."""
    manual = tmp_path / "ptb"
    manual.mkdir()
    for split, text in {"train": "a b\n", "valid": "a\n", "test": "b c\nc\n"}.items():
        (manual / f"ptb.{split}.txt.gz").write_bytes(gzip.compress(text.encode()))
    data_dir = str(tmp_path / "tfds")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reads = [
            pool.submit(read_corpus, "ptb", "test", data_dir=data_dir, manual_dir=str(manual))
            for _ in range(2)
        ]
        assert [r.result() for r in reads] == [["b c", "c"]] * 2


def test_ptb_from_tgz_in_manual_dir_and_gz_files(tmp_path):
    lines = {"train": "a b\n c <unk>\n", "valid": "a\n", "test": "b c\n"}
    manual = tmp_path / "ptb"
    manual.mkdir()
    with tarfile.open(manual / "simple-examples.tgz", "w:gz") as tar:
        for split, text in lines.items():
            info = tarfile.TarInfo(f"./simple-examples/data/ptb.{split}.txt")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))
    got = read_corpus("ptb", "train", data_dir=str(tmp_path / "tfds"), manual_dir=str(manual))
    assert got == ["a b", " c <unk>"]
    # The same files gzip-compressed directly in the manual dir.
    plain = tmp_path / "plain"
    plain.mkdir()
    for split, text in lines.items():
        (plain / f"ptb.{split}.txt.gz").write_bytes(gzip.compress(text.encode()))
    got = read_corpus("ptb", "test", data_dir=str(tmp_path / "tfds2"), manual_dir=str(plain))
    assert got == ["b c"]


def test_partial_copy_is_rejected(tmp_path):
    (tmp_path / "ptb.train.txt").write_text("a\n")
    with pytest.raises(FileNotFoundError, match="missing ptb.valid.txt, ptb.test.txt"):
        read_corpus("ptb", "train", data_dir=str(tmp_path / "tfds"), manual_dir=str(tmp_path))


def test_invalid_utf8_is_rejected(tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / f"wiki.{split}.tokens").write_bytes(b"ok\ncaf\xe9\n")
    with pytest.raises(ValueError, match=r"wiki\.train\.tokens: line 2 is not valid UTF-8"):
        read_corpus("wikitext2", "train", data_dir=str(tmp_path / "tfds"), manual_dir=str(tmp_path))


# --------------------------------------------------------------------------- download / offline


def _write_archive(path: Path, files: dict[str, bytes]) -> Path:
    """Writes a .zip or .tar.gz archive holding ``files`` ({member name: content})."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".zip":
        with zipfile.ZipFile(path, "w") as z:
            for name, data in files.items():
                z.writestr(name, data)
    else:
        with tarfile.open(path, "w:gz") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def _official_members() -> dict[str, dict[str, bytes]]:
    """The files of tiny archives laid out like the official downloads, by URL."""
    splits = ("train", "valid", "test")
    ptb = {}
    for s in splits:
        ptb[f"./simple-examples/data/ptb.{s}.txt"] = f" {s} words \n".encode()
        ptb[f"./simple-examples/data/ptb.char.{s}.txt"] = f"{' '.join(s)} \n ".encode()
    ptb["./simple-examples/models/unrelated.bin"] = b"\x00"
    wiki = {s: f" \n = {s} = \n".encode() for s in splits}
    lm1b = {
        "training-monolingual.tokenized.shuffled/news.en-00001-of-00100": b"A sentence .\n",
        "training-monolingual.tokenized.shuffled/news.en-00002-of-00100": b"Another one .\n",
        "heldout-monolingual.tokenized.shuffled/news.en.heldout-00000-of-00050": b"Held out .\n",
    }
    return {
        URLS["ptb"]: ptb,
        URLS["wikitext2"]: {f"wikitext-2/wiki.{s}.tokens": t for s, t in wiki.items()},
        URLS["wikitext103"]: {f"wikitext-103/wiki.{s}.tokens": t for s, t in wiki.items()},
        URLS["enwik8"]: {"enwik8": b"<mediawiki>\n" * 20},
        URLS["text8"]: {"text8": b" anarchism originated" * 20},
        URLS["lm1b"]: {f"{LM1B_TOP}/{name}": data for name, data in lm1b.items()},
    }


def _official_archives(root: Path) -> dict[str, Path]:
    """Tiny archives laid out like the official downloads, by URL."""
    return {
        url: _write_archive(root / url.rsplit("/", 1)[-1], files)
        for url, files in _official_members().items()
    }


def _fake_download(monkeypatch, archives: dict[str, Path]) -> list[str]:
    """Makes the TFDS download manager 'download' the given archives; returns the URLs asked."""
    import tensorflow_datasets as tfds

    requested = []

    def download(self, url):
        requested.append(url)
        return archives[url]

    monkeypatch.setattr(raw_files.socket, "getaddrinfo", lambda *a, **k: [])
    monkeypatch.setattr(tfds.download.DownloadManager, "download", download)
    return requested


def _accept_tiny_archives(monkeypatch, name: str) -> None:
    """Records the digests of the tiny archives' files as the upstream ones of ``name``."""
    members = _official_members()[URLS[name]]
    digests = {Path(m).name: hashlib.sha256(data).hexdigest() for m, data in members.items()}
    recorded = checksums.SHA256.get(name, {})
    monkeypatch.setitem(checksums.SHA256, name, {f: digests[f] for f in recorded})


@pytest.mark.parametrize("name", list(LM_CORPORA))
def test_download_uses_official_url_and_archive_layout(name, tmp_path, monkeypatch):
    requested = _fake_download(monkeypatch, _official_archives(tmp_path / "upstream"))
    _accept_tiny_archives(monkeypatch, name)
    split = corpus_info(name).splits[-1]
    data_dir = str(tmp_path / "tfds")
    got = read_corpus(name, split, data_dir=data_dir, manual_dir=str(tmp_path / "none"))
    assert requested == [URLS[name]]
    expected = {
        "ptb": [" test words "],
        "ptb_char": ["t e s t ", " "],
        "wikitext2": [" ", " = test = "],
        "wikitext103": [" ", " = test = "],
        "enwik8": (b"<mediawiki>\n" * 20)[228:],
        "text8": (b" anarchism originated" * 20)[399:],
        "lm1b": ["Held out ."],
    }
    assert got == expected[name]
    if name == "lm1b":
        train = read_corpus(name, "train", data_dir=data_dir)
        assert sorted(train) == ["A sentence .", "Another one ."]
    else:  # only the corpus files were extracted, into a temporary folder
        assert not [p for p in (tmp_path / "tfds" / "downloads").rglob("*") if p.is_file()]


def test_downloaded_file_that_differs_from_upstream_is_an_error(tmp_path, monkeypatch):
    _fake_download(monkeypatch, _official_archives(tmp_path / "upstream"))  # not upstream text
    with pytest.raises(ValueError, match=r"ptb\.train\.txt in .*simple-examples\.tgz") as info:
        read_corpus(
            "ptb", "valid", data_dir=str(tmp_path / "tfds"), manual_dir=str(tmp_path / "no")
        )
    message = str(info.value)
    assert f"downloaded from {URLS['ptb']}" in message
    assert checksums.SHA256["ptb"]["ptb.train.txt"] in message


def test_lm1b_url_is_the_catalog_one():
    # The TFDS catalog's checksum file checks the lm1b download by this URL.
    from tensorflow_datasets.datasets.lm1b import lm1b_dataset_builder as tfds_lm1b

    assert corpus_info("lm1b").raw.url == tfds_lm1b._DOWNLOAD_URL == URLS["lm1b"]


def test_lm1b_from_manual_dir(tmp_path, monkeypatch):
    _no_network(monkeypatch)
    archive = _official_archives(tmp_path / "upstream")[URLS["lm1b"]]
    manual = tmp_path / "lm1b"
    raw_files.extract(archive, manual)  # the extracted folder
    got = read_corpus("lm1b", "test", data_dir=str(tmp_path / "tfds"), manual_dir=str(manual))
    assert got == ["Held out ."]


@pytest.mark.parametrize("name", list(LM_CORPORA))
def test_offline_without_local_copy_explains_where_files_go(name, tmp_path, monkeypatch):
    _no_network(monkeypatch)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataDownloadError) as info:
        read_corpus(name, "train", data_dir=str(tmp_path / "tfds"), manual_dir=str(empty))
    message = str(info.value)
    assert str(empty) in message
    assert "XFORMER_DATA_DIR" in message
    assert URLS[name] in message
    assert "unreachable" in message


# --------------------------------------------------------------------------- vocabularies


def test_word_vocab_order_unk_and_save(tmp_path):
    lines = ["b a b", "c  a", "", "a"]
    vocab = WordVocab.build(lines)
    # a: 3, <eos>: 4, b: 2, c: 1; ties would keep first appearance.
    assert vocab.tokens == (EOS, "a", "b", "c")
    assert WordVocab.build(["y x", "x y"]).tokens == ("y", "x", EOS)
    ids = vocab.encode_lines(lines)
    assert ids.tolist() == [2, 1, 2, 0, 3, 1, 0, 0, 1, 0] and ids.dtype == np.int32
    assert vocab.encode([]).shape == (0,)
    message = "'zebra' is not in the vocabulary, which has no <unk> .* set data.vocab_size"
    with pytest.raises(DataValueError, match=message):  # one line from train.py and eval.py
        vocab.encode(["a zebra"])
    with_unk = WordVocab.build(["a <unk> a"])
    assert with_unk.encode(["zebra a"]).tolist() == [with_unk.unk_id, 0, with_unk.eos_id]
    path = tmp_path / "vocab.txt"
    vocab.save(path)
    assert path.read_text() == "<eos>\na\nb\nc\n"
    assert WordVocab.load(path).tokens == vocab.tokens


def test_word_vocab_max_size_keeps_eos_and_adds_unk():
    """<unk> stands for the dropped tokens and takes their count's place in the frequency
    order (adaptive softmax's clusters assume ids sorted by frequency)."""
    lines = ["a a a a b b b c c d", "e f f"]  # drops c, d, e, f: <unk> counts 2 + 1 + 1 + 2
    vocab = WordVocab.build(lines, max_size=4)
    assert vocab.tokens == (UNK, "a", "b", EOS)
    assert vocab.encode(["d a"]).tolist() == [0, 1, 3]
    assert WordVocab.build(["a a b <unk> c c"], max_size=3).tokens == (UNK, "a", EOS)
    assert WordVocab.build(lines, max_size=100).size == 7  # no truncation, no <unk>
    assert build_vocab(corpus_info("lm1b"), lines, max_size=4).tokens == vocab.tokens


def test_char_and_byte_vocab(tmp_path):
    vocab = CharVocab.build(b"abcab a")
    assert vocab.chars == ("a", "b", " ", "c")
    assert vocab.encode("cab ").tolist() == [3, 0, 1, 2]
    assert vocab.decode([0, 2, 3]) == "a c"
    with pytest.raises(ValueError, match="'z' is not in the vocabulary"):
        vocab.encode("az")
    with pytest.raises(ValueError, match="'\U0001d11e' is not in the vocabulary"):
        vocab.encode("a\U0001d11e")  # beyond the largest code point of the vocabulary
    assert CharVocab.build("").encode("").shape == (0,)
    path = tmp_path / "chars.txt"
    vocab.save(path)
    assert CharVocab.load(path).chars == vocab.chars
    unicode = CharVocab.build("𝄞ü€€")  # ties by code point
    assert unicode.chars == ("€", "ü", "𝄞") and unicode.decode(unicode.encode("𝄞ü")) == "𝄞ü"
    mixed = CharVocab.build("ab €")  # ASCII text (uint8 code points) with a table past 255
    assert mixed.encode("ba").tolist() == [2, 1] and mixed.encode(b"a ").tolist() == [1, 0]
    assert mixed.unknown_chars("abz") == {"z": 1} and mixed.unknown_chars("ü€") == {"ü": 1}
    byte = ByteVocab()
    assert byte.encode(b"\x00\xff\n").tolist() == [0, 255, 10]
    assert byte.decode(np.array([104, 105])) == b"hi"
    with pytest.raises(ValueError):
        build_vocab(corpus_info("enwik8"), b"x", max_size=10)
