"""SIGTERM / SIGINT during training: finish the step, checkpoint, exit with EXIT_STOPPED.

Schedulers preempt with SIGTERM and a grace period; a user presses Ctrl-C. The first signal
asks the train loop to stop after its current step (it saves a checkpoint, data position and
XL memory included, and flushes metrics; re-running the same command resumes); a second one
exits at once, as the signal's default action would.
"""

import os
import signal
import threading

from absl import logging

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after checkpointing; re-run to resume
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    """Between install() and uninstall(), SIGTERM / SIGINT set `signal_name` instead of
    killing. Outside the main thread (where Python cannot install handlers) it does nothing."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum: int, frame) -> None:
        if self.requested():  # the second signal: its default action, now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal_name = signal.Signals(signum).name
        logging.warning(
            "%s: stopping after this step with a checkpoint (send it again to exit at once)",
            self.signal_name,
        )
