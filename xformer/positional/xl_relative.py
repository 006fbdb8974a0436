"""Transformer-XL relative positions (Dai et al., 2019, section 3.3).

For a query at position i and a key at position j, the scaled logit gains

    u . k_j  +  (q_i + v) . (R_{i-j} W_kR)

beside the content term q_i . k_j, where R is the sinusoidal encoding of the distance, W_kR a
projection per layer, and u, v global biases shared by the layers (or one pair per layer, the
"untied" setting of the TF scripts). The position term is computed once per (query,
distance) pair and moved to (query, key) layout by `relative_shift`.
"""

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from xformer import precision
from xformer.dropout import Dropout
from xformer.layout import Layout
from xformer.linear import Linear
from xformer.positional.absolute import check_even_d_model, sinusoidal_encoding
from xformer.positional.base import PositionalScheme
from xformer.sharding import logical


def relative_shift(x: jax.Array, k_len: int) -> jax.Array:
    """[..., Lq, W] scores by (query, distance) -> [..., Lq, Lk] scores by (query, key).

    Column c of x holds distance D - c, where D is the distance from the last query to the
    first key. Output [i, j] = x[i, j + Lq-1 - i], which is the score of distance
    (D - (Lq-1) + i) - j, the distance of query i to key j. Exact wherever j + Lq-1 - i < W:
    with W = Lk + Lq - 1 everywhere, with W = Lk for every key at or before the query. One pad,
    reshapes and a slice: no gather.
    """
    *batch, q_len, width = x.shape
    x = jnp.pad(x, [(0, 0)] * len(batch) + [(0, 0), (0, 1)])  # row stride width + 1
    flat = x.reshape(*batch, q_len * (width + 1))[..., q_len - 1 : q_len - 1 + q_len * width]
    return flat.reshape(*batch, q_len, width)[..., :k_len]


CPU_FORM_PLATFORMS = frozenset({"cpu"})  # backends that get the form made for XLA:CPU


def position_scores(qv: jax.Array, rk: jax.Array) -> jax.Array:
    """(q + v) [B, Lq, H, D] . R W_kR [W, H, D] -> [B, H, Lq, W] scores by (query, distance),
    accumulated in at_least_float32 as the content logits are.

    Off XLA:CPU, rk is broadcast over the batch, so that the product is a GEMM batched over
    (b, h), like the content logits', which writes [B, H, Lq, W] in the order it is read. With
    rk shared, XLA:GPU batches over h alone and transposes the [H, B * Lq, W] product, and its
    gradient back, in every layer: wt103_xl's step (bf16, H100 target) moved 7.3 GB in
    transposes against 1.2 GB this way, and keeps 0.28 GiB more (the broadcast, for the
    backward pass). On XLA:CPU the shared form is the faster (PTB-XL's train step: 5%)."""
    if jax.default_backend() in CPU_FORM_PLATFORMS:
        return precision.wide_einsum("bqhd,whd->bhqw", qv, rk)
    rk = jnp.broadcast_to(rk, (qv.shape[0], *rk.shape))
    return precision.wide_einsum("bqhd,bwhd->bhqw", qv, rk)


def relative_width(layout: Layout) -> int:
    """W, the distances `relative_shift` needs: Lk when no key after a query matters."""
    return layout.k_len if layout.causal else layout.k_len + layout.q_len - 1


def relative_distances(layout: Layout) -> jax.Array:
    """The distances that `relative_shift` expects, largest first: [W] int32."""
    largest = layout.q_start + layout.q_len - 1 - layout.k_start
    return largest - jnp.arange(relative_width(layout), dtype=jnp.int32)


class ProjectedDistances(NamedTuple):
    """R W_kR of every layer, [num_layers, W, H, D] by distance (largest first): computed once
    for incremental decoding instead of projecting R at every step."""

    rk: jax.Array


class XLRelativePositions(PositionalScheme):
    name = "relative"
    own_options = ("clamp_len", "untie_relative_biases")

    @classmethod
    def check_config(cls, cfg) -> None:
        check_even_d_model(cls.name, cfg.d_model)

    def __init__(self, cfg, num_layers: int, *, rngs: nnx.Rngs):
        d = cfg.d_model
        heads = (cfg.num_heads, d // cfg.num_heads)
        self.d_model, (self.num_heads, self.head_dim) = d, heads
        self.clamp_len, self.dtype = cfg.clamp_len, jnp.dtype(cfg.dtype)
        self.r_proj = nnx.List(
            [
                Linear(
                    d,
                    d,
                    axes=("embed", "heads"),
                    use_bias=False,
                    kernel_init=cfg.kernel_init,
                    **cfg.dtypes,
                    rngs=rngs,
                )
                for _ in range(num_layers)
            ]
        )  # W_{k,R} per layer
        self.untied = cfg.untie_relative_biases
        shape = (num_layers, *heads) if self.untied else heads  # heads = (H, D)
        axes = (None, "heads", "head_dim") if self.untied else ("heads", "head_dim")
        init = logical(nnx.initializers.normal(0.02), *axes)
        self.u = nnx.Param(init(rngs.params(), shape, jnp.dtype(cfg.param_dtype)))
        self.v = nnx.Param(init(rngs.params(), shape, jnp.dtype(cfg.param_dtype)))
        self.dropout = Dropout(cfg.dropout, rngs=rngs)

    def prepare(self, layout: Layout) -> jax.Array:
        distances = relative_distances(layout)
        if self.clamp_len > 0:
            distances = jnp.clip(distances, -self.clamp_len, self.clamp_len)
        return self.dropout(sinusoidal_encoding(distances, self.d_model, self.dtype))  # R [W, d]

    def _project(self, r: jax.Array, layer: int) -> jax.Array:
        """R [W, d] -> R W_kR of `layer`, [W, H, D]."""
        return self.r_proj[layer](r).reshape(r.shape[0], self.num_heads, self.head_dim)

    def prepare_cached(self, layout: Layout) -> ProjectedDistances:
        """Every layer's R W_kR for every distance of the segment's queries to its keys
        (both signs: W = Lk + Lq - 1), which each step then slices."""
        r = self.prepare(dataclasses.replace(layout, causal=False))
        return ProjectedDistances(jnp.stack([self._project(r, i) for i in range(len(self.r_proj))]))

    def prepare_step(self, cached: ProjectedDistances, layout: Layout) -> ProjectedDistances:
        """The W distances of the step's relative_shift, largest first: the cached table starts
        at the segment's largest distance, Lk - 1 - k_start, and the step's is
        q_start + Lq - 1 - k_start."""
        first = layout.k_len - layout.q_start - layout.q_len
        width = relative_width(layout)
        return ProjectedDistances(jax.lax.dynamic_slice_in_dim(cached.rk, first, width, 1))

    def logit_bias(self, r, q, k, layout, layer):
        """r: R [W, d] from `prepare`, or the projections of `prepare_step`."""
        u, v = ((p[layer] if self.untied else p[...]) for p in (self.u, self.v))
        rk = r.rk[layer] if isinstance(r, ProjectedDistances) else self._project(r, layer)
        position = position_scores(precision.add_bias(q, v), rk)  # v's gradient summed wide
        content_bias = precision.wide_einsum("hd,bkhd->bhk", u.astype(q.dtype), k)[:, :, None]
        return (content_bias + relative_shift(position, layout.k_len)) / math.sqrt(self.head_dim)
