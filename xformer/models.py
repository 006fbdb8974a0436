"""The encoder-decoder Transformer of Vaswani et al. (2017), in Flax NNX."""

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from xformer import masks, precision
from xformer.attention import decode_layout
from xformer.blocks import DecoderBlock, SelfAttentionBlock, layer_norm
from xformer.dropout import Dropout
from xformer.embedding import Embed
from xformer.layout import Layout
from xformer.linear import Linear, over_rows
from xformer.model_config import TransformerConfig
from xformer.positional import SCHEMES
from xformer.positional.base import BoundScheme
from xformer.remat import apply_layer
from xformer.sharding import logical


class EncoderDecoder(nnx.Module):
    """Token ids in, next-token logits out; `init_decode_cache`/`decode_step` for search."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        if cfg.share_embeddings and cfg.src_vocab_size != cfg.tgt_vocab_size:
            raise ValueError("share_embeddings needs equal source and target vocabulary sizes")
        init = logical(nnx.initializers.normal(d**-0.5), "vocab", "embed")  # unit scale after
        # the sqrt(d) multiplier
        embed = dict(embedding_init=init, **cfg.dtypes, rngs=rngs)
        self.src_embed = Embed(cfg.src_vocab_size, d, **embed)
        self.tgt_embed = (
            self.src_embed if cfg.share_embeddings else Embed(cfg.tgt_vocab_size, d, **embed)
        )
        scheme = SCHEMES[cfg.positional]
        self.src_positional = scheme(cfg, cfg.num_encoder_layers, rngs=rngs)
        self.tgt_positional = scheme(cfg, cfg.num_decoder_layers, rngs=rngs)
        self.embed_dropout = Dropout(cfg.dropout, rngs=rngs)
        self.encoder = nnx.List(
            [SelfAttentionBlock(cfg, rngs=rngs) for _ in range(cfg.num_encoder_layers)]
        )
        self.decoder = nnx.List(
            [DecoderBlock(cfg, rngs=rngs) for _ in range(cfg.num_decoder_layers)]
        )
        # Pre-LN stacks need a final norm; post-LN outputs are already normalised.
        norm = functools.partial(layer_norm, d, **cfg.dtypes, rngs=rngs)
        self.encoder_norm = norm() if cfg.pre_norm else None
        self.decoder_norm = norm() if cfg.pre_norm else None
        self.output = (
            None
            if cfg.tie_output
            else Linear(
                d,
                cfg.tgt_vocab_size,
                axes=("embed", "vocab"),
                use_bias=False,
                kernel_init=cfg.kernel_init,
                **cfg.dtypes,
                rngs=rngs,
            )
        )

    def _embed(self, table, scheme, tokens, positions):
        scheme.check_length(tokens.shape[1])
        x = table(tokens) * math.sqrt(self.cfg.d_model)
        encoding = scheme.embed(positions)
        return self.embed_dropout(x if encoding is None else x + encoding.astype(x.dtype))

    def _self_mask(self, kind: str, layout: Layout, segments: jax.Array) -> masks.Mask:
        return masks.attention_mask(
            kind,
            layout,
            window=self.cfg.attention_window,
            q_segments=segments,
            k_segments=segments,
            structured=True,
            max_segments=self.cfg.max_segments,
        )

    def _logits(self, x: jax.Array) -> jax.Array:
        """Final states [B, L, d] -> logits [B, L, V] in the model's dtype: the loss and the
        decoding's log-softmax upcast them to at least float32 themselves."""
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return self.output(x) if self.output is not None else over_rows(self.tgt_embed.attend, x)

    def encode(
        self, src: jax.Array, src_segments: jax.Array, src_positions: jax.Array
    ) -> jax.Array:
        """src, src_segments, src_positions [B, Ls] -> encoded states [B, Ls, d]."""
        x = self._embed(self.src_embed, self.src_positional, src, src_positions)
        layout = Layout(src.shape[1], src.shape[1], causal=False)
        mask = self._self_mask(self.cfg.encoder_mask, layout, src_segments)
        positional = BoundScheme.bind(self.src_positional, layout)
        for i, layer in enumerate(self.encoder):
            x = apply_layer(layer, lambda m, x, i=i: m(x, mask, positional, i), x, self.cfg.remat)
        return x if self.encoder_norm is None else self.encoder_norm(x)

    def __call__(
        self,
        src: jax.Array,
        tgt_in: jax.Array,
        src_segments: jax.Array | None = None,
        tgt_segments: jax.Array | None = None,
        src_positions: jax.Array | None = None,
        tgt_positions: jax.Array | None = None,
    ) -> jax.Array:
        """Teacher-forced logits [B, Lt, V] (model.dtype; `losses.cross_entropy` upcasts them)
        for src [B, Ls] and shifted targets tgt_in [B, Lt].

        Segment ids (0 = padding) and positions describe packed rows; they default to one
        example per row with padding id 0.
        """
        if src_segments is None:
            src_segments = masks.segments_from_tokens(src)
        if tgt_segments is None:
            tgt_segments = masks.segments_from_tokens(tgt_in)
        if src_positions is None:
            src_positions = masks.positions_from_segments(src_segments)
        if tgt_positions is None:
            tgt_positions = masks.positions_from_segments(tgt_segments)
        encoded = self.encode(src, src_segments, src_positions)
        x = self._embed(self.tgt_embed, self.tgt_positional, tgt_in, tgt_positions)
        layout = Layout(tgt_in.shape[1], tgt_in.shape[1])
        self_mask = self._self_mask(self.cfg.decoder_mask, layout, tgt_segments)
        cross_mask = masks.cross_mask(tgt_segments, src_segments, self.cfg.max_segments)
        positional = BoundScheme.bind(self.tgt_positional, layout)
        for i, layer in enumerate(self.decoder):
            x = apply_layer(
                layer,
                lambda m, x, i=i: m(x, self_mask, cross_mask, positional, i, encoded=encoded),
                x,
                self.cfg.remat,
            )
        return self._logits(x)

    # Incremental decoding ---------------------------------------------------------------------

    def init_decode_cache(self, src: jax.Array, max_len: int) -> dict:
        """Encode src [B, Ls] once and allocate the self-attention cache for max_len steps.

        Returns a pytree whose leaves all have leading dim B (so search can reorder beams):
        "self": per layer {"k", "v"} [B, H, max_len, D] (MultiHeadAttention.init_cache);
        "cross": per layer {"k", "v"} [B, H, Ls, D] (MultiHeadAttention.init_cross_cache);
        "src_valid" [B, Ls].
        """
        self.tgt_positional.check_length(max_len)
        segments = masks.segments_from_tokens(src)
        encoded = self.encode(src, segments, masks.positions_from_segments(segments))
        b = src.shape[0]
        return {
            "self": [
                layer.self_attn.init_cache(b, max_len, encoded.dtype) for layer in self.decoder
            ],
            "cross": [layer.cross_attn.init_cross_cache(encoded) for layer in self.decoder],
            "src_valid": segments > 0,
        }

    def grow_decode_cache(self, cache: dict, max_len: int) -> dict:
        """`init_decode_cache`'s cache (leaves [B or B * beam, ...]) with its self-attention
        caches enlarged to max_len slots; the other leaves are returned as they are."""
        self.tgt_positional.check_length(max_len)
        grow = self.decoder[0].self_attn.grow_cache
        return {**cache, "self": [grow(kv, max_len) for kv in cache["self"]]}

    def decode_step(
        self, tokens: jax.Array, cache: dict, index: jax.Array
    ) -> tuple[jax.Array, dict]:
        """tokens [B] at position `index` -> (log-probs [B, V] of the next token, new cache)."""
        b = tokens.shape[0]
        max_len = self.decoder[0].self_attn.cache_slots(cache["self"][0])
        positions = jnp.full((b, 1), index, jnp.int32)
        x = self._embed(self.tgt_embed, self.tgt_positional, tokens[:, None], positions)
        layout = decode_layout(index, max_len)
        self_mask = masks.attention_mask(
            self.cfg.decoder_mask, layout, window=self.cfg.attention_window
        )
        cross_mask = cache["src_valid"][:, None, None, :]
        positional = BoundScheme.bind(self.tgt_positional, layout)
        new_self = []
        for i, (layer, kv) in enumerate(zip(self.decoder, cache["self"], strict=True)):
            x, kv = layer.decode_step(
                x, kv, index, self_mask, cross_mask, cache["cross"][i], positional, i
            )
            new_self.append(kv)
        logits = self._logits(x)[:, 0]
        log_probs = jax.nn.log_softmax(logits.astype(precision.at_least_float32(logits.dtype)))
        return log_probs, {**cache, "self": new_self}
