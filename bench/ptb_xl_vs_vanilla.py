"""Benchmark: Transformer-XL vs the vanilla decoder-only LM of equal size on PTB (word level).

    python bench/ptb_xl_vs_vanilla.py --workdir=workdirs/bench_ptb

Trains configs/ptb_xl.py and then its `vanilla` variant, one after the other, each for its step
budget (about 60 minutes on the reference machine) on the whole machine. Then it evaluates both
with eval.py: XL at its training lengths and with longer evaluation memories (the one with the
best validation perplexity is reported on test); the vanilla model on non-overlapping 70-token
segments and with a sliding window of 70 tokens moved one token at a time (Al-Rfou et al.;
every prediction sees 70 tokens of context). A finished training run (done.json in its workdir)
is not repeated. Other arguments go to both train.py runs, e.g. `--config.train.num_steps=20`
for a smoke run.
"""

import argparse
import json
import os
import sys
import time

from xformer import launch
from xformer.compare import Run
from xformer.files import write_json

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_output import command_line  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XL_EVAL = {  # name -> eval.py flags; all at the training segment length
    "mem70": ["--mem_len=70"],
    "mem140_clamp139": ["--mem_len=140", "--clamp_len=139"],
    "mem280_clamp139_same": ["--mem_len=280", "--clamp_len=139", "--decoder_mask=same_length"],
}


def evaluate(workdir: str, split: str, flags: list[str], tag: str) -> dict:
    """eval.py's printed JSON, also kept as eval_<split>_<tag>.json, with its log beside it."""
    cmd = ["python", "eval.py", f"--workdir={workdir}", f"--split={split}", *flags]
    out = os.path.join(ROOT, workdir, f"eval_{split}_{tag}")
    return launch.run_json(cmd, cwd=ROOT, log=out + ".log", save=out + ".json")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="workdirs/bench_ptb")
    parser.add_argument("--skip_training", action="store_true")
    args, extra = parser.parse_known_args()
    xl, vanilla = (os.path.join(args.workdir, name) for name in ("xl", "vanilla"))
    os.makedirs(os.path.join(ROOT, args.workdir), exist_ok=True)

    train_cmds = {
        name: ["python", "train.py", f"--config={config}", f"--workdir={workdir}", *extra]
        for name, workdir, config in (
            ("xl", xl, "configs/ptb_xl.py"),
            ("vanilla", vanilla, "configs/ptb_xl.py:vanilla"),
        )
    }
    train_minutes = {}
    for (name, cmd), workdir in zip(train_cmds.items(), (xl, vanilla), strict=True):
        start = time.time()
        if not args.skip_training and not os.path.exists(os.path.join(ROOT, workdir, "done.json")):
            log = os.path.join(ROOT, args.workdir, f"train_{name}.log")
            launch.run(cmd, cwd=ROOT, log=log, check=True)
        train_minutes[name] = round((time.time() - start) / 60, 1)

    valid = {
        name: evaluate(xl, "valid", flags, name)["perplexity"] for name, flags in XL_EVAL.items()
    }
    valid["vanilla/segments"] = evaluate(vanilla, "valid", [], "segments")["perplexity"]
    best = min(XL_EVAL, key=valid.get)
    test = {
        f"xl/{best}": evaluate(xl, "test", XL_EVAL[best], best),
        "vanilla/segments": evaluate(vanilla, "test", [], "segments"),
        "vanilla/sliding1": evaluate(vanilla, "test", ["--sliding_stride=1"], "sliding1"),
    }

    def train_summary(workdir):
        run = Run.load(os.path.join(ROOT, workdir))
        return {
            "steps": run.train_rows[-1]["step"],
            "tokens_per_s_median": round(run.train_median("tokens_per_s")),
        }

    summary = {
        "train_wall_minutes": train_minutes,
        "xl": train_summary(xl),
        "vanilla": train_summary(vanilla),
        "valid_perplexity": {k: round(v, 2) for k, v in valid.items()},
        "xl_eval_chosen_on_valid": best,
        "test_perplexity": {k: round(v["perplexity"], 2) for k, v in test.items()},
        "test_tokens": {k: v["tokens"] for k, v in test.items()},
        "command": command_line(),
        "commands": [
            *(" ".join(cmd) for cmd in train_cmds.values()),
            f"python eval.py --workdir={xl} --split=test {' '.join(XL_EVAL[best])}",
            f"python eval.py --workdir={vanilla} --split=test",
            f"python eval.py --workdir={vanilla} --split=test --sliding_stride=1",
        ],
    }
    print(json.dumps(summary, indent=2))
    write_json(os.path.join(ROOT, args.workdir, "bench_summary.json"), summary)


if __name__ == "__main__":
    main()
