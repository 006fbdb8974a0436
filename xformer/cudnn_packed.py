"""cuDNN's packed-sequence mode for packed rows: `attention_impl="fused_packed"` on GPU.

jax.nn.dot_product_attention hands cuDNN a packed row's mask as a [B, 1, Lq, Lk] bias, which
every head reads and which cuDNN cannot use to skip tiles. cuDNN also takes packed rows as
per-segment lengths and offsets (jax's private `fused_attention_stablehlo` call; the public
one takes one length per row), with no bias at all. This module turns a
`masks.StructuredMask`'s segment ids into them, in M slots a row: its `max_segments`
(data.max_pairs_per_row), else the row length, a bound that holds for any batch but costs
memory: cuDNN keeps softmax statistics [B * M, H, Lq] in float32 (wmt14, M = 256: 201 MB a
call, against 0.8 MB for one row).

The offsets describe each segment as one run of positions, so the ids must be ascending
contiguous runs, 1..m then padding (0), as xformer's packer and padded batches write them; a
row may also start with padding. A query that sees no key gets zeros, where the reference gives
it the uniform average of the values. In xformer's batches those are the padding queries, whose
outputs nothing scores (every encoded sentence ends with EOS, so no example's side is empty);
the TPU splash kernel differs from the reference there too.
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp

from xformer import masks

PRIVATE_CALL = "jax._src.cudnn.fused_attention_stablehlo"


def unsupported(mask, bias: jax.Array | None) -> str | None:
    """Why packed mode cannot serve this call (None if it can)."""
    if not isinstance(mask, masks.StructuredMask) or mask.q_segments is None:
        return "the call has no packed rows (segment ids)"
    if bias is not None:
        return "the positional scheme adds a bias to the logits"
    if mask.window:
        return "a sliding window"
    if mask.max_segments == 1:  # jax then ignores the offsets (padding mode, -1 lengths)
        return "one pair a row (data.max_pairs_per_row=1): jax packs 2 segment slots or more"
    try:
        _private_call()
    except (ImportError, AttributeError) as error:
        return f"this jax has no packed cuDNN call ({error})"
    return None


def _private_call():
    """(jax's private cuDNN attention, its MaskType): imported only where it runs."""
    __import__(PRIVATE_CALL)
    module = sys.modules[PRIVATE_CALL]
    return module.dot_product_attention, module.MaskType


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SegmentRuns:
    """cuDNN's description of packed rows in M segment slots a row: q_lengths, k_lengths
    [B, M], q_offsets, k_offsets [B, M + 1] (-1 in the slots of segments absent from either
    side, and in the last column); q_covered [B, Lq] and k_covered [B, Lk]: positions inside
    a segment that cuDNN computes."""

    q_lengths: jax.Array
    k_lengths: jax.Array
    q_offsets: jax.Array
    k_offsets: jax.Array
    q_covered: jax.Array
    k_covered: jax.Array


def segment_runs(q_segments: jax.Array, k_segments: jax.Array, slots: int = 0) -> SegmentRuns:
    """Segment ids q_segments [B, Lq], k_segments [B, Lk] (ascending contiguous runs, 0 =
    padding; at most `slots` a row, 0: the longer length) -> SegmentRuns with M = slots.
    Segment j of the queries attends to segment j of the keys; a slot is used only where both
    sides have tokens, so that cuDNN never gets a query with no key (its backward is reported
    to return NaN for one: see attention._without_empty_rows)."""
    slots = slots or max(q_segments.shape[1], k_segments.shape[1])

    def runs(segments):  # lengths and first positions [B, M] of ids 1..M
        member = segments[:, None, :] == jnp.arange(1, slots + 1)[None, :, None]  # [B, M, L]
        return member.sum(-1, dtype=jnp.int32), jnp.argmax(member, -1).astype(jnp.int32)

    (q_len, q_start), (k_len, k_start) = runs(q_segments), runs(k_segments)
    used = (q_len > 0) & (k_len > 0)
    absent = jnp.full((used.shape[0], 1), -1, jnp.int32)

    def covered(segments):  # [B, L]: inside a used slot
        used_by_id = jnp.concatenate([jnp.zeros_like(absent, bool), used], axis=1)
        return jnp.take_along_axis(used_by_id, jnp.where(segments <= slots, segments, 0), axis=1)

    return SegmentRuns(
        q_lengths=jnp.where(used, q_len, -1),
        k_lengths=jnp.where(used, k_len, -1),
        q_offsets=jnp.concatenate([jnp.where(used, q_start, -1), absent], axis=1),
        k_offsets=jnp.concatenate([jnp.where(used, k_start, -1), absent], axis=1),
        q_covered=covered(q_segments),
        k_covered=covered(k_segments),
    )


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: masks.StructuredMask, scale: float
) -> jax.Array:
    """softmax(q k^T * scale, masked) v by cuDNN's packed mode: q [B, Lq, H, D], k and v
    [B, Lk, H, D] -> [B, Lq, H, D], zero for queries that see no key. Raises where cuDNN
    refuses the call (dtype, head size, a GPU before Hopper).

    cuDNN neither reads nor writes a position outside the computed segments. Its output there
    is set to zero (`_zero_outside`), and so are dq, dk and dv (`_gradient_inside`): whatever
    cuDNN leaves in that memory never reaches a result (a select, not a product, so not even
    a NaN). The two selects run one way each: the forward one is enough for the output, the
    backward ones for the gradients (wmt14 compiled for an H100: floor 18.94 ms, against
    19.30 ms for selects both ways)."""
    call, mask_type = _private_call()
    runs = segment_runs(mask.q_segments, mask.k_segments, mask.max_segments)
    out = call(
        _gradient_inside(q, runs.q_covered),
        _gradient_inside(k, runs.k_covered),
        _gradient_inside(v, runs.k_covered),
        None,
        None,
        runs.q_lengths,
        runs.k_lengths,
        runs.q_offsets,
        runs.k_offsets,
        scale=scale,
        mask_type=mask_type.PADDING_CAUSAL if mask.causal else mask_type.PADDING,
    )
    # Zeros, not the reference's uniform average, for rows nothing scores: its gradient would
    # cost a pass over dO in every call.
    return _zero_outside(out, runs.q_covered)


@jax.custom_vjp
def _gradient_inside(x: jax.Array, inside: jax.Array) -> jax.Array:
    """x [B, L, H, D] itself, with a gradient that is zero at positions not `inside` [B, L]."""
    return x


def _gradient_inside_forward(x, inside):
    return x, inside


def _gradient_inside_backward(inside, g):
    return _select_inside(g, inside), None


_gradient_inside.defvjp(_gradient_inside_forward, _gradient_inside_backward)


@jax.custom_vjp
def _zero_outside(x: jax.Array, inside: jax.Array) -> jax.Array:
    """x [B, L, H, D], zero at positions not `inside` [B, L]; the gradient passes unchanged
    (cuDNN's backward pass reads dO only inside the segments)."""
    return _select_inside(x, inside)


def _zero_outside_forward(x, inside):
    return _select_inside(x, inside), None


def _zero_outside_backward(_, g):
    return g, None


_zero_outside.defvjp(_zero_outside_forward, _zero_outside_backward)


def _select_inside(x: jax.Array, inside: jax.Array) -> jax.Array:
    """x [B, L, H, D] where `inside` [B, L], else 0 (a select: no NaN crosses it)."""
    return jnp.where(inside[:, :, None, None], x, 0)
