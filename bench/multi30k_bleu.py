"""Benchmark: train configs/multi30k_ende.py for at most 60 minutes, then score test_2016_flickr.

    python bench/multi30k_bleu.py --workdir=workdirs/bench_multi30k

Runs train.py and eval.py as a user would, measures the f32 matmul ceiling before and after
training, and prints BLEU (lowercased-tokenized and sacreBLEU), tokens/s and the train step's
achieved GFLOP/s (XLA cost analysis) against that ceiling. Extra flags go to train.py.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from matmul_ceiling import matmul_gflops  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="workdirs/bench_multi30k")
    parser.add_argument("--config", default="configs/multi30k_ende.py")
    parser.add_argument("--split", default="test_2016_flickr")
    args, extra = parser.parse_known_args()

    ceiling_before = matmul_gflops()
    train_cmd = [
        sys.executable,
        "train.py",
        f"--config={args.config}",
        f"--workdir={args.workdir}",
        *extra,
    ]
    eval_cmd = [sys.executable, "eval.py", f"--workdir={args.workdir}", f"--split={args.split}"]
    start = time.time()
    run(train_cmd)
    train_seconds = time.time() - start
    run(eval_cmd)
    ceiling_after = matmul_gflops()

    with open(os.path.join(ROOT, args.workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    train_rows = [r for r in rows if "train/tokens_per_s" in r]
    with open(os.path.join(ROOT, args.workdir, f"eval_{args.split}.json")) as f:
        result = json.load(f)
    ceiling = float(np.median([ceiling_before, ceiling_after]))
    gflops = float(np.median([r["train/gflop_per_s"] for r in train_rows]))
    summary = {
        "steps": train_rows[-1]["step"],
        "train_wall_minutes": round(train_seconds / 60, 1),
        "tokens_per_s_median": round(
            float(np.median([r["train/tokens_per_s"] for r in train_rows]))
        ),
        "target_tokens_per_s_median": round(
            float(np.median([r["train/target_tokens_per_s"] for r in train_rows]))
        ),
        "train_step_gflop_per_s_median": round(gflops, 1),
        "matmul_ceiling_gflop_per_s": [round(ceiling_before, 1), round(ceiling_after, 1)],
        "fraction_of_ceiling": round(gflops / ceiling, 3),
        f"{args.split}_lc_tok_bleu": round(result["lc_tok_bleu"], 2),
        f"{args.split}_sacrebleu": round(result["sacrebleu"], 2),
        "sacrebleu_signature": result["signature"],
        "commands": [" ".join(train_cmd[1:]), " ".join(eval_cmd[1:])],
    }
    print(json.dumps(summary, indent=2))
    with open(os.path.join(ROOT, args.workdir, "bench_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
