"""train.py / eval.py end to end on real Multi30k with a tiny model: one output line per input,
and the same run on 4 simulated devices; a checkpoint from before the "progress" item still
restores. (Resuming after a kill: test_reliability.py.)"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import sacrebleu

from xformer.checkpoint import Checkpointer
from xformer.data.translation import split_text
from xformer.experiment import load_config
from xformer.files import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
# 4 simulated CPU devices, on top of the session's XLA flags (set in tests/conftest.py).
FOUR_DEVICES = {
    "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
}
EVAL_SPLIT = "val[:128]"  # its metrics are logged as "val[:128]/nll" etc.
TINY = [
    "--config.model.d_model=32",
    "--config.model.num_heads=4",
    "--config.model.d_ff=64",
    "--config.model.num_encoder_layers=1",
    "--config.model.num_decoder_layers=1",
    "--config.data.vocab_size=400",
    "--config.data.max_train_length=32",
    "--config.train.batch_size=8",
    "--config.train.log_every=1",
    "--config.train.warmup_steps=2",
    "--config.train.max_train_seconds=0",
    f"--config.data.eval_split={EVAL_SPLIT}",
    "--config.eval.batch_size=16",
    "--config.eval.bleu_sentences=16",
    "--config.eval.max_decode_extra=5",
    "--config.eval.beam_size=2",
]


def run(args, env_extra=None, **kwargs):
    env = {
        **os.environ,
        "XFORMER_DATA_DIR": str(ROOT.parent / "shared" / "data"),
        **(env_extra or {}),
    }
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, **kwargs
    )


def shared_vocab_dir(tfds_dir) -> str:
    """Where a test worker's runs keep their SentencePiece models and PTB vocabulary
    (data.vocab_dir): built once per worker and data directory (a SentencePiece model about
    12 s on a slow machine, PTB's vocabulary and encoded splits ~2 s), not once per workdir."""
    return os.path.join(tfds_dir, "vocab")


def copy_shared_vocab(workdir, tfds_dir) -> None:
    """Copy the worker's shared SentencePiece model (trained here if no run has yet) into
    `workdir`'s own vocabulary directory, where a `shared_vocab=False` run finds it instead of
    training the same model again (~10 s)."""
    from xformer.data.translation import load_tokenizers

    load_tokenizers(tiny_config(tfds_dir), str(workdir))
    own = Path(workdir) / "vocab"
    own.mkdir(parents=True, exist_ok=True)
    for model in Path(shared_vocab_dir(tfds_dir)).glob("*.model"):
        shutil.copy(model, own / model.name)


def train_cmd(workdir, tfds_dir, *extra, shared_vocab=True):
    """train.py on Multi30k with the TINY model; `shared_vocab=False` keeps the tokenizers in
    the workdir, as a run does by default."""
    vocab = [f"--config.data.vocab_dir={shared_vocab_dir(tfds_dir)}"] if shared_vocab else []
    return [
        "train.py",
        "--config=configs/multi30k_ende.py",
        f"--workdir={workdir}",
        f"--config.data.data_dir={tfds_dir}",
        *TINY,
        *vocab,
        *extra,
    ]


def tiny_config(tfds_dir):
    """`train_cmd`'s run as a ConfigDict, for train_and_evaluate in this process: base_config
    with the TINY flags (each value converted to its key's type) and the shared directories."""
    from xformer import config as config_lib

    config = config_lib.base_config()
    defaults = config_lib.flatten(config)
    flags = dict(flag.removeprefix("--config.").split("=", 1) for flag in TINY)
    return config_lib.override(
        config,
        {
            **{key: type(defaults[key])(value) for key, value in flags.items()},
            "data.data_dir": tfds_dir,
            "data.vocab_dir": shared_vocab_dir(tfds_dir),
        },
    )


def train_metric(workdir, name="loss") -> dict[int, float]:
    """{step: train/<name>}; after a resume, a step's last row (the resumed run's)."""
    rows = read_jsonl(str(Path(workdir) / "metrics.jsonl"))
    return {r["step"]: r[f"train/{name}"] for r in rows if "train/loss" in r}


def checkpoint_steps(workdir) -> list[int]:
    d = Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


@pytest.mark.slow
def test_eval_py_translates_every_line_it_is_given(tmp_path, tfds_dir, multi30k_dir):
    """(A resumed run's exactness and its training seconds: test_reliability.py.)"""
    workdir = tmp_path / "run"
    trained = run(train_cmd(workdir, tfds_dir, "--config.train.num_steps=3"))
    assert trained.returncode == 0, trained.stderr[-3000:]

    # eval.py on a hostile file (BOM, CRLF, no final newline, empty and invisible lines, odd
    # Unicode, a lone CR, a 5,000-word line, a 20,000-character token): one output line per
    # input line, the long ones cut to eval.max_input_tokens in small batches (this OOMed).
    src = tmp_path / "in.en"
    lines = [
        "A man rides a bike.",
        "",
        "Zwölf 🚲 — ümlaut ﬁ ligature\u00a0nbsp",
        " ".join(["dog"] * 5000),
        "\u200b\u202e\x00\t ",
        "x" * 20_000,
        "Two\rwomen are\u2028talking.",
        *[""] * 150,
        "Two women are talking.",
    ]
    src.write_bytes(("\ufeff" + "\r\n".join(lines)).encode("utf-8"))
    out = tmp_path / "out.de"
    result = run(["eval.py", f"--workdir={workdir}", f"--input={src}", f"--output={out}"])
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = out.read_text(encoding="utf-8").split("\n")
    assert len(outputs) == len(lines) + 1 and outputs[-1] == ""
    assert [outputs[i] for i in (1, 4, *range(7, 157))] == [""] * 152
    assert all(outputs[i] for i in (0, 2, 3, 5, 6, 157))
    report = json.loads(result.stdout)
    assert report == json.loads((workdir / "eval_input.in.en.json").read_text())  # not a split's
    assert report["sentences"] == len(lines) and report["empty_inputs"] == 152
    assert report["truncated_inputs"] == 2 and report["longest_input_tokens"] > 5000
    assert "2 of 6 inputs have more than 512 tokens" in result.stderr
    assert "sentences/s | ETA" in result.stderr

    # Invalid UTF-8: one line naming file, line and column, status 2, before any compute.
    bad = tmp_path / "bad.en"
    bad.write_bytes(b"fine\nbad \xff byte\n")
    result = run(["eval.py", f"--workdir={workdir}", f"--input={bad}", f"--output={out}"])
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"eval.py: error: {bad}: line 2 is not valid UTF-8 (invalid start byte: "
        "byte(s) b'\\xff' at column 5)"
    ]
    assert "Traceback" not in result.stderr and len(outputs) == len(out.read_text().split("\n"))

    # eval.py on a whole split reports both BLEU conventions for every sentence.
    # Greedy search has no length penalty: the flag changes neither the file names nor the
    # report's settings (--compare would have flagged the same search as another setting).
    split_flags = ["--split=test_2017_mscoco", "--beam_size=1", "--length_penalty=1.0"]
    result = run(["eval.py", f"--workdir={workdir}", *split_flags])
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((workdir / "eval_test_2017_mscoco.beam_size=1.json").read_text())
    assert report["beam_size"] == 1 and report["length_penalty"] is None
    assert report["output"].endswith(
        f"/translations/test_2017_mscoco.step{report['step']}.beam_size=1.de"
    )
    assert not (workdir / "eval_test_2017_mscoco.json").exists()  # the run's own (beam 2)
    assert report["sentences"] == 461
    assert {"sacrebleu", "lc_tok_bleu", "signature"} <= set(report)
    hypotheses = Path(report["output"]).read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == 461
    # Beside them, the split's sources and references in their order: a split of the TFDS
    # catalog (WMT14's) is stored in TFDS's order, not the official file's.
    config = load_config(str(workdir))
    assert report["max_input_tokens"] == config.eval.max_input_tokens  # (the setting)
    sources, references = split_text(config, "test_2017_mscoco")
    assert report["sources"].endswith("/translations/test_2017_mscoco.en")
    assert report["references"].endswith("/translations/test_2017_mscoco.ref.de")
    assert Path(report["sources"]).read_text(encoding="utf-8").splitlines() == sources
    written = Path(report["references"]).read_text(encoding="utf-8").splitlines()
    assert written == references
    bleu = sacrebleu.corpus_bleu(hypotheses, [written])
    assert bleu.score == pytest.approx(report["sacrebleu"], abs=1e-9)


@pytest.mark.slow
def test_four_simulated_devices_match_one(tmp_path, tfds_dir, multi30k_dir):
    """Data parallelism over 4 CPU devices computes the same losses as 1 device."""
    args = [
        "--config.train.num_steps=3",
        "--config.train.checkpoint_every=3",
        "--config.train.eval_every=3",
    ]
    one = run(train_cmd(tmp_path / "one", tfds_dir, *args))
    assert one.returncode == 0, one.stderr[-3000:]
    four = run(
        train_cmd(tmp_path / "four", tfds_dir, *args),
        env_extra=FOUR_DEVICES,
    )
    assert four.returncode == 0, four.stderr[-3000:]
    assert "CpuDevice(id=3)" in four.stderr
    l1, l4 = train_metric(tmp_path / "one"), train_metric(tmp_path / "four")
    np.testing.assert_allclose([l4[s] for s in (1, 2, 3)], [l1[s] for s in (1, 2, 3)], rtol=1e-4)
    # (eval.py on 4 devices, a last batch padded to them: test_distributed.py.)


def test_checkpoint_from_before_progress_restores(tmp_path):
    """A checkpoint without the "progress" item (written before it existed) still restores."""
    state = {"step": jnp.array(7), "w": jnp.ones(3)}
    old = ocp.CheckpointManager(tmp_path / "checkpoints", item_names=("state", "data"))
    args = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave({"epoch": 1})}
    old.save(7, args=ocp.args.Composite(**args))
    old.close()
    checkpointer = Checkpointer(str(tmp_path))
    restored, data = checkpointer.restore(state)
    assert int(restored["step"]) == 7 and data == {"epoch": 1}
    assert checkpointer.progress() == {}
    checkpointer.save(8, state, data, {"train_seconds": 1.5})
    checkpointer.close()
    assert Checkpointer(str(tmp_path)).progress() == {"train_seconds": 1.5}


def tiny_experiment(workdir, keep_checkpoints: int = 2, d_ff: int = 32, layers: int = 1):
    """A translation Experiment of `layers` + `layers` layers over 50-token vocabularies,
    checkpointing in `workdir` (no data, no training)."""
    from xformer import config as config_lib
    from xformer import model_config
    from xformer.experiment import setup
    from xformer.models import EncoderDecoder

    config = config_lib.base_config()
    config_lib.override(
        config,
        {
            "model.d_model": 16,
            "model.num_heads": 2,
            "model.d_ff": d_ff,
            "model.num_encoder_layers": layers,
            "model.num_decoder_layers": layers,
            "train.keep_checkpoints": keep_checkpoints,
        },
    )
    cfg = model_config.from_config(config.model, src_vocab_size=50, tgt_vocab_size=50)
    return setup(config, str(workdir), EncoderDecoder, cfg)


def test_eval_restores_the_parameters_alone(tmp_path):
    """restore_params (eval.py's restore: a partial restore that asks for no optimizer state)
    gives the saved step and parameters, in their shardings; a missing step is named."""
    from xformer.checkpoint import CheckpointShapeError
    from xformer.params_checkpoint import restore_params

    exp = tiny_experiment(tmp_path)
    message = f"no checkpoint in {tmp_path / 'checkpoints'}: train.py writes them"
    with pytest.raises(FileNotFoundError, match=message):
        restore_params(exp)
    state = exp.init_state()
    state["step"] = state["step"] + 7
    exp.checkpointer.save(7, state, {"epoch": 1})
    exp.checkpointer.wait()
    params, step = restore_params(exp)
    assert step == 7
    saved, restored = jax.tree.leaves(state["params"]), jax.tree.leaves(params)
    assert len(saved) == len(restored) > 5
    for a, b in zip(saved, restored, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding == a.sharding
    with pytest.raises(FileNotFoundError, match=r"no checkpoint 3 in .* \(it holds \[7\]\)"):
        restore_params(exp, 3)
    wider = tiny_experiment(tmp_path, d_ff=48)  # a model the checkpoint does not hold
    message = r"hold 6 arrays of other shapes than this model's \(e.g. params/.*, the model's"
    with pytest.raises(CheckpointShapeError, match=message):  # (FFN kernels, biases)
        restore_params(wider)
    # Another number of layers: a partial restore would have taken the layers both hold.
    deeper = tiny_experiment(tmp_path, layers=2)
    message = r"other arrays than this model's \(\d+ of the model's missing, 0 more; e.g. the "
    with pytest.raises(CheckpointShapeError, match=message + r"model's params/.*/1/"):
        restore_params(deeper)
    with pytest.raises(CheckpointShapeError, match=message):  # a resume checks all the state
        deeper.checkpointer.restore(deeper.abstract_state())
    deeper.checkpointer.close()
    exp.checkpointer.save(8, tiny_experiment(tmp_path / "deep", layers=2).init_state(), {})
    exp.checkpointer.wait()
    extra = r"other arrays than this model's \(0 of the model's missing, \d+ more; e.g. params/"
    with pytest.raises(CheckpointShapeError, match=extra + r".*/1/.* is not in the model"):
        restore_params(exp)


def test_a_resumed_run_restores_onto_shapes_alone(tmp_path, tfds_dir, multi30k_dir, monkeypatch):
    """Resuming restores the checkpoint onto `abstract_state`: no initialised train state is
    made (and held beside the restored one), and the run goes on from the saved step. The
    training seconds leave out the compilation and the learning rate's first (compiling) call."""
    from xformer import config as config_lib
    from xformer import experiment as experiment_lib
    from xformer import train_lib
    from xformer.train_lib import train_and_evaluate

    compile_step = train_lib.compile_step

    def slow_compile(*args):
        time.sleep(4.0)
        return compile_step(*args)

    monkeypatch.setattr(train_lib, "compile_step", slow_compile)
    schedule = train_lib.learning_rate_schedule

    def slow_first_rate(t):  # the first call of a schedule compiles its jnp ops (~1 s)
        rate, calls = schedule(t), []
        return lambda count: calls.append(time.sleep(4.0) if not calls else None) or rate(count)

    monkeypatch.setattr(train_lib, "learning_rate_schedule", slow_first_rate)
    from xformer.checkpoint import Checkpointer
    from xformer.preemption import StopOnSignal

    handlers_at_close, close = [], Checkpointer.close

    def recorded_close(self):  # the last save is waited for with the signal handler installed
        handlers_at_close.append(getattr(signal.getsignal(signal.SIGTERM), "__func__", None))
        return close(self)

    monkeypatch.setattr(Checkpointer, "close", recorded_close)

    config = config_lib.override(
        tiny_config(tfds_dir),
        {
            "train.checkpoint_every": 2,
            "train.eval_every": 1000,
            "train.num_steps": 2,
            "data.eval_split": "val[:8]",  # each run ends with a validation pass
            "eval.batch_size": 8,
            "eval.bleu_sentences": 8,
        },
    )
    assert train_and_evaluate(config, str(tmp_path))["step"] == 2
    assert handlers_at_close == [StopOnSignal._handle]
    seconds = train_metric(tmp_path, "train_seconds")
    assert 0 < seconds[1] <= seconds[2] < 4.0  # the steps alone: no compiling, no first rate

    def no_init(self, carry=None):
        raise AssertionError("a resumed run initialised a train state")

    monkeypatch.setattr(experiment_lib.Experiment, "init_state", no_init)
    config.train.num_steps = 3
    assert train_and_evaluate(config, str(tmp_path))["step"] == 3
    assert sorted(train_metric(tmp_path)) == [1, 2, 3]
    # Two input shards cannot take one shard's data position: one line naming the key.
    config.train.num_steps, config.data.input_shards = 4, 2
    message = r"the checkpoint's data position does not fit .* data.input_shards"
    with pytest.raises(config_lib.ConfigError, match=message):
        train_and_evaluate(config, str(tmp_path), accept_config_changes=True)


def test_the_eta_counts_the_steps_at_their_pace_and_each_validation_left():
    from ml_collections import ConfigDict

    from xformer.train_lib import eta_seconds

    t = ConfigDict({"num_steps": 10, "eval_every": 3})
    # 4 steps in 14 s, 2 s of them in 1 validation: 3 s a step; validations 6, 9 and 10 left.
    assert eta_seconds(t, 4, 4, 14.0, 2.0, 1) == pytest.approx(6 * 3 + 3 * 2)
    # Step 6's line comes before its validation; a resumed start counts its own steps.
    assert eta_seconds(t, 6, 2, 9.0, 5.0, 2) == pytest.approx(4 * 2 + 3 * 2.5)
    assert eta_seconds(t, 10, 10, 30.0, 0.0, 0) == 0.0  # no validation timed yet
    t.num_steps = 9
    assert eta_seconds(t, 9, 9, 40.0, 4.0, 2) == pytest.approx(2.0)
