"""Multi-process runs (jax.distributed): start-up, and what the processes must agree on.

Every process runs the same program over its own devices; collectives join them. A decision
one process takes alone (a clock, a file it finds) must reach the others, or one skips a
collective the rest wait in, and the run hangs.
"""

import contextlib
import json
import signal
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

# The coordination-service directory where JAX's preemption sync protocol collects each
# process's step count (xla/tsl preemption_sync_manager.cc): read by preemption_decided only.
PREEMPTION_COUNTS = "PREEMPTION_CURRENT_COUNTER/"


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    training: bool,
) -> None:
    """jax.distributed.initialize: explicit arguments where given, else what JAX detects from
    the cluster's environment (SLURM, Open MPI, Cloud TPU, GKE, JAX_COORDINATOR_ADDRESS).

    It gives SIGTERM to JAX's preemption service, which only the training loop of several
    processes asks (see preemption_sync_point); elsewhere (`training` False, or one process)
    SIGTERM ends the process again, as without jax.distributed, instead of being kept for no
    one."""
    explicit = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    jax.distributed.initialize(**{k: v for k, v in explicit.items() if v is not None})
    if not training or jax.process_count() == 1:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def check_preemption_service() -> None:
    """Several processes agree on a stop through JAX's preemption service: fail before any
    compute where it is off (they could not stop together on a signal)."""
    if jax.process_count() > 1 and not jax.config.jax_enable_preemption_service:
        raise ValueError(
            "several processes stop on a signal through JAX's preemption service, which is off: "
            "unset JAX_ENABLE_PREEMPTION_SERVICE / jax_enable_preemption_service=False"
        )


def preemption_sync_point(count: int) -> bool:
    """Whether every process stops after this start's `count`th step (count 1, 2, ... on every
    process, after every step). With several processes, jax.distributed.initialize has given
    SIGTERM to JAX's preemption service: a SIGTERM to any process starts a protocol among all of
    them, on host threads through the coordination service (no device collective), that picks
    the step after the furthest any of them has reached; each returns True there. Counted
    from this start, not from the checkpoint's step, a signal during set-up (counts still 0)
    stops after the first step. One process: False (it acts on its own signal)."""
    return jax.process_count() > 1 and multihost_utils.reached_preemption_sync_point(count)


def preemption_decided() -> bool:
    """Every process has sent its step count to JAX's preemption sync protocol: the stop step
    is being decided, and this process's next preemption_sync_point call waits for it. (For a
    fault injection that stalls a process until a signal's stop is under way.)"""
    from jax._src import distributed as jax_distributed  # (its coordination-service client)

    counts = jax_distributed.global_state.client.key_value_dir_get(PREEMPTION_COUNTS)
    return len(counts) == jax.process_count()


@contextlib.contextmanager
def main_process_first(name: str) -> Iterator[None]:
    """Process 0 runs the block (e.g. preparing data, training a vocabulary on shared storage)
    while the others wait; then they run it, finding its files ready. One process: no wait.
    The block must hold no collective (no orbax manager, no multi-process jit): process 0 would
    meet it alone."""
    if jax.process_count() > 1 and jax.process_index() != 0:
        multihost_utils.sync_global_devices(name)
    try:
        yield
    finally:  # also when it failed: the others then run the block and report the error too
        if jax.process_count() > 1 and jax.process_index() == 0:
            multihost_utils.sync_global_devices(name)


def allgather_json(value: Any) -> list:
    """Every process's JSON-serialisable `value`, in process order, on every process."""
    if jax.process_count() == 1:
        return [value]
    raw = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size]))).ravel()
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: raw.size] = raw
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[:n])) for row, n in zip(rows, lengths, strict=True)]
