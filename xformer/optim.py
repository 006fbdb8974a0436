"""Learning-rate schedules and the optax optimizer built from config.train."""

import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(t: ml_collections.ConfigDict) -> optax.Schedule:
    """rsqrt: the paper's lr = peak * min(step / warmup, sqrt(warmup / step)), peaking at the end
    of warm-up; cosine: linear warm-up then cosine decay to 0 at num_steps; constant: warm-up
    then flat.
    """
    peak, warmup = t.learning_rate, max(t.warmup_steps, 1)
    if t.schedule == "rsqrt":

        def rsqrt(step):
            step = jnp.maximum(step, 1).astype(jnp.float32)
            return peak * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))

        return rsqrt
    if t.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(t.num_steps, warmup + 1))
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup]
    )


def make_optimizer(t: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Adam(b1, b2=0.98, eps=1e-9) as in the paper; AdamW when weight_decay > 0; optional clip."""
    schedule = learning_rate_schedule(t)
    if t.weight_decay:
        opt = optax.adamw(schedule, t.b1, t.b2, t.eps, weight_decay=t.weight_decay)
    else:
        opt = optax.adam(schedule, t.b1, t.b2, t.eps)
    if t.grad_clip_norm:
        opt = optax.chain(optax.clip_by_global_norm(t.grad_clip_norm), opt)
    return opt
