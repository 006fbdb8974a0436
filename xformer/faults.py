"""Fault injection: stall a training run at a chosen point, so that a test or the chaos
benchmark kills it exactly there (no sleeps tuned to one machine).

    XFORMER_FAULT=commit:4:/tmp/stalled python train.py ...

- `commit:<step>:<marker>`: checkpoint <step> is written to its temporary directory, then its
  commit (orbax's atomic rename) waits forever: a kill now interrupts an asynchronous write.
- `step:<step>:<marker>`: after step <step> is dispatched the loop waits until a stop is
  requested (SIGTERM / SIGINT; with several processes, until they are deciding where to stop),
  then goes on: a kill now falls between checkpoints.

On stalling, the process writes the file <marker>. Unset (the default), nothing changes.
"""

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

from orbax.checkpoint.path import atomicity

ENV = "XFORMER_FAULT"


def _spec() -> tuple[str, int, str] | None:
    value = os.environ.get(ENV)
    if not value:
        return None
    kind, step, marker = value.split(":", 2)
    if kind not in ("commit", "step"):
        raise ValueError(
            f"{ENV}={value!r}: expected commit:<step>:<marker> or step:<step>:<marker>"
        )
    return kind, int(step), marker


def _stalled(marker: str) -> None:
    Path(marker).write_text(f"stalled in process {os.getpid()}\n")


def stall_after_step(
    step: int, stop_requested: Callable[[], bool], wait_for_checkpoints: Callable[[], None]
) -> None:
    """Wait, at the step named by `step:<n>:<marker>`, until `stop_requested()`. Checkpoints
    still being written are committed first: a kill at the stall falls between checkpoints."""
    spec = _spec()
    if spec and spec[:2] == ("step", step):
        wait_for_checkpoints()
        _stalled(spec[2])
        while not stop_requested():
            time.sleep(0.02)


class CommitPath(atomicity.AtomicRenameTemporaryPath):
    """orbax's write-then-rename checkpoint directory, whose commit stalls for
    `commit:<step>:<marker>`."""

    async def finalize(self, *args, **kwargs):
        spec = _spec()
        final = Path(str(self.get_final()))
        if spec and spec[0] == "commit" and str(spec[1]) in (final.name, final.parent.name):
            _stalled(spec[2])
            while True:
                await asyncio.sleep(1)
        return await super().finalize(*args, **kwargs)


def checkpoint_path_class() -> type[atomicity.AtomicRenameTemporaryPath] | None:
    """CommitPath for a `commit:` fault, else None (orbax's default)."""
    spec = _spec()
    return CommitPath if spec and spec[0] == "commit" else None
