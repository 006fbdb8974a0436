"""A bounded queue of asynchronously dispatched steps.

A jitted call returns before the devices finish it, so a Python loop can queue many steps
ahead. With several devices in one process, XLA's CPU runtime deadlocks when too many
programs with collectives are queued (an evaluation loop with a cross-device sum hung with 64
steps queued on 4 simulated CPU devices, jax 0.10.2, and ran with 16). A few queued steps
already keep the devices busy, so loops wait for the step `size` places back.
"""

import collections

import jax

MAX_STEPS_QUEUED = 8


class DispatchWindow:
    """push(outputs of a dispatched step): returns once at most `size` pushed steps are
    unfinished."""

    def __init__(self, size: int = MAX_STEPS_QUEUED):
        self.size = size
        self._queued: collections.deque = collections.deque()

    def push(self, outputs) -> None:
        self._queued.append(outputs)
        if len(self._queued) > self.size:
            jax.block_until_ready(self._queued.popleft())
