"""Multi-head scaled dot-product attention: self-attention (optionally over a Transformer-XL
memory), cross-attention, and one-token steps over a key/value cache. Positional schemes act
through rotations of q and k and a bias on the logits (see positional/base.py)."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from xformer.dropout import Dropout
from xformer.layout import Layout
from xformer.positional.base import BoundScheme

NEG_INF = -1e9  # finite, so fully masked rows give a uniform softmax instead of NaN


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    dropout: nnx.Dropout | None = None,
    bias: jax.Array | None = None,
) -> jax.Array:
    """softmax(q k^T / sqrt(D) + bias, masked) v.

    q [B, Lq, H, D], k and v [B, Lk, H, D], mask [B or 1, 1 or H, Lq, Lk] bool, bias
    broadcastable to [B, H, Lq, Lk] -> [B, Lq, H, D].
    """
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias
    if mask is not None:
        logits = jnp.where(mask, logits, NEG_INF)
    weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(q.dtype)
    if dropout is not None:
        weights = dropout(weights)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class MultiHeadAttention(nnx.Module):
    """kind "self": one fused q/k/v projection; "memory": self-attention whose keys may also
    cover a memory of earlier states (separate q and k/v projections); "cross": queries from
    the decoder, keys and values from the encoder output."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        kind: str,
        dropout: float,
        use_bias: bool = True,
        rngs: nnx.Rngs,
    ):
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim, self.kind = num_heads, d_model // num_heads, kind
        linear = dict(use_bias=use_bias, rngs=rngs)
        if kind == "self":
            self.qkv_proj = nnx.Linear(d_model, 3 * d_model, **linear)
        else:
            self.q_proj = nnx.Linear(d_model, d_model, **linear)
            self.kv_proj = nnx.Linear(d_model, 2 * d_model, **linear)
        self.out_proj = nnx.Linear(d_model, d_model, **linear)
        self.dropout = Dropout(dropout, rngs=rngs)

    def _heads(self, x: jax.Array, n: int) -> list[jax.Array]:
        """[B, L, n*H*D] -> n arrays [B, L, H, D]."""
        x = x.reshape(*x.shape[:-1], n, self.num_heads, self.head_dim)
        return [x[..., i, :, :] for i in range(n)]

    def project_kv(self, states: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, L, H, D] of states [B, L, d] (cross-attention: once per input)."""
        return tuple(self._heads(self.kv_proj(states), 2))

    def _qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        if self.kind == "self":
            return tuple(self._heads(self.qkv_proj(x), 3))
        return self._heads(self.q_proj(x), 1)[0], *self.project_kv(x)

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array | None,
        *,
        positional: BoundScheme | None = None,
        layer: int = 0,
        memory: jax.Array | None = None,
        encoded: jax.Array | None = None,
        kv: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """x [B, Lq, d] -> [B, Lq, d]; mask [B or 1, 1, Lq, Lk].

        Self-attention: keys are x, or [memory ; x] with memory [B, Lm, d] (kind "memory").
        Cross-attention: keys from encoded [B, Lk, d] or their precomputed kv.
        """
        if self.kind == "cross":
            q = self._heads(self.q_proj(x), 1)[0]
            k, v = kv if kv is not None else self.project_kv(encoded)
        elif memory is not None:
            q = self._heads(self.q_proj(x), 1)[0]
            k, v = self.project_kv(jnp.concatenate([memory, x], axis=1))
        else:
            q, k, v = self._qkv(x)
        if positional is not None:
            q = positional.scheme.rotate(q, positional.layout.q_start)
            k = positional.scheme.rotate(k, positional.layout.k_start)
        return self._attend(q, k, v, mask, positional, layer)

    def _attend(self, q, k, v, mask, positional, layer) -> jax.Array:
        bias = None if positional is None else positional.bias(q, k, layer)
        out = dot_product_attention(q, k, v, mask, self.dropout, bias)
        return self.out_proj(out.reshape(*out.shape[:-2], -1))

    def decode_step(
        self,
        x: jax.Array,
        cache: dict,
        index: jax.Array,
        mask: jax.Array,
        positional: BoundScheme,
        layer: int,
    ) -> tuple[jax.Array, dict]:
        """One incremental self-attention step.

        x [B, 1, d] at position `index` (scalar); cache {"k", "v"}: [B, max_len, H, D] keys
        (rotated, for rotary schemes) and values of earlier positions; mask [B, 1, 1, max_len]
        hides slots > index; positional is bound to Layout(1, max_len, q_start=index).
        """
        q, k, v = self._qkv(x)
        q, k = (positional.scheme.rotate(t, index) for t in (q, k))
        cache = {
            "k": jax.lax.dynamic_update_slice_in_dim(cache["k"], k, index, axis=1),
            "v": jax.lax.dynamic_update_slice_in_dim(cache["v"], v, index, axis=1),
        }
        return self._attend(q, cache["k"], cache["v"], mask, positional, layer), cache


def decode_layout(index: jax.Array, max_len: int) -> Layout:
    """Where one decoding step sits: the query at `index`, keys at cache slots 0..max_len-1."""
    return Layout(1, max_len, q_start=index)
