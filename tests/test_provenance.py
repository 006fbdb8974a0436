"""run_info.json's provenance: the git commit and dirty flag of the checkout, the libraries,
and every start of a resumed run."""

import importlib.metadata
import os
import subprocess

import jax
import pytest

from xformer import provenance


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / "tracked.py").write_text("x = 1\n")
    git(tmp_path, "add", "tracked.py")
    git(tmp_path, "commit", "-q", "-m", "first")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    return tmp_path


def test_commit_and_dirty_flag(repo):
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert provenance.git_state() == {"commit": head, "dirty": False}
    (repo / "untracked.txt").write_text("notes")  # untracked files do not count
    assert provenance.git_state()["dirty"] is False
    (repo / "tracked.py").write_text("x = 2\n")
    assert provenance.git_state() == {"commit": head, "dirty": True}


def test_no_repository_is_unknown_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    assert provenance.git_state() == {"commit": None, "dirty": None}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git binary at all
    assert provenance.git_state() == {"commit": None, "dirty": None}


def test_versions_and_devices(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    record = provenance.start_record(step=7)
    assert record["glibc_tunables"] == "glibc.malloc.hugetlb=1"
    assert record["versions"]["jax"] == jax.__version__
    assert record["versions"]["flax"] == importlib.metadata.version("flax")
    assert record["versions"]["orbax-checkpoint"] == importlib.metadata.version("orbax-checkpoint")
    assert record["devices"] == jax.device_count() and record["processes"] == 1
    assert record["device_kind"] == jax.devices()[0].device_kind and record["step"] == 7
    assert record["cpu_count"] == os.cpu_count() and record["cpu"]
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            assert record["cpu"] == names[0]


def test_a_resumed_run_keeps_every_start():
    legacy = {"num_params": 5, "devices": 1, "start_step": 0}  # before starts were kept
    first = provenance.with_start(legacy, {"commit": "a", "step": 4}, 5)
    assert first["starts"] == [legacy, {"commit": "a", "step": 4}]
    second = provenance.with_start(first, {"commit": "b", "step": 8}, 5)
    assert [s.get("commit") for s in second["starts"]] == [None, "a", "b"]
    assert second["commits"] == [None, "a", "b"] and second["num_params"] == 5
    fresh = provenance.with_start(None, {"commit": "a", "step": 0}, 3)
    assert fresh == {"num_params": 3, "starts": [{"commit": "a", "step": 0}], "commits": ["a"]}
