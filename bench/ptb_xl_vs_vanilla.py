"""Benchmark: Transformer-XL vs the vanilla decoder-only LM of equal size on PTB (word level).

    python bench/ptb_xl_vs_vanilla.py --workdir=workdirs/bench_ptb

Trains configs/ptb_xl.py and configs/ptb_vanilla.py at the same time for at most 60 minutes,
each pinned to one of the two cores (`taskset`), so both get the same machine share and wall
time. Then it evaluates both with eval.py: XL at its training lengths and with longer
evaluation memories (the one with the best validation perplexity is reported on test); the
vanilla model on non-overlapping 70-token segments and with a sliding window of 70 tokens
moved one token at a time (Al-Rfou et al.; every prediction sees 70 tokens of context).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XL_EVAL = {  # name -> eval.py flags; all at the training segment length
    "mem70": ["--mem_len=70"],
    "mem140_clamp139": ["--mem_len=140", "--clamp_len=139"],
    "mem280_clamp139_same": ["--mem_len=280", "--clamp_len=139", "--same_length"],
}


def launch(cmd: list[str], core: int, log: str, stdout: str | None = None) -> subprocess.Popen:
    """Run `python cmd` on one core; stderr (and stdout, unless given a file) go to `log`."""
    full = ["taskset", "-c", str(core), sys.executable, *cmd]
    print(f"$ {' '.join(full)} 2> {log}", flush=True)
    out = open(stdout, "w") if stdout else open(log, "w")
    return subprocess.Popen(
        full, cwd=ROOT, stdout=out, stderr=open(log, "a" if not stdout else "w")
    )


def wait(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.wait():
            raise SystemExit(f"{p.args} failed; see its log")


def evaluate(workdir: str, split: str, flags: list[str], core: int, tag: str):
    log = os.path.join(ROOT, workdir, f"eval_{split}_{tag}.log")
    cmd = ["eval.py", f"--workdir={workdir}", f"--split={split}", *flags]
    result = os.path.join(ROOT, workdir, f"eval_{split}_{tag}.json")  # eval.py's printed JSON
    return launch(cmd, core, log, stdout=result), (workdir, split, tag)


def read_result(workdir: str, split: str, tag: str) -> dict:
    with open(os.path.join(ROOT, workdir, f"eval_{split}_{tag}.json")) as f:
        return json.load(f)


def run_parallel(jobs: list[tuple]) -> dict:
    """jobs: (workdir, split, flags, core, tag); at most one job per core at a time."""
    results = {}
    by_core: dict[int, list] = {}
    for job in jobs:
        by_core.setdefault(job[3], []).append(job)
    while any(by_core.values()):
        running = [evaluate(*queue.pop(0)) for queue in by_core.values() if queue]
        for proc, key in running:
            wait([proc])
            results[key] = read_result(*key)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="workdirs/bench_ptb")
    parser.add_argument("--skip_training", action="store_true")
    args = parser.parse_args()
    xl, vanilla = (os.path.join(args.workdir, name) for name in ("xl", "vanilla"))
    os.makedirs(os.path.join(ROOT, args.workdir), exist_ok=True)

    start = time.time()
    if not args.skip_training:
        wait(
            [
                launch(
                    ["train.py", "--config=configs/ptb_xl.py", f"--workdir={xl}"],
                    0,
                    os.path.join(ROOT, args.workdir, "train_xl.log"),
                ),
                launch(
                    ["train.py", "--config=configs/ptb_vanilla.py", f"--workdir={vanilla}"],
                    1,
                    os.path.join(ROOT, args.workdir, "train_vanilla.log"),
                ),
            ]
        )
    train_minutes = (time.time() - start) / 60

    valid = run_parallel(
        [(xl, "valid", flags, i % 2, name) for i, (name, flags) in enumerate(XL_EVAL.items())]
        + [(vanilla, "valid", [], 1, "segments")]
    )
    best = min(XL_EVAL, key=lambda name: valid[(xl, "valid", name)]["perplexity"])
    test = run_parallel(
        [
            (xl, "test", XL_EVAL[best], 0, best),
            (vanilla, "test", [], 0, "segments"),
            (vanilla, "test", ["--sliding_stride=1"], 1, "sliding1"),
        ]
    )

    def train_summary(workdir):
        with open(os.path.join(ROOT, workdir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        train_rows = [r for r in rows if "train/tokens_per_s" in r]
        return {
            "steps": train_rows[-1]["step"],
            "tokens_per_s_median": round(
                sorted(r["train/tokens_per_s"] for r in train_rows)[len(train_rows) // 2]
            ),
        }

    summary = {
        "train_wall_minutes_both": round(train_minutes, 1),
        "xl": train_summary(xl),
        "vanilla": train_summary(vanilla),
        "valid_perplexity": {
            f"{os.path.basename(k[0])}/{k[2]}": round(v["perplexity"], 2) for k, v in valid.items()
        },
        "xl_eval_chosen_on_valid": best,
        "test_perplexity": {
            f"{os.path.basename(k[0])}/{k[2]}": round(v["perplexity"], 2) for k, v in test.items()
        },
        "test_tokens": {f"{os.path.basename(k[0])}/{k[2]}": v["tokens"] for k, v in test.items()},
        "commands": [
            f"python train.py --config=configs/ptb_xl.py --workdir={xl}",
            f"python train.py --config=configs/ptb_vanilla.py --workdir={vanilla}",
            f"python eval.py --workdir={xl} --split=test {' '.join(XL_EVAL[best])}",
            f"python eval.py --workdir={vanilla} --split=test",
            f"python eval.py --workdir={vanilla} --split=test --sliding_stride=1",
        ],
    }
    print(json.dumps(summary, indent=2))
    with open(os.path.join(ROOT, args.workdir, "bench_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
