"""LayerNorm over the last axis with a hand-written backward pass.

nnx.LayerNorm's parameters (`scale`, `bias`) and function, y = (x - mean) / sqrt(var + eps) *
scale + bias with the statistics in at least float32. Why a custom VJP: autodiff's backward
reduces g * broadcast(scale) over the features; XLA:CPU fuses that multiply into a YNNPACK
reduction, which cannot take the broadcast in, so every LayerNorm materialised scale
broadcast to the activations' shape first (15 such [64, 32, 256] copies, ~20 ms of a 320 ms
train step in bench/cpu_vs_pytorch.py). On XLA:CPU (CPU_FORM_PLATFORMS) the two feature
reductions of the backward are therefore matrix-vector products with scale, and the broadcast
stays inside elementwise fusions; the normalized activations are kept for the backward pass.

Elsewhere the reductions stay reductions: XLA:GPU feeds a product from a float32 [2N, d]
operand that it writes and reads back. And the backward pass keeps x with its statistics
behind an optimization barrier: given the normalized activations XLA:GPU recomputes them
from x, statistics included, and writes g * normalized in float32 for the scale's gradient.
bench/gpu_compile.py, wmt14 bf16 on an H100, per step: 1,420 -> 1,360 kernels and 72.2 ->
63.7 GB at their boundaries for the reductions; then 1,390 kernels and 60.8 GB (LayerNorm with
the residual additions it absorbs: 11.4 -> 8.4 GB) for the kept statistics. For 16-bit
activations the forward pass there takes the variance as E[x^2] - E[x]^2 (clipped at 0;
nnx.LayerNorm's default formula, `use_fast_variance`), so that the residual addition, the
mean and the mean square are one kernel: 60 fewer kernels and 0.77 GB less a wmt14 step. Its
float32 rounding grows with the square of a row's mean in standard deviations, but stays far
below the rounding of bfloat16 inputs themselves (rows up to 100 standard deviations off 0:
the output within one bfloat16 ulp of the two-pass form's); float32 and float64 activations
keep the two-pass variance, as XLA:CPU does.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from xformer import precision

CPU_FORM_PLATFORMS = frozenset({"cpu"})  # backends that get the form made for XLA:CPU


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    return _forward(x, scale, bias, eps)[0]


def _forward(x, scale, bias, eps):
    stats = precision.at_least_float32(x.dtype)
    cpu_form = jax.default_backend() in CPU_FORM_PLATFORMS
    x32 = x.astype(stats)
    mean = x32.mean(-1, keepdims=True)
    centred = x32 - mean
    if cpu_form or jnp.dtype(x.dtype).itemsize >= 4:
        var = (centred * centred).mean(-1, keepdims=True)
    else:  # one pass over x: E[x^2] - E[x]^2, clipped at 0 (nnx.LayerNorm's default formula)
        var = jnp.maximum((x32 * x32).mean(-1, keepdims=True) - mean * mean, 0.0)
    rstd = jax.lax.rsqrt(var + eps)
    normalized = centred * rstd
    y = (normalized * scale.astype(stats) + bias.astype(stats)).astype(x.dtype)
    if cpu_form:
        # kept in x's dtype: a bfloat16 model keeps half the bytes (its activations are bf16)
        return y, (normalized.astype(x.dtype), None, rstd, scale)
    # the statistics as they are: without the barrier XLA:GPU recomputes them in the backward
    # pass, and the scale's column reduction cannot fuse with that row reduction
    mean, rstd = jax.lax.optimization_barrier((mean, rstd))
    return y, (x, mean, rstd, scale)


def _backward(eps, residuals, g):
    kept, mean, rstd, scale = residuals  # kept: normalized, or x with its mean
    x_dtype, g = g.dtype, g.astype(rstd.dtype)  # y and so g have x's dtype
    normalized = kept.astype(rstd.dtype)
    normalized = normalized if mean is None else (normalized - mean) * rstd
    scale32 = scale.astype(rstd.dtype)
    rows = tuple(range(g.ndim - 1))
    d_scale = (g * normalized).sum(rows).astype(scale.dtype)
    d_bias = g.sum(rows).astype(scale.dtype)
    # d/dx of normalized * scale, with u = g * scale: rstd * (u - mean(u) - n * mean(u * n))
    if jax.default_backend() in CPU_FORM_PLATFORMS:  # both means as products with scale
        mean_u = (g @ scale32)[..., None] / g.shape[-1]
        mean_un = ((g * normalized) @ scale32)[..., None] / g.shape[-1]
    else:
        u = g * scale32
        mean_u, mean_un = u.mean(-1, keepdims=True), (u * normalized).mean(-1, keepdims=True)
    dx = rstd * (g * scale32 - mean_u - normalized * mean_un)
    return dx.astype(x_dtype), d_scale, d_bias


_layer_norm.defvjp(_forward, _backward)


class LayerNorm(nnx.LayerNorm):
    """nnx.LayerNorm (same parameters and checkpoints) over the last axis, scale and bias on,
    computed by `_layer_norm`: x [..., d] -> [..., d] in the layer's dtype."""

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or jnp.result_type(x)
        return _layer_norm(x.astype(dtype), self.scale[...], self.bias[...], self.epsilon)
