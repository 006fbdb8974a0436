"""Start-up cost of a process: the imports every train.py / eval.py / sample.py start pays.

    python bench/process_start.py --repeats 7
    pip install --no-deps --target /tmp/ml_dtypes_07 ml_dtypes==0.7.0
    python bench/process_start.py --repeats 7 --other /tmp/ml_dtypes_07   # side by side

Each repeat runs, in fresh processes, `import ml_dtypes`, `import jax`, `import
xformer.train_lib` (the scripts' import stack) and `train.py` with a config file that does not
exist (everything a start does before its first check of the flags, including the
re-execution with the tuned malloc). With `--other DIR`, the same commands also run with DIR
first on PYTHONPATH (for example another ml_dtypes), alternating with the installed
packages. Prints the median wall seconds of each, then the versions each side imports and
every time as JSON, also written to `--output`.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = {  # name: (arguments, the exit status it must end with)
    "import ml_dtypes": (["-c", "import ml_dtypes"], 0),
    "import jax": (["-c", "import jax"], 0),
    "import xformer.train_lib": (["-c", "import xformer.train_lib"], 0),
    "train.py to its flag check": (
        ["train.py", "--config=no/such/config.py", "--workdir=unused"],
        1,  # train.py's one-line error for a config that cannot be loaded
    ),
}
VERSIONS = (
    "import ml_dtypes, numpy, jax; print(ml_dtypes.__version__, numpy.__version__, jax.__version__)"
)


def environment(pythonpath: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return env


def seconds(args: list[str], status: int, env: dict[str, str]) -> float:
    """Wall seconds of one fresh process; one that ends otherwise than `status` is an error."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True)
    elapsed = time.perf_counter() - start
    if result.returncode != status:
        tail = result.stderr.decode(errors="replace")[-2000:]
        raise RuntimeError(f"{args} exited {result.returncode}, not {status}:\n{tail}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--other", help="a directory put first on PYTHONPATH for a second side")
    parser.add_argument("--output", default="workdirs/process_start.json")
    args = parser.parse_args()
    sides = {"installed": environment(None)}
    if args.other:
        sides[f"PYTHONPATH={args.other}"] = environment(args.other)
    versions = {}
    for side, env in sides.items():
        out = subprocess.run(
            [sys.executable, "-c", VERSIONS], env=env, capture_output=True, text=True, check=True
        )
        versions[side] = dict(zip(("ml_dtypes", "numpy", "jax"), out.stdout.split(), strict=True))
    times = {side: {name: [] for name in COMMANDS} for side in sides}
    for _ in range(args.repeats):
        for name, (command, status) in COMMANDS.items():
            for side, env in sides.items():  # alternating: the same load for each side
                times[side][name].append(seconds(command, status, env))
    python = sys.version.split()[0]
    print(f"median seconds of {args.repeats} fresh processes each (Python {python})")
    heads = [f"{s}: ml_dtypes {v['ml_dtypes']}, numpy {v['numpy']}" for s, v in versions.items()]
    print("| command | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(sides))
    for name in COMMANDS:
        cells = " | ".join(f"{statistics.median(times[s][name]):.2f}" for s in sides)
        print(f"| {name} | {cells} |")
    from bench_output import finish  # here: the timed children need not wait for its imports

    finish({"versions": versions, "seconds": times}, args.output)


if __name__ == "__main__":
    main()
