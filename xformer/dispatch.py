"""A bounded queue of asynchronously dispatched steps.

A jitted call returns before the devices finish it, so a Python loop can queue many steps
ahead. With several devices in one process, XLA's CPU runtime deadlocks when too many
programs with collectives are queued (an evaluation loop with a cross-device sum hung with 64
steps queued on 4 simulated CPU devices, jax 0.10.2, and ran with 16; with 8 an all-reduce still
aborted once in a clean-clone test suite, "AwaitAndLogIfStuck"). A few queued steps
already keep the devices busy, so loops wait for the step `size` places back; with several CPU
devices in one process they wait for each step before the next is dispatched.
"""

import collections

import jax

MAX_STEPS_QUEUED = 8


def default_size() -> int:
    """0 (synchronous) with several CPU devices in one process, else MAX_STEPS_QUEUED."""
    cpu_devices = [d for d in jax.local_devices() if d.platform == "cpu"]
    return 0 if len(cpu_devices) > 1 else MAX_STEPS_QUEUED


class DispatchWindow:
    """push(outputs of a dispatched step): returns once at most `size` pushed steps are
    unfinished."""

    def __init__(self, size: int | None = None):
        self.size = default_size() if size is None else size
        self._queued: collections.deque = collections.deque()

    def push(self, outputs) -> None:
        self._queued.append(outputs)
        if len(self._queued) > self.size:
            jax.block_until_ready(self._queued.popleft())
