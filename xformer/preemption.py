"""SIGTERM / SIGINT during training: finish the step, checkpoint, exit with EXIT_STOPPED.

Schedulers preempt with SIGTERM and a grace period; a user presses Ctrl-C. The first signal
asks the train loop to stop after its current step (it saves a checkpoint, data position and
XL memory included, and flushes metrics; re-running the same command resumes); a second one
exits at once, as the signal's default action would. The same signal again within
SAME_REQUEST_S is the first one delivered twice (a Ctrl-C reaches every process of the
terminal's process group, a scheduler may signal every process of a job, and a sweep forwards
what it gets to its train.py), so it does not count as the second.

With several processes, SIGTERM belongs to JAX's preemption service (jax.distributed
.initialize installs it), which makes every process stop after the same step
(distributed.preemption_sync_point); a SIGINT is handed to it as a SIGTERM. A second SIGTERM
there does nothing (a scheduler's SIGKILL ends the grace period); a second SIGINT exits.
"""

import os
import signal
import threading
import time

from absl import logging

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after checkpointing; re-run to resume
SIGNALS = (signal.SIGTERM, signal.SIGINT)
SAME_REQUEST_S = 1.0


class StopOnSignal:
    """Between install() and uninstall(), SIGTERM / SIGINT set `signal_name` instead of
    killing; with `several_processes`, only SIGINT, which is passed on to JAX's preemption
    service. Outside the main thread (where Python cannot install handlers) it does nothing."""

    def __init__(self, several_processes: bool = False):
        self.signal_name: str | None = None
        self.several_processes = several_processes
        self._first_at = 0.0  # time.monotonic() of the first signal
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            mine = (signal.SIGINT,) if self.several_processes else SIGNALS
            self._previous = {s: signal.signal(s, self._handle) for s in mine}

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested():
            if name == self.signal_name and time.monotonic() - self._first_at < SAME_REQUEST_S:
                return  # the first signal, delivered twice
            signal.signal(signum, signal.SIG_DFL)  # the second signal: its default action, now
            os.kill(os.getpid(), signum)
            return
        self.signal_name, self._first_at = name, time.monotonic()
        if self.several_processes:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption service: all stop
        logging.warning(
            "%s: stopping after this step with a checkpoint (send it again, a second later, to "
            "exit at once)",
            self.signal_name,
        )
