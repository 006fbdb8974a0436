"""train.profile_steps: a jax.profiler trace of exactly the chosen train steps in
<workdir>/profile, the value checked by config.validate before any compute, and a resumed run
that traces the rest of the range (or nothing, past its end)."""

import gzip
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from xformer import config as config_lib
from xformer import op_profile
from xformer.config import lm_base_config
from xformer.timing import TrainClock
from xformer.train_lib import StepProfiler, train_and_evaluate

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TINY_PTB = {  # one small layer, a slice of PTB: compiling the step is most of the test's time
    "model.d_model": 32,
    "model.num_heads": 2,
    "model.num_decoder_layers": 1,
    "model.d_ff": 64,
    "model.mem_len": 16,
    "data.segment_length": 16,
    "data.train_split": "train[:2000]",
    "data.eval_split": "valid[:100]",
    "train.batch_size": 8,
    "train.log_every": 1,
    "train.warmup_steps": 2,
    "train.max_train_seconds": 0.0,
    "eval.batch_size": 8,
    "eval.segment_length": 64,
}


def trace_files(workdir: Path) -> tuple[list[Path], list[Path]]:
    """The (*.xplane.pb, perfetto_trace.json.gz) files under <workdir>/profile."""
    profile = workdir / "profile"
    return sorted(profile.rglob("*.xplane.pb")), sorted(profile.rglob("perfetto_trace.json.gz"))


def traced_steps(perfetto: Path, name: str = "train") -> set[int]:
    """Step numbers of the StepTraceAnnotation events called `name` in a Perfetto trace."""
    events = json.loads(gzip.decompress(perfetto.read_bytes()))["traceEvents"]
    return {int(e["args"]["step_num"]) for e in events if e.get("name") == name}


@pytest.mark.parametrize(
    "value", ["5", "3:1", "2:2", "-1:3", "a:b", "1:2:3", " 1:3", "1.5:3", "1:", ":3"]
)
def test_bad_profile_steps_are_named_by_validate(value):
    config = config_lib.base_config()
    config.train.profile_steps = value
    with pytest.raises(ValueError, match=r"train\.profile_steps=.*'start:stop'"):
        config_lib.validate(config)


def test_profile_steps_must_end_within_num_steps():
    config = config_lib.base_config()
    config.train.num_steps = 10
    config.train.profile_steps = "8:11"
    with pytest.raises(ValueError, match=r"train\.profile_steps='8:11' goes beyond .*=10"):
        config_lib.validate(config)
    for ok in ("", "0:1", "9:10", "0:10"):
        config.train.profile_steps = ok
        config_lib.validate(config)
    assert config_lib.profile_range("100:105") == (100, 105)
    assert config_lib.profile_range("") is None


@pytest.mark.slow  # end to end (~30 s, most of it compiling); the test below drives the same hooks
def test_train_writes_a_trace_of_the_chosen_steps(tmp_path, tfds_dir, caplog):
    if not (SHARED / "ptb").exists():
        pytest.skip(f"real data not found at {SHARED / 'ptb'}")
    config = lm_base_config("ptb")
    config.data.data_dir = tfds_dir
    for key, value in {**TINY_PTB, "train.num_steps": 3, "train.profile_steps": "1:3"}.items():
        section, name = key.split(".")
        config[section][name] = value
    caplog.set_level(logging.INFO)
    result = train_and_evaluate(config, str(tmp_path))
    assert result["step"] == 3

    (xplane,), (perfetto,) = trace_files(tmp_path)
    assert xplane.stat().st_size > 0 and b"jit_train_step" in xplane.read_bytes()
    assert traced_steps(perfetto) == {1, 2}  # the step counters 1 and 2: no more, no fewer
    assert f"profile of steps 1:3 written to {xplane.parent}" in caplog.text
    # the compiled step's HLO is saved beside the trace: xformer.op_profile ranks its ops
    summary = op_profile.summarise(str(xplane), (xplane.parent / op_profile.HLO_FILE).read_text())
    assert summary["steps"] == 2 and summary["ops_not_in_hlo"] == 0
    categories = {r["category"] for r in summary["categories"]}
    assert {"matmul: dense layers", "loss", "optimizer"} <= categories


def test_resumed_run_traces_the_rest_of_the_range(tmp_path, caplog):
    """The loop's calls, driven by hand on a small jitted step: a run resumed at step 3 with
    profile_steps 2:5 traces steps 3 and 4; one resumed at 5 traces nothing and says so."""
    caplog.set_level(logging.INFO)
    step_fn = jax.jit(lambda x: jnp.tanh(x @ x))

    def run(first_step: int, num_steps: int, workdir: Path) -> None:
        profiler = StepProfiler("2:5", str(workdir), first_step, TrainClock())
        x = jnp.eye(64)
        try:
            for step in range(first_step, num_steps):
                profiler.before_step(step, x)
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    x = step_fn(x)
                profiler.after_step(step + 1, x)
        finally:
            profiler.close()

    run(3, 8, tmp_path / "resumed")
    (xplane,), (perfetto,) = trace_files(tmp_path / "resumed")
    assert traced_steps(perfetto) == {3, 4}
    assert "train.profile_steps=2:5: resumed at step 3, tracing steps 3:5" in caplog.text

    run(5, 8, tmp_path / "past")
    assert not (tmp_path / "past" / "profile").exists()
    assert "train.profile_steps=2:5: no trace, this run starts at step 5" in caplog.text

    run(0, 4, tmp_path / "stopped")  # training ends inside the range: the trace is kept
    (_,), (perfetto,) = trace_files(tmp_path / "stopped")
    assert traced_steps(perfetto) == {2, 3}
    assert "profile of steps 2:4 written to" in caplog.text


def test_each_process_traces_into_its_own_folder(tmp_path, monkeypatch):
    """JAX names a trace's run folder by the second: processes stopping at one step on a
    shared disk would share it, and its perfetto export raises on a second host's trace."""
    assert StepProfiler("1:2", str(tmp_path), 0, TrainClock()).log_dir == str(tmp_path / "profile")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    profiler = StepProfiler("1:2", str(tmp_path), 0, TrainClock())
    assert profiler.log_dir == str(tmp_path / "profile" / "process_1")
