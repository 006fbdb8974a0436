"""Absolute positions added to the token embeddings: sinusoidal (Vaswani et al., 2017) and a
learned table."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xformer import precision
from xformer.embedding import Embed
from xformer.positional.base import PositionalScheme
from xformer.sharding import logical


def sinusoidal_encoding(positions: jax.Array, d_model: int, dtype=jnp.float32) -> jax.Array:
    """PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same): [...] -> [..., d_model].

    Computed in at least float32 (float64 for a float64 model), returned in `dtype`.
    """
    compute = precision.at_least_float32(dtype)
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, d_model, 2) / d_model), compute)
    angles = positions[..., None].astype(compute) * inv_freq  # [..., d/2]
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # interleave: even sin, odd cos
    return pe.reshape(*positions.shape, -1)[..., :d_model].astype(dtype)


def check_even_d_model(name: str, d_model: int) -> None:
    """Sinusoid tables interleave sin and cos, so they need an even width."""
    if d_model % 2:
        raise ValueError(f"model.positional={name!r} needs an even d_model, got {d_model}")


class SinusoidalPositions(PositionalScheme):
    name = "sinusoidal"
    absolute = True

    @classmethod
    def check_config(cls, cfg) -> None:
        check_even_d_model(cls.name, cfg.d_model)

    def __init__(self, cfg, num_layers: int, *, rngs: nnx.Rngs):
        self.d_model, self.dtype = cfg.d_model, jnp.dtype(cfg.dtype)

    def embed(self, positions: jax.Array) -> jax.Array:
        return sinusoidal_encoding(positions, self.d_model, self.dtype)


class LearnedPositions(PositionalScheme):
    name = "learned"
    absolute = True

    def __init__(self, cfg, num_layers: int, *, rngs: nnx.Rngs):
        self.max_len = cfg.max_len
        init = logical(nnx.initializers.normal(0.02), None, "embed")
        self.table = Embed(cfg.max_len, cfg.d_model, embedding_init=init, **cfg.dtypes, rngs=rngs)

    def embed(self, positions: jax.Array) -> jax.Array:
        return self.table(positions)
