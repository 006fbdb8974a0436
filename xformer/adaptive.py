"""Adaptive input embeddings (Baevski & Auli, 2019) and adaptive softmax (Grave et al., 2017).

Token ids are sorted by descending frequency and split by `cutoffs` into clusters, e.g.
cutoffs (20000, 40000, 200000) with V = 267735 gives [0, 20k), [20k, 40k), [40k, 200k),
[200k, V). Cluster i has dimension d_embed // div_val**i and, where that differs from d_model,
a projection [d_i, d_model]. With div_val == 1 one table [V, d_embed] serves every cluster.
Shapes are static throughout, so both modules work under jit.

Precision: parameters are created in `param_dtype`; lookups, projections and logit matmuls run
in `dtype` (None: the promoted dtype of the inputs and parameters); logits, log-softmax and
NLL are in `precision.at_least_float32(dtype)` (float32 for bfloat16, float64 stays float64).
"""

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xformer import precision
from xformer.losses import (
    log_softmax_at,
    log_softmax_at_gradient,
    log_softmax_at_with_residuals,
)
from xformer.sharding import logical, per_row_shard

INIT = nnx.initializers.normal(0.02)
# XLA:GPU pads a 16-bit matmul's dimensions to multiples of 8 for the tensor cores, in a pass
# of its own over the operand; gathered row blocks and cluster weights of such a size need none.
# Tables are stored with their rows rounded up to it too, for FSDP.
ROW_MULTIPLE = 8


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
        """[rows, dim] of each table: its tokens' rows, then rows up to a multiple of
        ROW_MULTIPLE that no token reads, so that FSDP can split the rows (jax splits a
        dimension only evenly: WikiText-103's 267,735 types could not be split at all)."""
        return [
            (-(-(e - s) // ROW_MULTIPLE) * ROW_MULTIPLE, self.dims[g])
            for g, (s, e) in enumerate(self.table_ranges)
        ]


def _param(rngs: nnx.Rngs, *shape: int, dtype, axes: tuple, init=INIT) -> nnx.Param:
    """A parameter of `shape` with logical axes `axes` (sharding.RULES)."""
    return nnx.Param(logical(init, *axes)(rngs.params(), shape, dtype))


def _table(rngs: nnx.Rngs, n: int, d: int, dtype, init=INIT) -> nnx.Param:
    return _param(rngs, n, d, dtype=dtype, axes=("vocab", None), init=init)


def _proj(rngs: nnx.Rngs, d: int, d_model: int, dtype) -> nnx.Param | None:
    return None if d == d_model else _param(rngs, d, d_model, dtype=dtype, axes=(None, "embed"))


def _dtypes(dtype, param_dtype) -> tuple[jnp.dtype | None, jnp.dtype]:
    """(dtype or None, param_dtype) as numpy dtypes; param_dtype None means float32."""
    return (None if dtype is None else jnp.dtype(dtype)), jnp.dtype(param_dtype or jnp.float32)


class AdaptiveEmbedding(nnx.Module):
    """tokens [B, L] int -> [B, L, d_model]: per-cluster lookup, projection, times sqrt(d_model).

    `tables[g]` [n_g, d_g] (n_g: its tokens, rounded up to ROW_MULTIPLE), initialised
    N(0, init_std); `projs[g]` [d_g, d_model], or None where d_g == d_model. Parameters are in
    `param_dtype`, the output in `dtype` (None: param dtype).
    """

    def __init__(
        self,
        layout: ClusterLayout,
        *,
        rngs: nnx.Rngs,
        init_std: float = 0.02,
        dtype=None,
        param_dtype=jnp.float32,
    ):
        self.layout = lay = layout
        self.dtype, self.param_dtype = pdt = _dtypes(dtype, param_dtype)
        init = nnx.initializers.normal(init_std)
        self.tables = nnx.List(
            [_table(rngs, n, d, pdt[1], init=init) for n, d in lay.table_shapes()]
        )
        self.projs = nnx.List([_proj(rngs, d, lay.d_model, pdt[1]) for _, d in lay.table_shapes()])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        dtype = self.dtype
        if dtype is None:
            dtype = jnp.result_type(*(t.dtype for t in self.tables))
        out = jnp.zeros((*tokens.shape, self.layout.d_model), dtype)
        for (start, end), table, proj in zip(
            self.layout.table_ranges, self.tables, self.projs, strict=True
        ):
            x = table[...][jnp.clip(tokens - start, 0, end - start - 1)].astype(dtype)
            x = x if proj is None else x @ proj[...].astype(dtype)
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

    `capacity` > 0 makes `nll` score each tail cluster i on C = ceil(capacity * N) gathered
    rows only (N = B * L; the positions whose target is in cluster i, padded), projection
    included. A batch with more than C such targets scores that cluster densely, all N
    positions, C rows at a time (lax.cond on the count), so the result is exact either way and
    no [N, n_i] array is built. `log_probs` is always dense. Traced under a mesh that splits
    batch rows (sharding.traced_on), each device gathers from its own N / shards positions, C
    of its own, and overflows alone (sharding.per_row_shard).
    """

    def __init__(
        self,
        layout: ClusterLayout,
        *,
        rngs: nnx.Rngs,
        tie_embedding: AdaptiveEmbedding | None = None,
        tie_projs: Sequence[bool] | None = None,
        capacity: float = 0.0,
        dtype=None,
        param_dtype=jnp.float32,
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
        if not 0.0 <= capacity <= 1.0:
            raise ValueError(f"capacity must lie in [0, 1], got {capacity}")
        self.capacity = float(capacity)
        self.dtype, self.param_dtype = _dtypes(dtype, param_dtype)
        pdt = self.param_dtype
        if tie_embedding is not None:
            self.tables = tie_embedding.tables
        else:
            self.tables = nnx.List([_table(rngs, m, d, pdt) for m, d in lay.table_shapes()])
        self.projs = nnx.List(
            [
                tie_embedding.projs[lay.table_of(i)]
                if tie
                else _proj(rngs, lay.dims[i], lay.d_model, pdt)
                for i, tie in enumerate(tie_projs)
            ]
        )
        zeros = nnx.initializers.zeros_init()  # draws no key
        self.bias = nnx.Param(logical(zeros, "vocab")(None, (lay.vocab_size,), pdt))
        self.cluster_weight = (
            _param(rngs, n - 1, lay.dims[0], dtype=pdt, axes=("cluster", None)) if n > 1 else None
        )
        self.cluster_bias = (
            nnx.Param(logical(zeros, "cluster")(None, (n - 1,), pdt)) if n > 1 else None
        )

    def _dtypes(self, hidden: jax.Array) -> tuple[jnp.dtype, jnp.dtype]:
        """(compute dtype, log-softmax dtype) for these hidden states."""
        dtype = self.dtype
        if dtype is None:
            dtype = jnp.result_type(hidden.dtype, self.bias.dtype, self.tables[0].dtype)
        return dtype, precision.at_least_float32(dtype)

    def _cluster(self, i: int, dtype, acc) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Cluster i's (weights [m_i, d_i] in dtype, bias [m_i] in acc, projection [d_i, d] or
        None): its n_i rows (the head's have n_tails more, the cluster logits), then padding
        rows up to a multiple of ROW_MULTIPLE (`_pad_rows`)."""
        start, end = self.layout.clusters[i]
        g = self.layout.table_of(i)
        row = start - self.layout.table_ranges[g][0]
        w, b = self.tables[g][row : row + end - start], self.bias[start:end]
        if i == 0 and self.cluster_weight is not None:
            w = jnp.concatenate([w, self.cluster_weight[...].astype(w.dtype)])
            b = jnp.concatenate([b, self.cluster_bias[...].astype(b.dtype)])
        w, b = _pad_rows(w.astype(dtype), b.astype(acc))
        proj = self.projs[i]
        return w, b, None if proj is None else proj[...].astype(dtype)

    def _log_softmax(self, hidden: jax.Array, i: int) -> jax.Array:
        """Cluster i's log-softmax [..., m_i]: n_i entries (the head's n_tails more), then
        the padding rows', exactly -inf or 0 in probability."""
        dtype, acc = self._dtypes(hidden)
        logits = _logits(hidden.astype(dtype), *self._cluster(i, dtype, acc))
        return jax.nn.log_softmax(logits.astype(acc))

    def log_probs(self, hidden: jax.Array) -> jax.Array:
        """hidden [B, L, d_model] -> normalised log-probabilities [B, L, V] (float32 or wider)."""
        head = self._log_softmax(hidden, 0)
        shortlist = self.layout.clusters[0][1]
        parts = [head[..., :shortlist]]
        for i, (start, end) in enumerate(self.layout.clusters[1:], start=1):
            tail = self._log_softmax(hidden, i)[..., : end - start]
            parts.append(head[..., shortlist + i - 1, None] + tail)
        return jnp.concatenate(parts, axis=-1)

    def nll(self, hidden: jax.Array, targets: jax.Array) -> jax.Array:
        """hidden [B, L, d_model], targets [B, L] int -> -log p(target) [B, L] (float32 or wider).

        Scores the head and each tail cluster separately; the [B, L, V] array is never built.
        With `capacity` > 0 a tail cluster is scored on the gathered rows of its targets only.
        """
        dtype, acc = self._dtypes(hidden)
        shape, d = targets.shape, self.layout.d_model
        h, t = hidden.reshape(-1, d).astype(dtype), targets.reshape(-1)
        shortlist = self.layout.clusters[0][1]
        head_index, tails = jnp.clip(t, 0, shortlist - 1), []
        for i, (start, end) in enumerate(self.layout.clusters[1:], start=1):
            local, member = jnp.clip(t - start, 0, end - start - 1), (t >= start) & (t < end)
            head_index = jnp.where(member, shortlist + i - 1, head_index)  # the cluster's logit
            w, b, proj = self._cluster(i, dtype, acc)
            if self.capacity:
                sparse = functools.partial(_sparse_tail_logp, self.capacity)
                tails.append(per_row_shard(sparse, (h, local, member), (w, b, proj)))
            else:
                tails.append(_dense_tail_logp(h, w, b, proj, local, member))
        logp = log_softmax_at(_logits(h, *self._cluster(0, dtype, acc)), head_index)
        for tail in tails:  # 0 outside its cluster
            logp = logp + tail
        return -logp.reshape(shape)


def _pad_rows(w: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Weights [n, d] and bias [n] -> [m, d], [m], m = n rounded up to ROW_MULTIPLE: zero
    weights and bias precision.mask_value, logits whose softmax is exactly 0 (no gradient).
    XLA:GPU would pad the GEMM to such a width itself, in passes over its operands and its
    [N, n] logits (WikiText-103: the head's 20,003 -> 20,008, the last tail's 67,735 -> 67,736)."""
    pad = -w.shape[0] % ROW_MULTIPLE
    if not pad:
        return w, b
    fill = jnp.full((pad,), precision.mask_value(b.dtype), b.dtype)
    return jnp.pad(w, ((0, pad), (0, 0))), jnp.concatenate([b, fill])


def _logits(h: jax.Array, w: jax.Array, b: jax.Array, proj: jax.Array | None) -> jax.Array:
    """h [..., d_model] -> (h @ proj^T) @ w^T + b [..., n] in h's dtype (b's, at_least_float32
    of h's, sums its gradient). A bfloat16 model's logits are bfloat16, as its output layer's
    in models.py, and the log-softmax upcasts them (`losses`): on a GPU the GEMM writes and the
    loss reads half the bytes of float32 logits, and the sparse path keeps them as its
    residuals (WikiText-103's [1352, 160000] tail)."""
    x = h if proj is None else h @ proj.T
    return precision.add_bias(jnp.einsum("...d,nd->...n", x, w), b)


def _dense_tail_logp(h, w, b, proj, local, member) -> jax.Array:
    """Every row [N, d]: log p(local target | cluster) [N] where `member`, else 0."""
    return jnp.where(member, log_softmax_at(_logits(h, w, b, proj), local), 0.0)


def _compact(
    member: jax.Array, cap: int, size: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """member [N] bool -> (rows [size]: the first size member positions in order, padded with
    0; used [size] bool: rows[k] is a member; slot [N]: each member's index in rows;
    overflow: there are more than cap <= size members)."""
    slot = jnp.cumsum(member, dtype=jnp.int32) - 1
    count = slot[-1] + 1
    index = jnp.where(member & (slot < size), slot, size)  # size: dropped
    rows = (
        jnp.zeros(size, jnp.int32)
        .at[index]
        .set(jnp.arange(len(member), dtype=jnp.int32), mode="drop")
    )
    return rows, jnp.arange(size) < count, jnp.clip(slot, 0, size - 1), count > cap


def capacity_rows(capacity: float, n: int) -> int:
    """The rows a tail cluster gathers of `n` positions at model.adaptive_capacity `capacity`
    (rounded first: 0.07 * 100 is 7.000000000000001, 7 rows, not 8)."""
    return min(n, max(1, math.ceil(round(capacity * n, 6))))


def _sparse_tail_logp(capacity, h, local, member, w, b, proj) -> jax.Array:
    """`_dense_tail_logp` [N] computed on the (at most cap = ceil(capacity * N)) member rows
    only. With more members
    it scores every row, a block of consecutive rows at a time, so that no [N, n] array is
    built either way. A custom VJP saves the gathered rows' log-softmax residuals [block, n]
    (`losses.log_softmax_at_with_residuals`) for the backward pass (lax.cond's own autodiff
    would save the dense branch's residuals too, zeros when unused); the dense fallback
    recomputes each block's in the backward pass.
    A block is cap rows rounded up to ROW_MULTIPLE (the extra rows are padding; more than cap
    members still overflow). bench/gpu_compile.py, wt103_xl bf16 fused on an H100 (cap 1,350
    -> blocks of 1,352): 10 pad kernels fewer, floor 22.01 -> 21.72 ms."""
    n, d = h.shape
    cap = capacity_rows(capacity, n)
    size = -(-cap // ROW_MULTIPLE) * ROW_MULTIPLE
    chunks = -(-n // size)
    # constants (numpy): the custom VJP's rules close over them
    chunk_rows = np.minimum(np.arange(chunks * size, dtype=np.int32), n - 1).reshape(-1, size)
    chunk_used = (np.arange(chunks * size) < n).reshape(-1, size)  # False: padding

    @jax.custom_vjp
    def tail_logp(h, w, b, proj, local, member):
        return fwd(h, w, b, proj, local, member)[0]

    def fwd(h, w, b, proj, local, member):
        params = (h, w, b, proj)
        rows, used, slot, overflow = _compact(member, cap, size)

        def sparse():
            log_p, scored = _score_rows(params, local, rows)
            return jnp.where(member, log_p[slot], 0.0), scored

        def dense():
            log_p = jax.lax.map(lambda r: _score_rows(params, local, r)[0], chunk_rows)
            out = jnp.where(member, log_p.reshape(-1)[:n], 0.0)
            unused = jax.eval_shape(sparse)[1]
            return out, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), unused)

        out, scored = jax.lax.cond(overflow, dense, sparse)
        return out, (params, local, member, rows, used, overflow, scored)

    def bwd(res, g):
        params, local, member, rows, used, overflow, scored = res
        h = params[0]

        def sparse():
            g_rows = jnp.where(used, g[rows], 0.0)
            dh_rows, *d_params = _backprop_rows(params, rows, g_rows, scored)
            return jnp.zeros_like(h).at[rows].add(dh_rows), *d_params

        def dense():
            def step(total, chunk):
                rows, used = chunk
                g_rows = jnp.where(used & member[rows], g[rows], 0.0)
                scored = _score_rows(params, local, rows)[1]
                dh_rows, *d_params = _backprop_rows(params, rows, g_rows, scored)
                return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, d_params), dh_rows

            acc = precision.at_least_float32(b.dtype)
            zeros = [jax.tree.map(lambda x: jnp.zeros(x.shape, acc), x) for x in params[1:]]
            total, dh = jax.lax.scan(step, zeros, (chunk_rows, chunk_used))
            d_params = jax.tree.map(lambda t, x: t.astype(x.dtype), total, list(params[1:]))
            return dh.reshape(-1, d)[:n], *d_params

        return (*jax.lax.cond(overflow, dense, sparse), None, None)

    tail_logp.defvjp(fwd, bwd)
    return tail_logp(h, w, b, proj, local, member)


def _score_rows(params, local, rows) -> tuple[jax.Array, tuple]:
    """params (h [N, d], w, b, proj), rows [R] -> (log p(local target) [R], the residuals of
    its gradient: `losses.log_softmax_at_with_residuals`)."""
    h, *wbp = params
    return log_softmax_at_with_residuals(_logits(h[rows], *wbp), local[rows])


def _backprop_rows(params, rows, g_rows, scored) -> list:
    """Cotangents g_rows [R] of `_score_rows`'s log-probabilities (zero for rows not scored),
    with its residuals -> [d h[rows] [R, d], d w, d b, d proj]."""
    h, *wbp = params
    d_logits = log_softmax_at_gradient(scored, g_rows)
    logits, vjp = jax.vjp(_logits, h[rows], *wbp)  # its forward value is unused: jit drops it
    return list(vjp(d_logits.astype(logits.dtype)))
