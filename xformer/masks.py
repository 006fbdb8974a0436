"""Attention masks, one builder for every model: [B or 1, 1, Lq, Lk] bool, True = may attend.

A masking scheme (selected by `model.encoder_mask` / `model.decoder_mask`) decides from query
and key positions (see layout.py) which pairs may attend; padding, packed-example boundaries
and empty memory slots are always ANDed in. A new scheme is one function plus one entry in
MASK_SCHEMES.
"""

import jax
import jax.numpy as jnp

from xformer.layout import Layout


def causal(layout: Layout, *, window: int, prefix_length: int) -> jax.Array:
    """A query sees keys at or before its position."""
    return layout.distances() >= 0


def bidirectional(layout: Layout, *, window: int, prefix_length: int) -> jax.Array:
    return jnp.ones((layout.q_len, layout.k_len), bool)


def sliding_window(layout: Layout, *, window: int, prefix_length: int) -> jax.Array:
    """Local attention: the `window` keys ending at the query (causal stacks), or the keys
    fewer than `window` positions away on either side (encoders)."""
    distance = layout.distances()
    if layout.causal:
        return (distance >= 0) & (distance < window)
    return jnp.abs(distance) < window


def prefix_lm(layout: Layout, *, window: int, prefix_length: int) -> jax.Array:
    """Causal, except that the first `prefix_length` positions also see each other."""
    in_prefix_q = layout.query_positions()[:, None] < prefix_length
    in_prefix_k = layout.key_positions()[None, :] < prefix_length
    return (layout.distances() >= 0) | (in_prefix_q & in_prefix_k)


def same_length(layout: Layout, *, window: int, prefix_length: int) -> jax.Array:
    """Transformer-XL's `same_length`: with keys [memory ; segment], every query sees exactly
    the memory length of keys ending at itself, whatever its place in the segment."""
    distance = layout.distances()
    return (distance >= 0) & (distance < layout.k_len - layout.q_len)


MASK_SCHEMES = {
    "causal": causal,
    "bidirectional": bidirectional,
    "sliding_window": sliding_window,
    "prefix_lm": prefix_lm,
    "same_length": same_length,
}


def attention_mask(
    kind: str,
    layout: Layout,
    *,
    window: int = 0,
    prefix_length: int = 0,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
    key_valid: jax.Array | None = None,
) -> jax.Array:
    """The scheme's mask AND same-example (segment ids [B, Lq], [B, Lk]; 0 = padding) AND
    valid keys ([B, Lk] bool) -> [B or 1, 1, Lq, Lk]."""
    mask = MASK_SCHEMES[kind](layout, window=window, prefix_length=prefix_length)[None, None]
    if q_segments is not None:
        mask = mask & segment_mask(q_segments, k_segments)
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :]
    return mask


def segment_mask(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
    """Packed rows: non-padding queries see non-padding keys of their own example (ids > 0).
    [B, Lq], [B, Lk] -> [B, 1, Lq, Lk]."""
    same = q_segments[:, None, :, None] == k_segments[:, None, None, :]
    return same & (q_segments > 0)[:, None, :, None] & (k_segments > 0)[:, None, None, :]


def memory_key_valid(mem_len: int, q_len: int, filled: jax.Array | int) -> jax.Array:
    """Keys [memory ; segment]: only the last `filled` memory slots hold states (a count per row
    [B] or a scalar) -> [B or 1, mem_len + q_len] bool."""
    keys = jnp.arange(mem_len + q_len)
    return keys[None, :] >= mem_len - jnp.reshape(jnp.asarray(filled), (-1, 1))


def segments_from_tokens(tokens: jax.Array, pad_id: int = 0) -> jax.Array:
    """Segment ids for an unpacked batch: 1 on tokens, 0 on padding. [B, L] -> [B, L] int32."""
    return (tokens != pad_id).astype(jnp.int32)


def positions_from_segments(segments: jax.Array) -> jax.Array:
    """Position of each token within its segment (restarting at every new segment). [B, L]."""
    idx = jnp.arange(segments.shape[-1])
    starts = jnp.concatenate(
        [jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=-1
    )
    last_start = jax.lax.cummax(jnp.where(starts, idx, 0), axis=segments.ndim - 1)
    return (idx - last_start).astype(jnp.int32)
