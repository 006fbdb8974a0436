"""Learning-rate schedules and the optax optimizer built from config.train."""

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(t: ml_collections.ConfigDict) -> optax.Schedule:
    """The rate of training step `step` (1 = the first update), as logged at that step.

    rsqrt: the paper's lr = peak * min(step / warmup, sqrt(warmup / step)), peaking at the end
    of warm-up; cosine: linear warm-up to the peak at step warmup, then cosine decay towards 0,
    which it would reach one step after num_steps; constant: warm-up then flat.
    """
    peak, warmup = t.learning_rate, max(t.warmup_steps, 1)
    if t.schedule == "rsqrt":

        def rsqrt(step):
            step = jnp.maximum(step, 1).astype(jnp.float32)
            return peak * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))

        return rsqrt
    if t.schedule == "cosine":
        end = max(t.num_steps, warmup) + 1  # the last step still learns
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, end)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup]
    )


# Parameters weight decay leaves alone: biases (XL's position biases u and v, T5's bucket
# table of attention-logit biases, the adaptive softmax's cluster bias) and normalisation
# scales; it decays weights and embedding tables (a learned position table's leaf is "embedding").
NO_DECAY = frozenset({"bias", "scale", "u", "v", "table", "cluster_bias"})


def decay_mask(params: Any) -> Any:
    """The params pytree with True where weight decay applies (by each leaf's own name)."""

    def decayed(path, _) -> bool:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        return not names or names[-1] not in NO_DECAY

    return jax.tree.map_with_path(decayed, params)


def make_optimizer(t: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Adam(b1, b2=0.98, eps=1e-9) as in the paper; AdamW when weight_decay > 0 (decoupled, on
    the parameters of `decay_mask`); optional clipping of the global gradient norm."""
    step_rate = learning_rate_schedule(t)

    def schedule(count):  # optax counts the updates already applied: update count + 1 is next
        return step_rate(count + 1)

    if t.weight_decay:
        opt = optax.adamw(schedule, t.b1, t.b2, t.eps, weight_decay=t.weight_decay, mask=decay_mask)
    else:
        opt = optax.adam(schedule, t.b1, t.b2, t.eps)
    if t.grad_clip_norm:
        opt = optax.chain(optax.clip_by_global_norm(t.grad_clip_norm), opt)
    return opt
