"""Tests for finding raw files (xformer.data.raw_files), the checksum table
(xformer.data.checksums), the dataset registry and data folders reached through symlinks."""

import gzip
import logging
import os
from pathlib import Path

import pytest

from xformer.data import checksums, raw_files
from xformer.data.checksums import SHA256, content_sha256, verify
from xformer.data.raw_files import find_local_files, resolve_manual_dir
from xformer.data.readers import read_corpus, translation_source
from xformer.data.registry import DATASETS, LM_CORPORA, dataset_entry

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared" / "data"
PTB = DATASETS["ptb"].raw


def _write_ptb(directory: Path, texts: dict[str, str], gz: bool = False) -> Path:
    """Writes ptb.<split>.txt (or .txt.gz) files; returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, text in texts.items():
        data = text.encode()
        name = f"ptb.{split}.txt"
        if gz:
            (directory / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (directory / name).write_bytes(data)
    return directory


TINY_PTB = {"train": "a b\n", "valid": "a\n", "test": "b\n"}


# --------------------------------------------------------------------------- registry


def test_registry_has_both_families():
    kinds = {name: entry.kind for name, entry in DATASETS.items()}
    assert kinds["multi30k"] == "translation"
    assert {n for n, k in kinds.items() if k == "language_model"} == set(LM_CORPORA)
    assert dataset_entry("multi30k").metric == "bleu"
    assert dataset_entry("wikitext2").folder == "wikitext-2"
    with pytest.raises(ValueError, match="valid datasets: multi30k, ptb"):
        dataset_entry("no_such_dataset")
    for entry in DATASETS.values():  # every builder exists and has the registry name
        assert entry.builder_class().name == entry.name


# --------------------------------------------------------------------------- manual dir


def test_resolve_manual_dir_order(tmp_path, monkeypatch):
    monkeypatch.setenv("XFORMER_DATA_DIR", str(tmp_path))
    assert resolve_manual_dir("multi30k", "/explicit/dir") == "/explicit/dir"
    assert resolve_manual_dir("multi30k", None) == str(tmp_path / "multi30k")
    assert resolve_manual_dir("wmt14_translate/de-en", None) == str(tmp_path / "wmt14_translate")
    monkeypatch.delenv("XFORMER_DATA_DIR")
    assert resolve_manual_dir("no_such_dataset_here", None) is None
    shared = SHARED / "multi30k"  # spelled as the checkout's ../shared, symlinks kept
    assert resolve_manual_dir("multi30k", None) == (str(shared) if shared.is_dir() else None)


def test_find_local_files_subdirs_gz_and_partial(tmp_path):
    root = tmp_path / "ptb"
    assert find_local_files(PTB, None) is None
    assert find_local_files(PTB, root) is None  # missing folder: nothing found
    nested = _write_ptb(root / "simple-examples" / "data", TINY_PTB, gz=True)
    found = find_local_files(PTB, root)
    assert found == {f"ptb.{s}.txt": nested / f"ptb.{s}.txt.gz" for s in TINY_PTB}
    (root / "ptb.test.txt").write_text("b\n")  # a partial copy higher up is an error
    with pytest.raises(FileNotFoundError, match="missing ptb.train.txt, ptb.valid.txt"):
        find_local_files(PTB, root)


def _symlinked_tree(tmp_path: Path) -> tuple[Path, Path]:
    """<tmp>/checkout_parent/shared -> <tmp>/mount, whose data/ holds a PTB copy; and
    <tmp>/data_dir/multi30k -> <tmp>/elsewhere/m30k (a Multi30k copy in raw/)."""
    mount = tmp_path / "mount"
    _write_ptb(mount / "data" / "ptb", TINY_PTB, gz=True)
    parent = tmp_path / "checkout_parent"
    parent.mkdir()
    (parent / "shared").symlink_to(mount, target_is_directory=True)
    m30k = tmp_path / "elsewhere" / "m30k" / "raw"
    m30k.mkdir(parents=True)
    for name in DATASETS["multi30k"].raw.files:
        (m30k / name).write_bytes(gzip.compress(f"{name}\n".encode()))
    data_dir = tmp_path / "data_dir"
    data_dir.mkdir()
    (data_dir / "multi30k").symlink_to(m30k.parent, target_is_directory=True)
    return parent / "shared" / "data", data_dir


def test_data_folders_reached_through_symlinks(tmp_path, monkeypatch):
    shared, data_dir = _symlinked_tree(tmp_path)
    monkeypatch.delenv("XFORMER_DATA_DIR", raising=False)
    monkeypatch.setattr(raw_files, "SHARED_DATA_DIR", shared)
    # The shared folder behind a symlinked ../shared: found, spelled without resolving.
    resolved = resolve_manual_dir("ptb", None)
    assert resolved == str(shared / "ptb") and os.path.realpath(resolved) != resolved
    found = find_local_files(PTB, resolved)
    assert found["ptb.train.txt"] == shared / "ptb" / "ptb.train.txt.gz"
    assert read_corpus("ptb", "train", data_dir=str(tmp_path / "tfds")) == ["a b"]
    # A data folder that is itself a symlink ($XFORMER_DATA_DIR/multi30k).
    monkeypatch.setenv("XFORMER_DATA_DIR", str(data_dir))
    assert resolve_manual_dir("multi30k", None) == str(data_dir / "multi30k")
    found = find_local_files(DATASETS["multi30k"].raw, resolve_manual_dir("multi30k", None))
    assert found["val.de.gz"] == data_dir / "multi30k" / "raw" / "val.de.gz"
    src = translation_source("multi30k", "val", data_dir=str(tmp_path / "tfds"))
    assert list(src) == [{"en": "val.en.gz", "de": "val.de.gz"}]


# --------------------------------------------------------------------------- checksums


def test_checksum_table_covers_registered_files_only():
    for dataset, digests in SHA256.items():
        assert set(digests) <= set(DATASETS[dataset].raw.files), dataset
        assert all(len(d) == 64 and int(d, 16) >= 0 for d in digests.values())
    # PTB-char's train file in ../shared is derived, not upstream: no digest recorded.
    assert set(SHA256["ptb_char"]) == {"ptb.char.valid.txt", "ptb.char.test.txt"}


@pytest.mark.parametrize("dataset", sorted(SHA256))
def test_recorded_digests_match_shared_data(dataset):
    entry = DATASETS[dataset]
    root = SHARED / entry.folder
    if not root.is_dir():
        pytest.skip(f"local copy not found at {root}")
    paths = find_local_files(entry.raw, root)
    assert paths is not None
    for name, digest in SHA256[dataset].items():
        assert content_sha256(paths[name]) == digest, paths[name]


def test_content_digest_is_the_same_plain_or_gz(tmp_path):
    plain = _write_ptb(tmp_path / "plain", TINY_PTB)
    gz = _write_ptb(tmp_path / "gz", TINY_PTB, gz=True)
    for split in TINY_PTB:
        name = f"ptb.{split}.txt"
        assert content_sha256(plain / name) == content_sha256(gz / f"{name}.gz")


def test_local_copy_that_differs_warns(tmp_path, caplog):
    local = _write_ptb(tmp_path / "ptb", TINY_PTB)
    paths = find_local_files(PTB, local)
    with caplog.at_level(logging.WARNING, logger=checksums.__name__):
        verify("ptb", PTB, paths, downloaded=False)
    assert "differ from upstream" in caplog.text and "ptb.valid.txt" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=checksums.__name__):
        lines = read_corpus("ptb", "valid", data_dir=str(tmp_path / "tfds"), manual_dir=str(local))
    assert lines == ["a"]  # read all the same
    assert "differ from upstream" in caplog.text


def test_download_that_differs_is_an_error(tmp_path, monkeypatch):
    local = _write_ptb(tmp_path / "ptb", TINY_PTB)
    paths = find_local_files(PTB, local)
    with pytest.raises(ValueError, match=r"ptb\.train\.txt .*downloaded from .* has SHA-256"):
        verify("ptb", PTB, paths, downloaded=True)
    # Recorded digests that match: no error; files without a digest are not checked.
    digests = {name: content_sha256(path) for name, path in paths.items()}
    monkeypatch.setitem(SHA256, "ptb", digests)
    verify("ptb", PTB, paths, downloaded=True)
    monkeypatch.setitem(SHA256, "ptb", {})
    verify(
        "ptb", PTB, {**paths, "ptb.train.txt": tmp_path / "ptb" / "ptb.test.txt"}, downloaded=True
    )
