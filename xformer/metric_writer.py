"""Scalars to TensorBoard event files and to <workdir>/metrics.jsonl."""

import json
import os
import time

import numpy as np
from tensorboardX import SummaryWriter


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
            self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def write_text(self, step: int, name: str, text: str) -> None:
        if self.enabled:
            self._tb.add_text(name, text, step)

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tb.close()
