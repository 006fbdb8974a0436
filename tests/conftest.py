"""Shared fixtures: tiny models, real Multi30k data, and a prepared TFDS directory."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    if not SHARED_MULTI30K.exists():
        pytest.skip(f"real data not found at {SHARED_MULTI30K}")
    return SHARED_MULTI30K


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory, multi30k_dir) -> str:
    """One prepared Multi30k array_record copy shared by every test of the session."""
    return os.fspath(tmp_path_factory.mktemp("tfds"))
