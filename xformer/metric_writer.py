"""Scalars to TensorBoard event files and to <workdir>/metrics.jsonl."""

import glob
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
    """Appends to metrics.jsonl and the TensorBoard events, keeping the rows and events that
    earlier starts logged for steps up to `resume_step` only: a run resumed from checkpoint N
    drops those after N (a killed start logged them after its last checkpoint; this one logs
    them again), a fresh start (-1) drops all of a start that died before its first checkpoint."""

    def __init__(self, workdir: str, enabled: bool = True, resume_step: int = -1):
        self.enabled = enabled
        if enabled:
            os.makedirs(workdir, exist_ok=True)
            path = os.path.join(workdir, "metrics.jsonl")
            if os.path.exists(path):
                _drop_rows_after(path, resume_step)
            self._jsonl = open(path, "a")  # noqa: SIM115
            logdir = os.path.join(workdir, "tensorboard")
            earlier = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
            purge = resume_step + 1 if earlier else None
            self._tb = SummaryWriter(logdir, purge_step=purge)

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


def _drop_rows_after(path: str, step: int) -> None:
    """Rewrite the JSONL file `path` without its rows of steps after `step` (and any torn last
    line), under a temporary name renamed over it."""
    with open(path) as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if row.get("step", 0) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


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
