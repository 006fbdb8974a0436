"""What produced a run: the code's git commit, the command, library versions and the devices,
recorded at every train.py start in <workdir>/run_info.json."""

import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax

REPO = Path(__file__).resolve().parents[1]  # the checkout that holds the xformer package
LIBRARIES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "grain",
    "tensorflow-datasets",
    "numpy",
    "sentencepiece",
    "sacrebleu",
)


def _git(*args: str) -> str | None:
    """git's output in REPO, or None when there is no git, no repository or it fails."""
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """{"commit": HEAD's hash or None, "dirty": whether tracked files differ from HEAD (untracked
    files do not count) or None when unknown}."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "commit": commit.strip() if commit else None,
        "dirty": None if status is None else bool(status.strip()),
    }


def library_versions() -> dict[str, str | None]:
    versions = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cpu_model() -> str:
    """The host CPU's model name (from /proc/cpuinfo on Linux), else platform's best guess."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_string() -> str:
    """One line for benchmark output, e.g. "cpu:cpu x1 | AMD EPYC, 2 cores"."""
    device = jax.devices()[0]
    return (
        f"{device.platform}:{device.device_kind} x{jax.device_count()} | "
        f"{cpu_model()}, {os.cpu_count()} cores"
    )


def start_record(step: int) -> dict[str, Any]:
    """This process's start: time, step, code, command line, libraries, devices and hosts."""
    devices = jax.devices()
    return {
        "time": time.time(),
        "step": step,
        **git_state(),
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        "versions": library_versions(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "local_devices": jax.local_device_count(),
        "processes": jax.process_count(),
        "hostname": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),  # malloc_tuning.py
    }


def with_start(run_info: dict | None, start: dict[str, Any], num_params: int) -> dict[str, Any]:
    """run_info.json with one more start: {"num_params", "starts": [every start, oldest
    first], "commits": the distinct commits of the starts}. A run_info from before starts were
    kept (one flat record) becomes the first start."""
    run_info = run_info or {}
    starts = run_info.get("starts", [run_info] if run_info else [])
    starts = [*starts, start]
    commits = list(dict.fromkeys(s.get("commit") for s in starts))
    return {"num_params": num_params, "starts": starts, "commits": commits}
