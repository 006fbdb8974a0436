"""nnx.Embed whose lookup gathers rows of the parameter and casts the rows, not the table.

nnx.Embed casts the whole [V, d] table to the compute dtype and gathers from the cast copy, so
in a bfloat16 model the backward pass scatter-adds every position's gradient into a bfloat16
[V, d] table: a frequent token's row sums thousands of contributions, each add rounded to
bfloat16. On an H100 those scatters were also slow: wmt14's two 32k x 512 tables took 3.8 and
3.3 ms of a 45 ms step, at ~30-35 GB/s (bench/GPU_NOTES.md, 2026-11-27). Gathering from the
parameter and casting the gathered [..., d] rows gives the same forward values (a cast commutes
with a gather) and a backward scatter-add in the parameter's dtype (float32). Parameters and
`attend` are nnx.Embed's, so checkpoints are unchanged; a float32 model computes the same
program as before.
"""

import jax
import jax.numpy as jnp
from flax import nnx


class Embed(nnx.Embed):
    """ids [...] int -> rows [..., features] in `dtype` (the parameter's dtype if None)."""

    def __call__(self, ids: jax.Array) -> jax.Array:
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"embedding ids must be integers, got {ids.dtype}")
        rows = jnp.take(self.embedding[...], ids, axis=0)
        return rows if self.dtype is None else rows.astype(self.dtype)
