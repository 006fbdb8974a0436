"""train.py and eval.py as several processes on localhost (jax.distributed, simulated CPU
devices) against 1 process on as many devices with the same global batch: the run stops (on
its time budget, decided by process 0's clock, or on a SIGTERM to one process, through JAX's
preemption service), checkpoints every process's own data position, resumes, and its losses,
final parameters, validation and test scores equal the one-process run's; process 0 alone
writes the results. Translation: 2 processes of 2 devices on fsdp 4,
each process reading its own rows and holding half of every parameter. The language model: 2
processes of one device on tensor 2, the pair reading the same rows, each holding its half of
the tensor-split parameters (one task per GPU, as under SLURM)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import test_language_modeling as lm
import test_train_eval as translation

from xformer import config as config_lib
from xformer import faults, sharding
from xformer.checkpoint import Checkpointer, CheckpointMismatchError, read_state
from xformer.config import flatten
from xformer.data.pipeline import EncodedPairs, ShardBatches, packed_train_dataset
from xformer.dispatch import DispatchWindow
from xformer.files import read_jsonl
from xformer.preemption import EXIT_STOPPED

ROOT = Path(__file__).resolve().parents[1]
# float64, so that only the order of sums differs. atol: Adam moves a parameter by
# lr * g / (|g| + eps), so one whose gradient is 0 up to rounding (a key bias) moves by noise.
X64 = {"JAX_ENABLE_X64": "1"}
FLOAT64 = ["--config.model.dtype=float64", "--config.model.param_dtype=float64"]
TOLERANCE = {"rtol": 1e-9, "atol": 1e-9}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def simulated_devices(count: int) -> dict[str, str]:
    """The environment of a float64 process with `count` simulated CPU devices."""
    flags = translation.FOUR_DEVICES["XLA_FLAGS"].replace("=4", f"={count}")
    return {**X64, "XLA_FLAGS": flags}


def launch(
    args: list[str], count: int, devices: int, logs: Path, fault: dict[int, str] | None = None
) -> list[subprocess.Popen]:
    """Start `python *args` as the `count` processes of one jax.distributed job, `devices`
    simulated CPU devices each, process i's stdout and stderr in logs/i.out and logs/i.err;
    `fault` {process: XFORMER_FAULT} stalls some of them (xformer/faults.py)."""
    port = free_port()
    env = {
        **os.environ,
        **simulated_devices(devices),
        "XFORMER_DATA_DIR": str(ROOT.parent / "shared" / "data"),
    }
    env.pop(faults.ENV, None)
    logs.mkdir(parents=True)
    procs = []
    for i in range(count):
        flags = [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={count}"]
        with open(logs / f"{i}.out", "w") as out, open(logs / f"{i}.err", "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *args, "--distributed", *flags, f"--process_id={i}"],
                    cwd=ROOT,
                    env={**env, **({faults.ENV: fault[i]} if fault and i in fault else {})},
                    stdout=out,
                    stderr=err,
                )
            )
    return procs


def outputs(
    procs: list[subprocess.Popen], logs: Path, status: int = 0, timeout: float = 600
) -> list[tuple[str, str]]:
    """Wait for the processes of `launch`; each one's (stdout, stderr), once every one has
    exited with `status`."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            p.kill()
    texts = [
        tuple((logs / f"{i}.{kind}").read_text() for kind in ("out", "err"))
        for i in range(len(procs))
    ]
    for i, (p, (_, err)) in enumerate(zip(procs, texts, strict=True)):
        assert p.returncode == status, f"process {i}: status {p.returncode}\n{err[-4000:]}"
    return texts


def wait_for_stall(
    marker: Path, procs: list[subprocess.Popen], logs: list[Path], timeout: float = 600
) -> None:
    """Until a process has stalled where its fault says (it wrote `marker`; xformer/faults.py);
    fails if any of `procs` (whose stderr is in `logs`) exits first."""
    deadline = time.time() + timeout
    while not marker.exists():
        for p, log in zip(procs, logs, strict=True):
            assert p.poll() is None, f"exited {p.returncode} before stalling:\n{log.read_text()}"
        assert time.time() < deadline, "never stalled"
        time.sleep(0.05)


def processes(args: list[str], count: int, devices: int, logs: Path) -> list[tuple[str, str]]:
    """`launch` and `outputs`: every process must exit with status 0."""
    return outputs(launch(args, count, devices, logs), logs)


def final_params(workdir: Path, step: int) -> dict[str, np.ndarray]:
    return flatten(read_state(str(workdir), step)["params"])


def metrics(workdir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_jsonl(str(workdir / "metrics.jsonl")) if key in r}


FAMILIES = {  # family -> (processes, devices a process, train command, its extra flags,
    # validation key, eval flags)
    # fsdp over both processes: each reads its own rows (two input shards: the same packed
    # batches whichever processes read them) and holds, checkpoints and restores half of every
    # parameter and of Adam's state.
    "translation": (
        2,
        2,
        translation.train_cmd,
        ["--config.data.input_shards=2", "--config.mesh.data=1", "--config.mesh.fsdp=4"],
        f"{translation.EVAL_SPLIT}/nll",
        # A slice of 2.5 batches of 16: two processes decode a step of beam search 5-10x slower
        # than one on CPU.
        ["--split=test_2017_mscoco[:40]", "--beam_size=2"],
    ),
    # One device a process: the tensor pair spans the processes, which read the same rows and
    # hold their halves of the tensor-split parameters. A slice: the whole test split (82k
    # tokens) is ~0.6k steps of 8 rows, each a few collectives between the processes.
    "language_modeling": (
        2,
        1,
        lm.train_cmd,
        ["--config.mesh.data=1", "--config.mesh.tensor=2"],
        f"{lm.EVAL_SPLIT}/nll",
        ["--split=test[:100]"],
    ),
}


@pytest.mark.slow  # 1-1.5 min per family: 3 runs of several processes, most of it compiling
@pytest.mark.parametrize("family", list(FAMILIES))
def test_processes_train_and_evaluate_like_one(family, tmp_path, tfds_dir, multi30k_dir):
    count, devices, train_cmd, extra, val_key, eval_flags = FAMILIES[family]
    all_devices, logs = simulated_devices(count * devices), tmp_path / "logs"
    common = [*FLOAT64, *extra, "--config.train.num_steps=4", "--config.train.eval_every=4"]
    one = tmp_path / "one"
    result = translation.run(
        train_cmd(one, tfds_dir, *common, "--config.train.checkpoint_every=2"),
        env_extra=all_devices,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    # Several processes, preparing their own data directory (one process while the others wait
    # on its lock) but reading the worker's vocabulary: training a fresh SentencePiece model
    # took process 0 ~11 s (the translation case 106 -> 83 s alone, middle kind, 2026-12-03),
    # and jobs sharing a missing model are tests/test_tokenizer_cache.py's.
    # The first run stops with a checkpoint: translation at its first logging step
    # (2) on a spent time budget (process 0's clock decides for all), the language model on a
    # SIGTERM to process 1 alone, sent while it stalls after step 2 (process 0 waits for it at
    # the logging step): JAX's preemption service stops both after the furthest step either
    # had reached when the notice came, plus one: 3 (status 75).
    two, data_dir = tmp_path / "two", tmp_path / "tfds_two"
    common = [*common, f"--config.data.vocab_dir={translation.shared_vocab_dir(tfds_dir)}"]
    stop = ["--config.train.log_every=2", "--config.train.checkpoint_every=100"]
    if family == "translation":
        stop_step = 2
        stop.append("--config.train.max_train_seconds=0.001")
        stopped = processes(train_cmd(two, data_dir, *common, *stop), count, devices, logs / "stop")
    else:
        stop_step = 3
        marker = tmp_path / "stalled"
        procs = launch(
            train_cmd(two, data_dir, *common, *stop),
            count,
            devices,
            logs / "stop",
            fault={1: f"step:2:{marker}"},
        )
        wait_for_stall(marker, procs, [logs / "stop" / f"{i}.err" for i in range(count)])
        procs[1].send_signal(signal.SIGTERM)
        stopped = outputs(procs, logs / "stop", status=EXIT_STOPPED)
        for _, err in stopped:
            assert "stopped by a signal to one of the processes at step 3" in err
    assert translation.checkpoint_steps(two) == [stop_step], stopped[0][1][-3000:]
    resumed = processes(
        train_cmd(two, data_dir, *common, "--config.train.checkpoint_every=2"),
        count,
        devices,
        logs / "resume",
    )
    for _, err in resumed:
        assert f"resumed from step {stop_step}" in err
    assert translation.checkpoint_steps(two)[-1] == 4

    # Steps 3 and 4 read each process's restored data position and the restored state.
    expected, got = metrics(one, "train/loss"), metrics(two, "train/loss")
    np.testing.assert_allclose([got[3], got[4]], [expected[3], expected[4]], **TOLERANCE)
    np.testing.assert_allclose(metrics(two, val_key)[4], metrics(one, val_key)[4], **TOLERANCE)
    want, have = final_params(one, 4), final_params(two, 4)
    assert have.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(have[name], want[name], **TOLERANCE, err_msg=name)

    # eval.py: the same scores; process 0 alone prints and writes them.
    result = translation.run(["eval.py", f"--workdir={one}", *eval_flags], env_extra=all_devices)
    assert result.returncode == 0, result.stderr[-3000:]
    want = json.loads(result.stdout)
    (out0, _), *others = processes(
        ["eval.py", f"--workdir={two}", *eval_flags], count, devices, logs / "eval"
    )
    assert not any("{" in out for out, _ in others)  # stdout also holds Gloo's lines
    out0 = "\n" + out0
    have = json.loads(out0[out0.index("\n{") + 1 :])
    assert json.loads((two / f"eval_{have['name']}.json").read_text()) == have
    if family == "translation":
        assert have["sentences"] == want["sentences"] == 40
        assert have["sacrebleu"] == want["sacrebleu"]
        assert Path(have["output"]).read_text() == Path(want["output"]).read_text()
    else:
        assert have["tokens"] == want["tokens"] > 0  # test[:100]: 2,100 tokens
        np.testing.assert_allclose(have["nll"], want["nll"], **TOLERANCE)


# The pieces, in one process ------------------------------------------------------------------


def test_input_shards_join_into_the_same_batches():
    """A batch of 2 input shards read by one process is the rows of each shard read alone (as
    2 processes read them), in shard order; the shards split the pairs; the joined stream
    resumes from its state."""
    rng = np.random.default_rng()
    lengths = rng.integers(4, 12, size=(2, 300))  # >= 4 tokens: no two pairs alike
    src, tgt = ([rng.integers(4, 50, n).astype(np.int32) for n in side] for side in lengths)
    pairs = EncodedPairs.from_sequences(src, tgt)
    settings = {"batch_size": 8, "max_length": 16, "seed": 3, "num_shards": 2}
    both = iter(packed_train_dataset(pairs, shards=(0, 1), **settings))
    alone = [iter(packed_train_dataset(pairs, shards=(s,), **settings)) for s in (0, 1)]
    seen = [set(), set()]
    for _ in range(4):
        batch, parts = next(both), [next(it) for it in alone]
        for key in batch:
            np.testing.assert_array_equal(batch[key], np.concatenate([p[key] for p in parts]))
        assert batch["src"].shape == (8, 16)
        for s, part in enumerate(parts):
            for row, segs in zip(part["src"], part["src_segments"], strict=True):
                for k in range(1, segs.max() + 1):
                    seen[s].add(tuple(row[segs == k]))
    assert not seen[0] & seen[1]
    state, expected = both.get_state(), next(both)
    resumed = iter(packed_train_dataset(pairs, shards=(0, 1), **settings))
    resumed.set_state(state)
    for key, value in next(resumed).items():
        np.testing.assert_array_equal(value, expected[key])


def test_a_position_resumes_only_onto_the_shards_that_wrote_it():
    """A process that read shard 1 of 2 and resumes reading shards [0, 1] of 2 (the mesh's
    row blocks changed: its block is now shared with the other process, which read shard 0)
    would feed other rows than that process: refused. Its own shards resume exactly, as does
    a position saved without its shards (older checkpoints)."""
    rng = np.random.default_rng()
    lengths = rng.integers(4, 12, size=(2, 200))
    src, tgt = ([rng.integers(4, 50, n).astype(np.int32) for n in side] for side in lengths)
    pairs = EncodedPairs.from_sequences(src, tgt)
    settings = {"batch_size": 8, "max_length": 16, "seed": 5, "num_shards": 2}

    def batches(shards):
        return ShardBatches(packed_train_dataset(pairs, shards=shards, **settings), 2, shards)

    one = batches((1,))
    next(one)
    state = one.get_state()
    assert state["num_shards"] == 2 and state["shards"] == [1]
    expected = next(one)
    with pytest.raises(ValueError, match=r"read input shards \[1\] of 2, this one reads \[0, 1\]"):
        batches((0, 1)).set_state(state)
    for resumed_state in (state, state["position"]):
        resumed = batches((1,))
        resumed.set_state(resumed_state)
        for key, value in next(resumed).items():
            np.testing.assert_array_equal(value, expected[key])


def test_input_shards_draw_their_own_orders():
    """Shard s holds lines s, s + 4, ... of the corpus: drawn in one shared order, the 4 shards
    of a global batch took lines 4k to 4k + 3 together (neighbouring sentences of a document
    in one batch, every epoch); in their own orders a line meets its next one by chance."""
    rng = np.random.default_rng()
    lengths = rng.integers(4, 12, size=4000)
    src = [np.full(n, 4 + i, np.int32) for i, n in enumerate(lengths)]  # tokens name the line
    tgt = [rng.integers(4, 50, n).astype(np.int32) for n in lengths]
    pairs = EncodedPairs.from_sequences(src, tgt)
    seed = int(rng.integers(2**31))
    batches = iter(
        packed_train_dataset(
            pairs, batch_size=32, max_length=32, seed=seed, num_shards=4, shards=range(4)
        )
    )
    together = total = 0
    for _ in range(8):
        lines = {int(t) - 4 for t in np.unique(next(batches)["src"]) if t >= 4}
        together += sum(i + 1 in lines for i in lines)
        total += len(lines)
    assert together / total < 0.15, (together, total, seed)  # by chance ~0.02


def test_input_shards_must_divide_over_processes_and_rows():
    config = config_lib.base_config()
    config.train.batch_size = 12
    config_lib.check_devices(config, 4, num_processes=2)  # 0 = one shard per process
    for shards in (3, 8, -1):  # not a multiple of 2 processes; 12 rows / 8; negative
        config.data.input_shards = shards
        with pytest.raises(ValueError, match=f"data.input_shards={shards} must be"):
            config_lib.check_devices(config, 4, num_processes=2)
    config.data.input_shards = 4
    config_lib.check_devices(config, 4, num_processes=2)
    config.train.batch_size = config.eval.batch_size = 6
    with pytest.raises(ValueError, match="train.batch_size=6 must be divisible by the 4"):
        config_lib.check_devices(config, 4, num_processes=4)
    # One device a process, tensor pairs across processes: a pair reads one block of rows, so
    # 8 blocks; the input shards divide over those.
    config.train.batch_size = config.eval.batch_size = 16
    config.mesh.data, config.mesh.tensor = -1, 2
    for shards in (0, 8, 16):
        config.data.input_shards = shards
        config_lib.check_devices(config, 16, num_processes=16)
    config.data.input_shards = 4
    with pytest.raises(ValueError, match="data.input_shards=4 .* multiple of the 8 blocks"):
        config_lib.check_devices(config, 16, num_processes=16)
    # 4 devices a process, tensor triples: the second process would hold half a shard.
    config.train.batch_size = config.eval.batch_size = 12
    config.mesh.tensor, config.data.input_shards = 3, 0
    message = r"mesh.tensor=3 splits the row shards .* over 3 processes of 4 devices each"
    for training in (True, False):
        with pytest.raises(ValueError, match=message):
            config_lib.check_devices(config, 12, num_processes=3, training=training)
    config_lib.check_devices(config, 12, num_processes=4)  # 3 devices a process: one triple


OWNER_LAYOUTS = {  # (mesh sizes, devices per process) -> the blocks the processes read
    "a shard per process": ((2, 2, 2), 2, [0, 1, 2, 3]),
    "two shards per process": ((4, 1, 2), 4, [0, 1]),
    "tensor pairs across processes": ((1, 2, 2), 1, [0, 0, 1, 1]),
    "one shard for all": ((1, 1, 4), 2, [0, 0]),
    "fsdp across processes": ((1, 4, 1), 2, [0, 1]),
}


@pytest.mark.parametrize("layout", list(OWNER_LAYOUTS))
def test_each_process_reads_the_rows_of_its_devices(layout):
    """Against the rows each device holds, device by device: a process's block is the union of
    its devices' rows, and two processes read the same rows or disjoint ones."""
    sizes, local, expected = OWNER_LAYOUTS[layout]
    owners = np.arange(int(np.prod(sizes))).reshape(sizes) // local
    blocks, count = sharding.row_blocks(owners)
    assert blocks == expected and count == max(expected) + 1
    rows, (data, fsdp, _) = 24, sizes
    per_shard = rows // (data * fsdp)
    for p, block in enumerate(blocks):
        wanted = set()
        for d, f, _ in np.argwhere(owners == p):
            shard = d * fsdp + f
            wanted |= set(range(shard * per_shard, (shard + 1) * per_shard))
        per_block = rows // count
        assert wanted == set(range(block * per_block, (block + 1) * per_block))


def test_checkpoint_from_another_process_count_is_refused(tmp_path):
    """Each process resumes its own data position, so the process count must match."""
    state = {"step": jnp.array(3), "w": jnp.asarray(np.random.default_rng().normal(size=4))}
    manager = ocp.CheckpointManager(tmp_path / "checkpoints", item_names=("state", "data"))
    positions = {"per_process": [{"segment": 1}, {"segment": 2}]}
    args = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave(positions)}
    manager.save(3, args=ocp.args.Composite(**args))
    manager.close()
    shutil.rmtree(tmp_path / "checkpoints" / "3" / "state")  # refused before any array is read
    with pytest.raises(
        CheckpointMismatchError, match="data positions of 2 processes, but this run has 1"
    ):
        Checkpointer(str(tmp_path)).restore(state)
    shutil.rmtree(tmp_path / "checkpoints")
    checkpointer = Checkpointer(str(tmp_path))  # a one-process checkpoint restores its own
    checkpointer.save(4, state, {"segment": 5})
    checkpointer.close()
    restored, data = Checkpointer(str(tmp_path)).restore(state)
    assert data == {"segment": 5} and int(restored["step"]) == 3
    np.testing.assert_array_equal(restored["w"], state["w"])


def test_dispatch_window_is_synchronous_only_with_several_cpu_devices(monkeypatch):
    cpu, gpu = (type("Device", (), {"platform": p}) for p in ("cpu", "gpu"))
    for devices, size in (([cpu], 8), ([cpu] * 4, 0), ([gpu] * 4, 8)):
        monkeypatch.setattr(jax, "local_devices", lambda devices=devices: devices)
        assert DispatchWindow().size == size


def test_dispatch_window_waits_for_the_step_size_places_back():
    finished = []

    class Step:
        def __init__(self, i):
            self.i = i

        def block_until_ready(self):
            finished.append(self.i)
            return self

    window = DispatchWindow(size=2)
    for i in range(6):
        window.push(Step(i))
        assert finished == list(range(max(0, i - 1)))
