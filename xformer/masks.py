"""Masking schemes and the one mask builder: [B or 1, 1, Lq, Lk] bool, True = may attend.

A masking scheme (selected by `model.encoder_mask` / `model.decoder_mask`) is one `MaskScheme`
object that owns everything about it: which keys a query sees (from the index positions of
layout.py), which stacks may use it, the model key that sizes it, whether it needs or forbids
an XL memory, which targets it leaves out of the loss and how evaluation windows must be laid
out. Padding, packed-example boundaries and empty memory slots are always ANDed in by
`attention_mask`. A new scheme is one `MaskScheme` (a subclass where it needs more than the
defaults) plus one entry in MASK_SCHEMES.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from xformer.layout import Layout

ENCODER, DECODER, LM = "encoder", "decoder", "lm"  # the stacks: encoder-decoder's two, LM's one


@dataclasses.dataclass(frozen=True)
class MaskScheme:
    """visible(layout, window=, prefix_length=) -> [Lq, Lk] bool; the other fields say where
    the scheme may be used (the per-scheme checks of `check`)."""

    name: str
    visible: Callable[..., jax.Array]
    stacks: frozenset[str]
    size_key: str | None = None  # model key that must be > 0 exactly when the scheme is used
    memory: str = "optional"  # "optional", "required" or "forbidden": an XL memory
    # in a decoder or LM: some query sees a key after it, so positional schemes must encode
    # negative distances too (the stack's Layout has causal=False)
    sees_later_keys: bool = False

    def unscored_targets(self, cfg: Any) -> int:
        """How many leading targets of a segment the loss skips (visible to the queries)."""
        return 0

    def eval_stride(self, cfg: Any, segment_length: int) -> int:
        """The sliding-window stride evaluation must use (0: any layout)."""
        return 0

    def check(
        self, key: str, cfg: Any, *, mem_len: int, segment_length: int, sliding_stride: int = 0
    ) -> None:
        """Raise ValueError naming `key` (the config key selecting the scheme) if this scheme
        cannot run with this memory, segment length and evaluation stride."""
        if self.size_key and getattr(cfg, self.size_key) <= 0:  # eval.decoder_mask's choice
            raise ValueError(
                f"{key}={self.name!r} needs model.{self.size_key} > 0, which only a model "
                f"trained with {self.name!r} has"
            )
        if self.memory == "required" and not mem_len:
            raise ValueError(f"{key}={self.name!r} needs a memory (model.mem_len / eval.mem_len)")
        if self.memory == "forbidden" and mem_len:
            raise ValueError(f"{key}={self.name!r} cannot be used with a memory")


def causal(layout: Layout, *, window: int, prefix_length: int) -> jax.Array:
    """A query sees keys at or before its position."""
    return layout.distances() >= 0


def bidirectional(layout: Layout, *, window: int, prefix_length: int) -> jax.Array:
    return jnp.ones((layout.q_len, layout.k_len), bool)


def sliding_window(layout: Layout, *, window: int, prefix_length: int) -> jax.Array:
    """Local attention: the `window` keys ending at the query (causal stacks), or the keys
    fewer than `window` positions away on either side (encoders)."""
    if window <= 0:  # no key at all: a fully masked row would average over every key
        raise ValueError(f"a sliding window needs window > 0, got {window}")
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


class PrefixLM(MaskScheme):
    """The prefix is context: its targets (seen by the prefix queries) are not scored, and
    evaluation slides windows whose prefix is context only, so every token is scored once."""

    def unscored_targets(self, cfg: Any) -> int:
        return cfg.prefix_length - 1

    def eval_stride(self, cfg: Any, segment_length: int) -> int:
        return segment_length - cfg.prefix_length + 1

    def check(self, key, cfg, *, mem_len, segment_length, sliding_stride=0) -> None:
        super().check(key, cfg, mem_len=mem_len, segment_length=segment_length)
        if cfg.prefix_length >= segment_length:
            raise ValueError("model.prefix_length must be shorter than the segment lengths")
        if sliding_stride > self.eval_stride(cfg, segment_length):
            raise ValueError(
                f"eval.sliding_stride={sliding_stride}: prefix_lm windows can score at most "
                f"segment length - prefix_length + 1 = {self.eval_stride(cfg, segment_length)} "
                "tokens (the others are visible inside the prefix)"
            )


MASK_SCHEMES: dict[str, MaskScheme] = {
    s.name: s
    for s in (
        MaskScheme("causal", causal, frozenset({DECODER, LM})),
        MaskScheme("bidirectional", bidirectional, frozenset({ENCODER})),
        MaskScheme(
            "sliding_window", sliding_window, frozenset({ENCODER, DECODER, LM}), "attention_window"
        ),
        PrefixLM(
            "prefix_lm",
            prefix_lm,
            frozenset({LM}),
            "prefix_length",
            memory="forbidden",
            sees_later_keys=True,
        ),
        MaskScheme("same_length", same_length, frozenset({LM}), memory="required"),
    )
}


def names_for(stack: str) -> tuple[str, ...]:
    """The masking schemes a stack (ENCODER, DECODER or LM) may use."""
    return tuple(name for name, s in MASK_SCHEMES.items() if stack in s.stacks)


def attention_mask(
    kind: str,
    layout: Layout,
    *,
    window: int = 0,
    prefix_length: int = 0,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
    key_valid: jax.Array | None = None,
    structured: bool = False,
    max_segments: int = 0,
) -> "Mask":
    """The scheme's mask AND same-example (segment ids [B, Lq], [B, Lk]; 0 = padding) AND
    valid keys ([B, Lk] bool) -> [B or 1, 1, Lq, Lk]. `structured`: a `StructuredMask` where
    the mask has that form (causal, all keys or a sliding window, on aligned positions, with
    no key_valid), with `max_segments` (see there)."""
    visible = MASK_SCHEMES[kind].visible(layout, window=window, prefix_length=prefix_length)
    mask = visible[None, None]
    if q_segments is not None:
        mask = mask & segment_mask(q_segments, k_segments)
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :]
    aligned = layout.q_len == layout.k_len and _is_zero(layout.q_start, layout.k_start)
    if structured and kind in STRUCTURED_KINDS and aligned and key_valid is None:
        causal = kind == "causal" or (kind == "sliding_window" and layout.causal)
        window = window if kind == "sliding_window" else 0
        return StructuredMask(
            mask, q_segments, k_segments, causal=causal, window=window, max_segments=max_segments
        )
    return mask


STRUCTURED_KINDS = ("causal", "bidirectional", "sliding_window")


def _is_zero(*starts: int | jax.Array) -> bool:
    return all(isinstance(start, int) and start == 0 for start in starts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StructuredMask:
    """A mask that is exactly "causal (or all keys), within `window` positions (0: any), AND
    same example" on aligned query and key positions, with what a blockwise kernel (TPU splash
    attention) builds it from instead of reading `dense`: segment ids q_segments [B, Lq],
    k_segments [B, Lk] (0 = padding; None: one example a row, no padding), `causal` and
    `window`. dense [B or 1, 1, Lq, Lk] is the XLA path's. `max_segments`: the most segments
    a row holds (0: no bound given; ids are ascending contiguous runs where it is used).

    Rows of padding queries (whose outputs nothing scores) may differ between the two: a
    kernel compares segment ids, so padding queries attend to padding keys there."""

    dense: jax.Array
    q_segments: jax.Array | None
    k_segments: jax.Array | None
    causal: bool = dataclasses.field(metadata=dict(static=True))
    window: int = dataclasses.field(default=0, metadata=dict(static=True))
    max_segments: int = dataclasses.field(default=0, metadata=dict(static=True))


Mask = jax.Array | StructuredMask  # what attention takes


def dense(mask: Mask | None) -> jax.Array | None:
    """The [B or 1, 1, Lq, Lk] bool array of any mask `attention_mask` returns."""
    return mask.dense if isinstance(mask, StructuredMask) else mask


def cross_mask(
    q_segments: jax.Array, k_segments: jax.Array, max_segments: int = 0
) -> StructuredMask:
    """Cross-attention: non-padding queries see the non-padding keys of their own example.
    [B, Lq], [B, Lk] segment ids -> a StructuredMask over all keys."""
    return StructuredMask(
        segment_mask(q_segments, k_segments),
        q_segments,
        k_segments,
        causal=False,
        max_segments=max_segments,
    )


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
