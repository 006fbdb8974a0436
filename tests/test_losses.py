"""cross_entropy and log_softmax_at (custom VJPs) against independent numpy formulas: values,
gradients, dtypes; every test runs both forms of their row statistics (XLA:CPU's passes that
keep exp(z), and the one-pass online reduction of the other backends)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformer import losses
from xformer.losses import cross_entropy, log_softmax_at


@pytest.fixture(autouse=True, params=["cpu", "other"])
def form(request, use_form):
    use_form(losses, request.param)
    return request.param


def numpy_reference(logits, targets, weights, smoothing):
    """(loss_sum, nll_sum, d loss_sum / d logits, d nll_sum / d logits) in float64, from the
    smoothed target distribution q written out explicitly."""
    x = np.asarray(logits, np.float64)
    v = x.shape[-1]
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    onehot = np.eye(v)[targets]
    q = onehot * (1 - smoothing) + (1 - onehot) * (smoothing / (v - 1) if smoothing else 0.0)
    log_q = np.log(np.where(q > 0, q, 1.0))
    kl = (q * (log_q - np.log(p))).sum(-1)  # cross-entropy minus the entropy of q
    nll = -np.log((p * onehot).sum(-1))
    w = np.asarray(weights, np.float64)[..., None]
    return (kl * w[..., 0]).sum(), (nll * w[..., 0]).sum(), (p - q) * w, (p - onehot) * w


def random_inputs(rng, shape, vocab, scale=3.0):
    logits = rng.standard_normal((*shape, vocab)) * scale + rng.standard_normal()
    targets = rng.integers(0, vocab, shape)
    weights = rng.random(shape) * (rng.random(shape) < 0.8)  # fractional weights and zeros
    return logits, targets, weights


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_values_and_gradients_match_numpy(smoothing, shape):
    rng = np.random.default_rng()
    vocab = int(rng.integers(5, 40))
    logits, targets, weights = random_inputs(rng, shape, vocab)
    loss, nll, d_loss, d_nll = numpy_reference(logits, targets, weights, smoothing)
    x, t, w = (jnp.asarray(a, jnp.float32) for a in (logits, targets, weights))
    t = t.astype(jnp.int32)
    got = cross_entropy(x, t, w, smoothing)
    assert all(g.dtype == jnp.float32 for g in got)
    np.testing.assert_allclose(got, (loss, nll), rtol=2e-5, atol=1e-5)
    for index, expected in ((0, d_loss), (1, d_nll)):
        grad = jax.jit(jax.grad(lambda x, i=index: cross_entropy(x, t, w, smoothing)[i]))(x)
        np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6)


def test_gradient_of_a_mix_of_both_outputs_and_of_the_weights():
    rng = np.random.default_rng()
    logits, targets, weights = random_inputs(rng, (4, 6), 13)
    _, _, d_loss, d_nll = numpy_reference(logits, targets, weights, 0.2)
    x, w = jnp.asarray(logits, jnp.float32), jnp.asarray(weights, jnp.float32)
    t = jnp.asarray(targets)

    def mix(x, w):
        loss, nll = cross_entropy(x, t, w, 0.2)
        return 0.7 * loss - 1.3 * nll

    dx, dw = jax.grad(mix, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(dx, 0.7 * d_loss - 1.3 * d_nll, rtol=1e-4, atol=1e-6)
    expected = np.zeros_like(weights)  # d/dw_i: token i's own loss and NLL
    for i in np.ndindex(weights.shape):
        one_loss, one_nll, _, _ = numpy_reference(logits[i], targets[i], 1.0, 0.2)
        expected[i] = 0.7 * one_loss - 1.3 * one_nll
    np.testing.assert_allclose(dw, expected, rtol=1e-4, atol=1e-5)


def test_bool_weights_and_bfloat16_logits_give_float32_loss_and_bfloat16_gradient():
    rng = np.random.default_rng()
    logits, targets, weights = random_inputs(rng, (3, 4), 17)
    mask = weights > 0
    x16 = jnp.asarray(logits, jnp.bfloat16)
    loss, nll, d_loss, _ = numpy_reference(np.asarray(x16, np.float64), targets, mask, 0.1)
    got = cross_entropy(x16, jnp.asarray(targets), jnp.asarray(mask), 0.1)
    assert got[0].dtype == jnp.float32
    np.testing.assert_allclose(got, (loss, nll), rtol=2e-5, atol=1e-5)
    grad = jax.grad(lambda x: cross_entropy(x, jnp.asarray(targets), jnp.asarray(mask), 0.1)[0])
    d = grad(x16)
    assert d.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(d, np.float64), d_loss, rtol=2e-2, atol=2e-3)


def test_float64_stays_float64_to_1e12():
    rng = np.random.default_rng()
    logits, targets, weights = random_inputs(rng, (3, 5), 23, scale=10.0)
    loss, nll, d_loss, _ = numpy_reference(logits, targets, weights, 0.1)
    with jax.enable_x64(True):
        x, w = jnp.asarray(logits, jnp.float64), jnp.asarray(weights, jnp.float64)
        t = jnp.asarray(targets)
        got = jax.jit(lambda x: cross_entropy(x, t, w, 0.1))(x)
        d = jax.jit(jax.grad(lambda x: cross_entropy(x, t, w, 0.1)[0]))(x)
        assert got[0].dtype == d.dtype == jnp.float64
        np.testing.assert_allclose(got, (loss, nll), rtol=1e-12)
        np.testing.assert_allclose(d, d_loss, rtol=1e-10, atol=1e-14)


def test_large_logits_are_stable():
    """A shift by 1e4 changes nothing (the max is subtracted before exp)."""
    rng = np.random.default_rng()
    logits, targets, weights = random_inputs(rng, (2, 3), 11)
    args = jnp.asarray(targets), jnp.asarray(weights, jnp.float32), 0.1
    base = cross_entropy(jnp.asarray(logits, jnp.float32), *args)
    shifted = cross_entropy(jnp.asarray(logits + 1e4, jnp.float32), *args)
    assert np.all(np.isfinite(shifted))
    np.testing.assert_allclose(shifted, base, rtol=1e-3)


def test_tied_maxima_and_minus_infinity_logits():
    """Integer logits (many rows with a tied maximum, where the online reduction rescales by
    exp(0)) and -inf entries (a banned token: probability 0, gradient 0)."""
    rng = np.random.default_rng()
    logits = rng.integers(-2, 3, (6, 40)).astype(np.float64)
    targets = rng.integers(0, 40, 6)
    banned = rng.random(logits.shape) < 0.2
    banned[np.arange(6), targets] = False
    logits[banned] = -np.inf
    weights = rng.random(6) + 0.1
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0) in the (unused) KL term
        _, nll, _, d_loss = numpy_reference(logits, targets, weights, 0.0)  # loss = nll here
    with jax.enable_x64(True):
        x, w, t = jnp.asarray(logits), jnp.asarray(weights), jnp.asarray(targets)
        got = jax.jit(lambda x: cross_entropy(x, t, w))(x)
        d = jax.jit(jax.grad(lambda x: cross_entropy(x, t, w)[0]))(x)
    np.testing.assert_allclose(got, (nll, nll), rtol=1e-12)
    np.testing.assert_allclose(d, d_loss, rtol=1e-10, atol=1e-14)
    assert np.all(np.asarray(d)[banned] == 0.0)


def log_softmax_at_reference(logits, index, g):
    """(log p[index] [...], d sum(g * log p[index]) / d logits [..., V]) in float64."""
    x = np.asarray(logits, np.float64)
    with np.errstate(divide="ignore"):  # -inf logits: p = 0, log p = -inf
        log_p = x - x.max(-1, keepdims=True)
        log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
    onehot = np.eye(x.shape[-1])[index]
    value = np.take_along_axis(log_p, np.asarray(index)[..., None], -1)[..., 0]
    return value, np.asarray(g)[..., None] * (onehot - np.exp(log_p))


def _log_softmax_at_and_gradient(x, index, g):
    value, vjp = jax.vjp(lambda x: log_softmax_at(x, index), x)
    return value, vjp(g)[0]


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_log_softmax_at_matches_numpy(shape):
    rng = np.random.default_rng()
    vocab = int(rng.integers(5, 300))
    logits, index, _ = random_inputs(rng, shape, vocab)
    g = rng.standard_normal(shape)
    value, grad = log_softmax_at_reference(logits, index, g)
    x, i, g32 = jnp.asarray(logits, jnp.float32), jnp.asarray(index), jnp.asarray(g, jnp.float32)
    got, d = jax.jit(_log_softmax_at_and_gradient)(x, i, g32)
    assert got.shape == shape and got.dtype == d.dtype == jnp.float32
    np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d, grad, rtol=1e-4, atol=1e-6)


def test_log_softmax_at_in_float64_to_1e12_with_ties_and_minus_infinity():
    """Integer logits (tied maxima) and -inf entries (probability 0, gradient 0)."""
    rng = np.random.default_rng()
    logits = rng.integers(-2, 3, (6, 40)).astype(np.float64)
    logits[:3] += rng.standard_normal((3, 40)) * 10.0
    index = rng.integers(0, 40, 6)
    banned = rng.random(logits.shape) < 0.2
    banned[np.arange(6), index] = False
    logits[banned] = -np.inf
    g = rng.standard_normal(6)
    value, grad = log_softmax_at_reference(logits, index, g)
    with jax.enable_x64(True):
        got, d = jax.jit(_log_softmax_at_and_gradient)(*map(jnp.asarray, (logits, index, g)))
        assert got.dtype == d.dtype == jnp.float64
    # atol: a row whose target holds nearly all the mass has a log-probability near 0 (-1e-6
    # drawn once), known only to float64's spacing at 1, 2.2e-16.
    np.testing.assert_allclose(got, value, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(d, grad, rtol=1e-10, atol=1e-14)
    assert np.all(np.asarray(d)[banned] == 0.0)


def test_log_softmax_at_of_bfloat16_logits_is_float32_with_a_bfloat16_gradient():
    rng = np.random.default_rng()
    logits, index, _ = random_inputs(rng, (3, 4), 17)
    x16 = jnp.asarray(logits, jnp.bfloat16)
    g = rng.standard_normal((3, 4))
    value, grad = log_softmax_at_reference(np.asarray(x16, np.float64), index, g)
    got, d = _log_softmax_at_and_gradient(x16, jnp.asarray(index), jnp.asarray(g, jnp.float32))
    assert got.dtype == jnp.float32 and d.dtype == jnp.bfloat16
    np.testing.assert_allclose(got, value, rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(d, np.float64), grad, rtol=2e-2, atol=2e-3)


def test_residuals_of_bfloat16_logits_keep_them_in_bfloat16(form):
    """log_softmax_at_with_residuals on bfloat16 logits (the adaptive softmax's sparse path
    keeps its residuals itself): value and gradient are those of the float32-upcast logits
    against numpy, and off CPU the residuals hold the logits in bfloat16, not a float32 copy."""
    rng = np.random.default_rng()
    logits, index, _ = random_inputs(rng, (6,), 37)
    x16, i = jnp.asarray(logits, jnp.bfloat16), jnp.asarray(index)
    g = rng.standard_normal(6)
    value, grad = log_softmax_at_reference(np.asarray(x16, np.float64), index, g)
    got, residuals = losses.log_softmax_at_with_residuals(x16, i)
    d = losses.log_softmax_at_gradient(residuals, jnp.asarray(g, jnp.float32))
    assert got.dtype == jnp.float32 and d.dtype == jnp.float32
    np.testing.assert_allclose(got, value, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(d, grad, rtol=2e-5, atol=2e-6)
    kept = residuals[0]
    if form == "cpu":  # exp(z), kept by the forward pass
        assert kept.dtype == jnp.float32
    else:
        assert kept.dtype == jnp.bfloat16
        np.testing.assert_array_equal(kept, x16)


@pytest.mark.parametrize("loss", ["cross_entropy", "log_softmax_at"])
def test_bfloat16_logits_reach_the_custom_vjp_unconverted(loss):
    """Both losses upcast inside their custom VJP, and the residual they keep off CPU is the
    bfloat16 logits: on XLA:TPU an upcast before the custom VJP was fused into the output
    layer's matmul, which then wrote float32 logits for every pass to read."""
    rng = np.random.default_rng()
    logits, index, weights = random_inputs(rng, (3, 4), 17)
    x16, i = jnp.asarray(logits, jnp.bfloat16), jnp.asarray(index)
    if loss == "cross_entropy":
        fn = lambda x: cross_entropy(x, i, jnp.asarray(weights), 0.1)[0]  # noqa: E731
    else:
        fn = lambda x: log_softmax_at(x, i).sum()  # noqa: E731
    eqns = jax.make_jaxpr(fn)(x16).jaxpr.eqns
    calls = [e for e in eqns if "custom_vjp" in e.primitive.name]
    assert len(calls) == 1 and calls[0].invars[0].aval.dtype == jnp.bfloat16
    upcasts = [e for e in eqns if e.primitive.name == "convert_element_type"]
    assert all(e.invars[0].aval.shape != x16.shape for e in upcasts)
    value, d = jax.value_and_grad(fn)(x16)
    assert value.dtype == jnp.float32 and d.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(d, np.float32))) and np.any(np.asarray(d) != 0)
