"""Transformer blocks: position-wise FFN, residual wrapper (pre- or post-LN), self-attention
layers (encoder, decoder-only LM, Transformer-XL) and encoder-decoder layers."""

import functools
from collections.abc import Callable

import jax
from flax import nnx

from xformer.attention import MultiHeadAttention
from xformer.dropout import Dropout
from xformer.positional.base import BoundScheme


class FeedForward(nnx.Module):
    """Linear(d, d_ff) -> ReLU -> dropout -> Linear(d_ff, d)."""

    def __init__(self, d_model: int, d_ff: int, *, dropout: float, rngs: nnx.Rngs):
        self.up = nnx.Linear(d_model, d_ff, rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, rngs=rngs)
        self.dropout = Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.dropout(jax.nn.relu(self.up(x))))


class Residual(nnx.Module):
    """x + dropout(f(x)) with LayerNorm before f (pre-LN) or after the sum (post-LN, the paper)."""

    def __init__(self, d_model: int, *, pre_norm: bool, dropout: float, rngs: nnx.Rngs):
        self.pre_norm = pre_norm
        self.norm = nnx.LayerNorm(d_model, epsilon=1e-6, rngs=rngs)
        self.dropout = Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, sublayer: Callable[[jax.Array], jax.Array]) -> jax.Array:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class SelfAttentionBlock(nnx.Module):
    """Self-attention then the FFN: an encoder layer, or a decoder-only LM layer whose keys may
    cover a Transformer-XL memory (`attention="memory"`)."""

    def __init__(self, cfg, *, attention: str = "self", use_bias: bool = True, rngs: nnx.Rngs):
        d = cfg.d_model
        self.attn = MultiHeadAttention(
            d,
            cfg.num_heads,
            kind=attention,
            dropout=cfg.attention_dropout,
            use_bias=use_bias,
            rngs=rngs,
        )
        self.ffn = FeedForward(d, cfg.d_ff, dropout=cfg.relu_dropout, rngs=rngs)
        self.attn_res, self.ffn_res = (
            Residual(d, pre_norm=cfg.pre_norm, dropout=cfg.dropout, rngs=rngs) for _ in range(2)
        )

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array,
        positional: BoundScheme,
        layer: int,
        memory: jax.Array | None = None,
    ) -> jax.Array:
        """x [B, L, d], memory [B, Lm, d] (this layer's inputs of earlier segments, or None),
        mask [B or 1, 1, L, Lm + L] -> [B, L, d]."""
        if memory is not None and self.attn_res.pre_norm:  # keys see normalised memory too
            memory = self.attn_res.norm(memory)
        attend = functools.partial(self.attn, positional=positional, layer=layer, memory=memory)
        x = self.attn_res(x, lambda h: attend(h, mask))
        return self.ffn_res(x, self.ffn)


class DecoderBlock(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.self_attn = MultiHeadAttention(
            d, cfg.num_heads, kind="self", dropout=cfg.attention_dropout, rngs=rngs
        )
        self.cross_attn = MultiHeadAttention(
            d, cfg.num_heads, kind="cross", dropout=cfg.attention_dropout, rngs=rngs
        )
        self.ffn = FeedForward(d, cfg.d_ff, dropout=cfg.relu_dropout, rngs=rngs)
        self.self_res, self.cross_res, self.ffn_res = (
            Residual(d, pre_norm=cfg.pre_norm, dropout=cfg.dropout, rngs=rngs) for _ in range(3)
        )

    def __call__(
        self,
        x: jax.Array,
        self_mask: jax.Array,
        cross_mask: jax.Array,
        positional: BoundScheme,
        layer: int,
        *,
        encoded: jax.Array | None = None,
        cross_kv: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """x [B, Lt, d], encoded [B, Ls, d] (or its precomputed cross_kv) -> [B, Lt, d]."""
        x = self.self_res(
            x, lambda h: self.self_attn(h, self_mask, positional=positional, layer=layer)
        )
        x = self.cross_res(
            x, lambda h: self.cross_attn(h, cross_mask, encoded=encoded, kv=cross_kv)
        )
        return self.ffn_res(x, self.ffn)

    def decode_step(self, x, cache, index, self_mask, cross_mask, cross_kv, positional, layer):
        """Incremental version of __call__ for x [B, 1, d]; returns (out, new self-attn cache)."""
        new_cache = {}

        def attend(h):
            out, new_cache["kv"] = self.self_attn.decode_step(
                h, cache, index, self_mask, positional, layer
            )
            return out

        x = self.self_res(x, attend)
        x = self.cross_res(x, lambda h: self.cross_attn(h, cross_mask, kv=cross_kv))
        return self.ffn_res(x, self.ffn), new_cache["kv"]
