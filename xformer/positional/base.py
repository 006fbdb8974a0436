"""The interface every positional scheme implements; the base class itself adds no position
information (the "none" scheme).

A scheme can act at three places, and most use one:
- `embed`: an absolute encoding added to the token embeddings (sinusoidal, learned);
- `rotate`: a position-dependent map of queries and keys before their dot product (rotary);
- `logit_bias`: a term added to the scaled attention logits (T5 buckets, ALiBi, Transformer-XL).
`prepare` computes, once per stack call, what `logit_bias` reuses in every layer.
"""

import dataclasses
from typing import Any

import jax
from flax import nnx

from xformer.layout import Layout


class PositionalScheme(nnx.Module):
    """Built as Scheme(cfg, num_layers, rngs=rngs) with cfg a model config (d_model, num_heads,
    max_len, dropout and the scheme's own fields)."""

    name = "none"  # its model.positional value
    max_len: int | None = None  # the longest sequence the scheme can encode (None: any)
    absolute = False  # positions are added to the embeddings, so states cannot be reused
    # at other positions (no Transformer-XL memory)
    own_options: tuple[str, ...] = ()  # model keys no other scheme may set (off their default)

    def __init__(self, cfg: Any, num_layers: int, *, rngs: nnx.Rngs):
        pass

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        """Raise ValueError naming the model key when the scheme cannot serve `cfg`."""

    @classmethod
    def check_memory(cls, mem_len: int, key: str = "model.mem_len") -> None:
        """Raise ValueError when a memory of `mem_len` states is asked for (by `key`) but the
        scheme adds absolute positions to the embeddings, which would repeat across segments."""
        if cls.absolute and mem_len:
            raise ValueError(
                f"a memory ({key}={mem_len}) cannot be used with model.positional={cls.name!r}: it "
                "adds absolute positions to the embeddings, which repeat across segments; use a "
                "relative scheme (relative, rope, t5_bias, alibi) or none"
            )

    def embed(self, positions: jax.Array) -> jax.Array | None:
        """positions [B, L] -> encoding [B, L, d] added to the embeddings, or None."""
        return None

    def prepare(self, layout: Layout) -> Any:
        """Per-call state shared by the layers of a stack (e.g. a bias computed once)."""
        return None

    def rotate(self, x: jax.Array, start: int | jax.Array) -> jax.Array:
        """Queries or keys x [B, L, H, D] at positions start..start+L-1 -> same shape."""
        return x

    def logit_bias(
        self, prepared: Any, q: jax.Array, k: jax.Array, layout: Layout, layer: int
    ) -> jax.Array | None:
        """Added to q.k / sqrt(D): q [B, Lq, H, D], k [B, Lk, H, D] -> [B or 1, H, Lq, Lk]."""
        return None

    def prepare_cached(self, layout: Layout) -> Any:
        """For incremental decoding over the keys of `layout` (a segment whose last query is its
        last key, as Layout.with_memory): what `prepare_step` reuses at every step, computed
        once (default: nothing)."""
        return None

    def prepare_step(self, cached: Any, layout: Layout) -> Any:
        """`prepare(layout)` for one decoding step over the same keys (queries at q_start..), from
        `prepare_cached`'s result where that is cheaper than preparing again."""
        return self.prepare(layout)

    def check_length(self, length: int) -> None:
        """Fail before compute when positions up to `length` cannot be encoded."""
        if self.max_len is not None and length > self.max_len:
            raise ValueError(
                f"sequence length {length} exceeds the learned position table "
                f"(model.max_len={self.max_len}); learned positions cannot extrapolate: use "
                "another model.positional or a larger model.max_len"
            )


@dataclasses.dataclass(frozen=True)
class BoundScheme:
    """A scheme bound to one call of an attention stack: what every layer's attention needs."""

    scheme: PositionalScheme
    layout: Layout
    prepared: Any

    @classmethod
    def bind(cls, scheme: PositionalScheme, layout: Layout) -> "BoundScheme":
        return cls(scheme, layout, scheme.prepare(layout))

    @classmethod
    def bind_step(cls, scheme: PositionalScheme, cached: Any, layout: Layout) -> "BoundScheme":
        """Bound to one decoding step, from `scheme.prepare_cached`'s result `cached`."""
        return cls(scheme, layout, scheme.prepare_step(cached, layout))

    def bias(self, q: jax.Array, k: jax.Array, layer: int) -> jax.Array | None:
        return self.scheme.logit_bias(self.prepared, q, k, self.layout, layer)
