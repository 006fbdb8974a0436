"""Measure this machine's matmul throughput with JAX (the ceiling for train-step GFLOP/s), and
optionally its device-to-device copy bandwidth (the ceiling for memory-bound ops).

    python bench/matmul_ceiling.py                                   # CPU: f32 2048^3
    python bench/matmul_ceiling.py --dtype bfloat16 --n 8192 --copy_gib 2   # a GPU's two ceilings

Inputs are random normal (never zeros: a GPU has run a bf16 product 13% faster on zeros). Each
timed window runs `--inner` products back to back and then waits for the last, so a GPU's
launch latency is not counted; the median over `--repeats` windows is reported. The copy
moves `--copy_gib` GiB through `x + 1` (one read and one write of every element: 2x the size
counted).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def _median_seconds(fn, arg, repeats: int, inner: int) -> float:
    fn(*arg).block_until_ready()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*arg)
        out.block_until_ready()
        times.append((time.perf_counter() - start) / inner)
    return float(np.median(times))


def matmul_gflops(n: int = 2048, repeats: int = 10, dtype=jnp.float32, inner: int = 1) -> float:
    """Median GFLOP/s of an n x n x n matmul in `dtype` (random normal inputs)."""
    a, b = (jax.random.normal(jax.random.key(i), (n, n), dtype) for i in range(2))
    return 2 * n**3 / _median_seconds(jax.jit(jnp.matmul), (a, b), repeats, inner) / 1e9


def copy_gbps(gib: float = 2.0, repeats: int = 10, inner: int = 5) -> float:
    """Median GB/s (bytes read + written) of `x + 1` over `gib` GiB of float32."""
    x = jax.random.normal(jax.random.key(0), (int(gib * 2**30) // 4,), jnp.float32)
    return 2 * x.nbytes / _median_seconds(jax.jit(lambda x: x + 1), (x,), repeats, inner) / 1e9


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--inner", type=int, default=1, help="products per timed window (the copy: 5 copies)"
    )
    parser.add_argument("--copy_gib", type=float, default=0.0, help="also time a copy")
    args = parser.parse_args()
    device = jax.devices()[0]
    rate = matmul_gflops(args.n, args.repeats, jnp.dtype(args.dtype), args.inner)
    print(
        f"{args.dtype} matmul {args.n}^3 on {device.device_kind}: {rate:.1f} GFLOP/s "
        f"(median of {args.repeats})"
    )
    if args.copy_gib:
        rate = copy_gbps(args.copy_gib, args.repeats)
        print(f"copy x + 1 over {args.copy_gib:g} GiB: {rate:.1f} GB/s (median of {args.repeats})")
    from bench_output import command_line

    print(f"command: {command_line()}")
