"""Token-level losses with padding weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from xformer import precision


def cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, label_smoothing: float = 0.0
) -> tuple[jax.Array, jax.Array]:
    """Label-smoothed cross-entropy and plain NLL, both summed over weighted tokens.

    logits [..., V], targets [...] int, weights [...] (0 on padding) -> (loss_sum, nll_sum), in
    the logits' dtype promoted to at least float32 (bfloat16 logits are upcast; float64 stays).
    The smoothed target puts 1 - label_smoothing on the target and label_smoothing / (V - 1) on
    every other token; the loss subtracts that target's entropy, so its minimum is 0.

    With z = logits - max and lse = log sum exp z, per token: nll = lse - z_t and the smoothed
    loss = lse - (conf - low) z_t - low sum(z) - entropy. The forward is three reductions over
    the logits; it keeps exp(z) [..., V] (in place of the logits) so that the custom VJP
    writes the gradient (softmax - smoothed target) * weight in one elementwise pass without
    a second exp over the vocabulary.
    """
    dtype = precision.at_least_float32(logits.dtype)
    weights = jnp.asarray(weights).astype(dtype)
    return _cross_entropy(logits.astype(dtype), targets, weights, float(label_smoothing))


def _smoothing(vocab: int, label_smoothing: float) -> tuple[float, float, float]:
    """(target probability, probability of each other token, entropy of that distribution)."""
    if not label_smoothing:
        return 1.0, 0.0, 0.0
    conf, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
    return conf, low, float(-(conf * np.log(conf) + (vocab - 1) * low * np.log(low)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cross_entropy(logits, targets, weights, label_smoothing):
    return _forward(logits, targets, weights, label_smoothing)[0]


def _forward(x, targets, weights, label_smoothing):
    conf, low, entropy = _smoothing(x.shape[-1], label_smoothing)
    top = x.max(-1)
    exp_z = jnp.exp(x - top[..., None])
    total = exp_z.sum(-1)
    lse = jnp.log(total)
    z_target = jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0] - top
    nll = lse - z_target
    if low:
        z_sum = x.sum(-1) - x.shape[-1] * top
        loss = lse - (conf - low) * z_target - low * z_sum - entropy
    else:
        loss = nll
    sums = ((loss * weights).sum(), (nll * weights).sum())
    return sums, (exp_z, total, targets, weights, loss, nll)


def _backward(label_smoothing, residuals, cotangents):
    exp_z, total, targets, weights, loss, nll = residuals
    d_loss, d_nll = cotangents
    conf, low, _ = _smoothing(exp_z.shape[-1], label_smoothing)
    g_loss, g_nll = d_loss * weights, d_nll * weights
    # d/dx of sum_j -q_j log p_j is p - q, with q = low + (conf - low) [j = target].
    is_target = jax.lax.broadcasted_iota(targets.dtype, exp_z.shape, exp_z.ndim - 1)
    is_target = is_target == targets[..., None]
    on_target = (g_loss * (conf - low) + g_nll)[..., None]
    d_logits = (
        ((g_loss + g_nll) / total)[..., None] * exp_z  # (g_loss + g_nll) * softmax
        - (g_loss * low)[..., None]
        - jnp.where(is_target, on_target, 0.0)
    )
    return d_logits, None, d_loss * loss + d_nll * nll


_cross_entropy.defvjp(_forward, _backward)
