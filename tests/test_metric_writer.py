"""MetricWriter: every scalar in metrics.jsonl and in TensorBoard's event file, and tensorboardX
imported without torch (which it would otherwise import wherever torch is installed)."""

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_sweep import read_events

from xformer.metric_writer import MetricWriter, tensorboard_tag

ROOT = Path(__file__).resolve().parents[1]


def test_scalars_reach_the_jsonl_file_and_the_event_file(tmp_path):
    rng = np.random.default_rng()
    rows = {step: {"loss": rng.normal(), "lr": np.float32(rng.uniform())} for step in (1, 5, 9)}
    writer = MetricWriter(str(tmp_path))
    for step, metrics in rows.items():
        writer.write(step, metrics, prefix="train/")
    writer.close()

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(rows)
    for line, metrics in zip(lines, rows.values(), strict=True):
        assert line["train/loss"] == float(metrics["loss"])
        assert line["train/lr"] == float(metrics["lr"])
    logged = {
        (v.tag, e.step): v.simple_value
        for e in read_events(tmp_path / "tensorboard")
        for v in e.summary.value
    }
    expected = {
        (f"train/{k}", step): v for step, metrics in rows.items() for k, v in metrics.items()
    }
    assert logged.keys() == expected.keys()
    for key, value in expected.items():
        assert logged[key] == pytest.approx(float(value), rel=1e-6), key  # float32 on disk


def test_a_resumed_writer_drops_the_steps_after_its_checkpoint(tmp_path):
    """A run killed after step 5 but resumed from checkpoint 3 logs steps 4 and 5 again: their
    old rows go (and a line cut by the kill); TensorBoard is told to purge from step 4."""
    writer = MetricWriter(str(tmp_path))
    for step in range(1, 6):
        writer.write(step, {"loss": float(step)}, prefix="train/")
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo')
    resumed = MetricWriter(str(tmp_path), resume_step=3)
    resumed.write(4, {"loss": 40.0}, prefix="train/")
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in lines] == [(1, 1), (2, 2), (3, 3), (4, 40)]
    starts = [e.step for e in read_events(tmp_path / "tensorboard") if e.HasField("session_log")]
    assert starts == [4]  # (TensorBoard drops the earlier files' events from step 4 on)


def test_a_fresh_start_drops_what_a_start_without_checkpoints_logged(tmp_path):
    """A start killed before its first checkpoint leaves rows that a fresh start (no checkpoint
    to resume) would log again, maybe with another config: they go, and TensorBoard is told to
    purge the earlier events from step 0. A first start into an empty workdir purges nothing."""
    writer = MetricWriter(str(tmp_path))
    for step in (50, 100):
        writer.write(step, {"loss": 9.0}, prefix="train/")
    writer.close()
    assert not [e for e in read_events(tmp_path / "tensorboard") if e.HasField("session_log")]
    fresh = MetricWriter(str(tmp_path))
    fresh.write(50, {"loss": 1.0}, prefix="train/")
    fresh.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in lines] == [(50, 1.0)]
    starts = [e.step for e in read_events(tmp_path / "tensorboard") if e.HasField("session_log")]
    assert starts == [0]


def test_a_logged_validation_is_found_by_its_step_and_split(tmp_path):
    """The validation row of a step (not its training row, not another split's, not a line cut
    by a kill): what a resumed run reads to know that validation finished."""
    from xformer.train_lib import logged_validation

    writer = MetricWriter(str(tmp_path))
    writer.write(4, {"loss": 3.0, "nll": 3.0}, prefix="train/")
    writer.write(4, {"val[:8]/nll": 2.5, "val[:8]/bleu": 7.0, "train/train_seconds": 9.0})
    writer.write(6, {"loss": 2.0, "nll": 2.0}, prefix="train/")
    writer.write(6, {"test/nll": 2.0})
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "val[:8]/nll": 1.')
    assert logged_validation(str(tmp_path), 4, "val[:8]") == {"nll": 2.5, "bleu": 7.0}
    assert logged_validation(str(tmp_path), 6, "val[:8]") is None
    assert logged_validation(str(tmp_path), 4, "val") is None
    assert logged_validation(str(tmp_path), 6, "train") is None  # a training row is none
    assert logged_validation(str(tmp_path / "absent"), 4, "val[:8]") is None


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_tensorboardx_is_imported_without_torch():
    code = "import sys, xformer.metric_writer; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
    code = "import sys, torch, xformer.metric_writer as m; print(m.SummaryWriter.__module__)"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "tensorboardX.writer"  # a process with torch keeps it


def test_names_that_are_not_tags_are_renamed_quietly(tmp_path, caplog):
    """A sliced split's metrics ("val[:128]/nll") keep their names in metrics.jsonl and reach
    TensorBoard under tensorboardX's spelling of the tag, with no log line per write."""
    value = float(np.random.default_rng().normal())
    writer = MetricWriter(str(tmp_path))
    with caplog.at_level(logging.INFO):
        writer.write(3, {"nll": value}, prefix="val[:128]/")
        writer.write_text(3, "val[:128]/samples", "ein Hund")
    writer.close()
    assert not [r for r in caplog.records if "illegal" in r.getMessage()]
    (line,) = (json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert line["val[:128]/nll"] == value
    tags = {v.tag for e in read_events(tmp_path / "tensorboard") for v in e.summary.value}
    assert tags == {"val__128_/nll", "val__128_/samples/text_summary"}
    assert tensorboard_tag("/a b/c-d.e_f") == "a_b/c-d.e_f"
