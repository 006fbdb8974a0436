"""Shared fixtures: tiny models, real Multi30k data, a prepared TFDS directory, and the
per-backend program forms.

Before any test imports jax, pytest_configure sets two things for this process and every
subprocess it starts (train.py, eval.py, xdist workers), through the environment:

* one persistent JAX compilation cache for the whole session (a fresh temp dir, removed at
  the end), so a resumed run, a reference run and eval.py reuse the programs an earlier
  process compiled instead of compiling them again;
* faster XLA:CPU compilation, which dominates the suite's time (the tiny test programs run
  just as well unoptimized): LLVM at optimization level 0, elementwise fusions through the
  classic IR emitter rather than the MLIR fusion emitters, no verification of emitted IR.
  HLO-level optimizations still run (the classic path fuses a little differently).
* glibc's malloc tuned as the entry scripts run it (xformer/malloc_tuning.py).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from xformer import malloc_tuning

ROOT = Path(__file__).resolve().parents[1]
SHARED_MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"

FAST_COMPILE_XLA_FLAG = "--xla_backend_optimization_level=0"
# 25-35% less backend compile time for a tiny train step on jax 0.10.2. Probed: jax 0.11.2's
# XLA no longer has the first (it aborts on it), and the second alone saves nothing there.
FAST_EMITTER_XLA_FLAGS = (
    "--xla_cpu_use_fusion_emitters=false --xla_cpu_emitter_verification_level=0"
)
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_owned_cache_dir: str | None = None


def pytest_configure(config):
    global _owned_cache_dir
    if "jax" in sys.modules:  # too late for the environment to take effect in this process
        raise RuntimeError("tests/conftest.py must configure JAX before jax is imported")
    if not os.environ.get(_CACHE_ENV):  # xdist workers inherit the controller's
        _owned_cache_dir = tempfile.mkdtemp(prefix="xformer-jax-cache-")
        os.environ[_CACHE_ENV] = _owned_cache_dir
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:  # xdist workers inherit the controller's
        flags = f"{flags} {FAST_COMPILE_XLA_FLAG}".strip()
        if _xla_accepts(f"{flags} {FAST_EMITTER_XLA_FLAGS}"):
            flags = f"{flags} {FAST_EMITTER_XLA_FLAGS}"
    os.environ["XLA_FLAGS"] = flags
    malloc_tuning.set_for_new_processes()  # as train.py runs; this process runs no test under xdist


def _xla_accepts(flags: str) -> bool:
    """Whether this jaxlib's XLA starts with `flags` (it aborts on an unknown flag)."""
    probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
    env = {**os.environ, "XLA_FLAGS": flags}
    return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0


def pytest_unconfigure(config):
    if _owned_cache_dir is not None:
        shutil.rmtree(_owned_cache_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def multi30k_dir() -> Path:
    if not SHARED_MULTI30K.exists():
        pytest.skip(f"real data not found at {SHARED_MULTI30K}")
    return SHARED_MULTI30K


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory, multi30k_dir) -> str:
    """One prepared Multi30k array_record copy shared by every test of the session."""
    return os.fspath(tmp_path_factory.mktemp("tfds"))


@pytest.fixture
def use_form(monkeypatch):
    """use_form(module, form): a module with a CPU_FORM_PLATFORMS switch computes its XLA:CPU
    form ("cpu") or the other backends' ("other") on this machine, for this test."""
    import jax  # not at import time: pytest_configure sets XLA's flags first

    def use(module, form: str) -> None:
        platforms = {jax.default_backend()} if form == "cpu" else set()
        monkeypatch.setattr(module, "CPU_FORM_PLATFORMS", frozenset(platforms))

    return use
