"""Benchmark: train short, test long (after Press et al. 2022, ALiBi), for every positional scheme.

    python bench/length_extrapolation.py --workdir=workdirs/length_extrapolation

Trains the PTB word-level decoder-only LM without memory (configs/ptb_xl.py, model.mem_len 0)
at segments of --train_length tokens under each positional scheme, with the same small model,
data, seed and number of steps. Then eval.py scores the whole test split at 1x, 2x, 4x and 8x
that length, every token once: on non-overlapping segments (a token sees the tokens before it in
its segment) and with a sliding window (windows of the evaluation length, each scoring its last
--stride tokens, so every token but the first few sees at least length - stride tokens). Learned
positions have a table of --train_length rows, so longer evaluations fail with eval.py's error,
shown as such. Finished trainings (done.json) and evaluations (their JSON) are reused. Prints
the tables and writes <workdir>/extrapolation.json, .md and .png.
"""

import argparse
import json
import os

from xformer import launch
from xformer.files import read_json_if_present, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMES = ("sinusoidal", "learned", "relative", "rope", "t5_bias", "alibi", "none")
MODES = ("segments", "sliding")


def model_flags(args, scheme: str) -> list[str]:
    return [
        f"--config.model.positional={scheme}",
        "--config.model.mem_len=0",
        "--config.eval.mem_len=0",
        f"--config.model.max_len={args.train_length}",
        f"--config.model.d_model={args.d_model}",
        "--config.model.num_heads=4",
        f"--config.model.num_decoder_layers={args.layers}",
        f"--config.model.d_ff={4 * args.d_model}",
        "--config.model.dropout=0.1",
        "--config.model.relu_dropout=0.1",
        f"--config.data.segment_length={args.train_length}",
        f"--config.eval.segment_length={args.train_length}",
        f"--config.train.num_steps={args.steps}",
        "--config.train.warmup_steps=200",
        "--config.train.learning_rate=1e-3",
        f"--config.train.eval_every={args.steps}",
        f"--config.train.checkpoint_every={args.steps}",
        "--config.train.log_every=100",
    ]


def evaluate(workdir: str, length: int, mode: str, stride: int) -> dict:
    """eval.py's JSON for the test split at `length`, or {"error": its last stderr line}."""
    out = os.path.join(workdir, f"extrapolation_{mode}_{length}.json")
    cached = read_json_if_present(out)
    if cached is not None:
        return cached
    cmd = ["python", "eval.py", f"--workdir={workdir}", "--split=test"]
    cmd += [f"--segment_length={length}", "--mem_len=0"]
    if mode == "sliding":
        cmd.append(f"--sliding_stride={min(stride, length)}")
    log = out.removesuffix(".json") + ".log"
    done = launch.run(cmd, cwd=ROOT, capture=True, log=log)
    if done.returncode == 0:
        result = json.loads(done.stdout)
    else:
        with open(log) as f:
            lines = [line.strip() for line in f if line.strip()]
        result = {"error": lines[-1] if lines else f"exit status {done.returncode}"}
    write_json(out, result)
    return result


def cell(result: dict) -> str:
    if "error" in result:
        return "error" if "max_len" not in result["error"] else "error: beyond max_len"
    return f"{result['perplexity']:.1f}"


def table(results: dict, lengths: list[int], mode: str, train_length: int) -> str:
    header = ["scheme", *(f"{n // train_length}x ({n})" for n in lengths)]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * len(lengths)]
    for scheme, by_length in results.items():
        cells = [cell(by_length[mode][str(n)]) for n in lengths]
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, lengths: list[int], path: str, stride: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, mode in zip(axes, MODES, strict=True):
        for scheme, by_length in results.items():
            points = [
                (n, by_length[mode][str(n)]["perplexity"])
                for n in lengths
                if "perplexity" in by_length[mode][str(n)]
            ]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=scheme)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_yscale("log")
        ax.set_xlabel("evaluation length (tokens)")
        title = "non-overlapping segments" if mode == "segments" else f"sliding, stride {stride}"
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("PTB test perplexity")
    axes[1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", default="workdirs/length_extrapolation")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--train_length", type=int, default=64)
    parser.add_argument("--multiples", default="1,2,4,8")
    parser.add_argument("--stride", type=int, default=32, help="sliding-window stride")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    from bench_output import command_line

    command = command_line()
    print(f"command: {command}", flush=True)
    root = os.path.join(ROOT, args.workdir)
    os.makedirs(root, exist_ok=True)
    lengths = [args.train_length * int(m) for m in args.multiples.split(",")]
    results = {}
    for scheme in args.schemes.split(","):
        workdir = os.path.join(root, scheme)
        if not os.path.exists(os.path.join(workdir, "done.json")):
            cmd = ["python", "train.py", "--config=configs/ptb_xl.py", f"--workdir={workdir}"]
            launch.run(cmd + model_flags(args, scheme), cwd=ROOT, check=True, log=workdir + ".log")
        results[scheme] = {
            mode: {str(n): evaluate(workdir, n, mode, args.stride) for n in lengths}
            for mode in MODES
        }

    summary = {"command": command, **vars(args), "lengths": lengths, "results": results}
    write_json(os.path.join(root, "extrapolation.json"), summary)
    text = "\n\n".join(
        f"{title}:\n\n" + table(results, lengths, mode, args.train_length)
        for mode, title in (
            ("segments", "Non-overlapping segments"),
            ("sliding", f"Sliding window, stride {args.stride}"),
        )
    )
    with open(os.path.join(root, "extrapolation.md"), "w") as f:
        f.write(f"{command}\n\n{text}\n")
    plot(results, lengths, os.path.join(root, "extrapolation.png"), args.stride)
    print(text, flush=True)


if __name__ == "__main__":
    main()
