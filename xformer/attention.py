"""Multi-head scaled dot-product attention with an optional key/value cache."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from xformer.dropout import Dropout

NEG_INF = -1e9  # finite, so fully masked rows give a uniform softmax instead of NaN


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    dropout: nnx.Dropout | None = None,
) -> jax.Array:
    """softmax(q k^T / sqrt(d) + mask) v.

    q [B, Lq, H, D], k and v [B, Lk, H, D], mask [B, 1 or H, Lq, Lk] bool -> [B, Lq, H, D].
    """
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        logits = jnp.where(mask, logits, NEG_INF)
    weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(q.dtype)
    if dropout is not None:
        weights = dropout(weights)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class MultiHeadAttention(nnx.Module):
    """Self- or cross-attention. Self-attention fuses the q/k/v projections into one matmul."""

    def __init__(
        self, d_model: int, num_heads: int, *, dropout: float, cross: bool, rngs: nnx.Rngs
    ):
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim, self.cross = num_heads, d_model // num_heads, cross
        if cross:
            self.q_proj = nnx.Linear(d_model, d_model, rngs=rngs)
            self.kv_proj = nnx.Linear(d_model, 2 * d_model, rngs=rngs)
        else:
            self.qkv_proj = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
        self.out_proj = nnx.Linear(d_model, d_model, rngs=rngs)
        self.dropout = Dropout(dropout, rngs=rngs)

    def _heads(self, x: jax.Array, n: int) -> list[jax.Array]:
        """[B, L, n*H*D] -> n arrays [B, L, H, D]."""
        x = x.reshape(*x.shape[:-1], n, self.num_heads, self.head_dim)
        return [x[..., i, :, :] for i in range(n)]

    def project_kv(self, memory: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Cross-attention keys and values of the encoder output, computed once per sentence."""
        return tuple(self._heads(self.kv_proj(memory), 2))

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array | None,
        *,
        memory: jax.Array | None = None,
        kv: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """x [B, Lq, d]; memory [B, Lk, d] (cross) or precomputed kv; mask [B, 1, Lq, Lk]."""
        if self.cross:
            (q,) = self._heads(self.q_proj(x), 1)
            k, v = kv if kv is not None else self.project_kv(memory)
        else:
            q, k, v = self._heads(self.qkv_proj(x), 3)
        return self._attend(q, k, v, mask)

    def _attend(self, q, k, v, mask) -> jax.Array:
        out = dot_product_attention(q, k, v, mask, self.dropout)
        return self.out_proj(out.reshape(*out.shape[:-2], -1))

    def decode_step(
        self, x: jax.Array, cache: dict, index: jax.Array, mask: jax.Array
    ) -> tuple[jax.Array, dict]:
        """One incremental self-attention step.

        x [B, 1, d]; cache {"k", "v"}: [B, max_len, H, D]; index: scalar position of x;
        mask [B, 1, 1, max_len] (the caller masks cache slots > index). Returns out, new cache.
        """
        q, k, v = self._heads(self.qkv_proj(x), 3)
        cache = {
            "k": jax.lax.dynamic_update_slice_in_dim(cache["k"], k, index, axis=1),
            "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], v, index, axis=1),
        }
        return self._attend(q, cache["k"], cache["v"], mask), cache
