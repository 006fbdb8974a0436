"""Config sweeps: grid semantics and names, overrides parsed exactly as train.py parses them,
validation before anything runs, the dry run's command lines, and a real 2-point sweep on PTB
that skips finished points, evaluates trained ones and resumes unfinished ones; then
`eval.py --compare` on its two runs."""

import csv
import io
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from test_distributed import wait_for_stall

from xformer import experiment as experiment_lib
from xformer import sweep
from xformer.config import lm_base_config
from xformer.preemption import EXIT_STOPPED
from xformer.tasks import make_task

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
NAMES = ["d_model=16,adaptive_cutoffs=none", "d_model=32,adaptive_cutoffs=100"]

TINY_CONFIG = """
from xformer.config import lm_base_config


def get_config():
    c = lm_base_config("ptb")
    c.model.d_model = 16
    c.model.num_heads = 2
    c.model.num_decoder_layers = 1
    c.model.d_ff = 32
    c.model.mem_len = 8
    c.data.segment_length = 8
    c.data.vocab_size = 200
    c.data.manual_dir = {manual_dir!r}
    c.data.data_dir = {data_dir!r}
    c.train.batch_size = 2
    c.train.num_steps = 3
    c.train.log_every = 1
    c.train.eval_every = 1
    c.train.checkpoint_every = 3
    c.train.warmup_steps = 1
    c.train.max_train_seconds = 0.0
    c.eval.batch_size = 32
    c.eval.segment_length = 64
    return c
"""

TINY_SWEEP = """
from xformer import sweep
from xformer.config import lm_base_config

BASE = {base!r}


def get_sweep():
    return sweep.zip_({{"model.d_model": [16, 32], "model.adaptive_cutoffs": [(), (100,)]}})
"""


def write_sweep(directory: Path, data_dir: str) -> Path:
    base = directory / "tiny.py"
    base.write_text(TINY_CONFIG.format(manual_dir=str(SHARED / "ptb"), data_dir=data_dir))
    path = directory / "sweep_tiny.py"
    path.write_text(TINY_SWEEP.format(base=str(base)))
    return path


def run(args):
    env = {**os.environ, "XFORMER_DATA_DIR": str(SHARED)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


# The grid ----------------------------------------------------------------------------------


def test_product_zip_and_point_names():
    points = sweep.product(
        sweep.grid("model.positional", ["relative", "rope"]),
        sweep.zip_({"train.seed": [0, 1], "train.learning_rate": [1e-3, 2e-3]}),
    )
    assert points == [
        {"model.positional": "relative", "train.seed": 0, "train.learning_rate": 1e-3},
        {"model.positional": "relative", "train.seed": 1, "train.learning_rate": 2e-3},
        {"model.positional": "rope", "train.seed": 0, "train.learning_rate": 1e-3},
        {"model.positional": "rope", "train.seed": 1, "train.learning_rate": 2e-3},
    ]
    assert [list(p) for p in points] == [
        ["model.positional", "train.seed", "train.learning_rate"]
    ] * 4
    assert sweep.point_names(points) == [
        "positional=relative,seed=0,learning_rate=0.001",
        "positional=relative,seed=1,learning_rate=0.002",
        "positional=rope,seed=0,learning_rate=0.001",
        "positional=rope,seed=1,learning_rate=0.002",
    ]
    # A dict is one grid axis per key: product of its keys, zip of its keys.
    assert sweep.product({"a.x": [1, 2], "a.y": [3, 4]}) == [
        {"a.x": 1, "a.y": 3},
        {"a.x": 1, "a.y": 4},
        {"a.x": 2, "a.y": 3},
        {"a.x": 2, "a.y": 4},
    ]
    assert sweep.zip_(sweep.grid("a.x", [1, 2]), {"a.y": [3, 4]}) == [
        {"a.x": 1, "a.y": 3},
        {"a.x": 2, "a.y": 4},
    ]
    with pytest.raises(ValueError, match=r"equal length.*\[2, 1\]"):
        sweep.zip_({"train.seed": [0, 1], "train.learning_rate": [1e-3]})
    with pytest.raises(ValueError, match="'train.seed' is set by more than one axis"):
        sweep.product(sweep.grid("train.seed", [0]), sweep.grid("train.seed", [1]))
    with pytest.raises(TypeError, match="list of values"):
        sweep.grid("model.positional", "rope")

    # Keys sharing a last component are named in full; tuples and odd characters stay safe.
    names = sweep.point_names(
        sweep.product(
            {"model.mem_len": [0, 8], "eval.mem_len": [16]},
            sweep.grid("model.adaptive_cutoffs", [(), (100, 150)]),
            sweep.grid("data.vocab_dir", ["/tmp/v 1"]),
        )
    )
    assert names[0] == "model.mem_len=0,eval.mem_len=16,adaptive_cutoffs=none,vocab_dir=_tmp_v_1"
    assert names[1].startswith("model.mem_len=0,eval.mem_len=16,adaptive_cutoffs=100-150,")
    assert len(set(names)) == len(names) == 4
    assert all(re.fullmatch(r"[A-Za-z0-9._=,+-]+", name) for name in names)
    with pytest.raises(ValueError, match="same name"):
        sweep.point_names(sweep.grid("train.seed", [1, 1]))


# Configs and validation --------------------------------------------------------------------


def test_numpy_grid_values_load_as_python_values(tmp_path):
    """np.arange / np.linspace grids: their values reach the flags, names and the HParams JSON
    (json.dumps refuses numpy scalars) as int, float and bool."""
    path = tmp_path / "numpy_sweep.py"
    path.write_text(
        "import numpy as np\nfrom xformer import sweep\nBASE = 'configs/ptb_xl.py'\n"
        "def get_sweep():\n    return sweep.product(sweep.grid('model.mem_len', "
        "list(np.arange(0, 140, 70))), sweep.grid('train.learning_rate', "
        "list(np.linspace(1e-3, 2e-3, 2))),"
        " sweep.grid('model.untie_relative_biases', [np.bool_(True)]))\n"
    )
    points = sweep.load(str(path)).points
    assert [type(v) for v in points[0].values()] == [int, float, bool]
    assert json.loads(json.dumps(points)) == [
        {"model.mem_len": m, "train.learning_rate": lr, "model.untie_relative_biases": True}
        for m in (0, 70)
        for lr in (1e-3, 2e-3)
    ]


def test_overrides_round_trip_through_the_command_line(tmp_path):
    base = str(ROOT / "configs" / "ptb_xl.py")
    point = {
        "model.adaptive_cutoffs": (100, 200),
        "model.tie_projs": (False, True, True),
        "model.positional": "rope",
        "model.dropout": 0.0,
        "train.learning_rate": 2e-3,
        "eval.mem_len": 0,
    }
    assert sweep.config_args(point) == [
        "--config.model.adaptive_cutoffs=(100, 200)",
        "--config.model.tie_projs=(False, True, True)",
        "--config.model.positional=rope",
        "--config.model.dropout=0.0",
        "--config.train.learning_rate=0.002",
        "--config.eval.mem_len=0",
    ]
    config = sweep.point_config(base, point)
    assert config.model.adaptive_cutoffs == (100, 200)
    assert config.model.tie_projs == (False, True, True)
    assert config.model.positional == "rope" and config.train.learning_rate == 2e-3
    assert config.model.d_model == 256  # from the base config
    assert sweep.point_config(base, {"model.adaptive_cutoffs": ()}).model.adaptive_cutoffs == ()

    with pytest.raises(ValueError, match=r"share_embeddings=1 parses to True, not 1"):
        sweep.point_config(base, {"model.share_embeddings": 1})
    with pytest.raises(ValueError, match=r"parses to \(100, 200\), not '100,200'"):
        sweep.point_config(base, {"model.adaptive_cutoffs": "100,200"})
    with pytest.raises(ValueError, match="positonal"):  # unknown key
        sweep.point_config(base, {"model.positonal": "rope"})
    with pytest.raises(ValueError, match="'model.positional' is 'rop'"):  # validate() says so
        sweep.point_config(base, {"model.positional": "rop"})
    with pytest.raises(ValueError, match="config.model.d_model"):  # not an int
        sweep.point_config(base, {"model.d_model": "big"})

    variant = tmp_path / "variant.py"
    variant.write_text(
        "from xformer.config import lm_base_config\n\n\ndef get_config(width):\n"
        "    c = lm_base_config('ptb')\n    c.model.d_model = int(width)\n    return c\n"
    )
    assert sweep.point_config(f"{variant}:48", {"model.num_heads": 4}).model.d_model == 48


def test_every_point_is_validated_before_anything_runs(tmp_path, monkeypatch):
    path = tmp_path / "sweep_bad.py"
    path.write_text(
        f"from xformer import sweep\nBASE = {str(ROOT / 'configs' / 'ptb_xl.py')!r}\n"
        "def get_sweep():\n    return sweep.grid('model.d_model', [64, 63])\n"
    )
    launched = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: launched.append(a))
    with pytest.raises(ValueError, match="point 'd_model=63'.*model.d_model=63"):
        sweep.run(sweep.load(str(path)), str(tmp_path / "root"))
    assert not launched and not (tmp_path / "root").exists()


def test_shipped_sweeps_validate_and_document_their_commands():
    paths = sorted((ROOT / "configs" / "sweeps").glob("*.py"))
    assert paths
    for path in paths:
        s = sweep.load(str(path))
        for point in s.points:
            sweep.point_config(s.base, point)
        doc = path.read_text()
        assert f"python train.py --sweep=configs/sweeps/{path.name} --workdir=" in doc
        assert "--dry_run" in doc and "python eval.py --compare=" in doc


def test_remaining_reads_the_done_and_eval_markers(tmp_path):
    config = lm_base_config("ptb")
    config.train.num_steps = 100

    def write(name, obj):
        (tmp_path / name).write_text(json.dumps(obj))

    assert sweep.remaining(str(tmp_path), config) == ["train", "eval"]
    write("done.json", {"step": 60, "reason": "num_steps", "metrics": {}})  # num_steps was raised
    assert sweep.remaining(str(tmp_path), config) == ["train", "eval"]
    write("done.json", {"step": 60, "reason": "max_train_seconds", "metrics": {}})
    assert sweep.remaining(str(tmp_path), config) == ["eval"]
    write("eval_test.json", {"step": 50})  # scores an older checkpoint
    assert sweep.remaining(str(tmp_path), config) == ["eval"]
    write("eval_test.json", {"step": 60})
    assert sweep.remaining(str(tmp_path), config) == []
    write("done.json", {"step": 100, "reason": "num_steps", "metrics": {}})
    assert sweep.remaining(str(tmp_path), config) == ["eval"]


def test_dry_run_prints_the_exact_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    s = sweep.load(str(write_sweep(tmp_path, str(tmp_path / "tfds"))))
    root = tmp_path / "root"
    lines = []
    todo = sweep.run(s, str(root), dry_run=True, echo=lines.append)
    base = tmp_path / "tiny.py"
    assert lines == [
        f"# sweep of 2 points (0 to 1) on {base} in {root}",
        f"# [0] {NAMES[0]}: run",
        f"python train.py --config={base} --config.model.d_model=16 "
        f"'--config.model.adaptive_cutoffs=()' --workdir={root}/{NAMES[0]}",
        f"python eval.py --workdir={root}/{NAMES[0]}",
        f"# [1] {NAMES[1]}: run",
        f"python train.py --config={base} --config.model.d_model=32 "
        f"'--config.model.adaptive_cutoffs=(100,)' --workdir={root}/{NAMES[1]}",
        f"python eval.py --workdir={root}/{NAMES[1]}",
    ]
    assert todo == {NAMES[0]: ["train", "eval"], NAMES[1]: ["train", "eval"]}
    assert not root.exists()


def test_train_py_needs_exactly_one_of_config_and_sweep(tmp_path):
    neither = run(["train.py", f"--workdir={tmp_path}"])
    both = run(
        [
            "train.py",
            "--config=configs/ptb_xl.py",
            "--sweep=configs/sweeps/ptb_positional.py",
            f"--workdir={tmp_path}",
        ]
    )
    for result in (neither, both):
        assert result.returncode != 0
        assert "give exactly one of --config and --sweep" in result.stderr


# A real sweep ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tfds_dir):
    """The tiny 2-point sweep, trained and evaluated through `train.py --sweep`."""
    if not (SHARED / "ptb").exists():
        pytest.skip(f"real data not found at {SHARED / 'ptb'}")
    directory = tmp_path_factory.mktemp("sweep")
    path = write_sweep(directory, tfds_dir)
    result = run(["train.py", f"--sweep={path}", f"--workdir={directory / 'root'}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("python train.py") == result.stdout.count("python eval.py") == 2
    return path, directory / "root"


def _files(workdir: Path) -> dict[str, int]:
    names = ("done.json", "eval_test.json", "metrics.jsonl", "run_info.json")
    return {n: (workdir / n).stat().st_mtime_ns for n in names if (workdir / n).exists()}


@pytest.mark.slow
def test_sweep_skips_finished_points_and_resumes_the_rest(swept, capfd):
    path, root = swept
    a, b = root / NAMES[0], root / NAMES[1]
    for workdir in (a, b):
        done = json.loads((workdir / "done.json").read_text())
        assert done["step"] == 3 and done["reason"] == "num_steps"
        assert json.loads((workdir / "eval_test.json").read_text())["step"] == 3
    before = {w: _files(w) for w in (a, b)}

    again = []  # the runner in-process this time: its commands still run as subprocesses
    todo = sweep.run(sweep.load(str(path)), str(root), echo=again.append)
    assert todo == {NAMES[0]: [], NAMES[1]: []}
    assert again[1:] == [
        f"# [0] {NAMES[0]}: finished: skip",
        f"# [1] {NAMES[1]}: finished: skip",
    ]
    assert {w: _files(w) for w in (a, b)} == before

    # a lost its test score: evaluate only; b lost its finished marker: train (resume), evaluate.
    (a / "eval_test.json").unlink()
    (b / "done.json").unlink()
    (b / "eval_test.json").unlink()
    train_rows = (b / "metrics.jsonl").read_text().count("train/loss")
    capfd.readouterr()
    third = []
    todo = sweep.run(sweep.load(str(path)), str(root), echo=third.append)
    assert todo == {NAMES[0]: ["eval"], NAMES[1]: ["train", "eval"]}
    assert third[1] == f"# [0] {NAMES[0]}: trained: eval"
    assert third[2] == f"python eval.py --workdir={a}"
    assert third[3] == f"# [1] {NAMES[1]}: run"
    assert third[4].startswith("python train.py ") and third[4].endswith(f"--workdir={b}")
    assert third[5] == f"python eval.py --workdir={b}"
    assert len(third) == 6
    assert "resumed from step 3" in capfd.readouterr().err
    assert (b / "metrics.jsonl").read_text().count("train/loss") == train_rows  # no new steps
    assert json.loads((b / "done.json").read_text())["step"] == 3
    for workdir in (a, b):
        assert json.loads((workdir / "eval_test.json").read_text())["step"] == 3
    assert _files(a)["done.json"] == before[a]["done.json"]
    assert _files(a)["metrics.jsonl"] == before[a]["metrics.jsonl"]


def _true_num_params(workdir: Path) -> int:
    config = experiment_lib.load_config(str(workdir))
    task = make_task(config, str(workdir), train_if_missing=False)
    model = nnx.eval_shape(lambda: task.exp.make_model(experiment_lib.model_rngs(0)))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.slow
def test_compare_the_two_runs(swept):
    _, root = swept
    result = run(["eval.py", f"--compare={root}/*"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(io.StringIO((root / "compare.csv").read_text())))
    columns = list(rows[0])
    assert columns[: columns.index("commit")] == ["run", "model.adaptive_cutoffs", "model.d_model"]
    assert [r["run"] for r in rows] == NAMES
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    assert {r["commit"].removesuffix("+dirty") for r in rows} == {head.stdout.decode()[:8]}
    for name in NAMES:  # the finished points' HParams sessions
        assert list((root / name / "tensorboard" / "hparams").glob("events.out.tfevents.*"))
    assert [(r["model.adaptive_cutoffs"], r["model.d_model"]) for r in rows] == [
        ("[]", "16"),
        ("[100]", "32"),
    ]
    params = [_true_num_params(root / name) for name in NAMES]
    assert params[0] != params[1]
    assert [int(r["params"]) for r in rows] == params
    for name, row in zip(NAMES, rows, strict=True):
        lines = (root / name / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(line) for line in lines]
        val = [(m["valid/perplexity"], m["step"]) for m in metrics if "valid/perplexity" in m]
        train = [m for m in metrics if "train/steps_per_s" in m]
        assert len(val) == 3 and len(train) == 3
        assert float(row["best_valid_perplexity"]) == min(val)[0]
        assert int(row["best_valid_perplexity_step"]) == min(val)[1]
        test = json.loads((root / name / "eval_test.json").read_text())
        assert float(row["test_perplexity"]) == test["perplexity"]
        assert int(row["steps"]) == 3
        logged = [m["train/train_seconds"] for m in metrics if "train/train_seconds" in m]
        assert float(row["train_seconds"]) == logged[-1] and logged == sorted(logged)
        # log_every=1: each train row's interval is one step of training time
        seconds = sum(1 / m["train/steps_per_s"] for m in train)
        assert train[-1]["train/train_seconds"] == pytest.approx(seconds, rel=1e-9)
        tokens = statistics.median(m["train/tokens_per_s"] for m in train)
        assert float(row["median_tokens_per_s"]) == pytest.approx(tokens, rel=1e-12)
    markdown = (root / "compare.md").read_text()
    assert markdown.splitlines()[0].startswith("| run | model.adaptive_cutoffs | model.d_model |")
    assert all(f"| {name} |" in markdown for name in NAMES)
    assert markdown in result.stdout
    assert (root / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    blocked = root.parent / "a_file"  # a --compare_out that cannot be a directory: one line
    blocked.write_text("")
    refused = run(["eval.py", f"--compare={root}/*", f"--compare_out={blocked}/out"])
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"--compare_out={blocked}/out: cannot write the comparison" in refused.stderr


def test_a_point_trained_with_another_config_is_not_finished(tmp_path):
    """A finished point whose stored config differs: resumable keys -> train (resume) and
    evaluate again; keys that change the run -> refused, naming them, before anything runs."""
    config = lm_base_config("ptb")
    config.train.num_steps = 100
    (tmp_path / "checkpoints" / "100").mkdir(parents=True)
    (tmp_path / "done.json").write_text(json.dumps({"step": 100, "reason": "num_steps"}))
    (tmp_path / "eval_test.json").write_text(json.dumps({"step": 100}))
    (tmp_path / "config.json").write_text(config.to_json())
    assert sweep.remaining(str(tmp_path), config) == []

    evaluated_otherwise = config.copy_and_resolve_references()
    evaluated_otherwise.eval.mem_len = 640
    assert sweep.remaining(str(tmp_path), evaluated_otherwise) == ["train", "eval"]
    other_model = config.copy_and_resolve_references()
    other_model.model.d_model, other_model.train.b2 = 256, 0.99
    with pytest.raises(ValueError, match=r"another config \(model.d_model: .* -> 256; train.b2"):
        sweep.remaining(str(tmp_path), other_model)


def test_a_point_evaluated_again_keeps_no_result_of_its_old_settings(tmp_path, monkeypatch):
    """A finished point swept with other evaluation settings trains (finished: nothing) and
    evaluates again; an eval.py interrupted then leaves no test result of the old settings, so
    the next sweep evaluates it (it read the old result as the point's)."""
    monkeypatch.chdir(ROOT)
    s = sweep.load(str(write_sweep(tmp_path, str(tmp_path / "tfds"))))
    root, name = str(tmp_path / "root"), NAMES[0]
    workdir = Path(s.workdir(root, name))
    config = sweep.point_config(s.base, s.points[0])
    earlier = config.copy_and_resolve_references()
    earlier.eval.mem_len = 0
    (workdir / "checkpoints" / "3").mkdir(parents=True)
    (workdir / "config.json").write_text(earlier.to_json())
    (workdir / "done.json").write_text(json.dumps({"step": 3, "reason": "num_steps"}))
    (workdir / "eval_test.json").write_text(json.dumps({"step": 3, "perplexity": 99.0}))

    def launched(cmd, echo):
        if Path(cmd[1]).name == "train.py":  # finished: it only records the new config
            (workdir / "config.json").write_text(config.to_json())
            return subprocess.CompletedProcess(cmd, 0)
        return subprocess.CompletedProcess(cmd, EXIT_STOPPED)  # eval.py preempted

    monkeypatch.setattr(sweep.launch, "run", launched)
    with pytest.raises(sweep.launch.StoppedError):
        sweep.run(s, root, echo=lambda line: None, point=0)
    assert not (workdir / "eval_test.json").exists()
    assert sweep.remaining(str(workdir), config) == ["eval"]


def test_a_signal_between_commands_starts_nothing_more(tmp_path, monkeypatch):
    """SIGTERM (or Ctrl-C) that reaches the sweep between its commands, e.g. as train.py
    returns, is kept until the next command would start: eval.py never starts and the sweep
    stops with StoppedError (exit 75), where it died with 143 (SIGINT: a traceback) before."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("Python handles signals in the main thread only")
    monkeypatch.chdir(ROOT)
    s = sweep.load(str(write_sweep(tmp_path, str(tmp_path / "tfds"))))
    root, started = str(tmp_path / "root"), tmp_path / "started"
    run_command = sweep.launch.run
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def launched(cmd, echo):
        if Path(cmd[1]).name == "train.py":  # trained; the signal comes as it returns
            os.kill(os.getpid(), signal.SIGTERM)
            return subprocess.CompletedProcess(cmd, 0)
        return run_command(["python", "-c", f"open({str(started)!r}, 'w')"], echo=echo)

    monkeypatch.setattr(sweep.launch, "run", launched)
    with pytest.raises(sweep.launch.StoppedError, match=r"SIGTERM before python -c"):
        sweep.run(s, root, echo=lambda line: None, point=0)
    assert not started.exists()
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # restored
    assert not sweep.launch._deferred


# Sweeps over several jobs: --point, locks, --list; seeds; the HParams dashboard ------------

HOLD_LOCK = """
import sys, time
from xformer import locks
with locks.exclusive(sys.argv[1]) as taken_by:
    assert taken_by is None
    print("locked", flush=True)
    time.sleep(600)
"""


def hold_lock(path: str) -> subprocess.Popen:
    """A child process that holds the lock of `path` until killed."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, path], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "locked"
    return child


HOLD_LOCK_THEN_LAUNCH = """
import sys
from xformer import launch, locks
with locks.exclusive(sys.argv[1]) as taken_by:
    assert taken_by is None
    launch.run(["python", "-c", "import time; print('started', flush=True); time.sleep(600)"])
"""


def test_a_lock_probed_at_that_instant_is_not_taken(tmp_path, monkeypatch):
    """`holder` (--list) takes and releases a lock to see whether it is free: a job that tries
    the lock in that instant tries again, rather than skipping a point nobody runs."""
    from xformer import locks

    path = str(tmp_path / "point.lock")
    try_lock, tries = locks._try_lock, []

    def busy_twice(lock_path: str) -> int | None:
        tries.append(lock_path)
        return None if len(tries) <= 2 else try_lock(lock_path)

    monkeypatch.setattr(locks, "_try_lock", busy_twice)
    with locks.exclusive(path) as taken_by:
        assert taken_by is None and len(tries) == 3
        assert locks.held() and json.loads(Path(path).read_text())["pid"] == os.getpid()
    assert not locks.held()

    # Released while the last retry waited: the probe finds it free, and the job takes it.
    def busy_through_the_retries(lock_path: str) -> int | None:
        tries.append(lock_path)
        return None if len(tries) <= locks.PROBE_RETRIES + 1 else try_lock(lock_path)

    tries.clear()
    monkeypatch.setattr(locks, "_try_lock", busy_through_the_retries)
    monkeypatch.setattr(locks, "PROBE_RETRY_S", 0.0)
    with locks.exclusive(path) as taken_by:
        assert taken_by is None and locks.held()


def test_a_points_command_keeps_its_lock_when_the_sweep_dies(tmp_path):
    """The sweep (here a stand-in) hands its point's lock to the train.py it starts: killed
    with kill -9, it leaves the point locked until that train.py ends."""
    path = str(tmp_path / "point.lock")
    parent = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK_THEN_LAUNCH, path],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the child's group, to end it below
    )
    try:
        assert parent.stdout.readline().startswith("python -c")  # launch.run's echo
        assert parent.stdout.readline().strip() == "started"
        parent.kill()
        parent.wait()
        assert sweep.locks.holder(path)["pid"] == parent.pid  # held by the orphan child
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the child, in the dead parent's group
    deadline = time.time() + 30
    while sweep.locks.holder(path) is not None and time.time() < deadline:
        time.sleep(0.1)
    assert sweep.locks.holder(path) is None


def test_seeds_repeat_every_point():
    points = sweep.seeds(sweep.grid("model.positional", ["rope", "alibi"]), [0, 1, 2])
    assert len(points) == 6
    assert sweep.point_names(points) == [
        f"positional={p},seed={s}" for p in ("rope", "alibi") for s in (0, 1, 2)
    ]


def test_point_runs_one_point_and_names_the_valid_range(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    s = sweep.load(str(write_sweep(tmp_path, str(tmp_path / "tfds"))))
    lines = []
    todo = sweep.run(s, str(tmp_path / "root"), dry_run=True, echo=lines.append, point=1)
    assert todo == {NAMES[1]: ["train", "eval"]}
    assert lines[1] == f"# [1] {NAMES[1]}: run" and len(lines) == 4
    with pytest.raises(ValueError, match=r"--point=2: this sweep has 2 points, 0 to 1"):
        sweep.run(s, str(tmp_path / "root"), point=2)


def test_a_point_locked_by_another_job_is_skipped_until_that_job_dies(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    s = sweep.load(str(write_sweep(tmp_path, str(tmp_path / "tfds"))))
    root = str(tmp_path / "root")
    launched = []
    monkeypatch.setattr(
        sweep.launch,
        "run",
        lambda cmd, echo: launched.append(cmd) or subprocess.CompletedProcess(cmd, 0),
    )
    child = hold_lock(sweep.lock_path(root, NAMES[0]))
    try:
        lines = []
        assert sweep.run(s, root, echo=lines.append) == {NAMES[1]: ["train", "eval"]}
        assert re.fullmatch(
            rf"# \[0\] {re.escape(NAMES[0])}: running in another job \(host .*, pid "
            rf"{child.pid}, since .*\): skip",
            lines[1],
        )
        assert [Path(cmd[1]).name for cmd in launched] == ["train.py", "eval.py"]
        assert all(f"--workdir={root}/{NAMES[1]}" in cmd for cmd in launched)
        assert sweep.locks.holder(sweep.lock_path(root, NAMES[0]))["pid"] == child.pid
    finally:
        child.kill()  # SIGKILL: the OS frees the lock
        child.wait()
    assert sweep.locks.holder(sweep.lock_path(root, NAMES[0])) is None
    launched.clear()
    assert sweep.run(s, root, echo=lambda _: None, point=0) == {NAMES[0]: ["train", "eval"]}
    assert len(launched) == 2 and launched[0][-1] == f"--workdir={root}/{NAMES[0]}"


def stop_sweep_at_step(path: Path, root: Path, step: int, kill) -> tuple[int, str]:
    """Run the sweep until its train.py stalls after `step` (xformer/faults.py), call
    kill(sweep process), and return the sweep's exit status and stderr."""
    marker = root.parent / f"stalled-{step}"
    env = {**os.environ, "XFORMER_DATA_DIR": str(SHARED), "XFORMER_FAULT": f"step:{step}:{marker}"}
    cmd = [sys.executable, "train.py", f"--sweep={path}", f"--workdir={root}"]
    log_path = root.parent / f"log-{step}"
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=log, start_new_session=True)
        try:
            wait_for_stall(marker, [proc], [log_path], timeout=300)
            kill(proc)
            status = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        log.seek(0)
        return status, log.read()


@pytest.mark.slow  # ~40 s: two stopped train.py runs
def test_a_signal_stops_the_sweep_after_its_train_py_checkpoints(tmp_path, tfds_dir):
    """Ctrl-C (SIGINT to the whole process group: train.py gets it directly and forwarded) or
    SIGTERM to the sweep alone: train.py checkpoints, the sweep exits 75, no point starts."""
    if not (SHARED / "ptb").exists():
        pytest.skip(f"real data not found at {SHARED / 'ptb'}")
    path, root = write_sweep(tmp_path, tfds_dir), tmp_path / "root"
    base = tmp_path / "tiny.py"
    base.write_text(base.read_text().replace("num_steps = 3", "num_steps = 8"))
    first = root / NAMES[0]

    status, log = stop_sweep_at_step(path, root, 2, lambda p: os.killpg(p.pid, signal.SIGINT))
    assert status == EXIT_STOPPED, log[-3000:]
    assert "stopped by SIGINT at step 2" in log and f"stopped at point {NAMES[0]!r}" in log
    assert [p.name for p in (first / "checkpoints").iterdir() if p.name.isdigit()] == ["2"]
    assert not (root / NAMES[1]).exists()

    status, log = stop_sweep_at_step(path, root, 5, lambda p: p.send_signal(signal.SIGTERM))
    assert status == EXIT_STOPPED, log[-3000:]
    assert "resumed from step 2" in log and "stopped by SIGTERM at step 5" in log
    assert "5" in {p.name for p in (first / "checkpoints").iterdir()}
    assert not (root / NAMES[1]).exists()
    assert sweep.locks.holder(sweep.lock_path(str(root), NAMES[0])) is None


def test_list_prints_each_points_status(tmp_path):
    base = write_sweep(tmp_path, str(tmp_path / "tfds")).parent / "tiny.py"
    path = tmp_path / "sweep_seeds.py"
    path.write_text(
        f"from xformer import sweep\nBASE = {str(base)!r}\n"
        "def get_sweep():\n    return sweep.grid('train.seed', [0, 1, 2, 3, 4])\n"
    )
    s, root = sweep.load(str(path)), tmp_path / "root"
    configs = [sweep.point_config(s.base, p) for p in s.points]

    def fabricate(i, checkpoint, config, done=False):
        workdir = root / s.names[i]
        (workdir / "checkpoints" / str(checkpoint)).mkdir(parents=True)
        (workdir / "config.json").write_text(config.to_json())
        if done:
            marker = {"step": checkpoint, "reason": "num_steps", "metrics": {}}
            (workdir / "done.json").write_text(json.dumps(marker))
            (workdir / "eval_test.json").write_text(json.dumps({"step": checkpoint}))

    fabricate(0, 3, configs[0], done=True)
    fabricate(1, 2, configs[1])
    other = configs[3].copy_and_resolve_references()
    other.model.d_model = 24
    fabricate(3, 3, other)
    child = hold_lock(sweep.lock_path(str(root), s.names[4]))
    try:
        lines = sweep.list_points(s, str(root), echo=lambda _: None)
    finally:
        child.kill()
        child.wait()
    states = [line.split("\t") for line in lines]
    assert [(int(i), name) for i, _, name in states] == list(enumerate(s.names))
    assert states[0][1] == "done"
    assert states[1][1] == "partial (step 2 of 3)"
    assert states[2][1] == "not started"
    assert states[3][1].startswith("config changed (stored config differs")
    assert states[4][1].startswith("running (host ") and f"pid {child.pid}," in states[4][1]
    listed = run(["train.py", f"--sweep={path}", f"--workdir={root}", "--list"])
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert listed.stdout.splitlines()[4].endswith(f"not started\t{s.names[4]}")  # lock freed
    bad = run(["train.py", f"--sweep={path}", f"--workdir={root}", "--point=5"])
    assert bad.returncode != 0 and "0 to 4" in bad.stderr


def read_events(logdir: Path) -> list:
    """Every Event in the TFRecord event files of `logdir`."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        while data:
            length = int.from_bytes(data[:8], "little")
            events.append(event_pb2.Event.FromString(data[12 : 12 + length]))
            data = data[12 + length + 4 :]
    return events


def test_a_finished_point_gets_an_hparams_session(tmp_path):
    from tensorboardX.proto import plugin_hparams_pb2

    config = lm_base_config("ptb")
    config.train.num_steps = 3
    workdir = tmp_path / "point"
    workdir.mkdir()
    (workdir / "config.json").write_text(config.to_json())
    (workdir / "metrics.jsonl").write_text("")
    done = {"step": 3, "reason": "num_steps", "metrics": {"loss": 4.25}}
    (workdir / "done.json").write_text(json.dumps(done))
    result = {"step": 3, "perplexity": 123.5, "metric": "perplexity"}
    (workdir / "eval_test.json").write_text(json.dumps(result))
    point = {"model.positional": "rope", "train.learning_rate": 0.002, "model.adaptive_cutoffs": ()}
    sweep.write_hparams(str(workdir), point)

    events = read_events(workdir / "tensorboard" / "hparams")
    values = {v.tag: v for e in events for v in e.summary.value}
    start = plugin_hparams_pb2.HParamsPluginData.FromString(
        values["_hparams_/session_start_info"].metadata.plugin_data.content
    ).session_start_info
    assert start.hparams["model.positional"].string_value == "rope"
    assert start.hparams["train.learning_rate"].number_value == 0.002
    assert start.hparams["model.adaptive_cutoffs"].string_value == "[]"
    experiment = plugin_hparams_pb2.HParamsPluginData.FromString(
        values["_hparams_/experiment"].metadata.plugin_data.content
    ).experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"test/perplexity", "train/final_loss"}
    assert values["test/perplexity"].simple_value == 123.5
    assert values["train/final_loss"].simple_value == 4.25

    # Trained further (a larger train.num_steps) and evaluated again: the entry is rewritten
    # when the sweep ran the point (refresh), not when it only found it finished.
    config.train.num_steps = 6
    (workdir / "config.json").write_text(config.to_json())
    (workdir / "done.json").write_text(json.dumps({**done, "step": 6, "metrics": {"loss": 3.5}}))
    (workdir / "eval_test.json").write_text(json.dumps({**result, "step": 6, "perplexity": 99.0}))
    for refresh, want in ((False, 123.5), (True, 99.0)):
        sweep.write_hparams(str(workdir), point, refresh=refresh)
        values = {
            v.tag: v
            for e in read_events(workdir / "tensorboard" / "hparams")
            for v in e.summary.value
        }
        assert values["test/perplexity"].simple_value == want
    assert values["train/final_loss"].simple_value == 3.5

    # Interrupted while writing (a signal, a full disk): no entry at all, which the next
    # finished-point check writes whole (a half-written one was kept for good).
    shutil.rmtree(workdir / "tensorboard")
    write_summary = sweep.write_hparams_summary

    def interrupted(logdir, *args):
        write_summary(logdir, *args)
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as m:
        m.setattr(sweep, "write_hparams_summary", interrupted)
        with pytest.raises(KeyboardInterrupt):
            sweep.write_hparams(str(workdir), point)
    assert not (workdir / "tensorboard" / "hparams").exists()
    sweep.write_hparams(str(workdir), point)
    values = {
        v.tag: v for e in read_events(workdir / "tensorboard" / "hparams") for v in e.summary.value
    }
    assert values["test/perplexity"].simple_value == 99.0
    assert not (workdir / ".hparams.partial").exists()
    assert len(list((workdir / "tensorboard" / "hparams").iterdir())) == 1

    # Trained further without evaluating again: the step-6 test result is not the point's.
    (workdir / "done.json").write_text(json.dumps({**done, "step": 9, "metrics": {"loss": 3.0}}))
    sweep.write_hparams(str(workdir), point, refresh=True)
    events = read_events(workdir / "tensorboard" / "hparams")
    tags = {v.tag for e in events for v in e.summary.value}
    assert "train/final_loss" in tags and "test/perplexity" not in tags
