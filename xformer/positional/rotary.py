"""Rotary position embedding (RoPE; Su et al., 2021): each pair of query/key features is
rotated by an angle proportional to the position, so q.k depends on positions only through
their difference. Pairs are (x[i], x[i + D/2]), the half-split layout of GPT-NeoX and LLaMA."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xformer import precision
from xformer.positional.base import PositionalScheme


def rotate(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """x [B, L, H, D], positions [L] -> x with pair i rotated by positions * base^(-2i/D)."""
    half, compute = x.shape[-1] // 2, precision.at_least_float32(x.dtype)
    inv_freq = jnp.asarray(base ** (-np.arange(half) / half), compute)
    angles = positions.astype(compute)[:, None] * inv_freq  # [L, D/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # [L, 1, D/2]
    x1, x2 = x[..., :half].astype(compute), x[..., half:].astype(compute)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class RotaryPositions(PositionalScheme):
    name = "rope"
    own_options = ("rope_base",)

    def __init__(self, cfg, num_layers: int, *, rngs: nnx.Rngs):
        self.check_config(cfg)
        self.base = cfg.rope_base

    @classmethod
    def check_config(cls, cfg) -> None:
        head_dim = cfg.d_model // cfg.num_heads
        if head_dim % 2 or cfg.rope_base <= 1:
            raise ValueError(
                f"model.positional='rope' needs an even head size (d_model / num_heads = "
                f"{head_dim}) and model.rope_base > 1 (got {cfg.rope_base})"
            )

    def rotate(self, x: jax.Array, start: int | jax.Array) -> jax.Array:
        return rotate(x, start + jnp.arange(x.shape[1]), self.base)
