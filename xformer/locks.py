"""Exclusive locks for jobs that run at once (e.g. a SLURM job array): per sweep point, and
around work that one job does for all of them (training a shared tokenizer).

A lock is an advisory flock(2) on a file: the OS releases it when its holder exits, however it
dies (kill -9 included), so there is never a stale lock to clean up. The holder writes its host,
pid and start time into the file for whoever finds the lock taken. On a shared filesystem the
jobs of other hosts see the lock only where flock works across hosts (local disks, NFSv4,
Lustre mounted with -o flock, GPFS); elsewhere two jobs could run the same point.
"""

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator

_UNKNOWN = {"host": "?", "pid": "?", "since": None}
# `exclusive` tries this many more times, this far apart, before it finds a lock taken.
PROBE_RETRIES, PROBE_RETRY_S = 10, 0.1


def _open(path: str) -> int:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _try_lock(path: str) -> int | None:
    """An open descriptor holding the exclusive lock of `path`, or None if another holds it."""
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _sign(fd: int) -> None:
    """Write this process into the lock file it holds, for `holder`."""
    info = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(info).encode())


def holder(path: str) -> dict | None:
    """Who holds the lock of `path` ({"host", "pid", "since"}), or None when it is free. (It
    probes by taking and at once releasing the lock; `exclusive` tries again for a second, so a
    job starting in that instant does not find the point taken.)"""
    if not os.path.exists(path):
        return None
    fd = _try_lock(path)
    if fd is not None:
        os.close(fd)  # closing releases it
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # taken, but its holder has not written itself yet
        return dict(_UNKNOWN)


def describe(info: dict) -> str:
    since = info.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return f"host {info.get('host')}, pid {info.get('pid')}, since {when}"


@contextlib.contextmanager
def exclusive(path: str) -> Iterator[dict | None]:
    """Hold the lock of `path` for the block: yields None when this process holds it, or the
    other holder's info when it is taken (the block must then leave the point alone)."""
    fd = _try_lock(path)
    for _ in range(PROBE_RETRIES):  # (a `holder` probe holds the lock for an instant)
        if fd is not None:
            break
        time.sleep(PROBE_RETRY_S)
        fd = _try_lock(path)
    if fd is None:
        taken_by = holder(path)
        fd = _try_lock(path) if taken_by is None else None  # released meanwhile: take it
        if fd is None:
            yield taken_by or dict(_UNKNOWN)
            return
    try:
        _sign(fd)
        _HELD.add(fd)
        yield None
    finally:
        _HELD.discard(fd)
        os.close(fd)


# The descriptors of the `exclusive` locks this process holds. launch.run hands them to the
# commands it starts: a flock belongs to the open file, so a point's train.py keeps its point
# locked if the sweep that started it dies (else another job would train the same workdir).
_HELD: set[int] = set()


def held() -> tuple[int, ...]:
    return tuple(sorted(_HELD))


@contextlib.contextmanager
def waiting(path: str, on_wait: Callable[[dict], None] = lambda holder: None) -> Iterator[None]:
    """Hold the lock of `path` for the block, first waiting for its holder, if any, to release
    it; `on_wait` gets that holder's info before the wait."""
    fd = _open(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(holder(path) or dict(_UNKNOWN))
            fcntl.flock(fd, fcntl.LOCK_EX)
        _sign(fd)
        yield
    finally:
        os.close(fd)
