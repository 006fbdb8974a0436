"""Run python scripts (train.py, eval.py) as subprocesses of this interpreter, each echoed first
as the command line a user would type ("python train.py ...").

SIGINT and SIGTERM sent to this process while a command runs are forwarded to it, and this
process waits for it to exit (train.py finishes its step and checkpoints): it is never killed.
A Ctrl-C or a scheduler that signals every process of a job thus reaches the command twice
within milliseconds, which train.py takes as one request (xformer/preemption.py). Inside
`signals_deferred()` a signal that arrives between commands is kept: the next `run` starts
nothing and raises StoppedError (no KeyboardInterrupt traceback, no exit in the middle of
bookkeeping).
"""

import contextlib
import json
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from xformer import locks
from xformer.files import write_json

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StoppedError(Exception):
    """A command exited after a signal was forwarded to it, or a signal came between commands:
    whatever runs it should stop too."""


_deferred: list[str] = []  # the names of the signals kept by signals_deferred(), in order


def print_now(line: str) -> None:
    print(line, flush=True)  # before the command's own output


def run(
    cmd: Sequence[str],
    *,
    cwd: str | None = None,
    log: str | None = None,
    check: bool = False,
    capture: bool = False,
    echo: Callable[[str], None] = print_now,
) -> subprocess.CompletedProcess:
    """Run `cmd` ("python script.py ...") with sys.executable. Its output goes to the file `log`
    when given (stdout to the result instead, with capture); with check, a failure raises
    RuntimeError. StoppedError when a signal was forwarded to it (see the module docstring)."""
    if _deferred:
        raise StoppedError(f"{'+'.join(_deferred)} before {shlex.join(cmd)} started")
    echo(shlex.join(cmd))
    args = [sys.executable, *cmd[1:]]
    with open(log, "w") if log else contextlib.nullcontext() as f:
        stdout = subprocess.PIPE if capture else f
        child = subprocess.Popen(
            args, cwd=cwd, stdout=stdout, stderr=f, text=True, pass_fds=locks.held()
        )
        with _forwarding_signals(child) as forwarded:
            out, _ = child.communicate()
    result = subprocess.CompletedProcess(args, child.returncode, out)
    if forwarded:
        got = "+".join(forwarded)
        raise StoppedError(f"{shlex.join(cmd)} got {got}, exited with {child.returncode}")
    if check and result.returncode:
        see = f"; see {log}" if log else ""
        raise RuntimeError(f"{shlex.join(cmd)} exited with {result.returncode}{see}")
    return result


def run_json(cmd: Sequence[str], *, save: str | None = None, **kwargs) -> Any:
    """Run `cmd`, a script that prints one JSON document (eval.py), and return that document,
    also written to the file `save` when given; RuntimeError if it fails. kwargs go to `run`."""
    result = json.loads(run(cmd, check=True, capture=True, **kwargs).stdout)
    if save:
        write_json(save, result)
    return result


@contextlib.contextmanager
def _forwarding_signals(child: subprocess.Popen) -> Iterator[list[str]]:
    """Forward FORWARDED_SIGNALS to `child`, listing their names (main thread only: Python
    handles signals there)."""
    forwarded: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield forwarded
        return

    def forward(signum: int, frame) -> None:
        forwarded.append(signal.Signals(signum).name)
        child.send_signal(signum)  # nothing once the child has been reaped

    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    for name in _deferred:  # arrived after run() checked, before these handlers were set
        forward(signal.Signals[name], None)
    try:
        yield forwarded
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Within: a FORWARDED_SIGNALS signal that arrives while no command runs is kept rather
    than acted on; the next `run` raises StoppedError instead of starting its command (main
    thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def keep(signum: int, frame) -> None:
        _deferred.append(signal.Signals(signum).name)

    previous = {s: signal.signal(s, keep) for s in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _deferred.clear()
