"""Benchmark: a language model's train step with the loss's log-softmax at the target as a custom
VJP (`losses.log_softmax_at`, what the adaptive softmax uses) against autodiff's
(`jax.nn.log_softmax`, then the target's entry), side by side in one process.

    python bench/lm_loss_speed.py
    python bench/lm_loss_speed.py --config wt103_xl --windows 6

Both train steps are `train_lib.train_step` on the task's own loss, built as
bench/gpu_throughput.py builds them (the config file's model, synthetic Zipf token streams
through the real batcher, the XL memory carried, the state donated); only the function that
`adaptive.AdaptiveLogSoftmax.nll` calls for the head's and the dense tails' log-probabilities
differs. After --warmup steps each, --windows windows of --steps steps alternate between the
two; the medians of the per-step times are reported, with their ratio, each step's loss (the
two must agree) and the f32 matmul ceiling before and after. glibc's malloc runs as train.py
runs it (xformer/malloc_tuning.py). Prints a table and JSON with every window; the JSON also
goes to --output.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from xformer.malloc_tuning import reexec_with_malloc_tuning  # noqa: E402

if __name__ == "__main__":  # before jax starts, as train.py does (xformer/malloc_tuning.py)
    reexec_with_malloc_tuning()

import gpu_throughput  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_output import finish  # noqa: E402
from matmul_ceiling import matmul_gflops  # noqa: E402

from xformer import adaptive, precision, train_lib  # noqa: E402


def autodiff_log_softmax_at(logits: jax.Array, index: jax.Array) -> jax.Array:
    """The reference: the whole log-softmax [..., V], then the entry at index [...]."""
    log_p = jax.nn.log_softmax(logits.astype(precision.at_least_float32(logits.dtype)))
    return jnp.take_along_axis(log_p, index[..., None], axis=-1)[..., 0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="ptb_xl", choices=["ptb_xl", "wt103_xl"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--windows", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--output", default="workdirs/lm_loss_speed.json")
    args = parser.parse_args()

    config, vocab = gpu_throughput.load_config(args.config, False, args.dtype, "xla", {})
    task = gpu_throughput.make_task(config, vocab, tempfile.mkdtemp())
    exp = task.exp
    host_batches = gpu_throughput.synthetic_batches(config, vocab, 4)
    batches = [jax.make_array_from_process_local_data(exp.batch_sharding, b) for b in host_batches]
    rng_state = jax.device_put(exp.rng_state, exp.replicated)
    ceiling_before = matmul_gflops()

    forms = {"custom VJP": adaptive.log_softmax_at, "autodiff": autodiff_log_softmax_at}
    steps, states = {}, {}
    for name, fn in forms.items():  # adaptive.py calls the function by this name when traced
        adaptive.log_softmax_at = fn
        states[name] = exp.init_state(task.init_carry())
        platform = exp.mesh.devices.flat[0].platform  # (as train.py compiles its step)
        lowered = train_lib.lower_train_step(task, states[name], rng_state, batches[0], platform)
        steps[name] = train_lib.compile_step(lowered, platform)
        states[name] = train_lib.in_step_layouts(states[name], steps[name])
    adaptive.log_softmax_at = forms["custom VJP"]

    times, losses, count = {name: [] for name in forms}, {name: [] for name in forms}, 0
    for window in range(-1, args.windows):  # window -1: the untimed warm-up
        n = args.warmup if window < 0 else args.steps
        for name, step in steps.items():
            start, window_metrics = time.perf_counter(), []
            for i in range(count, count + n):
                states[name], metrics = step(states[name], rng_state, batches[i % len(batches)])
                window_metrics.append(metrics)
            jax.block_until_ready(states[name])
            if window >= 0:
                times[name].append((time.perf_counter() - start) / n)
            losses[name] += [float(m["loss_sum"] / m["tokens"]) for m in window_metrics]
        count += n
    ceiling_after = matmul_gflops()

    median_ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    ratio = median_ms["autodiff"] / median_ms["custom VJP"]
    print(f"\n| {args.config} {args.dtype} | step ms (median) | windows (ms) |")
    print("|---|---:|---|")
    for name, t in times.items():
        print(f"| {name} | {median_ms[name]:.1f} | {', '.join(f'{1000 * x:.0f}' for x in t)} |")
    print(f"autodiff / custom VJP: {ratio:.3f}x")
    summary = {
        "config": gpu_throughput.MODELS[args.config][0],
        "dtype": args.dtype,
        "windows": args.windows,
        "steps_per_window": args.steps,
        "step_ms_median": {k: round(v, 2) for k, v in median_ms.items()},
        "autodiff_over_custom_vjp": round(ratio, 4),
        "step_ms_windows": {k: [round(1000 * x, 1) for x in v] for k, v in times.items()},
        "last_loss": {k: v[-1] for k, v in losses.items()},
        "max_loss_difference": max(
            abs(a - b) for a, b in zip(losses["custom VJP"], losses["autodiff"], strict=True)
        ),
        "matmul_ceiling_gflops_before_after": [round(ceiling_before, 1), round(ceiling_after, 1)],
    }
    finish(summary, args.output)


if __name__ == "__main__":
    main()
