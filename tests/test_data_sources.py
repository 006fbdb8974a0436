"""Tests for translation_source (xformer.data.readers), the Multi30k TFDS builder and the strict
text readers (xformer.data.text); no TensorFlow needed."""

import gzip
import pickle
import random
import tempfile
from pathlib import Path

import pytest

from xformer.data import raw_files, readers, registry
from xformer.data.builder_base import BaseBuilder
from xformer.data.builders import multi30k
from xformer.data.errors import DataDownloadError, DataFileNotFoundError, DataValueError
from xformer.data.readers import read_all, translation_source
from xformer.data.text import read_parallel_files, read_text_lines

REPO_ROOT = Path(__file__).resolve().parents[1]
MULTI30K_DIR = REPO_ROOT.parent / "shared" / "data" / "multi30k"
RAW_DIR = MULTI30K_DIR / "raw"

needs_multi30k = pytest.mark.skipif(
    not MULTI30K_DIR.is_dir(), reason=f"local Multi30k copy not found at {MULTI30K_DIR}"
)


def _gz_lines(path: Path) -> list[str]:
    """Independent oracle: the lines of a gzip UTF-8 file without their newline."""
    text = gzip.decompress(path.read_bytes()).decode("utf-8")
    assert text.endswith("\n")
    return text[:-1].split("\n")


@pytest.fixture(scope="session")
def multi30k_data_dir(tmp_path_factory) -> str:
    """A TFDS data_dir with Multi30k prepared from the local copy (once per session)."""
    if not MULTI30K_DIR.is_dir():
        pytest.skip(f"local Multi30k copy not found at {MULTI30K_DIR}")
    data_dir = str(tmp_path_factory.mktemp("tfds"))
    translation_source("multi30k", "val", data_dir=data_dir, manual_dir=str(MULTI30K_DIR))
    return data_dir


def _source(data_dir: str, split: str) -> readers.TranslationSource:
    return translation_source("multi30k", split, data_dir=data_dir, manual_dir=str(MULTI30K_DIR))


# --------------------------------------------------------------------------- Multi30k


@needs_multi30k
def test_split_sizes(multi30k_data_dir):
    assert multi30k.SPLIT_SIZES == {
        "train": 29000,
        "val": 1014,
        "test_2016_flickr": 1000,
        "test_2017_flickr": 1000,
        "test_2017_mscoco": 461,
    }
    for split, size in multi30k.SPLIT_SIZES.items():
        src = _source(multi30k_data_dir, split)
        assert len(src) == size, split
        assert src.languages == ("en", "de")


@needs_multi30k
def test_records_match_file_lines(multi30k_data_dir):
    src = _source(multi30k_data_dir, "test_2016_flickr")
    en = _gz_lines(RAW_DIR / "test_2016_flickr.en.gz")
    de = _gz_lines(RAW_DIR / "test_2016_flickr.de.gz")
    assert len(en) == len(de) == len(src) == 1000
    indices = [0, 1, 999, *random.Random(1234).sample(range(1000), 20)]
    for i in indices:
        record = src[i]
        assert record == {"en": en[i], "de": de[i]}, i
        assert all(isinstance(v, str) for v in record.values())
    assert src[0]["en"] == "A man in an orange hat starring at something."
    assert src[-1] == {"en": en[-1], "de": de[-1]}
    assert src.__getitems__([5, 0, -1]) == [src[5], src[0], src[999]]
    with pytest.raises(IndexError):
        src[1000]


@needs_multi30k
def test_read_all_every_split_in_file_order(multi30k_data_dir):
    for split in multi30k.SPLITS:
        records = read_all(_source(multi30k_data_dir, split))
        en = _gz_lines(RAW_DIR / f"{split}.en.gz")
        de = _gz_lines(RAW_DIR / f"{split}.de.gz")
        assert [r["en"] for r in records] == en, split
        assert [r["de"] for r in records] == de, split
    # Small batches and plain sequences take the same path / fallback.
    src = _source(multi30k_data_dir, "test_2017_mscoco")
    assert read_all(src, batch_size=7) == list(src) == [src[i] for i in range(len(src))]
    assert read_all([{"a": 1}, {"a": 2}]) == [{"a": 1}, {"a": 2}]


@needs_multi30k
def test_source_pickles(multi30k_data_dir):
    src = _source(multi30k_data_dir, "val")
    clone = pickle.loads(pickle.dumps(src))
    assert len(clone) == len(src) and clone[17] == src[17]


def test_text_features_reads_exactly_one_byte_string_per_key():
    from tensorflow_datasets.proto import tf_example_pb2

    example = tf_example_pb2.Example()
    example.features.feature["en"].bytes_list.value.append("Zwei Männer".encode())
    example.features.feature["two"].bytes_list.value.extend([b"a", b"b"])
    record = example.SerializeToString()
    assert readers.text_features(record, ["en"]) == ["Zwei Männer".encode()]
    with pytest.raises(ValueError, match="one byte string in feature 'two'.*got 2"):
        readers.text_features(record, ["en", "two"])
    with pytest.raises(ValueError, match=r"feature 'de' of a record, got 0 \(features: \['en'"):
        readers.text_features(record, ["de"])


@needs_multi30k
def test_unknown_split_lists_valid_splits(multi30k_data_dir):
    with pytest.raises(ValueError, match="test_2016_flickr") as info:
        _source(multi30k_data_dir, "test")
    assert "'test'" in str(info.value) and "train, val" in str(info.value)


def _write_manual_dir(root: Path, lines: dict[str, list[bytes]]) -> Path:
    """Writes <split>.<lang>.gz files; splits not in `lines` get one line per language."""
    root.mkdir(parents=True, exist_ok=True)
    for split in multi30k.SPLITS:
        for lang in multi30k.LANGUAGES:
            data = lines.get(f"{split}.{lang}", [f"{split} {lang}\n".encode()])
            (root / f"{split}.{lang}.gz").write_bytes(gzip.compress(b"".join(data)))
    return root


def test_builder_keeps_empty_lines_and_strips_only_newlines(tmp_path):
    manual = _write_manual_dir(
        tmp_path / "manual" / "raw",  # files may sit in raw/ below the manual dir
        {
            "val.en": [b"first\n", b"\n", b"  spaced  \r\n", b"\r\n", b"last no newline"],
            "val.de": [b"erste\n", b"zweite\n", b"\n", b"vierte\n", "f\u00fcnfte\n".encode()],
        },
    )
    src = translation_source(
        "multi30k", "val", data_dir=str(tmp_path / "tfds"), manual_dir=str(manual.parent)
    )
    assert read_all(src) == [
        {"en": "first", "de": "erste"},
        {"en": "", "de": "zweite"},
        {"en": "  spaced  ", "de": ""},
        {"en": "", "de": "vierte"},
        {"en": "last no newline", "de": "f\u00fcnfte"},
    ]
    assert len(translation_source("multi30k", "train", data_dir=str(tmp_path / "tfds"))) == 1


def test_builders_leave_no_temp_folders_and_ask_no_bucket(tmp_path, monkeypatch):
    """A builder made for an unprepared data_dir: TFDS's DatasetInfo would probe its GCS
    bucket for the dataset's metadata and leave an empty tmp*tfds folder behind each time."""
    from tensorflow_datasets.core.utils import gcs_utils

    def no_bucket(name):
        raise AssertionError(f"asked TFDS's bucket for {name}")

    monkeypatch.setattr(gcs_utils, "gcs_dataset_info_files", no_bucket)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    ours = [n for n, e in registry.DATASETS.items() if issubclass(e.builder_class(), BaseBuilder)]
    assert {"multi30k", "ptb", "wikitext2"} <= set(ours)
    for name in ours:
        builder = registry.make_builder(name, str(tmp_path / "tfds"))
        assert not builder.data_path.exists()  # unprepared: TFDS went to initialize_from_bucket
    assert list((tmp_path / "tmp").iterdir()) == []


def test_builder_rejects_mismatched_split(tmp_path):
    manual = _write_manual_dir(tmp_path / "manual", {"val.de": [b"a\n", b"b\n"]})
    with pytest.raises(DataValueError, match="different line counts") as info:
        translation_source(
            "multi30k", "val", data_dir=str(tmp_path / "tfds"), manual_dir=str(manual)
        )
    message = str(info.value)
    assert "val.en.gz has 1 lines" in message and "val.de.gz has 2 lines" in message


def test_builder_rejects_invalid_utf8(tmp_path):
    manual = _write_manual_dir(
        tmp_path / "manual", {"train.de": [b"ok\n", b"caf\xe9\n"], "train.en": [b"a\n", b"b\n"]}
    )
    with pytest.raises(DataValueError, match=r"train\.de\.gz: line 2 is not valid UTF-8"):
        translation_source(
            "multi30k", "train", data_dir=str(tmp_path / "tfds"), manual_dir=str(manual)
        )


def test_builder_rejects_partial_copy(tmp_path):
    manual = _write_manual_dir(tmp_path / "manual", {})
    (manual / "test_2017_mscoco.de.gz").unlink()
    with pytest.raises(DataFileNotFoundError, match="missing test_2017_mscoco.de.gz"):
        translation_source(
            "multi30k", "val", data_dir=str(tmp_path / "tfds"), manual_dir=str(manual)
        )


def test_offline_without_local_copy_explains_where_files_go(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr(raw_files.socket, "getaddrinfo", no_network)
    monkeypatch.setattr(raw_files.urllib.request, "getproxies", dict)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataDownloadError) as info:
        translation_source(
            "multi30k", "val", data_dir=str(tmp_path / "tfds"), manual_dir=str(empty)
        )
    message = str(info.value)
    assert str(empty) in message
    assert "XFORMER_DATA_DIR" in message
    assert "https://github.com/multi30k/dataset/raw/master/data/task1/raw/" in message
    assert "train.en.gz" in message


def _fake_download(monkeypatch, files: dict[str, Path]) -> list:
    """Makes the TFDS download manager 'download' Multi30k from local files."""
    import tensorflow_datasets as tfds

    requested = []

    def download(self, urls):
        requested.append(dict(urls))
        return {name: files[name] for name in urls}

    monkeypatch.setattr(raw_files.socket, "getaddrinfo", lambda *a, **k: [])
    monkeypatch.setattr(tfds.download.DownloadManager, "download", download)
    return requested


@needs_multi30k
def test_download_path_uses_upstream_urls_and_checks_sha256(tmp_path, monkeypatch):
    requested = _fake_download(monkeypatch, {n: RAW_DIR / n for n in multi30k.file_names()})
    src = translation_source(
        "multi30k", "test_2017_mscoco", data_dir=str(tmp_path), manual_dir=str(tmp_path / "none")
    )
    assert len(src) == 461
    assert requested == [
        {
            n: f"https://github.com/multi30k/dataset/raw/master/data/task1/raw/{n}"
            for n in multi30k.file_names()
        }
    ]


@needs_multi30k
def test_download_with_wrong_checksum_fails(tmp_path, monkeypatch):
    files = {n: RAW_DIR / n for n in multi30k.file_names()}
    files["val.de.gz"] = tmp_path / "val.de.gz"
    files["val.de.gz"].write_bytes(gzip.compress(b"tampered\n"))
    _fake_download(monkeypatch, files)
    with pytest.raises(ValueError, match="val.de.gz .* has SHA-256"):
        translation_source(
            "multi30k", "val", data_dir=str(tmp_path / "tfds"), manual_dir=str(tmp_path / "none")
        )


# --------------------------------------------------------------------------- text files


def test_read_text_lines_plain_and_gzip(tmp_path):
    data = b"a\r\n\n\nb\rc\n  d \n\xc3\xa4\n"
    expected = ["a", "", "", "b\rc", "  d ", "\u00e4"]
    plain = tmp_path / "x.txt"
    plain.write_bytes(data)
    gz = tmp_path / "x.gz"
    gz.write_bytes(gzip.compress(data))
    assert read_text_lines(str(plain)) == expected
    assert read_text_lines(str(gz)) == expected


def test_read_text_lines_edge_cases(tmp_path):
    cases = {b"": [], b"\n": [""], b"x": ["x"], b"x\ny": ["x", "y"], b"\n\n": ["", ""]}
    for i, (data, expected) in enumerate(cases.items()):
        path = tmp_path / f"{i}.txt"
        path.write_bytes(data)
        assert read_text_lines(str(path)) == expected, data


def test_read_text_lines_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "bad.de"
    path.write_bytes(b"gut\n\nnoch gut\nschl\xe9cht\nende\n")
    with pytest.raises(ValueError, match=r"bad\.de: line 4 is not valid UTF-8") as info:
        read_text_lines(str(path))
    assert "column 5" in str(info.value)
    gz = tmp_path / "bad.de.gz"
    gz.write_bytes(gzip.compress(b"\xff\n"))
    with pytest.raises(ValueError, match=r"bad\.de\.gz: line 1 is not valid UTF-8"):
        read_text_lines(str(gz))


def test_read_parallel_files(tmp_path):
    src = tmp_path / "train.en"
    tgt = tmp_path / "train.de"
    src.write_text("a\n\nc\n", encoding="utf-8")
    tgt.write_text("x\ny\nz\n", encoding="utf-8")
    assert read_parallel_files(str(src), str(tgt)) == (["a", "", "c"], ["x", "y", "z"])
    tgt.write_text("x\ny\n", encoding="utf-8")
    with pytest.raises(ValueError, match="different line counts") as info:
        read_parallel_files(str(src), str(tgt))
    message = str(info.value)
    assert f"{src} has 3 lines" in message and f"{tgt} has 2 lines" in message
