"""Decoder-only language models: Transformer-XL (Dai et al., 2019) and its vanilla baseline.

`positional="relative"` gives Transformer-XL: relative attention over [memory ; segment], where
the memory of each layer holds that layer's input states from earlier segments (no gradient).
`positional="sinusoidal"` or `"learned"` gives the vanilla causal Transformer LM with absolute
positions and no memory, the baseline of the paper. Both use adaptive input embeddings and an
adaptive softmax (a plain embedding and softmax when there are no cutoffs).
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from xformer import masks
from xformer.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from xformer.blocks import EncoderBlock, XLBlock
from xformer.dropout import Dropout
from xformer.positional import POSITIONAL_SCHEMES, check_length
from xformer.relative_attention import RelativeBiases, relative_encoding

Memory = dict  # {"states": [num_layers, B, M, d], "filled": [B] int32 valid trailing slots}


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    num_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1  # embeddings, residual branches, R, and the final hidden state
    attention_dropout: float = 0.0
    relu_dropout: float = 0.1
    positional: str = "relative"  # "relative" (XL) or an absolute scheme (vanilla, no memory)
    max_len: int = 512  # learned absolute position table size
    pre_norm: bool = False
    clamp_len: int = 0  # relative distances beyond this share one encoding (0 = no clamping)
    same_length: bool = False  # every query attends to exactly mem_len keys
    untie_relative_biases: bool = False  # u, v per layer (TF scripts) or shared (PyTorch)
    d_embed: int = 0  # embedding size of the head cluster (0 = d_model)
    adaptive_cutoffs: tuple[int, ...] = ()
    div_val: int = 1
    tie_output: bool = True  # softmax cluster weights = embedding tables
    tie_projs: tuple[bool, ...] = ()  # per cluster: softmax projection = embedding projection

    @property
    def relative(self) -> bool:
        return self.positional == "relative"


class LanguageModel(nnx.Module):
    """tokens [B, L] -> next-token NLL [B, L], carrying a memory between segments (XL only)."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, d_embed = cfg.d_model, cfg.d_embed or cfg.d_model
        adaptive = (cfg.vocab_size, d_embed, d, cfg.adaptive_cutoffs, cfg.div_val)
        # Absolute positions are added to the embeddings at unit scale, so the embeddings
        # start at unit scale too (Vaswani et al.); XL keeps its N(0, 0.02) tables.
        init_std = 0.02 if cfg.relative else d_embed**-0.5
        self.embed = AdaptiveEmbedding(*adaptive, rngs=rngs, init_std=init_std)
        self.dropout = Dropout(cfg.dropout, rngs=rngs)
        if cfg.relative:
            heads = cfg.num_heads, d // cfg.num_heads
            self.biases = None if cfg.untie_relative_biases else RelativeBiases(*heads, rngs=rngs)
            self.layers = nnx.List([XLBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        else:
            self.positions = POSITIONAL_SCHEMES[cfg.positional](d, cfg.max_len, rngs=rngs)
            self.layers = nnx.List([EncoderBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = nnx.LayerNorm(d, epsilon=1e-6, rngs=rngs) if cfg.pre_norm else None
        self.softmax = AdaptiveLogSoftmax(
            *adaptive,
            tie_embedding=self.embed if cfg.tie_output else None,
            tie_projs=cfg.tie_projs or None,
            rngs=rngs,
        )

    def init_memory(self, batch_size: int, mem_len: int) -> Memory | None:
        """An empty memory of mem_len slots per layer (None when mem_len is 0)."""
        if not mem_len:
            return None
        if not self.cfg.relative:
            raise ValueError("only the relative (Transformer-XL) model can use a memory")
        shape = (self.cfg.num_layers, batch_size, mem_len, self.cfg.d_model)
        return {"states": jnp.zeros(shape), "filled": jnp.zeros((batch_size,), jnp.int32)}

    def hidden(
        self,
        tokens: jax.Array,
        memory: Memory | None = None,
        *,
        positions: jax.Array | None = None,
        key_valid: jax.Array | None = None,
    ) -> tuple[jax.Array, Memory | None]:
        """tokens [B, L] -> (final hidden states [B, L, d], updated memory).

        positions [B, L] (absolute models; default 0..L-1) and key_valid [B, L] (False marks
        left padding that no query may attend to) serve sliding-window evaluation.
        """
        x = self.embed(tokens)
        if self.cfg.relative:
            x, memory = self._relative_layers(self.dropout(x), memory)
        else:
            if memory is not None:
                raise ValueError("absolute-position models have no memory")
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            check_length(self.positions, tokens.shape[1])
            x = self.dropout(x + self.positions(positions))
            mask = masks.causal_mask(positions, positions)
            if key_valid is not None:
                mask &= key_valid[:, None, None, :]
            for layer in self.layers:
                x = layer(x, mask)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.dropout(x), memory

    def _relative_layers(self, x, memory):
        cfg, q_len = self.cfg, x.shape[1]
        mem_len = 0 if memory is None else memory["states"].shape[2]
        filled = 0 if memory is None else memory["filled"]
        mask = masks.memory_causal_mask(
            q_len, mem_len, filled, window=mem_len if cfg.same_length else 0
        )
        r = self.dropout(relative_encoding(mem_len + q_len, cfg.d_model, cfg.clamp_len))
        inputs = []
        for i, layer in enumerate(self.layers):
            inputs.append(x)
            x = layer(x, None if memory is None else memory["states"][i], r, mask, self.biases)
        if memory is not None:
            states = jnp.concatenate([memory["states"], jnp.stack(inputs)], axis=2)[:, :, -mem_len:]
            memory = {
                "states": jax.lax.stop_gradient(states),
                "filled": jnp.minimum(filled + q_len, mem_len),
            }
        return x, memory

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
