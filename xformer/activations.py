"""ReLU whose backward pass reads its output, so that XLA:GPU can apply it in the matmul.

XLA:GPU puts a dense layer's bias and ReLU into the cuBLAS matmul's epilogue (BIAS_RELU) only
when the matmul's result has no other use. Autodiff's ReLU keeps its input for the backward
mask (x > 0), so the pre-activation [N, d_ff] is written, read back by a separate maximum
kernel, and kept until the backward pass. The mask from the output (y > 0) is the same, but
XLA's simplifier rewrites max(x, 0) > 0 back to x > 0 unless the output sits behind an
optimization barrier. bench/gpu_compile.py, wmt14 bf16 fused on an H100, per step: 1,390 ->
1,378 kernels, 60.8 -> 58.3 GB at their boundaries, floor 20.13 -> 19.41 ms, step memory
9.25 -> 8.12 GiB. Where the features are not a multiple of 8 (WikiText-103's d_ff 2,100),
XLA:GPU pads the matmul's output for the tensor cores and slices it after the epilogue; the
slice then costs a pass of its own that autodiff's ReLU fused away (wt103_xl: floor 23.84 ->
24.20 ms), so those keep autodiff's ReLU. On XLA:CPU (CPU_FORM_PLATFORMS) there is no such
epilogue, and the barrier would only keep the maximum from fusing with what follows.
"""

import jax
import jax.numpy as jnp

CPU_FORM_PLATFORMS = frozenset({"cpu"})  # backends that keep autodiff's ReLU


def relu(x: jax.Array) -> jax.Array:
    """max(x, 0) elementwise, any shape; its gradient is g where x > 0, else 0."""
    if jax.default_backend() in CPU_FORM_PLATFORMS or x.shape[-1] % 8:
        return jax.nn.relu(x)
    return _relu_masked_by_output(x)


@jax.custom_vjp
def _relu_masked_by_output(x: jax.Array) -> jax.Array:
    return jnp.maximum(x, 0)


def _forward(x):
    y = jax.lax.optimization_barrier(jnp.maximum(x, 0))
    return y, y


def _backward(y, g):
    return (jnp.where(y > 0, g, jnp.zeros_like(g)),)


_relu_masked_by_output.defvjp(_forward, _backward)
