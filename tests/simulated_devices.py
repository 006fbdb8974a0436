"""Running a test's own script on several simulated CPU devices, in a fresh process (the
device count is fixed when jax starts)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, devices: int, *args: str, timeout: int = 600) -> str:
    """`python script *args` from the repository root on `devices` XLA:CPU devices; asserts
    that it exits 0 and returns its stdout."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    result = subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        env={**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout
