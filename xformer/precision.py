"""Dtype rules shared by the layers: what must stay at least float32, and a mask fill value that
is safe in every dtype.

A model computes in `model.dtype` (float32, bfloat16, or float64 under JAX_ENABLE_X64) and
stores parameters in `model.param_dtype`. Softmax, log-softmax, LayerNorm statistics, the loss
and decoding scores run in `at_least_float32(dtype)`: float32 for bfloat16 models and the
model's own dtype otherwise, so a float64 model has no hidden float32 step.
"""

import functools

import jax
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def wide_einsum(spec: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """jnp.einsum(spec, x, y) accumulated and returned in at_least_float32 of the operands'
    dtype (logits that a softmax reads), with gradients computed in the operands' dtype.

    Autodiff of an einsum with a float32 `preferred_element_type` would multiply the float32
    cotangent by the other bfloat16 operand upcast to float32: float32 matmuls (and twice the
    bytes) in the backward pass of a bfloat16 model. Here the cotangent is rounded to the
    operands' dtype first, as flash attention rounds its dS, so both gradient matmuls run in
    bfloat16 on an accelerator. For float32 and float64 operands it is the plain einsum.
    """
    return _wide_einsum_fwd(spec, x, y)[0]


def _wide_einsum_fwd(spec, x, y):
    wide = at_least_float32(jnp.result_type(x, y))
    return jnp.einsum(spec, x, y, preferred_element_type=wide), (x, y)


def _wide_einsum_bwd(spec, operands, g):
    x, y = operands
    _, vjp = jax.vjp(functools.partial(jnp.einsum, spec), x, y)
    return vjp(g.astype(jnp.result_type(x, y)))


wide_einsum.defvjp(_wide_einsum_fwd, _wide_einsum_bwd)


@jax.custom_vjp
def add_bias(x: jax.Array, b: jax.Array) -> jax.Array:
    """x [..., *b.shape] + b in x's dtype, with b's gradient summed over x's leading axes in
    float32 or wider and cast once to b's dtype: a float32 bias of a bfloat16 layer accumulates
    in float32, where autodiff sums the bfloat16 cotangent into a bfloat16 result (4,096 rows
    of ~1: 4,096 on XLA:CPU, for a float32 sum of 4,090-4,104), and XLA:GPU's split reductions
    round partial sums too."""
    return x + b.astype(x.dtype)


def _add_bias_fwd(x, b):
    return add_bias(x, b), b


def _add_bias_bwd(b, g):
    wide = at_least_float32(jnp.result_type(g, b))  # (a bfloat16 bias: summed in float32 too)
    return g, g.sum(tuple(range(g.ndim - b.ndim)), dtype=wide).astype(b.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)
