"""Run python scripts (train.py, eval.py) as subprocesses of this interpreter, each echoed first
as the command line a user would type ("python train.py ...")."""

import contextlib
import json
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from xformer.files import write_json


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
    RuntimeError."""
    echo(shlex.join(cmd))
    with open(log, "w") if log else contextlib.nullcontext() as f:
        result = subprocess.run(
            [sys.executable, *cmd[1:]],
            cwd=cwd,
            stdout=subprocess.PIPE if capture else f,
            stderr=f,
            text=True,
            check=False,
        )
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
