"""The matmuls of a train step by operand dtype: how many, and their FLOPs (no device needed).

    python bench/matmul_dtypes.py                                   # bf16, xla attention
    python bench/matmul_dtypes.py --configs wmt14 --impl fused --dtype bfloat16

Lowers `train_lib.train_step` of the GPU benchmark's models (`bench/gpu_throughput.py`: the
real configs, synthetic batches) and counts the `dot_general`s of the lowered program (what
xformer asks XLA for, before XLA's own rewrites) by whether both operands are float32. A
bfloat16 model's float32 matmuls run on an accelerator at a fraction of its bfloat16 rate and
move twice the bytes. Matrix-vector products (an operand of rank 1: the LayerNorm backward's
reductions) are left out. Both branches of a `lax.cond` count (the adaptive softmax's
capacity fallback), so the FLOPs are the program's, not one step's.
"""

import argparse
import functools
import math
import re
import tempfile

import gpu_throughput as gt

DOT = re.compile(
    r"stablehlo\.dot_general.*contracting_dims = \[([\d, ]*)\] x.*"
    r":\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)"
)


def dims(tensor: str) -> list[int]:
    """'tensor<2x3xf32>' -> [2, 3]."""
    return [int(d) for d in tensor[len("tensor<") : -1].split("x")[:-1]]


def census(program: str) -> dict[str, list[float]]:
    """{"float32" | "other": [matmuls, FLOPs]} of a lowered program's matrix-matrix dots."""
    counts = {"float32": [0, 0.0], "other": [0, 0.0]}
    for line in program.splitlines():
        match = DOT.search(line)
        if not match:
            continue
        contracting, lhs, rhs, out = match.groups()
        if len(dims(lhs)) < 2 or len(dims(rhs)) < 2:
            continue
        k = math.prod(dims(lhs)[int(i)] for i in contracting.split(",") if i.strip())
        kind = "float32" if lhs.endswith("f32>") and rhs.endswith("f32>") else "other"
        counts[kind][0] += 1
        counts[kind][1] += 2.0 * k * math.prod(dims(out))
    return counts


def lowered_step(name: str, dtype: str, impl: str) -> str:
    import jax

    from xformer import train_lib

    config, vocab = gt.load_config(name, False, dtype, impl, {})
    with tempfile.TemporaryDirectory() as workdir:
        task = gt.make_task(config, vocab, workdir)
        exp = task.exp
        host_batch = gt.synthetic_batches(config, vocab, 1)[0]
        batch = jax.make_array_from_process_local_data(exp.batch_sharding, host_batch)
        state = jax.eval_shape(lambda: exp.init_state(task.init_carry()))
        rng_state = jax.device_put(exp.rng_state, exp.replicated)
        step = jax.jit(functools.partial(train_lib.train_step, task))
        return step.lower(state, rng_state, batch).as_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="wmt14,ptb_xl,wt103_xl")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--impl", default="xla", help="model.attention_impl")
    args = parser.parse_args()
    from bench_output import command_line

    print("command:", command_line())
    print("| model | dtype | attention | float32 matmuls | their GFLOP | all GFLOP | share |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name in args.configs.split(","):
        counts = census(lowered_step(name, args.dtype, args.impl))
        (n32, f32), (_, other) = counts["float32"], counts["other"]
        print(
            f"| {name} | {args.dtype} | {args.impl} | {n32} | {f32 / 1e9:,.0f} | "
            f"{(f32 + other) / 1e9:,.0f} | {f32 / (f32 + other):.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
