"""Decoder-only language models: Transformer-XL (Dai et al., 2019) and the vanilla baseline.

One model, two axes chosen by config. `positional` is any scheme of positional.SCHEMES
("relative" is Transformer-XL's). A memory (mem_len > 0) makes every layer attend over
[memory ; segment], the memory holding that layer's input states from earlier segments (no
gradient); it needs a scheme that does not add absolute positions to the embeddings. With
absolute positions and no memory this is the vanilla causal Transformer LM the paper compares
against. Inputs go through adaptive embeddings and an adaptive softmax (a plain embedding and
softmax when there are no cutoffs).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from xformer import masks
from xformer.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax, ClusterLayout
from xformer.blocks import SelfAttentionBlock, layer_norm
from xformer.dropout import Dropout
from xformer.layout import Layout
from xformer.model_config import LMConfig
from xformer.positional import SCHEMES
from xformer.positional.base import BoundScheme

Memory = dict  # {"states": [num_layers, B, M, d], "filled": [B] int32 valid trailing slots}
MEMORY_BATCH_AXES = {"states": 1, "filled": 0}  # each memory entry's batch (row) axis


class LanguageModel(nnx.Module):
    """tokens [B, L] -> next-token NLL [B, L], carrying a memory between segments if given."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, d_embed = cfg.d_model, cfg.d_embed or cfg.d_model
        clusters = ClusterLayout.make(cfg.vocab_size, d_embed, d, cfg.adaptive_cutoffs, cfg.div_val)
        # Absolute positions are added to the embeddings at unit scale, so the embeddings
        # start at unit scale too (Vaswani et al.); otherwise N(0, 0.02) tables as in XL.
        init_std = d_embed**-0.5 if cfg.absolute else 0.02
        self.embed = AdaptiveEmbedding(clusters, rngs=rngs, init_std=init_std, **cfg.dtypes)
        self.dropout = Dropout(cfg.dropout, rngs=rngs)
        self.positional = SCHEMES[cfg.positional](cfg, cfg.num_layers, rngs=rngs)
        self.layers = nnx.List(
            [
                SelfAttentionBlock(cfg, kind="memory", use_bias=False, rngs=rngs)
                for _ in range(cfg.num_layers)
            ]
        )
        self.final_norm = layer_norm(d, **cfg.dtypes, rngs=rngs) if cfg.pre_norm else None
        self.softmax = AdaptiveLogSoftmax(
            clusters,
            tie_embedding=self.embed if cfg.tie_output else None,
            tie_projs=cfg.tie_projs or None,
            capacity=cfg.adaptive_capacity,
            rngs=rngs,
            **cfg.dtypes,
        )

    def init_memory(self, batch_size: int, mem_len: int) -> Memory | None:
        """An empty memory of mem_len slots per layer (None when mem_len is 0)."""
        if not mem_len:
            return None
        SCHEMES[self.cfg.positional].check_memory(mem_len)
        shape = (self.cfg.num_layers, batch_size, mem_len, self.cfg.d_model)
        states = jnp.zeros(shape, self.cfg.dtype)  # stored in the model's dtype
        return {"states": states, "filled": jnp.zeros((batch_size,), jnp.int32)}

    def hidden(
        self,
        tokens: jax.Array,
        memory: Memory | None = None,
        *,
        positions: jax.Array | None = None,
        key_valid: jax.Array | None = None,
    ) -> tuple[jax.Array, Memory | None]:
        """tokens [B, L] -> (final hidden states [B, L, d], updated memory).

        positions [B, L] feed absolute schemes (default 0..L-1); key_valid [B, L] (False marks
        left padding no query may attend to) serves sliding-window evaluation.
        """
        cfg, q_len = self.cfg, tokens.shape[1]
        mem_len = 0 if memory is None else memory["states"].shape[2]
        x = self.embed(tokens)
        if cfg.absolute:  # (init_memory refuses a memory for these schemes)
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(q_len), tokens.shape)
            self.positional.check_length(q_len)
            x = x + self.positional.embed(positions).astype(x.dtype)
        x = self.dropout(x)
        layout = Layout.with_memory(q_len, mem_len)
        if memory is not None:
            filled_keys = masks.memory_key_valid(mem_len, q_len, memory["filled"])
            key_valid = filled_keys if key_valid is None else key_valid & filled_keys
        mask = masks.attention_mask(
            cfg.decoder_mask,
            layout,
            window=cfg.attention_window,
            prefix_length=cfg.prefix_length,
            key_valid=key_valid,
        )
        positional = BoundScheme.bind(self.positional, layout)
        inputs = []
        for i, layer in enumerate(self.layers):
            inputs.append(x)
            x = layer(x, mask, positional, i, None if memory is None else memory["states"][i])
        if memory is not None:
            states = jnp.concatenate([memory["states"], jnp.stack(inputs)], axis=2)[:, :, -mem_len:]
            states = states.astype(memory["states"].dtype)  # stored in the model's dtype
            memory = {
                "states": jax.lax.stop_gradient(states),
                "filled": jnp.minimum(memory["filled"] + q_len, mem_len),
            }
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.dropout(x), memory

    def __call__(
        self, tokens: jax.Array, targets: jax.Array, memory: Memory | None = None, **kwargs
    ) -> tuple[jax.Array, Memory | None]:
        """tokens, targets [B, L] -> (NLL of each target in nats [B, L], updated memory)."""
        hidden, memory = self.hidden(tokens, memory, **kwargs)
        return self.softmax.nll(hidden, targets), memory

    def log_probs(self, tokens: jax.Array, memory: Memory | None = None, **kwargs) -> jax.Array:
        """Full next-token log-probabilities [B, L, V] (for small vocabularies and tests)."""
        hidden, _ = self.hidden(tokens, memory, **kwargs)
        return self.softmax.log_probs(hidden)


def reset_memory(memory: Memory | None, reset: jax.Array) -> Memory | None:
    """Empty the memory of rows whose stream restarts (reset [B] bool)."""
    if memory is None:
        return None
    return {**memory, "filled": jnp.where(reset, 0, memory["filled"])}
