"""T5's bucketed relative position bias (Raffel et al., 2020): a learned scalar per head for
each bucket of the query-key distance, shared by the layers of a stack. Small distances get a
bucket each; larger ones share logarithmically wider buckets up to max_distance."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from xformer.layout import Layout
from xformer.positional.base import PositionalScheme
from xformer.sharding import logical


def relative_bucket(
    distance: jax.Array, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> jax.Array:
    """distance = query position - key position (int array) -> bucket ids in [0, num_buckets).

    Bidirectional: half the buckets for keys after the query. Causal: keys after the query
    (distance < 0) share bucket 0 with distance 0; the mask hides them anyway.
    """
    offset = jnp.zeros_like(distance)
    if bidirectional:
        num_buckets //= 2
        offset = jnp.where(distance < 0, num_buckets, 0)
        distance = jnp.abs(distance)
    else:
        distance = jnp.maximum(distance, 0)
    exact = num_buckets // 2
    scale = (num_buckets - exact) / math.log(max_distance / exact)
    log_bucket = exact + jnp.log(jnp.maximum(distance, 1) / exact) * scale
    log_bucket = jnp.minimum(log_bucket.astype(jnp.int32), num_buckets - 1)
    return offset + jnp.where(distance < exact, distance, log_bucket)


class T5RelativeBias(PositionalScheme):
    name = "t5_bias"
    own_options = ("relative_buckets", "relative_max_distance")

    def __init__(self, cfg, num_layers: int, *, rngs: nnx.Rngs):
        self.check_config(cfg)
        self.num_buckets, self.max_distance = cfg.relative_buckets, cfg.relative_max_distance
        init = logical(nnx.initializers.normal(0.02), "relative", "heads")
        shape = (self.num_buckets, cfg.num_heads)
        self.table = nnx.Param(init(rngs.params(), shape, jnp.dtype(cfg.param_dtype)))

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.relative_buckets < 4 or cfg.relative_max_distance <= cfg.relative_buckets // 2:
            raise ValueError(
                "model.positional='t5_bias' needs model.relative_buckets >= 4 and "
                "model.relative_max_distance > relative_buckets / 2; got "
                f"{cfg.relative_buckets}, {cfg.relative_max_distance}"
            )

    def prepare(self, layout: Layout) -> jax.Array:
        buckets = relative_bucket(
            layout.distances(),
            bidirectional=not layout.causal,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        return jnp.transpose(self.table[...][buckets], (2, 0, 1))[None]  # [1, H, Lq, Lk]

    def logit_bias(self, prepared, q, k, layout, layer):
        return prepared
