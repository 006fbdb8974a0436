"""How soon several processes stop on a signal: a 2-process Transformer-XL run on PTB
(localhost, one CPU device a process, tensor 2), SIGTERM to process 1 once both are training,
repeated --trials times from scratch. Per trial: seconds from the signal until JAX's preemption
service noticed it, and until the stop's checkpoint was written (both processes exit 75); the
step each process had logged when the signal was sent, and the step both stopped after.

    python bench/stop_latency.py --trials=3 --workdir=/tmp/xformer_stop_latency
"""

import argparse
import datetime
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_output import finish  # noqa: E402
from chaos import TINY  # noqa: E402

from xformer.preemption import EXIT_STOPPED  # noqa: E402

STEP = re.compile(r"^\w(\d\d\d\d \d\d:\d\d:\d\d\.\d+) .*\] step (\d+)/")
NOTICED = re.compile(r"SIGTERM caught at (\S+)")
STOPPED = re.compile(r"^\w(\d\d\d\d \d\d:\d\d:\d\d\.\d+) .*stopped by .* at step (\d+)")


def log_time(stamp: str) -> float:
    """An absl log line's "MMDD HH:MM:SS.ffffff" (local time, this year) as a Unix time."""
    year = datetime.datetime.now().year
    return datetime.datetime.strptime(f"{year}{stamp}", "%Y%m%d %H:%M:%S.%f").timestamp()


def trial(root: Path, data_dir: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = {
        **TINY,
        "train.num_steps": 100_000,
        "train.checkpoint_every": 100_000,
        "mesh.data": 1,
        "mesh.tensor": 2,
        "data.data_dir": data_dir,
    }
    args = [
        sys.executable,
        "train.py",
        "--config=configs/ptb_xl.py",
        f"--workdir={root / 'run'}",
        *(f"--config.{k}={v}" for k, v in overrides.items()),
        "--distributed",
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
    ]
    logs = [root / f"{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            cmd = [*args, f"--process_id={i}"]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT))
    try:
        while not all(" step 20/" in log.read_text() for log in logs):
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a process exited before training:\n{logs[0].read_text()}")
            time.sleep(0.005)
        sent = time.time()
        procs[1].send_signal(signal.SIGTERM)
        statuses = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    if statuses != [EXIT_STOPPED] * 2:
        raise RuntimeError(f"exit statuses {statuses}:\n{logs[1].read_text()[-3000:]}")
    texts = [log.read_text() for log in logs]
    (noticed,) = NOTICED.findall(texts[1])  # RFC 3339 with nanoseconds
    noticed = re.sub(r"(\.\d{6})\d*", r"\1", noticed)
    noticed_s = datetime.datetime.fromisoformat(noticed).timestamp() - sent
    result = {"noticed_s": round(noticed_s, 3)}
    for i, text in enumerate(texts):
        lines = text.splitlines()
        logged = [int(m[2]) for line in lines if (m := STEP.match(line)) and log_time(m[1]) < sent]
        ((stamp, step),) = [(m[1], int(m[2])) for line in lines if (m := STOPPED.match(line))]
        result[f"process_{i}"] = {
            "logged_step_at_signal": logged[-1],
            "stopped_after_step": step,
            "checkpointed_s": round(log_time(stamp) - sent, 3),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/xformer_stop_latency")
    parser.add_argument("--output", default="workdirs/stop_latency.json")
    args = parser.parse_args()
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    data_dir = root / "tfds"  # prepared by the first trial, kept for the others
    trials = []
    for n in range(args.trials):
        shutil.rmtree(root / "run", ignore_errors=True)
        trials.append(trial(root, data_dir))
        print(f"trial {n + 1}: {trials[-1]}", flush=True)
    checkpointed = [max(t[f"process_{i}"]["checkpointed_s"] for i in range(2)) for t in trials]
    finish(
        {
            "trials": trials,
            "median_noticed_s": statistics.median(t["noticed_s"] for t in trials),
            "median_checkpointed_s": statistics.median(checkpointed),
        },
        args.output,
    )


if __name__ == "__main__":
    main()
