"""Checkpoint averaging: the mean parameters of the last N checkpoints (xformer/averaging.py),
through eval.py --average_last and average.py's averaged workdir."""

import json
import logging

import jax
import numpy as np
import pytest
from test_train_eval import copy_shared_vocab, run, tiny_experiment, train_cmd

from xformer.averaging import average_params, steps_to_average
from xformer.checkpoint import read_state


def flat(tree) -> dict[str, np.ndarray]:
    """{"decoder/0/cross_attn/kv_proj/bias": array}, for an nnx.State and a restored dict."""

    def name(path) -> str:
        keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
        return "/".join(str(k) for k in keys if k != "value")

    return {name(path): np.asarray(v) for path, v in jax.tree.leaves_with_path(tree)}


@pytest.fixture
def saved(tmp_path):
    """An experiment with checkpoints 3, 6, 9, 12 of fresh random parameters."""
    exp = tiny_experiment(tmp_path, keep_checkpoints=4)
    state = exp.init_state()
    rng = np.random.default_rng(0)
    for step in (3, 6, 9, 12):
        state["params"] = jax.tree.map(
            lambda x: x + rng.normal(size=x.shape).astype(x.dtype), state["params"]
        )
        state["step"] = state["step"] * 0 + step
        exp.checkpointer.save(step, state, {"epoch": 0})
    exp.checkpointer.wait()
    return exp


def test_average_is_the_mean_of_the_checkpoints(saved):
    steps = steps_to_average(saved, 3)
    assert steps == [6, 9, 12]
    averaged = flat(average_params(saved, steps))
    states = [flat(read_state(saved.workdir, step)["params"]) for step in steps]
    assert averaged.keys() == states[0].keys() and len(averaged) > 5
    for name, value in averaged.items():
        expected = np.mean([s[name] for s in states], axis=0, dtype=np.float64)
        assert value.dtype == states[0][name].dtype
        np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-6, err_msg=name)
    one = flat(average_params(saved, [9]))
    for name, value in one.items():
        np.testing.assert_array_equal(value, flat(read_state(saved.workdir, 9)["params"])[name])


def test_steps_to_average_end_at_a_step_and_name_what_is_kept(saved, caplog):
    saved.config.train.checkpoint_every = 3
    with caplog.at_level(logging.WARNING):
        assert steps_to_average(saved, 2, until=9) == [6, 9]
        assert not caplog.records
        saved.config.train.checkpoint_every = 2  # (as if a signal had saved 3, 6, 9 and 12)
        steps_to_average(saved, 2, until=9)
    assert "the checkpoints averaged, [6, 9], are not train.checkpoint_every=2" in caplog.text
    with pytest.raises(
        ValueError, match=r"needs 5, .* holds 4 .*\[3, 6, 9, 12\].*keep_checkpoints"
    ):
        steps_to_average(saved, 5)
    with pytest.raises(ValueError, match=r"holds 2 up to that step \(\[3, 6\]\)"):
        steps_to_average(saved, 3, until=6)
    with pytest.raises(ValueError, match="no checkpoint 7"):
        steps_to_average(saved, 1, until=7)


@pytest.mark.slow  # ~1 min: train.py, 4 eval.py runs, average.py
@pytest.mark.usefixtures("multi30k_dir")
def test_eval_average_last_and_the_averaged_workdir(tmp_path, tfds_dir):
    """eval.py --average_last=1 is the plain evaluation; --average_last=3 translates like
    eval.py on average.py's workdir; too few checkpoints is exit status 2 before compute;
    average.py refuses a non-empty output; train.py refuses to train an averaged workdir."""
    workdir, averaged = tmp_path / "run", tmp_path / "avg3"
    steps = [
        "--config.train.num_steps=6",
        "--config.train.checkpoint_every=2",
        "--config.train.keep_checkpoints=3",
    ]
    copy_shared_vocab(workdir, tfds_dir)
    trained = run(train_cmd(workdir, tfds_dir, *steps, shared_vocab=False))  # average.py copies it
    assert trained.returncode == 0, trained.stderr[-3000:]
    source = tmp_path / "in.en"
    source.write_text("a man rides a bike .\ntwo dogs play in the snow .\nhello\n")

    def translate(wd, name, *flags):
        out = tmp_path / f"{name}.de"
        done = run(["eval.py", f"--workdir={wd}", f"--input={source}", f"--output={out}", *flags])
        assert done.returncode == 0, done.stderr[-3000:]
        return out.read_text().splitlines(), json.loads(done.stdout)

    plain, plain_result = translate(workdir, "plain")
    one, one_result = translate(workdir, "one", "--average_last=1")
    three, three_result = translate(workdir, "three", "--average_last=3")
    assert one == plain and len(plain) == 3
    assert one_result["averaged_steps"] == [6] and "averaged_steps" not in plain_result
    assert three_result["averaged_steps"] == [2, 4, 6] and three_result["step"] == 6

    written = run(["average.py", f"--workdir={workdir}", "--last=3", f"--output={averaged}"])
    assert written.returncode == 0, written.stderr[-3000:]
    from_workdir, result = translate(averaged, "written")
    assert from_workdir == three and result["step"] == 6
    averaged_params = flat(read_state(str(averaged), 6)["params"])
    assert set(read_state(str(averaged), 6)) == {"step", "params"}  # no optimizer state
    info = json.loads((workdir / "run_info.json").read_text())  # --compare's size and commits
    assert json.loads((averaged / "run_info.json").read_text()) == info and info["num_params"] > 0
    states = [flat(read_state(str(workdir), s)["params"]) for s in (2, 4, 6)]
    for name, value in averaged_params.items():
        np.testing.assert_allclose(value, np.mean([s[name] for s in states], axis=0), rtol=1e-6)

    too_many = run(["eval.py", f"--workdir={workdir}", f"--input={source}", "--average_last=4"])
    assert too_many.returncode == 2 and "Traceback" not in too_many.stderr
    assert "train.keep_checkpoints" in too_many.stderr
    missing = run(["eval.py", f"--workdir={workdir}", f"--input={source}", "--step=5"])
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    holds = f"no checkpoint 5 in {workdir / 'checkpoints'} (it holds [2, 4, 6])"
    assert f"eval.py: error: {holds}" in missing.stderr
    again = run(["average.py", f"--workdir={workdir}", "--last=2", f"--output={averaged}"])
    assert again.returncode != 0 and "is not an empty directory" in again.stderr
    resumed = run(train_cmd(averaged, tfds_dir, *steps))
    assert resumed.returncode != 0 and "averaged parameters" in resumed.stderr
