"""The code base stays ruff clean (configured in pyproject.toml)."""

import shutil
import subprocess
from pathlib import Path

import pytest


def test_ruff_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    result = subprocess.run(
        [ruff, "check", "."],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout
