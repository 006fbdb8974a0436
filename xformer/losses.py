"""Token-level losses with padding weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from xformer import precision

# Backends whose forward keeps exp(z) [..., V] for the backward pass (no second exp over the
# vocabulary there), after reductions for the max, then sum(exp z) and sum(z). Elsewhere
# (XLA:GPU) the three statistics come from one pass over the logits, the reduction carrying
# (max, sum of exp, sum) with the sum rescaled when the max grows, and the backward pass
# recomputes exp(z) from the logits (XLA:GPU did so anyway, rather than keep exp(z)).
# bench/gpu_compile.py, wmt14 bf16 fused on an H100: the [24576, 32000] logits are read once
# instead of twice in the forward pass: loss 3.22 -> 1.65 GB a step, floor -0.47 ms.
CPU_FORM_PLATFORMS = frozenset({"cpu"})


def cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, label_smoothing: float = 0.0
) -> tuple[jax.Array, jax.Array]:
    """Label-smoothed cross-entropy and plain NLL, both summed over weighted tokens.

    logits [..., V], targets [...] int, weights [...] (0 on padding) -> (loss_sum, nll_sum), in
    the logits' dtype promoted to at least float32 (bfloat16 logits are upcast; float64 stays).
    The upcast happens inside the loss's custom VJP, so bfloat16 logits reach it as the output
    layer wrote them (XLA:TPU fused an upcast made before it into the output layer's matmul,
    which then wrote float32 logits that every pass over them read).
    The smoothed target puts 1 - label_smoothing on the target and label_smoothing / (V - 1) on
    every other token; the loss subtracts that target's entropy, so its minimum is 0.

    With z = logits - max and lse = log sum exp z, per token: nll = lse - z_t and the smoothed
    loss = lse - (conf - low) z_t - low sum(z) - entropy. The custom VJP writes the gradient
    (softmax - smoothed target) * weight in one elementwise pass over the vocabulary.
    """
    weights = jnp.asarray(weights).astype(precision.at_least_float32(logits.dtype))
    return _cross_entropy(logits, targets, weights, float(label_smoothing), logits.dtype)


def _smoothing(vocab: int, label_smoothing: float) -> tuple[float, float, float]:
    """(target probability, probability of each other token, entropy of that distribution)."""
    if not label_smoothing:
        return 1.0, 0.0, 0.0
    conf, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
    return conf, low, float(-(conf * np.log(conf) + (vocab - 1) * low * np.log(low)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _cross_entropy(logits, targets, weights, label_smoothing, dtype):
    """dtype: the logits' (their gradient's)."""
    return _forward(logits, targets, weights, label_smoothing, dtype)[0]


def _online_max_and_sums(a: tuple, b: tuple) -> tuple:
    """Combines two partial (max, sum of exp(x - max), sum of x): one exp, of the gap between
    the maxima, rescales the sum whose max is the smaller (equal maxima: exp(0), also for
    -inf, the reduction's start)."""
    (top_a, exp_a, sum_a), (top_b, exp_b, sum_b) = a, b
    rescale = jnp.exp(jnp.where(top_a == top_b, 0.0, -jnp.abs(top_a - top_b)))
    exp_sum = jnp.where(top_a >= top_b, exp_a + exp_b * rescale, exp_a * rescale + exp_b)
    return jnp.maximum(top_a, top_b), exp_sum, sum_a + sum_b


def _row_statistics(logits: jax.Array) -> tuple:
    """logits [..., V] -> (max, sum exp(x - max), sum x) each [...] of x, the logits in
    at_least_float32 of their dtype, and what the backward pass keeps to get exp(x - max)
    back (`_exp_z`): (exp(x - max), None), or (the logits in their own dtype, max)."""
    x = logits.astype(precision.at_least_float32(logits.dtype))
    if jax.default_backend() in CPU_FORM_PLATFORMS:
        top = x.max(-1)
        exp_z = jnp.exp(x - top[..., None])
        return top, exp_z.sum(-1), x.sum(-1), (exp_z, None)
    start = (jnp.array(-jnp.inf, x.dtype), jnp.array(0, x.dtype), jnp.array(0, x.dtype))
    stats = jax.lax.reduce((x, jnp.ones_like(x), x), start, _online_max_and_sums, (x.ndim - 1,))
    return (*stats, (logits, stats[0]))


def _forward(logits, targets, weights, label_smoothing, dtype):
    conf, low, entropy = _smoothing(logits.shape[-1], label_smoothing)
    top, total, x_sum, kept = _row_statistics(logits)
    lse = jnp.log(total)
    z_target = _at(logits, targets).astype(top.dtype) - top
    nll = lse - z_target
    if low:
        z_sum = x_sum - logits.shape[-1] * top
        loss = lse - (conf - low) * z_target - low * z_sum - entropy
    else:
        loss = nll
    sums = ((loss * weights).sum(), (nll * weights).sum())
    return sums, (*kept, total, targets, weights, loss, nll)


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[..., index]: x [..., V], index [...] int -> [...]."""
    return jnp.take_along_axis(x, index[..., None], axis=-1)[..., 0]


def _backward(label_smoothing, dtype, residuals, cotangents):
    *kept, total, targets, weights, loss, nll = residuals
    exp_z = _exp_z(*kept)
    d_loss, d_nll = cotangents
    conf, low, _ = _smoothing(exp_z.shape[-1], label_smoothing)
    g_loss, g_nll = d_loss * weights, d_nll * weights
    # d/dx of sum_j -q_j log p_j is p - q, with q = low + (conf - low) [j = target].
    d_logits = _softmax_minus_target(
        exp_z, total, targets, g_loss + g_nll, g_loss * (conf - low) + g_nll, g_loss * low
    )
    return d_logits.astype(dtype), None, d_loss * loss + d_nll * nll


def _exp_z(exp_z_or_x: jax.Array, top: jax.Array | None) -> jax.Array:
    """exp(x - max) [..., V]: kept by the forward pass (top None), or recomputed from x."""
    if top is None:
        return exp_z_or_x
    return jnp.exp(exp_z_or_x.astype(top.dtype) - top[..., None])


def _softmax_minus_target(exp_z, total, targets, scale, on_target, uniform=None) -> jax.Array:
    """scale * softmax - on_target * onehot(targets) - uniform, [..., V] in one elementwise pass;
    softmax = exp_z / total, the other arguments [...]."""
    is_target = jax.lax.broadcasted_iota(targets.dtype, exp_z.shape, exp_z.ndim - 1)
    is_target = is_target == targets[..., None]
    d = (scale / total)[..., None] * exp_z
    if uniform is not None:
        d = d - uniform[..., None]
    return d - jnp.where(is_target, on_target[..., None], 0.0)


_cross_entropy.defvjp(_forward, _backward)


def log_softmax_at(logits: jax.Array, index: jax.Array) -> jax.Array:
    """log_softmax(logits)[..., index]: logits [..., V], index [...] int -> [...], in the logits'
    dtype promoted to at least float32.

    The same as ``jnp.take_along_axis(jax.nn.log_softmax(logits), index[..., None], -1)``
    without the [..., V] log-softmax: the forward pass computes the row statistics (and keeps
    exp(z) on XLA:CPU, as `cross_entropy` does), and a custom VJP writes the gradient
    g * (onehot(index) - softmax) in one elementwise pass, where autodiff would scatter g
    into a zero [..., V] array and then run the log-softmax's own backward pass over it.
    """
    return _log_softmax_at(logits, index, logits.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _log_softmax_at(logits, index, dtype):
    """dtype: the logits' (their gradient's); they are upcast inside, as in `cross_entropy`."""
    return log_softmax_at_with_residuals(logits, index)[0]


def log_softmax_at_with_residuals(logits: jax.Array, index: jax.Array) -> tuple[jax.Array, tuple]:
    """`log_softmax_at`, and the residuals its gradient needs: the forward half of its VJP, for
    callers that keep the residuals themselves. Off CPU the residuals hold the logits in their
    own dtype (bfloat16 logits: half a float32 copy's bytes)."""
    top, total, _, kept = _row_statistics(logits)
    return _at(logits, index).astype(top.dtype) - top - jnp.log(total), (*kept, total, index)


def log_softmax_at_gradient(residuals: tuple, g: jax.Array) -> jax.Array:
    """g [...] -> d sum(g * log_softmax_at(logits, index)) / d logits [..., V], from the
    residuals of `log_softmax_at_with_residuals`: g * (onehot(index) - softmax)."""
    *kept, total, index = residuals
    return _softmax_minus_target(_exp_z(*kept), total, index, -g, -g)


def _log_softmax_at_forward(logits, index, dtype):
    return log_softmax_at_with_residuals(logits, index)


def _log_softmax_at_backward(dtype, residuals, g):
    return log_softmax_at_gradient(residuals, g).astype(dtype), None


_log_softmax_at.defvjp(_log_softmax_at_forward, _log_softmax_at_backward)
