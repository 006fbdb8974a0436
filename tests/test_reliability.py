"""Reliability: a kill at any moment loses at most the work since the last checkpoint, and the
resumed run is the run that would have happened.

SIGTERM / SIGINT stop after the step with a checkpoint (exit status 75); kill -9 in the middle
of an asynchronous checkpoint write (xformer/faults.py stalls its commit) or between
checkpoints resumes from the newest complete one; the final parameters equal an uninterrupted
run's bit for bit. Non-finite steps never reach the parameters. A workdir resumes only its own
run, its time budget spans resumes, and write failures are one clear error.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_language_modeling as lm
import test_train_eval as translation
from jax.experimental import multihost_utils
from test_distributed import final_params, free_port, metrics, wait_for_stall
from test_grad_accum import ROWS, tiny_task
from test_language_modeling import ptb  # noqa: F401 (a fixture)

from xformer import config as config_lib
from xformer import experiment as experiment_lib
from xformer import faults, train_lib
from xformer.checkpoint import Checkpointer, state_dir, stored_tree
from xformer.preemption import EXIT_STOPPED
from xformer.train_lib import train_step

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CMDS = {"translation": translation.train_cmd, "language_modeling": lm.train_cmd}
STEPS = ["--config.train.num_steps=6", "--config.train.checkpoint_every=2"]


def start(cmd: list[str], log: Path, fault: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "XFORMER_DATA_DIR": str(ROOT.parent / "shared" / "data")}
    env.pop("XFORMER_FAULT", None)
    if fault:
        env["XFORMER_FAULT"] = fault
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stderr=f)


def kill_at(cmd: list[str], tmp_path: Path, fault: str, sig: int) -> tuple[int, str]:
    """Run `cmd` until it stalls at `fault` ("commit:<step>" or "step:<step>"), send `sig`,
    and return its exit status and log."""
    marker, log = tmp_path / f"stalled-{fault}", tmp_path / f"log-{fault}-{sig}"
    marker.unlink(missing_ok=True)  # (an earlier kill at the same fault wrote it)
    proc = start(cmd, log, f"{fault}:{marker}")
    wait_for_stall(marker, [proc], [log], timeout=300)
    proc.send_signal(sig)
    return proc.wait(timeout=300), log.read_text()


@pytest.mark.slow  # ~1 min per family: 5 train.py runs
@pytest.mark.parametrize("family", list(TRAIN_CMDS))
@pytest.mark.usefixtures("ptb", "multi30k_dir")
def test_interrupted_run_equals_uninterrupted_bit_for_bit(family, tmp_path, tfds_dir):
    train_cmd = TRAIN_CMDS[family]
    ref = tmp_path / "ref"
    result = translation.run(train_cmd(ref, tfds_dir, *STEPS))
    assert result.returncode == 0, result.stderr[-3000:]

    run = tmp_path / "run"
    cmd = train_cmd(run, tfds_dir, *STEPS)
    # kill -9 while checkpoint 4 is written but not committed: only checkpoint 2 counts.
    status, log = kill_at(cmd, tmp_path, "commit:4", signal.SIGKILL)
    assert status == -signal.SIGKILL, log[-3000:]
    assert translation.checkpoint_steps(run) == [2]
    assert (run / "checkpoints" / "4.orbax-checkpoint-tmp").is_dir()
    # As if a signal's checkpoint at step 3 had been killed too: a step never saved again.
    (run / "checkpoints" / "3.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
    # SIGTERM after step 5 (resumed from 2): the step finishes, checkpoint 5, status 75; the
    # unfinished writes are gone.
    status, log = kill_at(cmd, tmp_path, "step:5", signal.SIGTERM)
    assert status == EXIT_STOPPED, log[-3000:]
    assert "resumed from step 2" in log and "stopped by SIGTERM at step 5" in log
    assert translation.checkpoint_steps(run) == [4, 5]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4", "5"]
    # kill -9 between checkpoints (after step 6 ran, before it was saved).
    status, log = kill_at(cmd, tmp_path, "step:6", signal.SIGKILL)
    assert status == -signal.SIGKILL and "resumed from step 5" in log, log[-3000:]
    # SIGTERM after the last step: checkpoint 6, status 75, and the final validation it
    # skips is the next start's, which trains nothing and then marks the run done.
    status, log = kill_at(cmd, tmp_path, "step:6", signal.SIGTERM)
    assert status == EXIT_STOPPED and "resumed from step 5" in log, log[-3000:]
    assert not (run / "done.json").exists()
    result = translation.run(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "already finished at step 6" in result.stderr
    # As if killed after that validation, before writing done.json: the next start takes the
    # validation's logged row (it validated again), and metrics.jsonl keeps one validation row
    # of step 6 (checked below).
    (run / "done.json").unlink()
    result = translation.run(cmd)
    assert result.returncode == 0 and "already finished at step 6" in result.stderr
    done, ref_done = (json.loads((d / "done.json").read_text()) for d in (run, ref))
    val = [
        k for k in ref_done["metrics"] if k[:4] == "val_" and not k.endswith(("seconds", "_per_s"))
    ]
    assert val and {k: done["metrics"][k] for k in val} == {k: ref_done["metrics"][k] for k in val}

    # Each step logged once: a resumed run drops the rows its killed start logged after the
    # checkpoint it resumes from (here steps 3-4 and 6, and the validation of step 6 run twice).
    def logged_steps(workdir: Path) -> tuple[list[int], list[int]]:
        """The steps of the training rows and of the validation rows of metrics.jsonl."""
        rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        val = [r for r in rows if any(k.endswith("/nll") and k[:6] != "train/" for k in r)]
        return [r["step"] for r in rows if "train/loss" in r], [r["step"] for r in val]

    assert logged_steps(run) == logged_steps(ref) == ([1, 2, 3, 4, 5, 6], logged_steps(ref)[1])
    assert logged_steps(ref)[1][-1] == 6

    want, have = final_params(ref, 6), final_params(run, 6)
    assert have.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(have[name], want[name], err_msg=name)
    losses, ref_losses = metrics(run, "train/loss"), metrics(ref, "train/loss")
    assert losses == ref_losses  # {step: loss} of the last run to log each step
    # Training seconds go on from each checkpoint's: they grow step by step across the resumes.
    seconds = metrics(run, "train/train_seconds")
    assert 0 < seconds[1] and all(seconds[s] < seconds[s + 1] for s in range(1, 6))
    assert metrics(run, "train/nonfinite_steps_total")[6] == 0

    # Killed during the final validation (its checkpoint saved, its row not yet logged): the
    # next start validates and marks the run done with the validation's metrics (it found the
    # run finished and wrote done.json without them); a start after that validates no more.
    rows, dropped = (ref / "metrics.jsonl").read_text().splitlines(), val_rows(ref, 6)
    assert dropped
    (ref / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if r not in dropped))
    (ref / "done.json").unlink()
    for rerun in range(2):
        result = translation.run(train_cmd(ref, tfds_dir, *STEPS))
        assert result.returncode == 0 and "already finished at step 6" in result.stderr
        validated = re.search(r"eval \S+ at step 6: ", result.stderr) is not None
        assert validated == (rerun == 0), result.stderr[-3000:]
        done = json.loads((ref / "done.json").read_text())
        assert {k: done["metrics"][k] for k in val} == {k: ref_done["metrics"][k] for k in val}
        assert logged_steps(ref)[1].count(6) == 1


def val_rows(workdir: Path, step: int) -> list[str]:
    """The validation rows of `step` in metrics.jsonl, as written."""
    rows = (workdir / "metrics.jsonl").read_text().splitlines()
    return [
        r for r in rows if json.loads(r)["step"] == step and "train/loss" not in r and "/nll" in r
    ]


def test_a_step_fault_stalls_after_the_checkpoints_in_flight(tmp_path, monkeypatch):
    """`step:<n>` has the checkpoints still being written committed before it writes its
    marker: a kill at the stall falls between checkpoints, never inside a write."""
    marker = tmp_path / "stalled"
    monkeypatch.setenv(faults.ENV, f"step:3:{marker}")
    events = []

    def stop_requested() -> bool:
        events.append("stop?")
        return True

    def wait_for_checkpoints() -> None:
        events.append(("committed", marker.exists()))

    faults.stall_after_step(2, stop_requested, wait_for_checkpoints)
    assert events == [] and not marker.exists()
    faults.stall_after_step(3, stop_requested, wait_for_checkpoints)
    assert events == [("committed", False), "stop?"] and marker.exists()


def test_a_second_signal_exits_at_once(tmp_path):
    """The first SIGTERM / SIGINT only asks to stop; the same signal again at once is the first
    delivered twice (a process group's Ctrl-C and a sweep forwarding it); a second one after
    SAME_REQUEST_S kills, as by default."""
    script = textwrap.dedent(
        """
        import os, signal, sys, time
        from xformer.preemption import SAME_REQUEST_S, StopOnSignal
        stop = StopOnSignal()
        stop.install()
        os.kill(os.getpid(), signal.SIG)
        assert stop.requested() and stop.signal_name == "SIG", stop.signal_name
        os.kill(os.getpid(), signal.SIG)
        print("asked to stop", flush=True)
        time.sleep(SAME_REQUEST_S)
        os.kill(os.getpid(), signal.SIG)
        print("still alive", flush=True)
        """
    )
    for name in ("SIGTERM", "SIGINT"):
        result = subprocess.run(
            [sys.executable, "-c", script.replace("SIG", name)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert result.stdout == "asked to stop\n", result.stderr
        assert result.returncode == -getattr(signal, name)


def test_with_several_processes_sigterm_stays_with_jax_and_sigint_goes_to_it():
    """In a run of several processes SIGTERM belongs to JAX's preemption service (here a Python
    handler stands for it): installing leaves it there, and a SIGINT asks to stop and reaches
    the service as a SIGTERM, so that every process stops at the same step."""
    script = textwrap.dedent(
        """
        import os, signal
        from xformer.preemption import StopOnSignal
        notices = []
        service = lambda signum, frame: notices.append(signal.Signals(signum).name)
        signal.signal(signal.SIGTERM, service)
        stop = StopOnSignal(several_processes=True)
        stop.install()
        assert signal.getsignal(signal.SIGTERM) is service
        os.kill(os.getpid(), signal.SIGINT)
        print(stop.signal_name, notices, signal.getsignal(signal.SIGTERM) is service)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True
    )
    assert result.stdout == "SIGINT ['SIGTERM'] True\n", result.stderr


@pytest.mark.parametrize("training,processes", [(True, 2), (True, 1), (False, 2)])
def test_sigterm_stays_with_jax_only_for_training_several_processes(training, processes):
    """jax.distributed.initialize gives SIGTERM to JAX's preemption service: training of
    several processes keeps it there, and a loop asking the service after every "step" stops
    every process after the same one; eval.py, or a run of one process, gets SIGTERM's default
    back, so that `kill` ends it as without --distributed (JAX would keep it for no one)."""
    port = free_port()
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time
        from xformer import distributed
        index = int(sys.argv[1])
        distributed.initialize("127.0.0.1:{port}", {processes}, index, training={training})
        if index == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        step = 1
        while not distributed.preemption_sync_point(step):
            time.sleep(0.02)
            step += 1
        print("stopped after", step, flush=True)
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(i)], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        for i in range(processes)
    ]
    kept = training and processes > 1
    try:
        outs = [p.communicate(timeout=120)[0] for p in (procs if kept else procs[:1])]
    finally:  # (a process left alone would loop, or wait for process 0 at shutdown)
        for p in procs:
            p.kill()
            p.communicate()
    if kept:
        assert [p.returncode for p in procs] == [0, 0] and outs[0] == outs[1], outs
        assert outs[0].startswith("stopped after "), outs
    else:
        assert (procs[0].returncode, outs[0]) == (-signal.SIGTERM, "")


def test_saving_leaves_jax_preemption_service_to_the_train_loop(tmp_path, monkeypatch):
    """Saves (their finalize threads included) never ask JAX's preemption service, as orbax's
    manager does by default: the step count its protocol reads is the train loop's alone."""
    asked = []
    monkeypatch.setattr(
        multihost_utils, "reached_preemption_sync_point", lambda step: asked.append(step) or False
    )
    ckpt = Checkpointer(str(tmp_path))
    weights = np.random.default_rng().normal(size=3).astype(np.float32)
    for step in (1, 2):
        ckpt.save(step, {"w": jnp.asarray(weights * step)})
    ckpt.close()
    state, _ = Checkpointer(str(tmp_path)).restore({"w": jnp.zeros(3)})
    np.testing.assert_array_equal(state["w"], weights * 2)
    assert asked == []


# Non-finite steps -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["translation", "language_modeling"])
def test_a_nonfinite_step_never_reaches_the_parameters(family, tmp_path):
    """Between two finite steps, a step with a NaN in its batch (LM token weights) or its
    parameters (translation) leaves parameters and Adam's state exactly as they were, moves the
    counter, reports itself, and keeps the XL memory finite."""
    with jax.enable_x64(True):  # the tiny task is float64
        check_nonfinite_step_is_skipped(family, str(tmp_path))


def check_nonfinite_step_is_skipped(family: str, workdir: str) -> None:
    task = tiny_task(family, workdir, **{"train.nonfinite": "skip"})
    rng = np.random.default_rng()
    state = task.exp.init_state(task.carry(rng))
    step = jax.jit(lambda state, batch: train_step(task, state, task.exp.rng_state, batch))

    state, out = step(state, task.batch(rng))
    assert float(out["nonfinite"]) == 0.0
    batch = task.batch(rng)
    if family == "language_modeling":
        batch["weights"][3, 2] = np.nan
    else:
        leaves, treedef = jax.tree.flatten(state["params"])
        leaves[-1] = leaves[-1].at[(0,) * leaves[-1].ndim].set(jnp.nan)
        state = {**state, "params": jax.tree.unflatten(treedef, leaves)}
    before = jax.device_get(state)
    after, out = step(state, batch)
    after = jax.device_get(after)
    assert float(out["nonfinite"]) == 1.0 and not np.isfinite(float(out["loss_sum"]))
    assert int(after["step"]) == int(before["step"]) + 1
    for part in ("params", "opt_state"):
        for (path, old), new in zip(
            jax.tree.leaves_with_path(before[part]), jax.tree.leaves(after[part]), strict=True
        ):
            np.testing.assert_array_equal(new, old, err_msg=jax.tree_util.keystr(path))
    for name, value in after["carry"].items():
        assert np.isfinite(value).all(), name
    if family == "language_modeling":  # and training goes on
        state, out = step(after, task.batch(rng))
        assert float(out["nonfinite"]) == 0.0
        changed = jax.tree.map(
            lambda a, b: not np.array_equal(a, b), jax.device_get(state["params"]), after["params"]
        )
        assert sum(jax.tree.leaves(changed)) > len(jax.tree.leaves(changed)) / 2
        # A NaN in row 1's memory: the step is skipped, row 1's memory restarts empty and the
        # other rows keep the memory this step wrote.
        states = np.array(state["carry"]["states"])
        states[:, 1, -1] = np.nan
        batch = {**task.batch(rng), "reset": np.zeros(ROWS, bool)}
        poisoned = {**state, "carry": {**state["carry"], "states": states}}
        after, out = jax.device_get(step(poisoned, batch))
        clean, _ = jax.device_get(step(state, batch))
        assert float(out["nonfinite"]) == 1.0
        assert after["carry"]["filled"][1] == 0 and not after["carry"]["states"][:, 1].any()
        others = np.arange(ROWS) != 1
        for name in ("states", "filled"):
            axis = 1 if name == "states" else 0
            np.testing.assert_array_equal(
                np.compress(others, after["carry"][name], axis),
                np.compress(others, clean["carry"][name], axis),
            )


def test_a_skipped_step_leaves_the_intervals_losses_to_the_others():
    rng = np.random.default_rng()
    steps = []
    for _ in range(4):
        tokens = float(rng.integers(10, 50))
        nll, grad_norm = tokens * rng.uniform(2, 6), rng.uniform(0.5, 2)
        sums = {"loss_sum": nll * 1.1, "nll_sum": nll, "tokens": tokens, "grad_norm": grad_norm}
        steps.append({**sums, "nonfinite": 0.0})
    skipped = {"loss_sum": np.nan, "nll_sum": np.nan, "tokens": 30.0, "grad_norm": np.inf}
    pending = [steps[0], steps[1], {**skipped, "nonfinite": 1.0}, steps[2], steps[3]]
    got = train_lib.interval_losses([{k: jnp.asarray(v) for k, v in m.items()} for m in pending])
    nll = sum(m["nll_sum"] for m in steps) / sum(m["tokens"] for m in steps)
    assert got["nll"] == pytest.approx(nll) and got["perplexity"] == pytest.approx(np.exp(nll))
    assert got["loss"] == pytest.approx(1.1 * nll)
    assert got["grad_norm"] == pytest.approx(np.mean([m["grad_norm"] for m in steps]))
    assert np.isnan(train_lib.interval_losses([{**skipped, "nonfinite": 1.0}])["loss"])


def test_the_select_skips_a_step_like_the_cond(monkeypatch, tmp_path):
    """The GPU's form of the skip (a select after the update) against the CPU's (a cond around
    it, train_lib.SKIP_BY_COND): finite steps update alike (to float64 rounding: the two
    programs fuse differently), and a non-finite step leaves the state exactly as it was."""
    with jax.enable_x64(True):
        task = tiny_task("language_modeling", str(tmp_path), **{"train.nonfinite": "skip"})
        rng = np.random.default_rng()
        start = task.exp.init_state(task.carry(rng))
        finite = [task.batch(rng), task.batch(rng)]
        nonfinite = task.batch(rng)
        nonfinite["weights"][1, 3] = np.nan
        after = {}
        for form, platforms in (("cond", frozenset({"cpu"})), ("select", frozenset())):
            monkeypatch.setattr(train_lib, "SKIP_BY_COND", platforms)
            step = jax.jit(lambda s, b: train_step(task, s, task.exp.rng_state, b))
            state = start
            for batch in finite:
                state, out = step(state, batch)
                assert float(out["nonfinite"]) == 0.0
            skipped, out = step(state, nonfinite)
            assert float(out["nonfinite"]) == 1.0
            state, skipped = jax.device_get((state, skipped))
            for part in ("params", "opt_state"):
                jax.tree.map(np.testing.assert_array_equal, skipped[part], state[part])
            after[form] = state
    # Adam's m / sqrt(v) turns last-bit differences of tiny gradients into ~1e-11 relative ones
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12),
        after["select"],
        after["cond"],
    )
    moved = jax.tree.map(
        lambda a, b: not np.allclose(a, b), after["select"]["params"], start["params"]
    )
    assert sum(jax.tree.leaves(moved)) > len(jax.tree.leaves(moved)) / 2


@pytest.mark.slow  # ~30 s: 2 train.py runs
@pytest.mark.usefixtures("ptb")
def test_divergence_stops_or_skips(tmp_path, tfds_dir):
    """An absurd learning rate makes step 2 non-finite (step 1 moves every parameter by
    ~1e30). "stop": status 3, a message naming the step, no checkpoint after step 1. "skip": the
    run finishes, its parameters stay step 1's, and the metrics count the 3 skipped steps."""
    common = [
        "--config.train.num_steps=4",
        "--config.train.checkpoint_every=1",
        "--config.train.learning_rate=1e30",
        "--config.train.warmup_steps=1",
        "--config.train.schedule=constant",
        "--config.train.grad_clip_norm=0",
    ]
    stop = tmp_path / "stop"
    result = translation.run(lm.train_cmd(stop, tfds_dir, *common))
    assert result.returncode == 3, result.stderr[-3000:]
    assert re.search(
        r"non-finite loss or gradient at step 2 \(loss sum \S+, gradient norm "
        r"\S+\)",
        result.stderr,
    ), result.stderr[-3000:]
    assert "the last one kept: step 1" in result.stderr
    assert translation.checkpoint_steps(stop) == [1]

    skip = tmp_path / "skip"
    result = translation.run(lm.train_cmd(skip, tfds_dir, *common, "--config.train.nonfinite=skip"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert metrics(skip, "train/nonfinite_steps") == {1: 0, 2: 1, 3: 1, 4: 1}
    assert metrics(skip, "train/nonfinite_steps_total")[4] == 3
    after_3, after_4 = final_params(skip, 3), final_params(skip, 4)  # (checkpoints kept: 2)
    for name, value in after_4.items():
        assert np.isfinite(value).all(), name
        np.testing.assert_array_equal(value, after_3[name], err_msg=name)


@pytest.mark.parametrize("loss,norm", [(1234.5, np.nan), (np.inf, np.nan), (np.nan, 3.0)])
def test_divergence_message_points_at_a_kernel_when_only_the_gradient_is_not_finite(loss, norm):
    """The stop message gives the first bad step's values and, when its loss was finite but
    its gradient was not (Multi30k's first step on an H100 under cuDNN attention), the way to
    rule out the fused attention kernel; steps already checked are not counted again."""
    steps = train_lib.NonfiniteSteps("stop", checked_through=1)
    pending = [
        {"nonfinite": True, "loss_sum": np.nan, "grad_norm": np.nan},  # step 1: checked before
        {"nonfinite": False, "loss_sum": 10.0, "grad_norm": 1.0},
        {"nonfinite": True, "loss_sum": loss, "grad_norm": norm},
    ]
    with pytest.raises(train_lib.DivergedError) as error:
        steps.check(pending, step=3, last_checkpoint=2)
    message = str(error.value)
    assert f"at step 3 (loss sum {loss:.4g}, gradient norm {norm:.4g})" in message
    assert "the last one kept: step 2" in message
    assert ("attention_impl='fused'" in message) == bool(np.isfinite(loss) and np.isnan(norm))


# The workdir's run ----------------------------------------------------------------------------


@pytest.mark.slow  # ~40 s: 4 train.py runs
def test_a_workdir_resumes_only_its_own_run(tmp_path, tfds_dir, multi30k_dir):
    """Changing the model or optimizer is refused before compute, listing the keys, unless
    --accept_config_changes; resumable keys may change; the time budget spans resumes; a
    missing vocabulary is an error, never a new one."""
    workdir = tmp_path / "run"

    def train_cmd(*extra):  # the workdir's own vocabulary, deleted below
        return translation.train_cmd(workdir, tfds_dir, *extra, shared_vocab=False)

    translation.copy_shared_vocab(workdir, tfds_dir)
    first = translation.run(train_cmd("--config.train.num_steps=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    progress = json.loads((workdir / "checkpoints" / "2" / "progress" / "metadata").read_text())
    assert progress["budget_seconds"] > 0
    marker = (workdir / "done.json").read_text()
    again = translation.run(train_cmd("--config.train.num_steps=2"))  # a finished run
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already finished at step 2 (train.num_steps=2)" in again.stderr
    assert "train step:" not in again.stderr  # nothing compiled
    assert (workdir / "done.json").read_text() == marker

    changed = translation.run(
        train_cmd("--config.model.d_ff=96", "--config.train.learning_rate=3e-3")
    )
    assert changed.returncode != 0
    assert "model.d_ff: 64 -> 96; train.learning_rate: " in changed.stderr
    assert "--accept_config_changes" in changed.stderr
    # Accepted, the checkpoint cannot restore onto the wider model: one line, and config.json
    # still describes the checkpoints (it was overwritten before the restore failed).
    forced = translation.run(train_cmd("--config.model.d_ff=96", "--accept_config_changes"))
    assert forced.returncode == 1 and "Traceback" not in forced.stderr
    assert "train.py: The checkpoints in " in forced.stderr
    assert "arrays of other shapes than this model's" in forced.stderr
    assert json.loads((workdir / "config.json").read_text())["model"]["d_ff"] == 64

    # More steps, under a budget the first run already spent: it stops before any step (a
    # budget per start would run on for most of a second run's worth of seconds), and so does
    # every rerun of that command.
    budget = progress["budget_seconds"] * 0.9
    resumed = translation.run(
        train_cmd(
            "--config.train.num_steps=50",
            f"--config.train.max_train_seconds={budget}",
            "--config.train.learning_rate=3e-3",
            "--accept_config_changes",
        )
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = json.loads((workdir / "done.json").read_text())
    assert done["reason"] == "max_train_seconds" and done["step"] == 2
    assert "resumed from step 2" in resumed.stderr and "the time budget is spent" in resumed.stderr
    assert translation.checkpoint_steps(workdir) == [2]

    models = list((workdir / "vocab").glob("*.model"))  # (its encoded split stays)
    assert models and (workdir / "vocab" / "encoded").is_dir()
    for path in models:
        path.unlink()
    more = ["--config.train.num_steps=60", "--config.train.learning_rate=3e-3"]
    missing = translation.run(train_cmd(*more))
    assert missing.returncode != 0
    assert "a workdir with checkpoints needs the one it was trained with" in missing.stderr


def test_more_steps_resume_except_under_a_cosine_schedule():
    """num_steps sets where the cosine decay ends: changing it would change the rates of the
    steps already planned, so a resume refuses it (under rsqrt or constant it only extends)."""
    for schedule, refused in (("rsqrt", False), ("constant", False), ("cosine", True)):
        old = config_lib.lm_base_config("ptb")
        old.train.schedule = schedule
        new = old.copy_and_resolve_references()
        new.train.num_steps, new.train.eval_every = old.train.num_steps * 2, 7
        new.data.eval_split, new.data.test_split = "valid[:50%]", "valid"  # (what is scored)
        changes = config_lib.unresumable_changes(old, new)
        assert changes == (
            {"train.num_steps": (old.train.num_steps, new.train.num_steps)} if refused else {}
        )


def test_unwritable_workdir_is_refused(tmp_path):
    config = config_lib.base_config()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="is not writable"):
        experiment_lib.check_workdir(config, str(blocker / "run"), accept_changes=False)


def test_a_dropped_checkpoint_leaves_its_step_whole_before_it_is_deleted(tmp_path, monkeypatch):
    """orbax deletes a dropped checkpoint's files under its step's name, so a kill half way
    left a partial checkpoint that every later reader listed (and failed on). Now the step
    leaves in one rename, into checkpoints/deleted/, and only then are its files deleted; a
    partial checkpoint (from an earlier version) is named in the error of whoever reads it."""
    checkpoints = tmp_path / "checkpoints"
    seen = []  # at each deletion: the checkpoints directory, and the deleted steps' arrays
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        steps = sorted(os.listdir(path))
        shapes = [stored_tree(state_dir(path, step))["w"].shape for step in steps]
        seen.append((sorted(os.listdir(checkpoints)), steps, shapes))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    rng = np.random.default_rng()
    states = {step: {"w": jnp.asarray(rng.normal(size=(3, 4)))} for step in (1, 2, 3)}
    checkpointer = Checkpointer(str(tmp_path), keep=2)
    for step, state in states.items():
        checkpointer.save(step, state)
        checkpointer.wait()
    checkpointer.close()
    assert seen == [(["2", "3", "deleted"], ["1"], [(3, 4)])]
    assert sorted(os.listdir(checkpoints)) == ["2", "3"]
    restored, _ = Checkpointer(str(tmp_path)).restore(states[3])
    np.testing.assert_array_equal(restored["w"], states[3]["w"])

    (checkpoints / "2" / "state" / "_METADATA").unlink()
    with pytest.raises(FileNotFoundError, match=r"incomplete .*; remove .*checkpoints/2$"):
        Checkpointer(str(tmp_path)).restore(states[2], step=2)


def test_failed_checkpoint_write_is_one_clear_error(tmp_path):
    """A write that fails (a file size limit stands in for a full disk) raises one error naming
    the directory; the failed checkpoint is never committed and the previous one restores."""
    script = textwrap.dedent(
        f"""
        import resource, signal
        import jax.numpy as jnp, numpy as np
        from xformer.checkpoint import Checkpointer, CheckpointWriteError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too large write fails, not kills
        small = {{"w": jnp.asarray(np.random.default_rng().normal(size=8), jnp.float32)}}
        checkpointer = Checkpointer({str(tmp_path)!r})
        checkpointer.save(1, small, {{"epoch": 0}})
        checkpointer.close()
        checkpointer = Checkpointer({str(tmp_path)!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        try:
            big = np.random.default_rng().normal(size=(1000, 1000))  # does not compress
            checkpointer.save(2, {{"w": jnp.asarray(big, jnp.float32)}}, {{"epoch": 1}})
            checkpointer.close()
        except CheckpointWriteError as e:
            print(e)
        restored, data = Checkpointer({str(tmp_path)!r}).restore(small)
        np.testing.assert_array_equal(restored["w"], small["w"])
        print("restored", data)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    message, restored = result.stdout.strip().splitlines()
    assert message.startswith(f"checkpoint 2 could not be written to {tmp_path / 'checkpoints'}")
    assert "File too large" in message and "Is the disk full" in message
    assert restored == "restored {'epoch': 0}"
    assert translation.checkpoint_steps(tmp_path) == [1]


def test_a_workdir_from_an_older_version_resumes(tmp_path):
    """Keys that did not exist when a workdir was written take their defaults: the run resumes
    and evaluates (config.json from before train.nonfinite, eval.max_input_tokens and the mesh
    section), while a real change is still refused."""
    config = config_lib.base_config()
    stored = json.loads(config.to_json())
    del stored["train"]["nonfinite"], stored["eval"]["max_input_tokens"], stored["mesh"]
    (tmp_path / "checkpoints" / "4").mkdir(parents=True)
    (tmp_path / experiment_lib.CONFIG_FILE).write_text(json.dumps(stored))

    loaded = experiment_lib.load_config(str(tmp_path))
    assert config_lib.config_changes(loaded, config) == {}  # (JSON lists equal tuples there)
    experiment_lib.check_workdir(config, str(tmp_path), accept_changes=False)
    config.model.d_ff += 1
    with pytest.raises(ValueError, match="model.d_ff"):
        experiment_lib.check_workdir(config, str(tmp_path), accept_changes=False)


@pytest.mark.usefixtures("multi30k_dir")
def test_validation_passes_do_not_spend_the_time_budget(tmp_path, tfds_dir):
    """The budget counts the loop's wall time without its validation passes: with passes far
    slower than this tiny model's steps, the seconds they took exceed the budget spent.
    Training rows: every log_every (3) steps and at every checkpoint (2, 4), so that a run
    resumed from a checkpoint has logged every step before it; the checkpoint keeps its row."""
    workdir = tmp_path / "run"
    flags = ["--config.train.num_steps=4", "--config.train.eval_every=2"]
    flags += ["--config.train.log_every=3", "--config.train.checkpoint_every=2"]
    done = translation.run(translation.train_cmd(workdir, tfds_dir, *flags))
    assert done.returncode == 0, done.stderr[-3000:]
    progress = json.loads((workdir / "checkpoints" / "4" / "progress" / "metadata").read_text())
    assert progress["eval_seconds"] > progress["budget_seconds"] > 0
    assert len(re.findall(r"eval \S+ at step [24]:", done.stderr)) == 2
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_rows = {r["step"]: r for r in rows if "train/loss" in r}
    assert list(train_rows) == [2, 3, 4]
    assert {f"train/{k}": v for k, v in progress["metrics"].items()} == {
        k: v for k, v in train_rows[4].items() if k.startswith("train/")
    }

    # The same run's provenance (tests/test_provenance.py checks the pieces).
    info = json.loads((workdir / "run_info.json").read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    assert info["starts"][0]["commit"] == (head.stdout.decode().strip() or None)
    assert info["starts"][0]["command"][1] == "train.py" and info["num_params"] > 0


def test_a_workdir_trained_by_another_train_py_is_refused(tmp_path, tfds_dir):
    """Process 0 of a run holds the workdir's lock: a second start on it is one ConfigError
    naming the holder, before it reads any data (it would delete the first's checkpoint writes
    in progress and rewrite its metrics.jsonl)."""
    from xformer import locks

    config = translation.tiny_config(tfds_dir)
    with locks.exclusive(str(tmp_path / train_lib.TRAIN_LOCK)) as taken_by:
        assert taken_by is None
        with pytest.raises(
            config_lib.ConfigError, match=rf"is being trained by .*pid {os.getpid()}"
        ):
            train_lib.train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_a_signal_at_the_step_that_spends_the_budget_leaves_the_last_validation_pending(
    tmp_path, tfds_dir, monkeypatch
):
    """The signal skips the final validation of a run whose budget its step spent; the next
    start finds the budget spent, trains nothing, and runs that validation (it marked the run
    done without validation metrics)."""
    from xformer.preemption import StopOnSignal

    config = config_lib.override(
        translation.tiny_config(tfds_dir),
        {
            "train.num_steps": 50,
            "train.max_train_seconds": 1e-6,  # spent by the first step
            "data.eval_split": "val[:8]",
            "eval.batch_size": 8,
            "eval.bleu_sentences": 8,
        },
    )
    monkeypatch.setattr(StopOnSignal, "requested", lambda self: True)  # a signal at step 1
    assert train_lib.train_and_evaluate(config, str(tmp_path))["stopped"] == "signal"
    assert not (tmp_path / "done.json").exists()
    monkeypatch.undo()
    train_lib.train_and_evaluate(config, str(tmp_path))
    done = json.loads((tmp_path / "done.json").read_text())
    assert done["step"] == 1 and done["reason"] == "max_train_seconds"
    assert {"val_nll", "val_lc_tok_bleu"} <= set(done["metrics"]), done["metrics"]
