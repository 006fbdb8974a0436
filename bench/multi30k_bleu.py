"""Benchmark: train configs/multi30k_ende.py (5,300 steps), then score test_2016_flickr.

    python bench/multi30k_bleu.py --workdir=workdirs/bench_multi30k
    python bench/multi30k_bleu.py --workdir=... --config.train.max_train_seconds=3600  # 60 min

Runs train.py and eval.py as a user would, measures the f32 matmul ceiling before and after
training, and prints BLEU (lowercased-tokenized and sacreBLEU), tokens/s and the train step's
achieved GFLOP/s (XLA cost analysis) against that ceiling. Extra flags go to train.py.
"""

import argparse
import json
import os
import statistics
import sys
import time

from xformer import launch
from xformer.compare import Run
from xformer.files import write_json

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_output import command_line  # noqa: E402
from matmul_ceiling import matmul_gflops  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="workdirs/bench_multi30k")
    parser.add_argument("--config", default="configs/multi30k_ende.py")
    parser.add_argument("--split", default="test_2016_flickr")
    args, extra = parser.parse_known_args()

    ceiling_before = matmul_gflops()
    train_cmd = [
        "python",
        "train.py",
        f"--config={args.config}",
        f"--workdir={args.workdir}",
        *extra,
    ]
    eval_cmd = ["python", "eval.py", f"--workdir={args.workdir}", f"--split={args.split}"]
    start = time.time()
    launch.run(train_cmd, cwd=ROOT, check=True)
    train_seconds = time.time() - start
    result = launch.run_json(eval_cmd, cwd=ROOT)
    ceiling_after = matmul_gflops()

    run = Run.load(os.path.join(ROOT, args.workdir))
    ceiling = statistics.median([ceiling_before, ceiling_after])
    gflops = run.train_median("gflop_per_s")
    summary = {
        "steps": run.train_rows[-1]["step"],
        "train_wall_minutes": round(train_seconds / 60, 1),
        "tokens_per_s_median": round(run.train_median("tokens_per_s")),
        "target_tokens_per_s_median": round(run.train_median("target_tokens_per_s")),
        "train_step_gflop_per_s_median": round(gflops, 1),
        "matmul_ceiling_gflop_per_s": [round(ceiling_before, 1), round(ceiling_after, 1)],
        "fraction_of_ceiling": round(gflops / ceiling, 3),
        f"{args.split}_lc_tok_bleu": round(result["lc_tok_bleu"], 2),
        f"{args.split}_sacrebleu": round(result["sacrebleu"], 2),
        "sacrebleu_signature": result["signature"],
        "command": command_line(),
        "commands": [" ".join(train_cmd[1:]), " ".join(eval_cmd[1:])],
    }
    print(json.dumps(summary, indent=2))
    write_json(os.path.join(ROOT, args.workdir, "bench_summary.json"), summary)


if __name__ == "__main__":
    main()
