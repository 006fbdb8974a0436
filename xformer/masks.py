"""Boolean attention masks, shaped [batch, 1, q_len, k_len]; True means "may attend".

Every mask is built from per-token metadata (validity, segment ids, positions) so that
padding, causality and packed-example boundaries compose with a plain logical AND.
"""

import jax
import jax.numpy as jnp


def padding_mask(q_valid: jax.Array, k_valid: jax.Array) -> jax.Array:
    """q_valid [B, Lq], k_valid [B, Lk] (bool) -> [B, 1, Lq, Lk]."""
    return q_valid[:, None, :, None] & k_valid[:, None, None, :]


def segment_mask(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
    """Packed examples: a query sees only keys of its own segment. [B, Lq], [B, Lk] -> mask."""
    return q_segments[:, None, :, None] == k_segments[:, None, None, :]


def causal_mask(q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """A query at position i sees keys at positions <= i. [B, Lq], [B, Lk] -> mask."""
    return q_positions[:, None, :, None] >= k_positions[:, None, None, :]


def packed_mask(
    q_segments: jax.Array,
    k_segments: jax.Array,
    *,
    causal: bool = False,
    q_positions: jax.Array | None = None,
    k_positions: jax.Array | None = None,
) -> jax.Array:
    """Padding (segment id 0) AND same-segment AND, optionally, causal ordering.

    Unpacked batches are the special case segment id = 1 for tokens, 0 for padding.
    """
    mask = padding_mask(q_segments > 0, k_segments > 0) & segment_mask(q_segments, k_segments)
    if causal:
        if q_positions is None or k_positions is None:
            raise ValueError("causal masks need q_positions and k_positions")
        mask &= causal_mask(q_positions, k_positions)
    return mask


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


def memory_causal_mask(
    q_len: int, mem_len: int, mem_valid: jax.Array | int, *, window: int = 0
) -> jax.Array:
    """Causal mask of a segment over [memory ; segment] keys: [B or 1, 1, Lq, Lm + Lq].

    Query i sits at key index Lm + i. It sees key j when the distance Lm + i - j is >= 0, the
    key is not an empty memory slot (only the last `mem_valid` of the Lm slots hold states;
    a scalar or one count per row [B]), and, with window > 0, the distance is < window
    (Transformer-XL's `same_length`: every query sees the same number of keys).
    """
    keys = jnp.arange(mem_len + q_len)
    distance = (mem_len + jnp.arange(q_len))[:, None] - keys[None, :]  # [Lq, Lk]
    mask = distance >= 0
    if window > 0:
        mask &= distance < window
    filled = keys >= mem_len - jnp.reshape(jnp.asarray(mem_valid), (-1, 1))  # [B or 1, Lk]
    return mask[None, None] & filled[:, None, None, :]
