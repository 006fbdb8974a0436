"""Language modelling end to end on real PTB with tiny models: evaluation equals a brute-force
pass, train/resume is exact (memory included), 4 devices match 1, eval.py scores every token,
and a tiny Transformer-XL overfits a short real text."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from test_train_eval import shared_vocab_dir

from xformer.config import lm_base_config
from xformer.data.errors import DataValueError
from xformer.data.lm_stream import TrainStream, sliding_windows
from xformer.files import read_jsonl
from xformer.language_model import LanguageModel, reset_memory
from xformer.tasks import make_task
from xformer.tasks.language_modeling import EvalSettings, LanguageModelingTask
from xformer.train_lib import train_and_evaluate

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
# 4 simulated CPU devices, on top of the session's XLA flags (set in tests/conftest.py).
FOUR_DEVICES = {
    "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
}
EVAL_SPLIT = "valid[:400]"  # 8.6k tokens; its metrics are logged as "valid[:400]/nll" etc.
TINY = {
    "data.eval_split": EVAL_SPLIT,
    "model.d_model": 32,
    "model.num_heads": 2,
    "model.num_decoder_layers": 2,
    "model.d_ff": 64,
    "model.mem_len": 16,
    "data.segment_length": 16,
    "train.batch_size": 8,
    "train.log_every": 1,
    "train.warmup_steps": 2,
    "train.max_train_seconds": 0.0,
    "eval.batch_size": 8,
}
PTB_TEST_TOKENS = 82_430


@pytest.fixture(scope="module")
def ptb():
    if not (SHARED / "ptb").exists():
        pytest.skip(f"real data not found at {SHARED / 'ptb'}")
    return SHARED


def tiny_config(tfds_dir, **overrides):
    c = lm_base_config("ptb")
    c.data.data_dir = tfds_dir
    for key, value in {**TINY, **overrides}.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


def jitted(model):
    """model(...) compiled as one program: calling a model eagerly, op by op, is slow."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))
    return lambda *args: fn(state, *args)


def _params(task, seed=0):
    model = task.exp.make_model(nnx.Rngs(seed))
    return nnx.state(model, nnx.Param), jax.device_put(task.exp.rng_state, task.exp.replicated)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_xl_score_equals_one_pass_over_each_row(tmp_path, tfds_dir, ptb, batch_size):
    task = make_task(tiny_config(tfds_dir), str(tmp_path))
    stream = task.stream("valid")[:157]
    task._streams["short"] = stream
    params, rng_state = _params(task)
    settings = EvalSettings(batch_size, 10, mem_len=200, clamp_len=0)
    result = task.score(params, rng_state, "short", settings)

    model = jitted(nnx.merge(task.exp.eval_graphdef, params, task.exp.rng_state))
    inputs = np.concatenate([[task.boundary_id], stream[:-1]])
    row_len = -(-len(stream) // batch_size)
    total = 0.0
    for row in range(batch_size):  # every row is an independent stream
        sl = slice(row * row_len, (row + 1) * row_len)
        nll, _ = model(inputs[None, sl], stream[None, sl])
        total += float(np.asarray(nll, dtype=np.float64).sum())  # np.sum(jax array) sums in f32
    assert result["tokens"] == len(stream)
    assert result["nll"] == pytest.approx(total / len(stream), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["nll"]))
    assert "bpc" not in result  # a word corpus: bits per character only for character ones
    task.corpus = dataclasses.replace(task.corpus, metric="bpc")
    assert task.score(params, rng_state, "short", settings)["bpc"] == pytest.approx(
        result["nll"] / math.log(2), rel=1e-12
    )


def test_vanilla_sliding_window_equals_per_token_passes(tmp_path, tfds_dir, ptb):
    config = tiny_config(tfds_dir, **{"model.mem_len": 0})
    config.model.positional = "sinusoidal"
    task = make_task(config, str(tmp_path))
    stream = task.stream("valid")[:41]
    task._streams["short"] = stream
    params, rng_state = _params(task, seed=1)
    window = 8
    settings = EvalSettings(4, window, mem_len=0, clamp_len=0, sliding_stride=1)
    result = task.score(params, rng_state, "short", settings)

    model = jitted(nnx.merge(task.exp.eval_graphdef, params, task.exp.rng_state))
    inputs = np.concatenate([[task.boundary_id], stream[:-1]])
    # One pass per token t over the window of up to `window` tokens that ends at t, positions
    # from 0, all passes in one batch: row t holds the `window` tokens from the window's start
    # and is read at t (for t < window - 1 the tokens after t are unseen: the model is causal).
    t = np.arange(len(stream))
    starts = np.maximum(0, t - window + 1)
    rows = starts[:, None] + np.arange(window)
    nll, _ = model(inputs[rows], stream[rows])
    total = float(np.sum(np.asarray(nll)[t, t - starts], dtype=np.float64))
    assert result["tokens"] == len(stream)
    assert result["nll"] == pytest.approx(total / len(stream), rel=1e-5)


@pytest.mark.slow
def test_tiny_xl_overfits_a_short_real_text(tmp_path, tfds_dir, ptb):
    task = make_task(tiny_config(tfds_dir), str(tmp_path))
    text = task.stream("train")[:1025]
    cfg = dataclasses.replace(task.exp.model_cfg, dropout=0.0, d_model=64, d_ff=128)
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    batches = TrainStream(text, batch_size=4, segment_length=16)

    @nnx.jit
    def step(model, optimizer, memory, batch):
        def loss_fn(model):
            nll, new_memory = model(batch["inputs"], batch["targets"], memory)
            return (nll * batch["weights"]).sum() / batch["weights"].sum(), new_memory

        (loss, memory), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss, memory

    memory = model.init_memory(4, 16)
    losses = []
    for _ in range(300):
        batch = next(batches)
        memory = reset_memory(memory, batch["reset"])
        loss, memory = step(model, optimizer, memory, batch)
        losses.append(float(loss))
    assert losses[0] > 8.0  # ~ln(10000) at initialisation
    assert np.mean(losses[-16:]) < 1.0  # memorised: the same 1024 tokens every epoch


# train.py / eval.py as a user runs them --------------------------------------------------------


def run(args, env_extra=None):
    env = {**os.environ, "XFORMER_DATA_DIR": str(SHARED), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


def train_cmd(workdir, tfds_dir, *extra):
    flags = [f"--config.{k}={v}" for k, v in TINY.items()]
    return [
        "train.py",
        "--config=configs/ptb_xl.py",
        f"--workdir={workdir}",
        f"--config.data.data_dir={tfds_dir}",
        f"--config.data.vocab_dir={shared_vocab_dir(tfds_dir)}",  # PTB's vocabulary too
        "--config.train.checkpoint_every=3",
        "--config.train.eval_every=1000",
        *flags,
        *extra,
    ]


def train_metrics(workdir) -> dict[int, dict]:
    """{step: that step's train/ metrics} from metrics.jsonl."""
    rows = [
        json.loads(line)
        for line in (Path(workdir) / "metrics.jsonl").read_text().split("\n")
        if line
    ]
    return {r["step"]: r for r in rows if "train/loss" in r}


def losses(workdir) -> dict[int, float]:
    return {step: r["train/loss"] for step, r in train_metrics(workdir).items()}


@pytest.mark.slow
def test_eval_py_scores_every_token(tmp_path, tfds_dir, ptb):
    """(A resumed run's exactness, the XL memory included: test_reliability.py.)"""
    trained = run(train_cmd(tmp_path / "run", tfds_dir, "--config.train.num_steps=6"))
    assert trained.returncode == 0, trained.stderr[-3000:]

    result = run(
        [
            "eval.py",
            f"--workdir={tmp_path / 'run'}",
            "--split=test",
            "--segment_length=32",
            "--mem_len=64",
            "--clamp_len=40",
            "--decoder_mask=same_length",
            "--batch_size=5",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Not the run's own result (eval_test.json, read by --compare and sweeps): named by the
    # settings that differ from the workdir's.
    tag = "batch_size=5,segment_length=32,mem_len=64,clamp_len=40,decoder_mask=same_length"
    report = json.loads((tmp_path / "run" / f"eval_test.{tag}.json").read_text())
    assert not (tmp_path / "run" / "eval_test.json").exists()
    assert report["tokens"] == PTB_TEST_TOKENS
    assert report["step"] == 6 and report["eval_mem_len"] == 64
    assert report["eval_decoder_mask"] == "same_length"
    assert report["perplexity"] == pytest.approx(math.exp(report["nll"]))
    assert 100 < report["perplexity"] < 10_000  # six steps: far from trained, far from broken

    # A text file: every token scored once, words outside the vocabulary as <unk>, counted.
    text = tmp_path / "in.txt"
    lines = ["the company said zzyzx", "", "qwxq shares <unk> fell\r", "no final newline blorp"]
    text.write_bytes("\n".join(lines).encode())
    result = run(["eval.py", f"--workdir={tmp_path / 'run'}", f"--input={text}"])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "eval_input.in.txt.json").read_text())
    words = [w for line in lines for w in line.split()]
    vocab = set((Path(shared_vocab_dir(tfds_dir)) / "ptb.vocab").read_text().split("\n"))
    assert report["oov_tokens"] == sum(w not in vocab for w in words) == 4  # newline too
    # An earlier checkpoint's result is named by its step: the latest one's stays.
    result = run(["eval.py", f"--workdir={tmp_path / 'run'}", f"--input={text}", "--step=3"])
    assert result.returncode == 0, result.stderr[-3000:]
    earlier = json.loads((tmp_path / "run" / "eval_input.in.txt.step3.json").read_text())
    assert earlier["step"] == 3 and earlier["nll"] != report["nll"]
    assert json.loads((tmp_path / "run" / "eval_input.in.txt.json").read_text()) == report
    assert report["tokens"] == len(words) + len(lines)

    bad = run(["eval.py", f"--workdir={tmp_path / 'run'}", "--beam_size=2"])
    assert bad.returncode != 0 and "--beam_size is for encoder_decoder" in bad.stderr


@pytest.mark.slow
def test_four_simulated_devices_match_one_with_memory(tmp_path, tfds_dir, ptb):
    # Long eval segments: few cross-device reductions in the final validation pass (XLA's CPU
    # collectives can starve on a loaded 2-core machine when there are hundreds of them).
    args = [
        "--config.train.num_steps=3",
        "--config.eval.segment_length=512",
        "--config.train.peak_tflops=0.001",
    ]
    one = run(train_cmd(tmp_path / "one", tfds_dir, *args))
    assert one.returncode == 0, one.stderr[-3000:]
    # Four devices as data 2 x fsdp 2: the batch rows over all four, parameters split in two.
    mesh = ["--config.mesh.data=2", "--config.mesh.fsdp=2"]
    four = run(
        train_cmd(tmp_path / "four", tfds_dir, *args, *mesh),
        env_extra=FOUR_DEVICES,
    )
    assert four.returncode == 0, four.stderr[-3000:]
    assert "CpuDevice(id=3)" in four.stderr
    l1, l4 = losses(tmp_path / "one"), losses(tmp_path / "four")
    np.testing.assert_allclose([l4[s] for s in (1, 2, 3)], [l1[s] for s in (1, 2, 3)], rtol=1e-4)
    # The same global batch: the same model FLOPs a step, whatever the devices (behind MFU =
    # FLOPs / s / (devices x peak)); XLA counts one device's program, x 4: a little more than
    # one device executes, as each also runs the replicated work (Adam's update of every
    # parameter, the relative encodings' projection).
    for step in (1, 2, 3):
        per_step = {}
        for name, devices in (("one", 1), ("four", 4)):
            r = train_metrics(tmp_path / name)[step]
            steps_per_s = r["train/steps_per_s"]
            per_step[name] = (
                r["train/gflop_per_s"] / steps_per_s,
                r["train/mfu"] * devices * 1e12 * 0.001 / steps_per_s,
            )
        (xla_one, model_one), (xla_four, model_four) = per_step["one"], per_step["four"]
        assert xla_one < xla_four < 1.2 * xla_one
        assert model_four == pytest.approx(model_one, rel=1e-9)
        assert 0.5 * xla_one * 1e9 < model_one < xla_one * 1e9

    # eval.py on one device scores the four-device run as its final validation did: the
    # training mesh does not fit one device, so it evaluates over data alone (logged).
    key = f"{EVAL_SPLIT}/nll"
    lines = (tmp_path / "four" / "metrics.jsonl").read_text().splitlines()
    final_nll = [r[key] for r in map(json.loads, lines) if key in r][-1]
    result = run(["eval.py", f"--workdir={tmp_path / 'four'}", f"--split={EVAL_SPLIT}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the training mesh does not fit this run" in result.stderr
    report = json.loads((tmp_path / "four" / f"eval_{EVAL_SPLIT}.json").read_text())
    assert report["step"] == 3
    assert report["nll"] == pytest.approx(final_nll, rel=1e-5)
    bad = run(["eval.py", f"--workdir={tmp_path / 'four'}", "--mesh=2,2,1"])
    assert bad.returncode != 0
    assert "--mesh=2,2,1: mesh.data=2, mesh.fsdp=2, mesh.tensor=1: the mesh has 4" in bad.stderr


def test_train_step_draws_fresh_dropout_masks_every_step(tmp_path, tfds_dir, ptb):
    """Dropout keys come from (seed, step): the same step repeats its masks exactly, the next
    step gets new ones (a stream the per-step re-keying misses would repeat one mask forever)."""
    from xformer.train_lib import train_step

    task = make_task(tiny_config(tfds_dir, **{"model.dropout": 0.3}), str(tmp_path))
    state = task.exp.init_state(task.init_carry())
    batch = next(task.train_batches())

    def loss(state, rng_state, step_no):
        return train_step(task, {**state, "step": step_no}, rng_state, batch)[1]["loss_sum"]

    step = jax.jit(loss)
    a, again, b = (float(step(state, task.exp.rng_state, np.int32(i))) for i in (0, 0, 1))
    assert a == again
    assert abs(a - b) > 1e-5 * abs(a)  # at initialisation dropout moves the loss only a little


@pytest.mark.usefixtures("ptb")
def test_a_shared_vocab_dir_keeps_one_vocabulary_per_training_split(tmp_path, tfds_dir):
    """A run on a slice of train builds its vocabulary from that slice, and a later run on all
    of train in the same data.vocab_dir builds its own instead of reusing the slice's."""
    sizes = {}
    for split in ("train[:300]", "train"):
        overrides = {"data.vocab_dir": str(tmp_path / "vocab"), "data.train_split": split}
        task = LanguageModelingTask(tiny_config(tfds_dir, **overrides), str(tmp_path / split))
        sizes[split] = len(task.vocab)
    assert sizes["train"] == 10_000 and sizes["train[:300]"] < 5_000, sizes
    assert len(list((tmp_path / "vocab").glob("*.vocab"))) == 2


@pytest.mark.usefixtures("ptb")
def test_a_validation_split_that_cannot_be_read_fails_before_training(tmp_path, tfds_dir):
    """A misspelt data.eval_split stops the run before its first step (it failed at the first
    evaluation, train.eval_every steps in, with nothing checkpointed)."""
    overrides = {"data.eval_split": "vaild", "train.num_steps": 2, "train.eval_every": 2}
    with pytest.raises(DataValueError, match="Unknown split 'vaild' for corpus 'ptb'"):
        train_and_evaluate(tiny_config(tfds_dir, **overrides), str(tmp_path))
    assert not read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert not list((tmp_path / "checkpoints").glob("*"))


def test_prefix_lm_evaluation_scores_each_token_once_and_never_inside_the_prefix():
    config = lm_base_config("ptb")
    config.model.mem_len, config.data.segment_length = 0, 12
    config.model.decoder_mask, config.model.prefix_length = "prefix_lm", 5
    settings = EvalSettings.from_config(config)
    assert settings.sliding_stride == 12 - 5 + 1 and settings.mem_len == 0
    stream = np.arange(1, 102)  # distinct tokens: each scored target names its position
    scored = []
    for batch in sliding_windows(stream, 3, 12, settings.sliding_stride, 0):
        rows, offsets = np.nonzero(batch["weights"])
        assert offsets.min() >= 5 - 1  # query offset >= P - 1: its target is after the prefix
        scored += list(batch["targets"][rows, offsets])
    assert sorted(scored) == list(stream)
