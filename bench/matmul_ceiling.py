"""Measure this machine's f32 matmul throughput with JAX (the ceiling for train-step GFLOP/s).

python bench/matmul_ceiling.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np


def matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
    """Median GFLOP/s of an n x n x n f32 matmul."""
    a, b = (jax.random.normal(jax.random.key(i), (n, n), jnp.float32) for i in range(2))
    mm = jax.jit(jnp.matmul)
    mm(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mm(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / float(np.median(times)) / 1e9


if __name__ == "__main__":
    print(f"f32 matmul 2048^3: {matmul_gflops():.1f} GFLOP/s (median of 10)")
