"""Training time: a clock that pauses for evaluation and checkpoints, and its h/m/s format."""

import contextlib
import time
from collections.abc import Iterator


class TrainClock:
    """Seconds spent training: `seconds` (e.g. restored from a checkpoint) plus the time since
    it was made, less the time spent inside `paused()`."""

    def __init__(self, seconds: float = 0.0):
        self._counted, self._since = seconds, time.perf_counter()

    def seconds(self) -> float:
        if self._since is None:  # paused
            return self._counted
        return self._counted + time.perf_counter() - self._since

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._counted, self._since = self.seconds(), None
        try:
            yield
        finally:
            self._since = time.perf_counter()


def format_duration(seconds: float) -> str:
    """Under a minute "12.3s", else e.g. "1h02m03s"."""
    if seconds < 60:
        return f"{max(seconds, 0.0):.1f}s"
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"
