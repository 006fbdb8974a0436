"""Adaptive embedding and adaptive softmax against per-token numpy references."""

import functools
import json
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from simulated_devices import run_script

from xformer import adaptive, losses
from xformer.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax, ClusterLayout

V = 50
CUTOFFS = (10, 25, 40)


def _rngs() -> nnx.Rngs:
    return nnx.Rngs(int(np.random.default_rng().integers(2**31)))


def _randomize(module: nnx.Module, scale: float = 0.5) -> None:
    """Give every parameter (biases included) fresh N(0, scale^2) values in its own dtype, so
    that the distributions are far from uniform; tied variables stay tied (nnx.state lists them
    once). The module may be abstract (nnx.eval_shape): no initializer runs eagerly, op by op."""
    rng = np.random.default_rng()
    leaves, treedef = jax.tree.flatten(nnx.state(module, nnx.Param))
    new = [jnp.asarray(rng.normal(0, scale, x.shape), x.dtype) for x in leaves]
    nnx.update(module, jax.tree.unflatten(treedef, new))


def _softmax_module(d_embed, d_model, cutoffs, div_val, **kwargs) -> AdaptiveLogSoftmax:
    layout = ClusterLayout.make(V, d_embed, d_model, cutoffs, div_val)
    sm = nnx.eval_shape(lambda: AdaptiveLogSoftmax(layout, rngs=_rngs(), **kwargs))  # shapes
    _randomize(sm)
    return sm


def _hidden(d_model: int, shape=(3, 7)) -> np.ndarray:
    return np.random.default_rng().standard_normal((*shape, d_model)).astype(np.float32)


def _targets(cutoffs, shape=(3, 7)) -> np.ndarray:
    """Random targets, shuffled together with the first and last token of every cluster."""
    rng = np.random.default_rng()
    t = rng.integers(0, V, shape)
    edges = (0, *cutoffs, V)
    t.flat[: 2 * len(edges) - 2] = [*edges[:-1], *(e - 1 for e in edges[1:])]
    return rng.permutation(t.ravel()).reshape(shape)


def _np(x) -> np.ndarray | None:
    return None if x is None else np.asarray(x[...], np.float64)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


SETTINGS = [  # d_embed, d_model, cutoffs, div_val
    (16, 16, (), 1),
    (16, 12, (), 1),
    (16, 16, (10, 25), 1),
    (16, 12, (10, 25), 1),
    (16, 12, (10, 25), 2),
    (16, 16, (10, 25), 4),
    (64, 48, CUTOFFS, 4),
    (8, 8, (1, 49), 2),
]


@pytest.mark.parametrize("d_embed, d_model, cutoffs, div_val", SETTINGS)
def test_log_probs_are_normalised(d_embed, d_model, cutoffs, div_val):
    sm = _softmax_module(d_embed, d_model, cutoffs, div_val)
    log_p = sm.log_probs(jnp.asarray(_hidden(d_model)))
    assert log_p.shape == (3, 7, V) and log_p.dtype == jnp.float32
    np.testing.assert_allclose(jax.nn.logsumexp(log_p, axis=-1), 0.0, atol=2e-5)
    assert float(log_p.max() - log_p.min()) > 3.0  # far from uniform: the test can fail


@pytest.mark.parametrize("d_model", [16, 12])
def test_single_cluster_is_the_plain_softmax(d_model):
    sm = _softmax_module(16, d_model, (), 1)
    assert sm.cluster_weight is None and len(sm.tables) == len(sm.projs) == 1
    h = _hidden(d_model)
    x = h if d_model == 16 else h @ _np(sm.projs[0]).T
    assert sm.tables[0].shape[0] == V + 6  # rounded up to a multiple of 8
    expected = _log_softmax(x @ _np(sm.tables[0])[:V].T + _np(sm.bias))
    np.testing.assert_allclose(sm.log_probs(jnp.asarray(h)), expected, atol=1e-4)


@pytest.mark.parametrize("cutoffs, widths", [((), [56]), (CUTOFFS, [16, 16, 16, 16])])
def test_cluster_rows_padded_to_a_multiple_of_8_score_nothing(cutoffs, widths, monkeypatch):
    """Every cluster's rows (the head's: shortlist + n_tails) come padded to a width GPU matmuls
    take as it is; the padding's logits have probability exactly 0, and the loss, every
    parameter's gradient and log_probs equal the unpadded clusters' (float64, 1e-12)."""
    with jax.enable_x64(True):
        f64 = {"dtype": jnp.float64, "param_dtype": jnp.float64}
        sm = _softmax_module(16, 16, cutoffs, 1, **f64)
        sizes = [end - start for start, end in sm.layout.clusters]
        sizes[0] += len(cutoffs)  # the head's cluster logits
        h = jnp.asarray(_hidden(16), jnp.float64)
        t = jnp.asarray(_targets(cutoffs))
        for i, (n, width) in enumerate(zip(sizes, widths, strict=True)):
            w, b, _ = sm._cluster(i, jnp.float64, jnp.float64)
            assert w.shape == (width, 16) and b.shape == (width,) and width > n
            assert float(jnp.abs(jax.nn.softmax(h @ w.T + b)[..., n:]).max()) == 0.0

        def loss_grads_and_log_probs():
            loss, grads = nnx.value_and_grad(lambda m: m.nll(h, t).sum())(sm)
            return [loss, *jax.tree.leaves(grads), sm.log_probs(h)]

        padded = loss_grads_and_log_probs()
        monkeypatch.setattr(adaptive, "ROW_MULTIPLE", 1)
        assert [
            sm._cluster(i, jnp.float64, jnp.float64)[0].shape[0] for i in range(len(sizes))
        ] == sizes
        for got, expected in zip(padded, loss_grads_and_log_probs(), strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("form", ["cpu", "other"])  # losses.log_softmax_at's two forms
@pytest.mark.parametrize("div_val", [1, 2, 4])
def test_nll_equals_gathered_log_probs(div_val, form, use_form):
    use_form(losses, form)
    sm = _softmax_module(64, 48, CUTOFFS, div_val)
    h, t = jnp.asarray(_hidden(48)), jnp.asarray(_targets(CUTOFFS))

    def gathered(h):
        return -jnp.take_along_axis(sm.log_probs(h), t[..., None], axis=-1)[..., 0]

    nll = sm.nll(h, t)
    assert nll.shape == t.shape
    np.testing.assert_allclose(nll, gathered(h), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        jax.grad(lambda h: sm.nll(h, t).sum())(h),
        jax.grad(lambda h: gathered(h).sum())(h),
        rtol=1e-4,
        atol=1e-5,
    )


def _by_hand_probs(sm: AdaptiveLogSoftmax, div_val: int, h: np.ndarray) -> np.ndarray:
    """p(v) for one hidden state h [d_model], token by token: p_head(v) for shortlist tokens,
    p_head(cluster i) * p_i(v | cluster i) otherwise, scoring v as (P_i h) . W_i[v] + b[v]."""
    edges = (0, *CUTOFFS, V)
    tables, projs = [_np(t) for t in sm.tables], [_np(p) for p in sm.projs]
    bias, cw, cb = _np(sm.bias), _np(sm.cluster_weight), _np(sm.cluster_bias)
    projected = [h if p is None else p @ h for p in projs]

    def score(v):
        i = int(np.searchsorted(CUTOFFS, v, side="right"))
        row = tables[0][v] if div_val == 1 else tables[i][v - edges[i]]
        return np.exp(row @ projected[i] + bias[v])

    cluster_scores = np.exp(cw @ projected[0] + cb)
    head_z = sum(score(v) for v in range(CUTOFFS[0])) + cluster_scores.sum()
    probs = np.zeros(V)
    for v in range(V):
        i = int(np.searchsorted(CUTOFFS, v, side="right"))
        if i == 0:
            probs[v] = score(v) / head_z
        else:
            tail_z = sum(score(u) for u in range(edges[i], edges[i + 1]))
            probs[v] = cluster_scores[i - 1] / head_z * score(v) / tail_z
    return probs


@pytest.mark.parametrize("div_val, d_model", [(1, 16), (1, 12), (2, 12), (2, 16)])
def test_probabilities_match_a_by_hand_numpy_reference(div_val, d_model):
    sm = _softmax_module(16, d_model, CUTOFFS, div_val)
    h = _hidden(d_model, (2, 3))
    probs = np.asarray(jnp.exp(sm.log_probs(jnp.asarray(h))))
    for pos in np.ndindex(2, 3):
        expected = _by_hand_probs(sm, div_val, h[pos].astype(np.float64))
        np.testing.assert_allclose(probs[pos], expected, rtol=2e-4, atol=1e-7)


@pytest.mark.parametrize(
    "div_val, d_embed, d_model", [(1, 16, 16), (1, 16, 12), (2, 16, 12), (4, 64, 64)]
)
def test_embedding_matches_a_per_token_loop(div_val, d_embed, d_model):
    layout = ClusterLayout.make(V, d_embed, d_model, CUTOFFS, div_val)
    emb = nnx.eval_shape(lambda: AdaptiveEmbedding(layout, rngs=_rngs()))  # shapes only
    _randomize(emb)
    tables, projs = [_np(t) for t in emb.tables], [_np(p) for p in emb.projs]
    tokens = _targets(CUTOFFS)
    out = np.asarray(emb(jnp.asarray(tokens)))
    assert out.shape == (*tokens.shape, d_model)
    edges = (0, *CUTOFFS, V)
    for pos in np.ndindex(tokens.shape):
        v = tokens[pos]
        i = 0 if div_val == 1 else int(np.searchsorted(CUTOFFS, v, side="right"))
        row = tables[i][v - (0 if div_val == 1 else edges[i])]
        assert row.shape == (d_embed // div_val**i,)
        expected = row if projs[i] is None else row @ projs[i]
        np.testing.assert_allclose(out[pos], expected * np.sqrt(d_model), rtol=1e-5, atol=1e-5)


class _LM(nnx.Module):
    """Adaptive embedding in, adaptive softmax out: the smallest model that uses tying."""

    def __init__(self, tie: bool, div_val: int, *, rngs: nnx.Rngs, capacity: float = 0.0, **dtypes):
        layout = ClusterLayout.make(V, 16, 12, CUTOFFS, div_val)
        self.embed = AdaptiveEmbedding(layout, rngs=rngs, **dtypes)
        self.out = AdaptiveLogSoftmax(
            layout,
            rngs=rngs,
            tie_embedding=self.embed if tie else None,
            tie_projs=(False, True, True, True) if tie else None,
            capacity=capacity,
            **dtypes,
        )

    def loss(self, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return self.out.nll(jnp.tanh(self.embed(tokens)), targets).mean()


def _num_params(module: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


@pytest.mark.parametrize("div_val", [1, 2])
def test_tied_weights_and_projections_are_the_embedding_variables(div_val):
    tied, untied = _LM(True, div_val, rngs=_rngs()), _LM(False, div_val, rngs=_rngs())
    emb, out = tied.embed, tied.out
    assert all(a is b for a, b in zip(out.tables, emb.tables, strict=True))
    assert out.projs[0] is not emb.projs[0]  # tie_projs[0] is False
    for i in (1, 2, 3):  # with div_val == 1 every cluster shares the one embedding projection
        assert out.projs[i] is emb.projs[0 if div_val == 1 else i]
    assert out.bias is not None and "bias" not in nnx.state(emb)
    tied_size = sum(t[...].size for t in emb.tables) + sum(
        emb.projs[0 if div_val == 1 else i][...].size for i in (1, 2, 3)
    )
    assert _num_params(tied) == _num_params(untied) - tied_size
    assert "tables" not in nnx.state(tied, nnx.Param)["out"]  # one variable, listed once


@pytest.mark.parametrize("div_val", [1, 2])
def test_tied_gradient_is_the_sum_of_both_uses(div_val):
    """Untied copies with equal values: d loss / d shared = grad(embedding) + grad(softmax)."""
    tied, untied = _LM(True, div_val, rngs=_rngs()), _LM(False, div_val, rngs=_rngs())
    _randomize(tied)
    nnx.update(untied.embed, nnx.state(tied.embed, nnx.Param))
    nnx.update(untied.out, nnx.state(tied.out, nnx.Param))
    for mine, theirs in zip(untied.out.projs, tied.out.projs, strict=True):  # state lists a
        if mine is not None:  # variable shared by several clusters only once
            mine[...] = theirs[...]
    tokens, targets = jnp.asarray(_targets(CUTOFFS)), jnp.asarray(_targets(CUTOFFS))
    loss_t, g_t = nnx.value_and_grad(lambda m: m.loss(tokens, targets))(tied)
    loss_u, g_u = nnx.value_and_grad(lambda m: m.loss(tokens, targets))(untied)
    np.testing.assert_allclose(loss_t, loss_u, rtol=1e-6)
    for g in range(len(tied.embed.tables)):
        in_grad, out_grad = _np(g_u["embed"]["tables"][g]), _np(g_u["out"]["tables"][g])
        assert np.abs(in_grad).max() > 0 and np.abs(out_grad).max() > 0
        np.testing.assert_allclose(
            _np(g_t["embed"]["tables"][g]), in_grad + out_grad, rtol=1e-4, atol=1e-7
        )
    shared_proj = _np(g_t["embed"]["projs"][0 if div_val == 1 else 1])
    expected = _np(g_u["embed"]["projs"][0 if div_val == 1 else 1])
    expected += sum(_np(g_u["out"]["projs"][i]) for i in ((1, 2, 3) if div_val == 1 else (1,)))
    np.testing.assert_allclose(shared_proj, expected, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(
        _np(g_t["out"]["projs"][0]), _np(g_u["out"]["projs"][0]), rtol=1e-4, atol=1e-7
    )


def test_jit_traces_once_with_static_shapes():
    model = _LM(True, 2, rngs=_rngs())
    _randomize(model)
    traces = []

    @nnx.jit
    def step(m, tokens, targets):
        traces.append(tokens.shape)
        h = jnp.tanh(m.embed(tokens))
        return m.out.nll(h, targets), m.out.log_probs(h)

    for _ in range(3):
        tokens, targets = jnp.asarray(_targets(CUTOFFS)), jnp.asarray(_targets(CUTOFFS))
        nll, log_p = step(model, tokens, targets)
        assert nll.shape == (3, 7) and log_p.shape == (3, 7, V)
        h = jnp.tanh(model.embed(tokens))
        np.testing.assert_allclose(nll, model.out.nll(h, targets), rtol=1e-5, atol=1e-6)
    assert len(traces) == 1


@pytest.mark.parametrize(
    "cutoffs, div_val, d_embed, error",
    [
        ((10, 10), 1, 16, "must increase strictly"),
        ((0, 10), 1, 16, "must increase strictly"),
        ((10, 50), 1, 16, "must increase strictly"),
        ((10, 25), 8, 16, "leave an empty cluster"),
    ],
)
def test_bad_layouts_raise(cutoffs, div_val, d_embed, error):
    with pytest.raises(ValueError, match=error):
        ClusterLayout.make(V, d_embed, 16, cutoffs, div_val)


def test_tying_needs_a_matching_embedding():
    emb = AdaptiveEmbedding(ClusterLayout.make(V, 16, 12, CUTOFFS, 2), rngs=_rngs())
    layout, other_layout = (ClusterLayout.make(V, 16, 12, CUTOFFS, d) for d in (2, 1))
    with pytest.raises(ValueError, match="different vocabulary/cluster layout"):
        AdaptiveLogSoftmax(other_layout, rngs=_rngs(), tie_embedding=emb)
    with pytest.raises(ValueError, match="tie_projs needs tie_embedding"):
        AdaptiveLogSoftmax(layout, rngs=_rngs(), tie_projs=(True,) * 4)
    with pytest.raises(ValueError, match="one entry per cluster"):
        AdaptiveLogSoftmax(layout, rngs=_rngs(), tie_embedding=emb, tie_projs=(True,))


def test_capacity_must_be_a_fraction():
    layout = ClusterLayout.make(V, 16, 12, CUTOFFS, 2)
    for capacity in (-0.1, 1.5):
        with pytest.raises(ValueError, match="capacity must lie in"):
            AdaptiveLogSoftmax(layout, rngs=_rngs(), capacity=capacity)


def _targets_with_counts(counts, shape=(3, 7)) -> np.ndarray:
    """Targets [shape] with counts[i] of them drawn uniformly from cluster i, shuffled."""
    rng = np.random.default_rng()
    edges = (0, *CUTOFFS, V)
    t = np.concatenate([rng.integers(edges[i], edges[i + 1], c) for i, c in enumerate(counts)])
    assert t.size == np.prod(shape)
    return rng.permutation(t).reshape(shape)


# capacity 0.25 of 21 positions: C = 6 gathered rows per tail cluster
CAPACITY_CASES = {
    "fits": (0.25, (9, 4, 6, 2)),  # cluster 2 exactly full
    "overflows": (0.25, (5, 3, 10, 3)),  # cluster 2 overflows (10 > 6): scored densely
    "one_row": (0.01, (19, 1, 0, 1)),  # C = 1: clusters 1 and 3 fit, cluster 2 is empty
    "all_overflow": (0.05, (3, 6, 6, 6)),  # C = 2: every tail cluster scored densely
}


@pytest.mark.parametrize("form", ["cpu", "other"])  # losses.log_softmax_at's two forms
@pytest.mark.parametrize(
    "div_val, case", [(1, c) for c in CAPACITY_CASES] + [(2, "fits"), (2, "overflows")]
)
def test_capacity_equals_the_dense_loss_and_gradients(div_val, case, form, use_form):
    """Tied LM: the capacity-limited NLL, its gradients w.r.t. the hidden states and every
    parameter (both uses of the tied tables) equal the dense path's, under jit."""
    use_form(losses, form)
    capacity, counts = CAPACITY_CASES[case]
    dense = _LM(True, div_val, rngs=_rngs())
    _randomize(dense)
    sparse = nnx.eval_shape(lambda: _LM(True, div_val, rngs=_rngs(), capacity=capacity))
    nnx.update(sparse, nnx.state(dense, nnx.Param))
    tokens, targets = jnp.asarray(_targets(CUTOFFS)), jnp.asarray(_targets_with_counts(counts))
    weights = jnp.asarray(np.random.default_rng().uniform(0.5, 1.5, targets.shape), jnp.float32)

    @nnx.jit
    def loss_and_grads(m, hidden):
        def loss(m):
            return (m.out.nll(jnp.tanh(m.embed(tokens)), targets) * weights).sum()

        value, g_params = nnx.value_and_grad(loss)(m)
        nll, vjp = jax.vjp(lambda h: m.out.nll(h, targets), hidden)
        return value, nll, g_params, vjp(weights)[0]

    hidden = jnp.asarray(_hidden(12))
    value_d, nll_d, g_d, gh_d = loss_and_grads(dense, hidden)
    value_s, nll_s, g_s, gh_s = loss_and_grads(sparse, hidden)
    np.testing.assert_allclose(value_s, value_d, rtol=1e-6)
    np.testing.assert_allclose(nll_s, nll_d, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gh_s, gh_d, rtol=1e-5, atol=1e-6 * np.abs(gh_d).max())
    assert np.abs(gh_d).min() > 0  # every position has a gradient
    leaves_d, leaves_s = jax.tree.leaves(g_d), jax.tree.leaves(g_s)
    assert len(leaves_d) == len(leaves_s) == len(jax.tree.leaves(nnx.state(dense, nnx.Param)))
    for a, b in zip(leaves_s, leaves_d, strict=True):
        assert a.shape == b.shape and np.abs(b).max() > 0  # float32 sums in another order:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())  # atol scaled


def test_capacity_switches_between_gathered_and_dense_without_retracing():
    """One compiled step serves batches that fit and batches that overflow, exactly."""
    sm = _softmax_module(16, 12, CUTOFFS, 2, capacity=0.25)
    dense = _softmax_module(16, 12, CUTOFFS, 2)
    nnx.update(dense, nnx.state(sm, nnx.Param))
    traces = []

    @nnx.jit
    def grads(m, h, t):
        traces.append(1)
        return jax.grad(lambda h: m.nll(h, t).sum())(h), m.nll(h, t)

    for _, counts in [*CAPACITY_CASES.values()][:2] * 2:
        h, t = jnp.asarray(_hidden(12)), jnp.asarray(_targets_with_counts(counts))
        for got, expected in zip(grads(sm, h, t), grads(dense, h, t), strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert len(traces) == 2  # one per module


def test_float64_matches_the_by_hand_reference():
    """With float64 parameters and dtype (jax_enable_x64) everything stays float64: log_probs,
    the dense and capacity NLL against the numpy reference to 1e-12 (gradients of the two
    paths too), the embedding against a per-token loop."""
    with jax.enable_x64(True):
        f64 = {"dtype": jnp.float64, "param_dtype": jnp.float64}
        sm = _softmax_module(16, 12, CUTOFFS, 2, **f64)
        sparse = _softmax_module(16, 12, CUTOFFS, 2, capacity=0.25, **f64)
        nnx.update(sparse, nnx.state(sm, nnx.Param))
        params = jax.tree.leaves(nnx.state(sm, nnx.Param))
        assert all(x.dtype == jnp.float64 for x in params)
        h = np.random.default_rng().standard_normal((3, 7, 12))
        t = _targets_with_counts(CAPACITY_CASES["fits"][1])  # the gathered rows are scored
        expected = np.zeros((3, 7, V))
        for pos in np.ndindex(3, 7):
            expected[pos] = _by_hand_probs(sm, 2, h[pos])
        log_p = sm.log_probs(jnp.asarray(h))
        assert log_p.dtype == jnp.float64
        np.testing.assert_allclose(np.exp(log_p), expected, rtol=1e-12, atol=1e-15)
        nll_expected = -np.log(np.take_along_axis(expected, t[..., None], -1)[..., 0])
        for module in (sm, sparse):
            nll = jax.jit(lambda m, h, t: m.nll(h, t))(module, jnp.asarray(h), jnp.asarray(t))
            assert nll.dtype == jnp.float64
            np.testing.assert_allclose(nll, nll_expected, rtol=1e-12)
        grad = nnx.jit(lambda m, h, t: jax.grad(lambda h: m.nll(h, t).sum())(h))
        grads = [grad(m, jnp.asarray(h), jnp.asarray(t)) for m in (sparse, sm)]
        assert grads[0].dtype == jnp.float64
        np.testing.assert_allclose(grads[0], grads[1], rtol=1e-12, atol=1e-14)

        layout = ClusterLayout.make(V, 16, 12, CUTOFFS, 2)
        emb = nnx.eval_shape(lambda: AdaptiveEmbedding(layout, rngs=_rngs(), **f64))
        _randomize(emb)
        out = emb(jnp.asarray(t))
        assert out.dtype == jnp.float64
        edges = (0, *CUTOFFS, V)
        for pos in np.ndindex(t.shape):
            i = int(np.searchsorted(CUTOFFS, t[pos], side="right"))
            row = _np(emb.tables[i])[t[pos] - edges[i]]
            row = row if emb.projs[i] is None else row @ _np(emb.projs[i])
            np.testing.assert_allclose(out[pos], row * np.sqrt(12), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float32])
def test_bfloat16_compute_keeps_param_dtype_and_float32_losses(param_dtype):
    """dtype bfloat16 (tied LM): parameters and their gradients stay in param_dtype, the
    embedding is bfloat16, log_probs and the NLL are float32. With the same (bfloat16-
    representable) values as a float32 module they agree to 0.1 nats + 2% (log_probs) and
    0.1 nats + 1% (NLL; measured: at most 0.05 nats, 2%); the embedding to 0.05 + 1%. The
    capacity path's summed NLL matches the dense bfloat16 one to 1% (per position measured
    0.025 nats, 0.4%: XLA may keep excess precision between bfloat16 ops differently)."""
    kw = {"dtype": jnp.bfloat16, "param_dtype": param_dtype}
    lm = nnx.eval_shape(lambda: _LM(True, 2, rngs=_rngs(), **kw))
    _randomize(lm)
    state = nnx.state(lm, nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(state)} == {jnp.dtype(param_dtype)}
    state = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(param_dtype), state)
    nnx.update(lm, state)  # values representable in bfloat16
    sparse = nnx.eval_shape(lambda: _LM(True, 2, rngs=_rngs(), capacity=0.5, **kw))
    nnx.update(sparse, state)
    ref = nnx.eval_shape(lambda: _LM(True, 2, rngs=_rngs()))
    nnx.update(ref, jax.tree.map(lambda x: x.astype(jnp.float32), state))

    h = jnp.asarray(_hidden(12), jnp.bfloat16).astype(jnp.float32)  # representable too
    t = jnp.asarray(_targets(CUTOFFS))

    @nnx.jit
    def outputs(m, h, t):
        return m.embed(t), m.out.log_probs(h), m.out.nll(h, t)

    (emb, log_p, nll), (emb_ref, log_p_ref, nll_ref) = outputs(lm, h, t), outputs(ref, h, t)
    assert emb.dtype == jnp.bfloat16 and log_p.dtype == nll.dtype == jnp.float32
    np.testing.assert_allclose(emb.astype(jnp.float32), emb_ref, rtol=0.01, atol=0.05)
    np.testing.assert_allclose(log_p, log_p_ref, rtol=0.02, atol=0.1)
    np.testing.assert_allclose(nll, nll_ref, rtol=0.01, atol=0.1)
    grads = nnx.jit(nnx.value_and_grad(lambda m: m.out.nll(h, t).sum()))(sparse)
    np.testing.assert_allclose(grads[0], nll.sum(), rtol=0.01)
    assert {x.dtype for x in jax.tree.leaves(grads[1])} == {jnp.dtype(param_dtype)}


def test_tables_are_stored_with_rows_for_fsdp_and_old_checkpoints_are_explained(tmp_path):
    """WikiText-103's 267,735-type table is stored as 267,736 rows, which fsdp=8 splits (the
    rows past the vocabulary are never read); a checkpoint of an unpadded table is refused
    with that cause."""
    from jax.sharding import PartitionSpec as P

    from xformer import sharding
    from xformer.checkpoint import Checkpointer

    wt103 = ClusterLayout.make(267_735, 410, 410, (20_000, 40_000, 200_000), 1)
    assert wt103.table_shapes() == [(267_736, 410)]
    fsdp8 = sharding.abstract_mesh((1, 8, 1))
    assert sharding.mesh_spec(P("vocab", None), (267_736, 410), fsdp8) == P("fsdp", None)
    div2 = ClusterLayout.make(V, 16, 12, CUTOFFS, 2)  # clusters of 10, 15, 15 and 10 tokens
    assert [rows for rows, _ in div2.table_shapes()] == [16, 16, 16, 16]
    old = {"table": jnp.asarray(np.random.default_rng().normal(size=(V, 4)))}
    checkpointer = Checkpointer(str(tmp_path))
    checkpointer.save(1, old)
    checkpointer.close()
    cause = "adaptive embedding tables had as many rows as their tokens"
    with pytest.raises(ValueError, match=cause):
        Checkpointer(str(tmp_path)).restore({"table": jnp.zeros((V + 6, 4))})


@pytest.mark.slow  # a subprocess on 4 simulated devices: ~15 s
def test_capacity_gathers_each_devices_own_rows(tmp_path):
    """Over a mesh that splits rows ((fsdp=4) and (data=2, tensor=2)), each device gathers the
    tail-cluster rows of its own positions (capacity of its own N; sharding.per_row_shard):
    with one device's rows overflowing a cluster (scored densely) and the others' fitting,
    the NLL and the gradients w.r.t. the hidden states and every parameter equal the dense
    path's in float64. Each device computes less than when every device gathers the whole
    batch's rows, as XLA's partitioner leaves that gather (XLA's FLOPs: 0.49x at fsdp=4, 0.67x
    at data=2, the head's share unchanged)."""
    report = json.loads(run_script(__file__, 4, str(tmp_path)).splitlines()[-1])
    for mesh, found in report.items():
        assert found["gap"] < 1e-12 * found["scale"], (mesh, found)
        assert found["flops"] < 0.75 * found["flops_whole_batch_gather"], (mesh, found)


def _four_devices() -> dict:
    """_LM's tied softmax, capacity 0.25 of each device's positions (64 at fsdp=4: 16 rows per
    tail cluster; the first device's 64 targets of cluster 2 overflow it)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from xformer import sharding

    assert jax.device_count() == 4, jax.devices()
    jax.config.update("jax_enable_x64", True)
    f64 = {"dtype": jnp.float64, "param_dtype": jnp.float64}
    dense = nnx.eval_shape(lambda: _LM(True, 2, rngs=_rngs(), **f64))
    _randomize(dense)
    sparse = nnx.eval_shape(lambda: _LM(True, 2, rngs=_rngs(), capacity=0.25, **f64))
    nnx.update(sparse, nnx.state(dense, nnx.Param))
    rng = np.random.default_rng()
    edges = (0, *CUTOFFS, V)
    targets = rng.integers(0, V, (8, 32))
    targets[:2] = rng.integers(edges[2], edges[3], (2, 32))  # the first 2 rows: cluster 2 only
    targets, hidden = jnp.asarray(targets), rng.standard_normal((8, 32, 12))
    weights = jnp.asarray(rng.uniform(0.5, 1.5, (8, 32)))

    def loss_and_grads(graphdef, params, hidden):
        def loss(params, hidden):
            return (nnx.merge(graphdef, params).out.nll(hidden, targets) * weights).sum()

        return jax.value_and_grad(loss, argnums=(0, 1))(params, hidden)

    graphdef, params = nnx.split(dense)
    expected = jax.tree.leaves(jax.jit(functools.partial(loss_and_grads, graphdef))(params, hidden))
    graphdef, params = nnx.split(sparse)
    report = {}
    for sizes in ((1, 4, 1), (2, 1, 2)):
        mesh = sharding.make_mesh(dict(zip(sharding.MESH_AXES, sizes, strict=True)))
        rows = jax.device_put(hidden, NamedSharding(mesh, P(sharding.BATCH_AXES)))
        step = jax.jit(sharding.traced_on(mesh, functools.partial(loss_and_grads, graphdef)))
        got = jax.tree.leaves(step(params, rows))
        flops = {"flops": step.lower(params, rows).compile().cost_analysis()["flops"]}
        with mock.patch.object(
            adaptive, "per_row_shard", lambda fn, rows, shared: fn(*rows, *shared)
        ):
            whole = jax.jit(sharding.traced_on(mesh, functools.partial(loss_and_grads, graphdef)))
            flops["flops_whole_batch_gather"] = (
                whole.lower(params, rows).compile().cost_analysis()["flops"]
            )
        report[str(sizes)] = {
            "gap": max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True)),
            "scale": max(float(np.max(np.abs(b))) for b in expected),
            **flops,
        }
    return report


if __name__ == "__main__":
    print(json.dumps(_four_devices()))


def test_capacity_rows_are_the_same_in_the_model_and_in_flops():
    """adaptive_capacity x positions, rounded before the ceiling (0.07 x 100 is
    7.000000000000001 in floating point), at least 1 and at most every position; flops.py
    counts the rows the model gathers."""
    from xformer.adaptive import capacity_rows

    cases = {(0.07, 100): 7, (0.15, 9000): 1350, (0.3, 10): 3, (0.3, 11): 4, (1e-9, 5): 1}
    assert {case: capacity_rows(*case) for case in cases} == cases
    assert capacity_rows(1.0, 5) == 5
