"""Transformer-XL relative multi-head attention (Dai et al., 2019, section 3.3).

For a query at absolute position i and a key at position j (distance i - j), the score is

    (E_i W_q + u) . (E_j W_kE)  +  (E_i W_q + v) . (R_{i-j} W_kR)
       content terms (a)+(c)        position terms (b)+(d)

with R the sinusoidal encoding of the distance. The position term is computed once per
(query, distance) pair and moved into (query, key) layout by `rel_shift`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xformer.attention import NEG_INF
from xformer.dropout import Dropout
from xformer.positional import sinusoidal_encoding


def relative_encoding(k_len: int, d_model: int, clamp_len: int = 0) -> jax.Array:
    """Sinusoidal R for distances k_len-1, ..., 1, 0 (in that order): [k_len, d_model].

    With clamp_len > 0, distances beyond clamp_len share the encoding of clamp_len.
    """
    distances = np.arange(k_len - 1, -1, -1)
    if clamp_len > 0:
        distances = np.minimum(distances, clamp_len)
    return sinusoidal_encoding(jnp.asarray(distances), d_model)


def rel_shift(x: jax.Array) -> jax.Array:
    """Move scores from (query, distance) to (query, key) layout: [..., Lq, Lk] -> same shape.

    Column c of x holds distance Lk-1-c (the order of `relative_encoding`); queries are the last
    Lq of the Lk keys. Output [i, j] = x[i, j + Lq-1 - i], i.e. the score for distance
    (Lk-Lq + i) - j. Exact wherever that distance is >= 0 (every key a causal query may see);
    entries for future keys hold other values and must be masked. One pad and two reshapes
    instead of a gather.
    """
    *batch, q_len, k_len = x.shape
    x = jnp.pad(x, [(0, 0)] * len(batch) + [(0, 0), (1, 0)])  # [..., Lq, Lk+1]
    x = x.reshape(*batch, k_len + 1, q_len)[..., 1:, :]  # drop the first Lq entries
    return x.reshape(*batch, q_len, k_len)


class RelativeMultiHeadAttention(nnx.Module):
    """Self-attention of the current segment over [memory ; segment] with relative positions.

    The global biases u and v are passed in by the caller (shared across layers) or owned by
    this layer (`own_biases=True`, the "untied" setting of the TF scripts).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        dropout: float,
        own_biases: bool,
        rngs: nnx.Rngs,
    ):
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        linear = dict(use_bias=False, rngs=rngs)
        self.q_proj = nnx.Linear(d_model, d_model, **linear)
        self.kv_proj = nnx.Linear(d_model, 2 * d_model, **linear)
        self.r_proj = nnx.Linear(d_model, d_model, **linear)  # W_{k,R}
        self.out_proj = nnx.Linear(d_model, d_model, **linear)
        self.dropout = Dropout(dropout, rngs=rngs)
        self.biases = RelativeBiases(num_heads, self.head_dim, rngs=rngs) if own_biases else None

    def __call__(
        self,
        x: jax.Array,
        memory: jax.Array | None,
        r: jax.Array,
        mask: jax.Array,
        biases: "RelativeBiases | None" = None,
    ) -> jax.Array:
        """x [B, Lq, d]; memory [B, Lm, d] or None; r [Lk, d] (Lk = Lm + Lq);
        mask [B or 1, 1, Lq, Lk] bool -> [B, Lq, d]."""
        biases = self.biases if self.biases is not None else biases
        context = x if memory is None else jnp.concatenate([memory, x], axis=1)
        heads = (self.num_heads, self.head_dim)
        q = self.q_proj(x).reshape(*x.shape[:2], *heads)
        kv = self.kv_proj(context).reshape(*context.shape[:2], 2, *heads)
        k, v = kv[:, :, 0], kv[:, :, 1]
        rk = self.r_proj(r).reshape(r.shape[0], *heads)
        content = jnp.einsum("bqhd,bkhd->bhqk", q + biases.u[...], k)
        position = rel_shift(jnp.einsum("bqhd,khd->bhqk", q + biases.v[...], rk))
        logits = (content + position) / math.sqrt(self.head_dim)
        logits = jnp.where(mask, logits, NEG_INF)
        weights = self.dropout(jax.nn.softmax(logits.astype(jnp.float32), axis=-1))
        out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)
        return self.out_proj(out.reshape(*x.shape[:2], -1))


class RelativeBiases(nnx.Module):
    """The global content bias u and position bias v, each [H, D]."""

    def __init__(self, num_heads: int, head_dim: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.u = nnx.Param(init(rngs.params(), (num_heads, head_dim)))
        self.v = nnx.Param(init(rngs.params(), (num_heads, head_dim)))
