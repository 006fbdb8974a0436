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
from xformer.remat import apply_layer

Memory = dict  # {"states": [num_layers, B, M, d], "filled": [B] int32 valid trailing slots}
MEMORY_BATCH_AXES = {"states": 1, "filled": 0}  # each memory entry's batch (row) axis
DecodeCache = dict  # see LanguageModel.init_cache


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

    @property
    def causal(self) -> bool:
        """False where the mask lets a query see later keys (prefix_lm): see Layout.causal."""
        return not masks.MASK_SCHEMES[self.cfg.decoder_mask].sees_later_keys

    def init_memory(self, batch_size: int, mem_len: int) -> Memory | None:
        """An empty memory of mem_len slots per layer (None when mem_len is 0)."""
        return empty_memory(self.cfg, batch_size, mem_len)

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
        the segment's keys no query may attend to, such as left padding) serves sliding-window
        evaluation.
        """
        q_len = tokens.shape[1]
        mem_len = 0 if memory is None else memory["states"].shape[2]
        if self.cfg.absolute:  # (init_memory refuses a memory for these schemes)
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(q_len), tokens.shape)
            self.positional.check_length(q_len)
        x = self._embed(tokens, positions)
        layout = Layout.with_memory(q_len, mem_len, self.causal)
        if memory is not None:
            filled_keys = masks.memory_key_valid(mem_len, q_len, memory["filled"])
            if key_valid is not None:  # the segment's keys; the memory's are by `filled`
                key_valid = jnp.pad(key_valid, ((0, 0), (mem_len, 0)), constant_values=True)
            key_valid = filled_keys if key_valid is None else key_valid & filled_keys
        mask = self._mask(layout, key_valid, structured=True)
        positional = BoundScheme.bind(self.positional, layout)
        inputs = []
        for i, layer in enumerate(self.layers):
            inputs.append(x)
            states = None if memory is None else memory["states"][i]
            x = apply_layer(
                layer, lambda m, x, i=i, s=states: m(x, mask, positional, i, s), x, self.cfg.remat
            )
        if memory is not None:
            memory = _remember(memory, jnp.stack(inputs))
        return self._output(x), memory

    def _embed(self, tokens: jax.Array, positions: jax.Array | None) -> jax.Array:
        """tokens [B, L] (at positions [B, L], for absolute schemes) -> inputs [B, L, d]."""
        x = self.embed(tokens)
        if self.cfg.absolute:
            x = x + self.positional.embed(positions).astype(x.dtype)
        return self.dropout(x)

    def _mask(
        self, layout: Layout, key_valid: jax.Array | None, structured: bool = False
    ) -> masks.Mask:
        cfg = self.cfg
        return masks.attention_mask(
            cfg.decoder_mask,
            layout,
            window=cfg.attention_window,
            prefix_length=cfg.prefix_length,
            key_valid=key_valid,
            structured=structured,
        )

    def _output(self, x: jax.Array) -> jax.Array:
        """Last layer's states [B, L, d] -> the final hidden states the softmax reads."""
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.dropout(x)

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

    # Incremental decoding ---------------------------------------------------------------------
    #
    # The sequence is cut into segments of S tokens from its start, as evaluation cuts a
    # stream; every layer's keys and values of [memory ; segment so far] are cached, and a full
    # segment moves into the memory (as `hidden` moves it) when the next token arrives. Each
    # position thus gets exactly the hidden state that `hidden` gives it, segment by segment,
    # without running its context again. Without a memory the segment holds the whole sequence.

    def init_cache(self, batch_size: int, mem_len: int, segment_length: int) -> DecodeCache:
        """An empty decoding cache for segments of S = segment_length tokens over a memory of
        M = mem_len states per layer (0: none).

        "kv": per layer the key/value cache of M + S slots (MultiHeadAttention.init_cache): the
        keys (rotated, for rotary schemes) and values of [memory ; segment]; "memory": a Memory
        (or None); "inputs" [num_layers, B, S, d]: the segment's layer inputs, its next memory
        (or None); "offset": int32 scalar, the segment's tokens so far; "positional": what the
        scheme reuses at every step.
        """
        cfg = self.cfg
        memory = self.init_memory(batch_size, mem_len)
        if cfg.absolute:
            self.positional.check_length(segment_length)
        slots = mem_len + segment_length
        inputs_shape = (cfg.num_layers, batch_size, segment_length, cfg.d_model)
        return {
            "kv": [layer.attn.init_cache(batch_size, slots, cfg.dtype) for layer in self.layers],
            "memory": memory,
            "inputs": None if memory is None else jnp.zeros(inputs_shape, cfg.dtype),
            "offset": jnp.zeros((), jnp.int32),
            "positional": self.positional.prepare_cached(
                Layout.with_memory(segment_length, mem_len, self.causal)
            ),
        }

    def prefill(
        self, context: jax.Array, mem_len: int, segment_length: int
    ) -> tuple[jax.Array, DecodeCache]:
        """context [B, C] -> (log-probabilities of the token after it [B, V], the cache).

        The segments before the last (partial or full) one go through `hidden` with the
        memory, as in evaluation; the last one's keys and values are cached in one `extend`.
        Without a memory the whole context must fit one segment (C <= segment_length).
        """
        batch_size, context_len = context.shape
        done = (context_len - 1) // segment_length * segment_length if mem_len else 0
        if context_len - done > segment_length:
            raise ValueError(f"a context of {context_len} tokens exceeds {segment_length=}")
        cache = self.init_cache(batch_size, mem_len, segment_length)
        if done:
            segments = context[:, :done].reshape(batch_size, -1, segment_length).swapaxes(0, 1)
            memory, _ = jax.lax.scan(
                lambda memory, tokens: (self.hidden(tokens, memory)[1], None),
                cache["memory"],
                segments,
            )
            cache = self._start_segment({**cache, "memory": memory})
        hidden, cache = self.extend(context[:, done:], cache)
        return self.softmax.log_probs(hidden[:, -1]), cache

    def decode_step(self, tokens: jax.Array, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
        """tokens [B], the next token of every row -> (log-probabilities of the token after it
        [B, V], the cache). A full segment first moves into the memory."""
        if cache["memory"] is not None:
            full = cache["offset"] == cache["inputs"].shape[2]
            cache = jax.lax.cond(full, self._next_segment, lambda cache: cache, cache)
        hidden, cache = self.extend(tokens[:, None], cache)
        return self.softmax.log_probs(hidden[:, 0]), cache

    def extend(self, tokens: jax.Array, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
        """tokens [B, n] at the next n places of the current segment (n <= its free places) ->
        (their final hidden states [B, n, d], the cache with their keys and values).

        The mask and positions are rows offset..offset+n-1 of those `hidden` uses for the
        whole segment.
        """
        memory, offset, n = cache["memory"], cache["offset"], tokens.shape[1]
        mem_len = 0 if memory is None else memory["states"].shape[2]
        segment_length = self.layers[0].attn.cache_slots(cache["kv"][0]) - mem_len
        x = self._embed(tokens, jnp.broadcast_to(offset + jnp.arange(n), tokens.shape))
        key_valid = None
        if memory is not None:
            key_valid = masks.memory_key_valid(mem_len, segment_length, memory["filled"])
        segment = Layout.with_memory(segment_length, mem_len, self.causal)
        mask = jax.lax.dynamic_slice_in_dim(self._mask(segment, key_valid), offset, n, axis=2)
        step = Layout(n, mem_len + segment_length, q_start=mem_len + offset, causal=self.causal)
        positional = BoundScheme.bind_step(self.positional, cache["positional"], step)
        kv, inputs = [], []
        for i, (layer, layer_kv) in enumerate(zip(self.layers, cache["kv"], strict=True)):
            inputs.append(x)
            x, layer_kv = layer.decode_step(x, layer_kv, mem_len + offset, mask, positional, i)
            kv.append(layer_kv)
        cache = {**cache, "kv": kv, "offset": offset + n}
        if memory is not None:
            inputs = jnp.stack(inputs).astype(cache["inputs"].dtype)
            cache["inputs"] = jax.lax.dynamic_update_slice_in_dim(
                cache["inputs"], inputs, offset, axis=2
            )
        return self._output(x), cache

    def _next_segment(self, cache: DecodeCache) -> DecodeCache:
        """The full segment's layer inputs join the memory; a new segment starts."""
        return self._start_segment({**cache, "memory": _remember(cache["memory"], cache["inputs"])})

    def _start_segment(self, cache: DecodeCache) -> DecodeCache:
        """The memory's keys and values into cache slots 0..M-1; an empty segment."""
        kv = []
        for layer, layer_kv, states in zip(
            self.layers, cache["kv"], cache["memory"]["states"], strict=True
        ):
            memory_kv = layer.memory_kv(states, self.positional)
            kv.append(layer.attn.write_cache(layer_kv, memory_kv["k"], memory_kv["v"], 0))
        return {**cache, "kv": kv, "offset": jnp.zeros((), jnp.int32)}


def empty_memory(cfg: LMConfig, batch_size: int, mem_len: int) -> Memory | None:
    """An empty memory of mem_len slots per layer for models of `cfg` (None when mem_len is 0):
    states [num_layers, batch_size, mem_len, d_model] in the model's dtype, filled [batch_size]."""
    if not mem_len:
        return None
    SCHEMES[cfg.positional].check_memory(mem_len)
    shape = (cfg.num_layers, batch_size, mem_len, cfg.d_model)
    return {"states": jnp.zeros(shape, cfg.dtype), "filled": jnp.zeros((batch_size,), jnp.int32)}


def _remember(memory: Memory, inputs: jax.Array) -> Memory:
    """The memory after a segment whose layer inputs are `inputs` [num_layers, B, L, d]: the
    last mem_len states of [memory ; inputs] (no gradient)."""
    mem_len = memory["states"].shape[2]
    states = jnp.concatenate([memory["states"], inputs], axis=2)[:, :, -mem_len:]
    states = states.astype(memory["states"].dtype)  # stored in the model's dtype
    return {
        "states": jax.lax.stop_gradient(states),
        "filled": jnp.minimum(memory["filled"] + inputs.shape[2], mem_len),
    }


def reset_memory(memory: Memory | None, reset: jax.Array) -> Memory | None:
    """Empty the memory of rows whose stream restarts (reset [B] bool)."""
    if memory is None:
        return None
    return {**memory, "filled": jnp.where(reset, 0, memory["filled"])}
