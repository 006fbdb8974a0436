"""Chaos benchmark: train a small Transformer-XL on PTB while killing it at random moments
(SIGKILL, or SIGTERM for a graceful stop), re-running the same command until it finishes, and
compare the final parameters and losses with an uninterrupted run, bit for bit.

    python bench/chaos.py --kills=50 --seed=0 --workdir=/tmp/chaos

Kill times are drawn (seeded) uniformly over the uninterrupted run's wall time, so they land
in start-up, compilation, training steps, asynchronous checkpoint writes and evaluation alike.
An episode is one training run from scratch, killed and resumed until it exits 0; episodes
repeat until --kills kills have been survived. Prints each kill, then the totals: kills
survived (by signal), episodes, mismatching episodes (goal: 0).
"""

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from absl import logging

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_output import command_line  # noqa: E402

from xformer.checkpoint import read_state  # noqa: E402
from xformer.config import flatten  # noqa: E402
from xformer.files import read_jsonl  # noqa: E402

TINY = {
    "model.d_model": 32,
    "model.num_heads": 2,
    "model.num_decoder_layers": 2,
    "model.d_ff": 64,
    "model.mem_len": 16,
    "data.segment_length": 16,
    "train.batch_size": 8,
    "train.num_steps": 120,
    "train.checkpoint_every": 7,
    "train.log_every": 1,  # every step's own loss (an interval's mean depends on where it began)
    "train.eval_every": 1000,
    "train.max_train_seconds": 0.0,
    "eval.batch_size": 40,
}


def train_cmd(workdir: Path, data_dir: Path) -> list[str]:
    overrides = {**TINY, "data.data_dir": str(data_dir)}
    return [
        sys.executable,
        "train.py",
        "--config=configs/ptb_xl.py",
        f"--workdir={workdir}",
        *(f"--config.{k}={v}" for k, v in overrides.items()),
    ]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "a") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=f)


def result(workdir: Path) -> tuple[dict[str, np.ndarray], dict[int, float]]:
    """Final parameters and {step: that step's train loss} (of the last run that logged it)."""
    params = flatten(read_state(str(workdir), TINY["train.num_steps"])["params"])
    rows = read_jsonl(str(workdir / "metrics.jsonl"))
    return params, {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def same(a: tuple, b: tuple) -> bool:
    (params_a, losses_a), (params_b, losses_b) = a, b
    return (
        params_a.keys() == params_b.keys()
        and all(np.array_equal(params_a[k], params_b[k]) for k in params_a)
        and losses_a == losses_b
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sigterm_share", type=float, default=0.3)
    parser.add_argument("--workdir", default="/tmp/xformer_chaos")
    args = parser.parse_args()
    logging.set_verbosity(logging.ERROR)  # orbax's metadata warnings of read_state
    root = Path(args.workdir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    data_dir, log = root / "tfds", root / "train.log"
    rng = np.random.default_rng(args.seed)
    print(f"command: {command_line()}", flush=True)

    start_time = time.time()
    ref = root / "reference"
    if start(train_cmd(ref, data_dir), log).wait() != 0:  # also prepares the data
        sys.exit(f"the uninterrupted run failed: see {log}")
    expected = result(ref)
    again = time.time()
    if start(train_cmd(root / "reference2", data_dir), log).wait() != 0:
        sys.exit(f"the second uninterrupted run failed: see {log}")
    run_seconds = time.time() - again
    if not same(result(root / "reference2"), expected):
        sys.exit("two uninterrupted runs differ: the comparison would mean nothing")
    print(f"uninterrupted run: {run_seconds:.1f}s, two of them identical", flush=True)

    kills = {"SIGKILL": 0, "SIGTERM": 0}
    episodes, mismatches, restarts = 0, 0, 0
    while sum(kills.values()) < args.kills:
        episodes += 1
        workdir = root / f"episode{episodes}"
        while True:
            proc = start(train_cmd(workdir, data_dir), log)
            restarts += 1
            delay = rng.uniform(0.0, run_seconds)
            sig = signal.SIGTERM if rng.random() < args.sigterm_share else signal.SIGKILL
            try:
                status = proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(sig)
                status = proc.wait()
                print(
                    f"episode {episodes}: {sig.name} after {delay:.1f}s -> exit {status}",
                    flush=True,
                )
                if status != 0:  # (0: the signal came as the finished run was exiting)
                    kills[sig.name] += 1
                    continue
            if status != 0:
                sys.exit(f"episode {episodes}: train.py exited {status} unkilled; see {log}")
            break
        ok = same(result(workdir), expected)
        mismatches += not ok
        print(f"episode {episodes}: finished, {'identical' if ok else 'MISMATCH'}", flush=True)
        if ok:
            shutil.rmtree(workdir)
    summary = {
        "kills": sum(kills.values()),
        **kills,
        "episodes": episodes,
        "train_py_starts": restarts,
        "mismatching_episodes": mismatches,
        "seconds": round(time.time() - start_time),
    }
    (root / "chaos.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
