"""ALiBi (Press et al., 2022): no position embeddings; head h subtracts slope_h * |distance|
from its logits. Slopes form a geometric sequence, so heads attend at different ranges and
the model extrapolates to sequences longer than those it was trained on."""

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xformer import precision
from xformer.layout import Layout
from xformer.positional.base import PositionalScheme


def alibi_slopes(num_heads: int) -> np.ndarray:
    """2^(-8/n), 2^(-16/n), ... for n heads (a power of two); otherwise the slopes of the
    nearest smaller power of two, then every other slope of the next one (as in the paper)."""

    def geometric(n):
        return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)

    n = 2 ** int(math.log2(num_heads))
    extra = geometric(2 * n)[0::2][: num_heads - n]
    return np.concatenate([geometric(n), extra])


class ALiBi(PositionalScheme):
    name = "alibi"

    def __init__(self, cfg, num_layers: int, *, rngs: nnx.Rngs):
        self.num_heads = cfg.num_heads
        self.dtype = precision.at_least_float32(cfg.dtype)  # the logits' dtype

    def prepare(self, layout: Layout):
        slopes = jnp.asarray(alibi_slopes(self.num_heads), self.dtype)[:, None, None]
        distance = jnp.abs(layout.distances()).astype(self.dtype)
        return (-slopes * distance)[None]  # [1, H, Lq, Lk]

    def logit_bias(self, prepared, q, k, layout, layer):
        return prepared
