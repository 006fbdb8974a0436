"""Absolute positional schemes: modules mapping positions [B, L] -> embeddings [B, L, d].

A new scheme is one class here plus one entry in POSITIONAL_SCHEMES.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sinusoidal_encoding(positions: jax.Array, d_model: int) -> jax.Array:
    """Vaswani et al. (2017): PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same)."""
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d_model, 2, dtype=np.float32) / d_model))
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., d/2]
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # interleave: even sin, odd cos
    return pe.reshape(*positions.shape, -1)[..., :d_model]


class SinusoidalPositions(nnx.Module):
    max_len = None  # any length

    def __init__(self, d_model: int, max_len: int, *, rngs: nnx.Rngs):
        self.d_model = d_model

    def __call__(self, positions: jax.Array) -> jax.Array:
        return sinusoidal_encoding(positions, self.d_model)


class LearnedPositions(nnx.Module):
    def __init__(self, d_model: int, max_len: int, *, rngs: nnx.Rngs):
        self.max_len = max_len
        self.table = nnx.Embed(
            max_len, d_model, embedding_init=nnx.initializers.normal(0.02), rngs=rngs
        )

    def __call__(self, positions: jax.Array) -> jax.Array:
        return self.table(positions)


POSITIONAL_SCHEMES = {"sinusoidal": SinusoidalPositions, "learned": LearnedPositions}


def check_length(scheme: nnx.Module, length: int) -> None:
    """Fail before compute when a sequence is longer than a learned position table."""
    if scheme.max_len is not None and length > scheme.max_len:
        raise ValueError(
            f"sequence length {length} exceeds the learned position table "
            f"(model.max_len={scheme.max_len}); use model.positional='sinusoidal' or a larger "
            "model.max_len"
        )
