"""Dtype rules shared by the layers: what must stay at least float32, and a mask fill value that
is safe in every dtype.

A model computes in `model.dtype` (float32, bfloat16, or float64 under JAX_ENABLE_X64) and
stores parameters in `model.param_dtype`. Softmax, log-softmax, LayerNorm statistics, the loss
and decoding scores run in `at_least_float32(dtype)`: float32 for bfloat16 models and the
model's own dtype otherwise, so a float64 model has no hidden float32 step.
"""

import jax.numpy as jnp
import numpy as np


def at_least_float32(dtype) -> np.dtype:
    """float32 for narrower floats (bfloat16, float16), else dtype itself (float32, float64)."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


def mask_value(dtype) -> float:
    """A large finite negative logit for masked keys in `dtype`: exp underflows to exactly 0,
    and a fully masked row stays finite (a uniform softmax, never NaN), unlike -inf or a
    constant such as -1e9 that overflows float16."""
    return float(jnp.finfo(dtype).min) / 2
