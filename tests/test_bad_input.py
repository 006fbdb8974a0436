"""Bad input fails fast with a message that says what is wrong and where."""

import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xformer import config as config_lib
from xformer.data.text import read_parallel_files, read_text_lines
from xformer.experiment import save_config
from xformer.files import check_output_file

ROOT = Path(__file__).resolve().parents[1]


def run(args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--config=configs/multi30k_ende.py", "--config.model.num_head=8"],
            "--config.model.num_head: the config has no key 'num_head' (Did you mean "
            '"num_heads" instead of "num_head"?)',
        ),
        (
            ["--config=configs/multi30k_ende.py:rotary"],
            "flag --config=configs/multi30k_ende.py:rotary: unknown config variant 'rotary'; "
            "known: ['alibi', 'learned', 'local', 'none', 'relative', 'rope', 'short', "
            "'t5_bias'] (--helpshort lists the flags)",
        ),
        (["--config=configs/missing.py"], "--config: [Errno 2] No such file or directory"),
    ],
)
def test_config_flags_that_cannot_be_used_are_one_line(tmp_path, flags, message):
    """An unknown override key, config variant or config file: train.py says which in one
    line (ml_collections raises them as tracebacks) and writes nothing."""
    result = run(["train.py", f"--workdir={tmp_path / 'run'}", *flags])
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1].startswith(
        f"train.py: {message}"
    )
    assert "Traceback" not in result.stderr and "Pass --help" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_eval_flags_that_cannot_be_used_are_one_line(tmp_path):
    """eval.py, sample.py, average.py and train.py --sweep: a workdir that is not one, an
    evaluation batch of no rows, an output that is a directory, --split with --input, a
    negative memory, flags that would be ignored: one line (not the script's help), before any
    data is read."""
    save_config(config_lib.base_config(), str(tmp_path))
    lm = tmp_path / "lm"
    lm.mkdir()
    save_config(config_lib.lm_base_config("ptb"), str(lm))
    source = tmp_path / "in.en"
    source.write_text("a man\n", encoding="utf-8")
    missing = tmp_path / "missing"
    for args, status, message in [
        (
            ["eval.py", f"--workdir={missing}"],
            2,
            f"eval.py: error: {missing / 'config.json'} not found: is '{missing}' a train.py",
        ),
        (
            ["average.py", f"--workdir={missing}", "--last=2", f"--output={tmp_path / 'avg'}"],
            1,
            f"average.py: {missing / 'config.json'} not found",
        ),
        (
            ["eval.py", f"--workdir={tmp_path}", "--batch_size=0"],
            2,
            "eval.py: error: eval.batch_size must be >= 1, got 0",
        ),
        (
            ["eval.py", f"--workdir={tmp_path}", "--split=val", f"--output={tmp_path}"],
            2,
            f"eval.py: error: --output={tmp_path} is a directory, not a file",
        ),
        (
            ["eval.py", f"--workdir={tmp_path}", "--split=val", f"--input={source}"],
            1,
            "eval.py: give --split or --input, not both (--helpshort lists the flags)",
        ),
        (
            ["eval.py", f"--workdir={lm}", "--mem_len=-5"],
            2,
            "eval.py: error: --mem_len must be >= 0, got -5 (leave it out to use the workdir's",
        ),
        (
            ["sample.py", f"--workdir={lm}", "--prompt=the", "--segment_length=0"],
            1,
            "sample.py: --segment_length must be >= 1, got 0 (leave it out to use the",
        ),
        (
            ["eval.py", f"--compare={tmp_path}", "--split=valid", "--num_processes=2"],
            1,
            "eval.py: --compare evaluates nothing: --split, --num_processes would be ignored",
        ),
        (
            ["train.py", "--sweep=configs/sweeps/ptb_positional.py", f"--workdir={missing}"]
            + ["--dry_run", "--accept_config_changes", "--process_id=1"],
            1,
            "train.py: --process_id, --accept_config_changes: for --config runs, not --sweep",
        ),
        (
            ["eval.py", f"--workdir={tmp_path}", "--distributed", "--coordinator_address=x:1"]
            + ["--num_processes=2", "--process_id=2"],
            1,
            "eval.py: --distributed: process_id and num_processes must be nonnegative, with "
            "process_id < num_processes",
        ),
        (  # (an evaluation of 64 rows over 3 devices, checked before any data is read)
            ["eval.py", f"--workdir={tmp_path}", "--batch_size=64", "--xla_devices=3"],
            2,
            "eval.py: error: eval.batch_size=64 must be divisible by the 3 row shards of the "
            "mesh (mesh.data x mesh.fsdp = 3 x 1) (--batch_size or --mesh sets another)",
        ),
    ]:
        # --xla_devices=N is the test's, not the script's: N simulated devices (XLA_FLAGS).
        devices = [a for a in args if a.startswith("--xla_devices=")]
        args = [a for a in args if a not in devices]
        xla = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count="
        result = run(args, {"XLA_FLAGS": xla + devices[0].split("=")[1]} if devices else None)
        assert result.returncode == status and message in result.stderr, args
        printed = [
            line for line in result.stderr.splitlines() if not re.match(r"[IWE]\d{4} ", line)
        ]
        assert "Traceback" not in result.stderr and len(printed) == 1, (args, printed)
    assert not (tmp_path / "vocab").exists() and not missing.exists()


@pytest.mark.parametrize(
    "flag,value,least",
    [("segment_length", 0, 1), ("mem_len", -5, 0), ("clamp_len", -1, 0), ("sliding_stride", -1, 0)],
)
def test_eval_flags_below_their_minimum_are_refused(flag, value, least):
    """eval.py's and sample.py's lengths: one message naming the flag and its minimum (a
    negative --sliding_stride was refused as needing mem_len=0)."""
    config = config_lib.lm_base_config("ptb")
    with pytest.raises(ValueError, match=rf"^--{flag} must be >= {least}, got {value} \(leave"):
        config_lib.set_eval_flags(config, {flag: value})
    config_lib.set_eval_flags(config, {flag: least, "batch_size": None})  # None: left out
    assert config.eval[flag] == least


def test_unknown_config_key_in_config_file():
    config = config_lib.base_config()
    config.model.num_head = 8
    with pytest.raises(ValueError, match=r"unknown config key 'model.num_head'.*num_heads"):
        config_lib.validate(config)


def test_d_model_not_divisible_by_heads(tmp_path):
    config = config_lib.base_config()
    config.model.d_model, config.model.num_heads = 100, 8
    with pytest.raises(
        ValueError, match=r"model.d_model=100 must be divisible by model.num_heads=8"
    ):
        config_lib.validate(config)
    result = run(
        [
            "train.py",
            "--config=configs/multi30k_ende.py",
            f"--workdir={tmp_path}",
            "--config.model.d_model=100",
            "--config.model.num_heads=8",
        ]
    )
    assert result.returncode != 0
    assert "must be divisible by model.num_heads" in result.stderr


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("model.positional", "rotary", r"allowed values: \('none', 'sinusoidal', 'learned'"),
        ("model.dropout", 1.5, "model.dropout must be in"),
        ("model.init_std", -0.02, r"model.init_std must be >= 0 \(0 = LeCun normal\)"),
        ("data.vocab", "separate", "share_embeddings=True needs data.vocab='joint'"),
        ("model.d_model", "big", "must be int"),
        ("model.num_heads", 0, "model.num_heads must be positive, got 0"),
        ("train.grad_accum_steps", 0, r"train.grad_accum_steps=0 must be an integer >= 1"),
        ("train.batch_size", 64.0, r"config key 'train.batch_size' must be int, got 64.0"),
        ("train.seed", 0.5, r"config key 'train.seed' must be int, got 0.5"),
        ("eval.beam_size", True, r"config key 'eval.beam_size' must be int, got True"),
        ("train.peak_tflops", -1.0, r"train.peak_tflops must be >= 0 \(0 = by device kind\)"),
        ("eval.batch_size", 0, "eval.batch_size must be >= 1, got 0"),
        ("train.keep_checkpoints", 0, "train.keep_checkpoints must be positive, got 0"),
        ("eval.max_decode_extra", -1, "eval.max_decode_extra must be >= 0, got -1"),
        ("eval.max_input_tokens", 1, "eval.max_input_tokens must be >= 2, got 1"),
        ("eval.length_penalty", -2.0, "eval.length_penalty must be >= 0.0, got -2.0"),
        ("train.grad_clip_norm", -0.25, "train.grad_clip_norm must be >= 0, got -0.25"),
        ("train.learning_rate", 0.0, "train.learning_rate must be positive, got 0.0"),
        ("train.weight_decay", -0.1, "train.weight_decay must be >= 0, got -0.1"),
        ("train.warmup_steps", -10, "train.warmup_steps must be >= 0, got -10"),
        ("train.eps", -1.0, "train.eps must be >= 0, got -1.0"),
        ("train.max_train_seconds", -1.0, "train.max_train_seconds must be >= 0, got -1.0"),
        ("train.b2", 1.5, r"train.b2 must be in \[0, 1\), got 1.5"),
        ("model.num_encoder_layers", 0, "model.num_encoder_layers must be positive, got 0"),
        ("model.num_decoder_layers", -1, "model.num_decoder_layers must be positive, got -1"),
        ("data.num_packing_bins", -3, "data.num_packing_bins must be >= 0, got -3"),
        ("data.max_train_length", 0, "data.max_train_length must be positive, got 0"),
        ("data.vocab_size", 4, r"data.vocab_size must be > 4 \(the tokenizer's 4 special"),
        ("data.segment_length", 32, "data.segment_length is for decoder_only runs; a "),
        ("eval.mem_len", 300, "eval.mem_len is for decoder_only runs"),
        ("eval.sliding_stride", 5, "eval.sliding_stride is for decoder_only runs"),
        (
            "train.grad_accum_steps",
            3,
            r"train.grad_accum_steps=3 must be an integer >= 1 that divides train.batch_size=64",
        ),
    ],
)
def test_invalid_values_and_combinations(key, value, message):
    config = config_lib.base_config()
    section, name = key.split(".")
    with config.ignore_type():
        config[section][name] = value
    with pytest.raises(ValueError, match=message):
        config_lib.validate(config)


def test_evaluation_mesh_fits_the_devices_it_runs_on():
    """eval.py, sample.py and average.py run a trained config on the devices they are given:
    its mesh where it fits them, else every device on data, or --mesh; the training batches are
    not checked there, the evaluation batch is."""
    from xformer.experiment import set_evaluation_mesh

    def trained(data, fsdp, tensor):
        config = config_lib.base_config()
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor = data, fsdp, tensor
        config.train.batch_size, config.eval.batch_size = 64, 12
        return config

    def sizes(config):
        return config.mesh.data, config.mesh.fsdp, config.mesh.tensor

    kept = trained(2, 2, 2)
    set_evaluation_mesh(kept, None, 8)
    assert sizes(kept) == (2, 2, 2)
    moved = trained(2, 4, 1)
    set_evaluation_mesh(moved, None, 3)
    assert sizes(moved) == (-1, 1, 1)
    config_lib.check_devices(moved, 3, training=False)  # 12 evaluation rows over 3 devices
    with pytest.raises(ValueError, match="train.batch_size=64 must be divisible by the 3 row"):
        config_lib.check_devices(moved, 3)
    chosen = trained(2, 4, 1)
    set_evaluation_mesh(chosen, "1,-1,2", 6)
    assert sizes(chosen) == (1, -1, 2)
    with pytest.raises(ValueError, match="eval.batch_size=12 must be divisible by the 8 row"):
        config_lib.check_devices(trained(2, 4, 1), 8, training=False)
    # sample.py and average.py read no evaluation batches: theirs is not checked.
    config_lib.check_devices(trained(2, 4, 1), 8, training=False, evaluating=False)
    for flag, message in (
        ("2,2", "give three integer sizes"),
        ("a,1,1", "give three integer sizes"),
        ("2,2,1", "the mesh has 4 devices, but there are 2"),
    ):
        with pytest.raises(ValueError, match=f"--mesh={flag}: .*{message}"):
            set_evaluation_mesh(trained(1, 1, 1), flag, 2)


def test_micro_batch_not_dividing_over_the_devices(tmp_path):
    """8 rows in 4 micro-batches of 2 cannot split over 4 devices: train.py says so, naming the
    keys, before it prepares data or builds a vocabulary."""
    config = config_lib.base_config()
    config.train.batch_size, config.train.grad_accum_steps, config.eval.batch_size = 8, 4, 8
    config_lib.validate(config)  # the config alone is fine
    message = r"train.batch_size / train.grad_accum_steps = 8 / 4 = 2 rows .* the 4 row shards"
    with pytest.raises(ValueError, match=message):
        config_lib.check_devices(config, 4)
    config_lib.check_devices(config, 2)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    result = run(
        [
            "train.py",
            "--config=configs/multi30k_ende.py",
            f"--workdir={tmp_path}",
            "--config.train.batch_size=8",
            "--config.train.grad_accum_steps=4",
            "--config.eval.batch_size=8",
        ],
        env_extra={"XLA_FLAGS": flags},
    )
    assert result.returncode != 0
    assert "train.py: a micro-batch of train.batch_size / train.grad_accum_steps = 8 / 4" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr  # one line, not a stack
    assert not (tmp_path / "vocab").exists() and not (tmp_path / "config.json").exists()


def test_missing_data_is_one_line_from_train_and_eval(tmp_path):
    """Data files that are missing: train.py and eval.py say which and where, in one line
    without a traceback, before any compute."""
    manual = tmp_path / "ptb_copy"
    manual.mkdir()
    (manual / "ptb.train.txt").write_text(" a b c \n", encoding="utf-8")
    data = [f"--config.data.manual_dir={manual}", f"--config.data.data_dir={tmp_path / 'tfds'}"]
    message = f"Incomplete copy in {manual}: missing ptb.valid.txt, ptb.test.txt"
    workdir = tmp_path / "run"
    result = run(["train.py", "--config=configs/ptb_xl.py", f"--workdir={workdir}", *data])
    assert result.returncode == 1 and f"train.py: {message}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (workdir / "checkpoints").exists() and not (workdir / "vocab").exists()
    # eval.py on a workdir whose vocabulary went missing: the same, exit status 2.
    save_config(config_lib.lm_base_config("ptb"), str(workdir))
    result = run(["eval.py", f"--workdir={workdir}", "--split=test"])
    message = f"{workdir / 'vocab' / 'ptb.vocab'} not found: train.py writes it"
    assert result.returncode == 2 and f"eval.py: error: {message}" in result.stderr
    assert "Traceback" not in result.stderr
    # Evaluation settings the model cannot use: one line too, before the data is looked at.
    result = run(["eval.py", f"--workdir={workdir}", "--mem_len=8", "--sliding_stride=4"])
    message = "eval.sliding_stride needs a memoryless evaluation (eval.mem_len=0)"
    assert result.returncode == 2 and f"eval.py: error: {message}" in result.stderr
    assert "Traceback" not in result.stderr


def test_parallel_files_of_different_lengths(tmp_path):
    src, tgt = tmp_path / "a.en", tmp_path / "b.de"
    src.write_text("one\ntwo\nthree\n", encoding="utf-8")
    with gzip.open(tgt, "wt", encoding="utf-8") as f:
        f.write("eins\nzwei\n")
    with pytest.raises(ValueError, match=r"3 lines.*2 lines"):
        read_parallel_files(str(src), str(tgt))
    # eval.py reports it before loading any model.
    save_config(config_lib.base_config(), str(tmp_path))
    result = run(["eval.py", f"--workdir={tmp_path}", f"--input={src}", f"--reference={tgt}"])
    assert result.returncode == 2  # an input error: one line, no traceback
    assert f"eval.py: error: Parallel files have different line counts: {src} has 3" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "bad.en"
    path.write_bytes(b"fine\nalso fine\nbad \xff byte\n")
    with pytest.raises(ValueError, match="line 3"):
        read_text_lines(str(path))


def test_a_truncated_gzip_file_is_named(tmp_path):
    path = tmp_path / "cut.en.gz"
    path.write_bytes(gzip.compress(b"a man rides a bike\n" * 100)[:40])
    with pytest.raises(ValueError, match=f"{path}: not a complete gzip file"):
        read_text_lines(str(path))


def test_empty_lines_are_kept(tmp_path):
    path = tmp_path / "x.en"
    path.write_text("a\n\n\nb\n", encoding="utf-8")
    assert read_text_lines(str(path)) == ["a", "", "", "b"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"model.positional": "sinusoidal"}, r"memory .*cannot be used with .*'sinusoidal'"),
        ({"model.positional": "learned", "eval.mem_len": 0}, r"memory .*cannot be used"),
        (
            {"model.mem_len": 0, "model.decoder_mask": "same_length"},
            r"same_length' needs .*mem_len",
        ),
        ({"eval.sliding_stride": 1}, r"sliding_stride needs a memoryless evaluation"),
        (
            {
                "model.positional": "learned",
                "model.mem_len": 0,
                "eval.mem_len": 0,
                "model.max_len": 64,
                "data.segment_length": 64,
                "eval.segment_length": 128,
            },
            r"eval segment length 128 exceed the learned position table \(model.max_len=64",
        ),
        ({"model.adaptive_cutoffs": (500, 200)}, r"adaptive_cutoffs must be increasing"),
        ({"model.adaptive_cutoffs": (200,), "model.tie_projs": (True,)}, r"one entry per cluster"),
        ({"data.segment_length": 0}, r"data.segment_length must be > 0"),
        (
            {"model.decoder_mask": "bidirectional"},
            r"'model.decoder_mask' is 'bidirectional'; allowed values for decoder_only",
        ),
        ({"model.encoder_mask": "sliding_window"}, r"encoder_mask is for encoder_decoder"),
        ({"model.decoder_mask": "sliding_window"}, r"attention_window=0 must be > 0 exactly"),
        ({"model.attention_window": 8}, r"attention_window=8 must be > 0 exactly when"),
        ({"model.decoder_mask": "prefix_lm"}, r"prefix_length=0 must be > 0 exactly when"),
        (
            {"model.decoder_mask": "prefix_lm", "model.prefix_length": 8},
            r"prefix_lm' cannot be used with a memory",
        ),
        (
            {
                "model.mem_len": 0,
                "model.decoder_mask": "prefix_lm",
                "model.prefix_length": 8,
                "data.segment_length": 64,
                "eval.sliding_stride": 60,
            },
            r"prefix_lm windows can score at most .* = 57",
        ),
        ({"eval.decoder_mask": "prefix_lm"}, r"can switch prefix_lm neither on nor off"),
        (  # a window of 0 keys would hide every key, and a fully masked row sees them all
            {"eval.decoder_mask": "sliding_window"},
            r"eval.decoder_mask='sliding_window' needs model.attention_window > 0",
        ),
        (
            {"model.positional": "rope", "model.d_model": 18, "model.num_heads": 2},
            r"rope' needs an even head size \(d_model / num_heads = 9\)",
        ),
        ({"model.positional": "rope", "model.clamp_len": 4}, r"clamp_len .* are for .*'relative'"),
        ({"model.positional": "rope", "eval.clamp_len": 0}, r"eval.clamp_len=0 is for .*'rel"),
        ({"eval.clamp_len": -2}, r"eval.clamp_len must be >= 0, or -1"),
        ({"eval.mem_len": -5}, r"eval.mem_len must be >= 0, or -1 \(as trained\); got -5"),
        ({"data.vocab_size": 1}, r"data.vocab_size must be 0 \(every type\) or >= 2"),
        (
            {"data.dataset": "enwik8", "data.vocab_size": 200},
            r"data.vocab_size=200 caps word vocabularies; 'enwik8' is read as bytes",
        ),
        ({"data.dataset": "text8", "data.vocab_size": 30}, r"'text8' is read as chars, every"),
        ({"model.num_decoder_layers": 0}, r"model.num_decoder_layers must be positive, got 0"),
        ({"eval.beam_size": 9}, r"eval.beam_size is for encoder_decoder runs; a decoder_only"),
        ({"data.max_train_length": 32}, r"data.max_train_length is for encoder_decoder runs"),
        ({"train.label_smoothing": 0.1}, r"label_smoothing=0.1 is for translation"),
        ({"model.positional": "t5_bias", "model.relative_buckets": 2}, r"relative_buckets >= 4"),
        ({"model.positional": "alibi", "model.untie_relative_biases": True}, r"not 'alibi'"),
        (
            {"model.positional": "rope", "model.relative_buckets": 64},
            r"relative_buckets and .* are",
        ),
        (
            {"model.positional": "alibi", "model.rope_base": 500.0},
            r"model.rope_base is for model.positional='rope', not 'alibi'",
        ),
    ],
)
def test_incompatible_language_model_options(overrides, message):
    config = config_lib.lm_base_config("ptb")
    config.model.mem_len = 16
    for key, value in overrides.items():
        section, name = key.split(".")
        config[section][name] = value
    with pytest.raises(ValueError, match=message):
        config_lib.validate(config)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"model.decoder_mask": "prefix_lm", "model.prefix_length": 4},
            r"'model.decoder_mask' is 'prefix_lm'; allowed values for encoder_decoder",
        ),
        (
            {"model.encoder_mask": "causal"},
            r"'model.encoder_mask' is 'causal'; allowed values for encoder_decoder",
        ),
        ({"model.mem_len": 70}, r"model.mem_len is for decoder_only models"),
        ({"data.dataset": "ptb"}, r"'encoder_decoder' needs translation data; .*'ptb' is not"),
        ({"model.encoder_mask": "sliding_window"}, r"attention_window=0 must be > 0"),
        (
            {"model.positional": "t5_bias", "model.relative_max_distance": 8},
            r"relative_max_distance > relative_buckets / 2",
        ),
    ],
)
def test_incompatible_translation_options(overrides, message):
    config = config_lib.base_config()
    for key, value in overrides.items():
        section, name = key.split(".")
        config[section][name] = value
    with pytest.raises(ValueError, match=message):
        config_lib.validate(config)


def test_a_language_models_learned_table_is_sized_by_its_segments():
    """Not by the translation-only data.max_train_length (64 by default)."""
    config = config_lib.lm_base_config("ptb")
    config.model.update(positional="learned", max_len=32, mem_len=0)
    config.data.segment_length = 32
    config_lib.validate(config)
    config.eval.segment_length = 33
    with pytest.raises(ValueError, match=r"eval segment length 33 exceed the learned position"):
        config_lib.validate(config)


def test_language_model_on_a_translation_corpus(tmp_path):
    result = run(
        [
            "train.py",
            "--config=configs/ptb_xl.py",
            f"--workdir={tmp_path}",
            "--config.data.dataset=multi30k",
        ]
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr  # one line, before data
    message = "train.py: model.family='decoder_only' needs a language-modelling corpus; "
    assert message + "data.dataset='multi30k' is not" in result.stderr and "'ptb'" in result.stderr
    assert not (tmp_path / "vocab").exists()


def test_adaptive_cutoffs_beyond_the_vocabulary(tmp_path):
    """Found once the vocabulary is built (PTB's 10,000 types), still before the model is."""
    result = run(
        [
            "train.py",
            "--config=configs/ptb_xl.py",
            f"--workdir={tmp_path / 'run'}",
            f"--config.data.data_dir={tmp_path / 'tfds'}",
            "--config.model.adaptive_cutoffs=(2000, 20000)",
        ]
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    message = "train.py: model.adaptive_cutoffs=(2000, 20000) must be below the vocabulary size"
    assert f"{message} 10000 of ptb" in result.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_output_path_naming_a_directory_is_refused_before_any_compute(tmp_path):
    """A path ending in a separator names a directory even when none exists yet (the folder
    check passed and the write failed after translating everything)."""
    for path in (str(tmp_path), f"{tmp_path}/not_yet/"):
        with pytest.raises(IsADirectoryError, match=f"--output={path} is a directory, not a file"):
            check_output_file(path, "--output")
    check_output_file(str(tmp_path / "not_yet" / "out.de"), "--output")  # makes its folder
    assert (tmp_path / "not_yet").is_dir()
