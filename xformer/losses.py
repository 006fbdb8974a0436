"""Token-level losses with padding weights."""

import jax
import jax.numpy as jnp


def cross_entropy(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, label_smoothing: float = 0.0
) -> tuple[jax.Array, jax.Array]:
    """Label-smoothed cross-entropy and plain NLL, both summed over weighted tokens.

    logits [B, L, V], targets [B, L] int, weights [B, L] (0 on padding) -> (loss_sum, nll_sum).
    The smoothed loss subtracts the entropy of the smoothed target, so its minimum is 0.
    """
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    if label_smoothing:
        confidence, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
        smooth = -(log_probs.sum(-1) + nll) * low  # mass on the other V-1 tokens
        entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low))
        loss = confidence * nll + smooth - entropy
    else:
        loss = nll
    return (loss * weights).sum(), (nll * weights).sum()
