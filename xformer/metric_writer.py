"""Scalars to TensorBoard event files and to <workdir>/metrics.jsonl."""

import json
import os
import re
import sys
import time

import numpy as np


def _import_tensorboardx():
    """tensorboardX, imported without torch: its writer imports torch wherever torch is
    installed (4-5 s and a thread pool in every train.py and eval.py) only to accept torch
    tensors, and xformer writes floats and text. Hidden, `import torch` raises ImportError,
    which tensorboardX handles; a process that imported torch already keeps it."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import tensorboardX
        import tensorboardX.summary
    finally:
        if hide:
            del sys.modules["torch"]
    return tensorboardX


_tensorboardx = _import_tensorboardx()
SummaryWriter = _tensorboardx.SummaryWriter
hparams_summaries = _tensorboardx.summary.hparams


_NOT_IN_TAGS = re.compile(r"[^-/\w.]")


def tensorboard_tag(name: str) -> str:
    """`name` as a TensorBoard tag: characters other than letters, digits and "_-./" become "_"
    ("val[:128]/nll" -> "val__128_/nll"), as tensorboardX would do, with a log line each time.
    metrics.jsonl keeps the names as given."""
    return _NOT_IN_TAGS.sub("_", name).lstrip("/")


class MetricWriter:
    def __init__(self, workdir: str, enabled: bool = True):
        self.enabled = enabled
        if enabled:
            os.makedirs(workdir, exist_ok=True)
            self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict, prefix: str = "") -> None:
        if not self.enabled:
            return
        scalars = {f"{prefix}{k}": float(np.asarray(v)) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **scalars}) + "\n")
        self._jsonl.flush()
        for k, v in scalars.items():
            self._tb.add_scalar(tensorboard_tag(k), v, step)
        self._tb.flush()

    def write_text(self, step: int, name: str, text: str) -> None:
        if self.enabled:
            self._tb.add_text(tensorboard_tag(name), text, step)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()


def write_hparams_summary(logdir: str, hparams: dict, metrics: dict, step: int) -> None:
    """One session of TensorBoard's HParams dashboard in `logdir`: `hparams` (values that are
    not bool, int, float or str are written as JSON text) and `metrics` (also written as
    scalars at `step`, which is where the dashboard reads their values; names as tags)."""
    plain = {
        k: v if isinstance(v, bool | int | float | str) else json.dumps(v)
        for k, v in hparams.items()
    }
    metrics = {tensorboard_tag(name): value for name, value in metrics.items()}
    experiment, start, end = hparams_summaries(plain, metrics)
    with SummaryWriter(logdir) as writer:
        for summary in (experiment, start, end):
            writer.file_writer.add_summary(summary)
        for name, value in metrics.items():
            writer.add_scalar(name, value, step)
