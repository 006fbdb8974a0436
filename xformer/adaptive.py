"""Adaptive input embeddings (Baevski & Auli, 2019) and adaptive softmax (Grave et al., 2017).

Token ids are sorted by descending frequency and split by `cutoffs` into clusters, e.g.
cutoffs (20000, 40000, 200000) with V = 267735 gives [0, 20k), [20k, 40k), [40k, 200k),
[200k, V). Cluster i has dimension d_embed // div_val**i and, where that differs from d_model,
a projection [d_i, d_model]. With div_val == 1 one table [V, d_embed] serves every cluster.
Shapes are static throughout, so both modules work under jit.
"""

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from xformer import precision

INIT = nnx.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class ClusterLayout:
    """Static cluster layout; table g covers tokens table_ranges[g] with dimension dims[g]."""

    vocab_size: int
    d_model: int
    clusters: tuple[tuple[int, int], ...]  # token range [start, end) of each cluster
    dims: tuple[int, ...]  # embedding dimension of each cluster
    table_ranges: tuple[tuple[int, int], ...]  # one per cluster, or one in all if div_val == 1

    @classmethod
    def make(
        cls, vocab_size: int, d_embed: int, d_model: int, cutoffs, div_val: int
    ) -> "ClusterLayout":
        edges = (0, *cutoffs, vocab_size)
        if any(a >= b for a, b in zip(edges, edges[1:], strict=False)):
            raise ValueError(f"cutoffs {cutoffs} must increase strictly within (0, {vocab_size})")
        if div_val < 1 or d_embed // div_val ** len(cutoffs) < 1:
            raise ValueError(f"d_embed={d_embed} and div_val={div_val} leave an empty cluster")
        clusters = tuple(zip(edges[:-1], edges[1:], strict=True))
        dims = tuple(d_embed // div_val**i for i in range(len(clusters)))
        tables = ((0, vocab_size),) if div_val == 1 else clusters
        return cls(vocab_size, d_model, clusters, dims, tables)

    def table_of(self, i: int) -> int:
        """Index of the table holding cluster i."""
        return 0 if len(self.table_ranges) == 1 else i

    def table_shapes(self) -> list[tuple[int, int]]:
        return [(e - s, self.dims[g]) for g, (s, e) in enumerate(self.table_ranges)]


def _param(rngs: nnx.Rngs, *shape: int, init=INIT) -> nnx.Param:
    return nnx.Param(init(rngs.params(), shape))


def _proj(rngs: nnx.Rngs, d: int, d_model: int) -> nnx.Param | None:
    return None if d == d_model else _param(rngs, d, d_model)


class AdaptiveEmbedding(nnx.Module):
    """tokens [B, L] int -> [B, L, d_model]: per-cluster lookup, projection, times sqrt(d_model).

    `tables[g]` [n_g, d_g], initialised N(0, init_std); `projs[g]` [d_g, d_model], or None where
    d_g == d_model.
    """

    def __init__(self, layout: ClusterLayout, *, rngs: nnx.Rngs, init_std: float = 0.02):
        self.layout = lay = layout
        init = nnx.initializers.normal(init_std)
        self.tables = nnx.List([_param(rngs, n, d, init=init) for n, d in lay.table_shapes()])
        self.projs = nnx.List([_proj(rngs, d, lay.d_model) for _, d in lay.table_shapes()])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        out = jnp.zeros((*tokens.shape, self.layout.d_model), self.tables[0].dtype)
        for (start, end), table, proj in zip(
            self.layout.table_ranges, self.tables, self.projs, strict=True
        ):
            x = table[...][jnp.clip(tokens - start, 0, end - start - 1)]
            x = x if proj is None else x @ proj[...]
            out = jnp.where(((tokens >= start) & (tokens < end))[..., None], x, out)
        return out * math.sqrt(self.layout.d_model)


class AdaptiveLogSoftmax(nnx.Module):
    """Adaptive softmax over hidden states [B, L, d_model].

    The head scores the first cluster's tokens plus one logit per tail cluster (`cluster_weight`
    [n_tails, d_0], `cluster_bias`); tail token t of cluster i gets
    log p = head[shortlist + i - 1] + log_softmax(tail_i)[t - start_i]. Cluster i projects
    h [d_model] -> [d_i] with `projs[i]` (h @ P^T, P [d_i, d_model]) unless d_i == d_model.
    `tie_embedding` shares its tables (same nnx.Param objects) as output weights; `tie_projs[i]`
    shares cluster i's embedding projection. Biases are never shared.
    """

    def __init__(
        self,
        layout: ClusterLayout,
        *,
        rngs: nnx.Rngs,
        tie_embedding: AdaptiveEmbedding | None = None,
        tie_projs: Sequence[bool] | None = None,
    ):
        self.layout = lay = layout
        n = len(lay.clusters)
        tie_projs = tuple(tie_projs) if tie_projs is not None else (False,) * n
        if len(tie_projs) != n:
            raise ValueError(f"tie_projs needs one entry per cluster ({n}), got {tie_projs}")
        if tie_embedding is not None and tie_embedding.layout != lay:
            raise ValueError("tie_embedding has a different vocabulary/cluster layout")
        if tie_embedding is None and any(tie_projs):
            raise ValueError("tie_projs needs tie_embedding")
        if tie_embedding is not None:
            self.tables = tie_embedding.tables
        else:
            self.tables = nnx.List([_param(rngs, n_g, d) for n_g, d in lay.table_shapes()])
        self.projs = nnx.List(
            [
                tie_embedding.projs[lay.table_of(i)]
                if tie
                else _proj(rngs, lay.dims[i], lay.d_model)
                for i, tie in enumerate(tie_projs)
            ]
        )
        self.bias = nnx.Param(jnp.zeros(lay.vocab_size))
        self.cluster_weight = _param(rngs, n - 1, lay.dims[0]) if n > 1 else None
        self.cluster_bias = nnx.Param(jnp.zeros(n - 1)) if n > 1 else None

    def _log_softmax(self, hidden: jax.Array, i: int) -> jax.Array:
        """Cluster i's log-softmax [B, L, n_i] (the head's has n_tails extra entries)."""
        start, end = self.layout.clusters[i]
        g = self.layout.table_of(i)
        row = start - self.layout.table_ranges[g][0]
        w, b = self.tables[g][row : row + end - start], self.bias[start:end]
        if i == 0 and self.cluster_weight is not None:
            w = jnp.concatenate([w, self.cluster_weight[...]])
            b = jnp.concatenate([b, self.cluster_bias[...]])
        x = hidden if self.projs[i] is None else hidden @ self.projs[i][...].T
        logits = x @ w.T + b
        return jax.nn.log_softmax(logits.astype(precision.at_least_float32(logits.dtype)))

    def log_probs(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, L, d_model] -> normalised log-probabilities [B, L, V] (float32)."""
        head = self._log_softmax(hidden, 0)
        shortlist = self.layout.clusters[0][1]
        parts = [head[..., :shortlist]]
        for i in range(1, len(self.layout.clusters)):
            parts.append(head[..., shortlist + i - 1, None] + self._log_softmax(hidden, i))
        return jnp.concatenate(parts, axis=-1)

    def nll(self, hidden: jax.Array, targets: jax.Array) -> jax.Array:
        """hidden [B, L, d_model], targets [B, L] int -> -log p(target) [B, L] (float32).

        Scores the head and each tail cluster separately; the [B, L, V] array is never built.
        """
        head = self._log_softmax(hidden, 0)
        shortlist = self.layout.clusters[0][1]
        logp = _gather(head, jnp.clip(targets, 0, shortlist - 1))
        for i, (start, end) in enumerate(self.layout.clusters[1:], start=1):
            tail = _gather(
                self._log_softmax(hidden, i), jnp.clip(targets - start, 0, end - start - 1)
            )
            logp = jnp.where(targets >= start, head[..., shortlist + i - 1] + tail, logp)
        return -logp


def _gather(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [..., n], index [...] -> x[..., index]."""
    return jnp.take_along_axis(x, index[..., None], axis=-1)[..., 0]
