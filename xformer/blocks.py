"""Transformer blocks: position-wise FFN, residual wrapper (pre- or post-LN), self-attention
layers (encoder, decoder-only LM, Transformer-XL) and encoder-decoder layers."""

import functools
from collections.abc import Callable

import jax
from flax import nnx

from xformer import activations, masks
from xformer.attention import MultiHeadAttention
from xformer.dropout import Dropout
from xformer.layer_norm import LayerNorm
from xformer.linear import Linear
from xformer.positional.base import BoundScheme, PositionalScheme
from xformer.sharding import logical


def layer_norm(d_model: int, *, rngs: nnx.Rngs, **dtypes) -> LayerNorm:
    """LayerNorm over the last axis (statistics in at least float32, whatever the dtype)."""
    return LayerNorm(
        d_model,
        epsilon=1e-6,
        scale_init=logical(nnx.initializers.ones_init(), "embed"),
        bias_init=logical(nnx.initializers.zeros_init(), "embed"),
        **dtypes,
        rngs=rngs,
    )


def attention(cfg, kind: str, *, use_bias: bool = True, rngs: nnx.Rngs) -> MultiHeadAttention:
    """A MultiHeadAttention of kind "self", "memory" or "cross" with cfg's sizes and precision."""
    return MultiHeadAttention(
        cfg.d_model,
        cfg.num_heads,
        kind=kind,
        dropout=cfg.attention_dropout,
        use_bias=use_bias,
        implementation=cfg.attention_impl,
        split_heads=cfg.split_heads,
        kernel_init=cfg.kernel_init,
        **cfg.dtypes,
        rngs=rngs,
    )


def feed_forward(cfg, *, rngs: nnx.Rngs) -> "FeedForward":
    return FeedForward(
        cfg.d_model,
        cfg.d_ff,
        dropout=cfg.relu_dropout,
        kernel_init=cfg.kernel_init,
        **cfg.dtypes,
        rngs=rngs,
    )


def residuals(cfg, n: int, *, rngs: nnx.Rngs) -> tuple["Residual", ...]:
    """n residual wrappers of cfg's width, norm placement, dropout and precision."""
    return tuple(
        Residual(cfg.d_model, pre_norm=cfg.pre_norm, dropout=cfg.dropout, **cfg.dtypes, rngs=rngs)
        for _ in range(n)
    )


class FeedForward(nnx.Module):
    """Linear(d, d_ff) -> ReLU -> dropout -> Linear(d_ff, d)."""

    def __init__(self, d_model: int, d_ff: int, *, dropout: float, rngs: nnx.Rngs, **dense):
        """dense: Linear's keyword arguments (dtype, param_dtype, kernel_init)."""
        self.up = Linear(d_model, d_ff, axes=("embed", "mlp"), **dense, rngs=rngs)
        self.down = Linear(d_ff, d_model, axes=("mlp", "embed"), **dense, rngs=rngs)
        self.dropout = Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.dropout(activations.relu(self.up(x))))


class Residual(nnx.Module):
    """x + dropout(f(x)) with LayerNorm before f (pre-LN) or after the sum (post-LN, the paper)."""

    def __init__(self, d_model: int, *, pre_norm: bool, dropout: float, rngs: nnx.Rngs, **dtypes):
        self.pre_norm = pre_norm
        self.norm = layer_norm(d_model, rngs=rngs, **dtypes)
        self.dropout = Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array, sublayer: Callable[[jax.Array], jax.Array]) -> jax.Array:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


class SelfAttentionBlock(nnx.Module):
    """Self-attention then the FFN: an encoder layer, or a decoder-only LM layer whose keys may
    cover a Transformer-XL memory (`kind="memory"`)."""

    def __init__(self, cfg, *, kind: str = "self", use_bias: bool = True, rngs: nnx.Rngs):
        self.attn = attention(cfg, kind, use_bias=use_bias, rngs=rngs)
        self.ffn = feed_forward(cfg, rngs=rngs)
        self.attn_res, self.ffn_res = residuals(cfg, 2, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        mask: masks.Mask,
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

    def decode_step(
        self,
        x: jax.Array,
        cache: dict,
        index: jax.Array,
        mask: jax.Array,
        positional: BoundScheme,
        layer: int,
    ) -> tuple[jax.Array, dict]:
        """Incremental __call__: x [B, n, d] at cache slots index..index+n-1, attending over the
        K cached keys and values (MultiHeadAttention.init_cache) with mask [B or 1, 1, n, K];
        returns (out [B, n, d], the cache with this step's keys and values written)."""
        new_cache = {}

        def attend(h):
            out, new_cache["kv"] = self.attn.decode_step(h, cache, index, mask, positional, layer)
            return out

        x = self.attn_res(x, attend)
        return self.ffn_res(x, self.ffn), new_cache["kv"]

    def memory_kv(self, memory: jax.Array, scheme: PositionalScheme) -> dict:
        """Keys and values {"k", "v"} [B, M, H, D] of this layer's memory states [B, M, d] at
        positions 0..M-1, as __call__ computes them for the memory part of its keys."""
        if self.attn_res.pre_norm:
            memory = self.attn_res.norm(memory)
        k, v = self.attn.project_kv(memory)
        return {"k": scheme.rotate(k, 0), "v": v}


class DecoderBlock(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.self_attn = attention(cfg, "self", rngs=rngs)
        self.cross_attn = attention(cfg, "cross", rngs=rngs)
        self.ffn = feed_forward(cfg, rngs=rngs)
        self.self_res, self.cross_res, self.ffn_res = residuals(cfg, 3, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        self_mask: masks.Mask,
        cross_mask: masks.Mask,
        positional: BoundScheme,
        layer: int,
        *,
        encoded: jax.Array,
    ) -> jax.Array:
        """x [B, Lt, d], encoded [B, Ls, d] -> [B, Lt, d]."""
        x = self.self_res(
            x, lambda h: self.self_attn(h, self_mask, positional=positional, layer=layer)
        )
        x = self.cross_res(x, lambda h: self.cross_attn(h, cross_mask, encoded=encoded))
        return self.ffn_res(x, self.ffn)

    def decode_step(self, x, cache, index, self_mask, cross_mask, cross_cache, positional, layer):
        """Incremental version of __call__ for x [B, 1, d], with the self-attention cache and
        the cross-attention's (`init_cross_cache`); returns (out, new self-attention cache)."""
        cross_kv = self.cross_attn.cached_kv(cross_cache)
        new_cache = {}

        def attend(h):
            out, new_cache["kv"] = self.self_attn.decode_step(
                h, cache, index, self_mask, positional, layer
            )
            return out

        x = self.self_res(x, attend)
        x = self.cross_res(x, lambda h: self.cross_attn(h, cross_mask, kv=cross_kv))
        return self.ffn_res(x, self.ffn), new_cache["kv"]
