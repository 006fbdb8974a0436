"""nnx.Linear that multiplies 2-D matrices: [..., d_in] is flattened to [N, d_in] first.

On XLA:CPU a dense layer over [B, L, d] lowers to a dot with two free dimensions whose
backward contracts over both of them, and XLA inserts layout copies around it. The same dot on
[B * L, d] does not need them. Measured fwd + bwd on a 2-core EPYC: an FFN at [64, 32, 256] took
100 ms flat vs 117 ms batched, and the [2048, 256] x [256, 8000] output layer with its loss
took 544 ms vs 1,102 ms. The parameters are nnx.Linear's, so checkpoints are unchanged.

`Projections`: several projections of one input (attention's q/k/v) in one [in, n, out] kernel.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from xformer import precision
from xformer.sharding import logical


def over_rows(layer: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """layer applied to x [..., d] as [N, d] -> [..., d_out]: its matmul is 2-D."""
    flat = layer(x.reshape(-1, x.shape[-1]))
    return flat.reshape(*x.shape[:-1], flat.shape[-1])


class Linear(nnx.Linear):
    """x [..., in_features] -> [..., out_features], computed as one [N, in] x [in, out] matmul.

    `axes`: the logical axis names (sharding.RULES) of the input and output features. The bias
    is added in the compute dtype and its gradient summed in its own (`precision.add_bias`: a
    bfloat16 model's float32 biases sum their gradients over the rows in float32).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[str | None, str | None] = (None, None),
        **kwargs,
    ):
        kernel_init = kwargs.pop("kernel_init", nnx.nn.linear.default_kernel_init)
        bias_init = kwargs.pop("bias_init", nnx.initializers.zeros_init())
        super().__init__(
            in_features,
            out_features,
            kernel_init=logical(kernel_init, *axes),
            bias_init=logical(bias_init, axes[1]),
            **kwargs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return over_rows(self._rows, x)

    def _rows(self, x: jax.Array) -> jax.Array:
        """x [N, in] -> [N, out]: nnx.Linear's product, then the bias."""
        x, kernel = nnx.nn.dtypes.promote_dtype((x, self.kernel[...]), dtype=self.dtype)
        extra = {}
        if self.preferred_element_type is not None:
            extra["preferred_element_type"] = self.preferred_element_type
        y = self.dot_general(x, kernel, (((1,), (0,)), ((), ())), precision=self.precision, **extra)
        return y if self.bias is None else precision.add_bias(y, self.bias[...])


THREE_D_PLATFORMS = frozenset({"tpu"})  # Projections' [in, n, out] matmul on one device too


class Projections(nnx.Module):
    """`n` projections of one input (attention's q/k/v or k/v): x [..., in_features] ->
    [..., n, out_features], one matmul.

    The kernel is [in, n, out] and the bias [n, out], so that a tensor split of `out` (the heads)
    gives every device the same heads of all n projections. A [in, n * out] kernel split in
    contiguous column blocks would give a device, say, q's last heads and k's first, and GSPMD
    would gather and permute activations in every layer to give attention its heads.

    `split_heads` (the mesh splits heads) and on TPU (THREE_D_PLATFORMS): the matmul keeps the
    [in, n, out] form, so that its result comes out split as attention wants it, and XLA:TPU
    lays the n projections out one after another (wmt14's one-chip step: 2.3 GB a step fewer
    layout copies with the splash kernel, 4.8 GB with XLA attention). Otherwise it reads the
    kernel as [in, n * out] (the same bytes): XLA:GPU then applies the bias in the GEMM's
    epilogue and XLA:CPU computes the weight gradient without transposing its operands,
    neither of which they do for the 3-D form. The kernel is drawn as nnx.Linear's of
    n * out features is.
    """

    def __init__(
        self,
        in_features: int,
        n: int,
        out_features: int,
        *,
        axes: tuple[str | None, str | None] = (None, None),
        split_heads: bool = False,
        use_bias: bool = True,
        kernel_init: Callable = nnx.nn.linear.default_kernel_init,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        def flat(init: Callable) -> Callable:  # the draws of a [..., n * out] parameter
            def draw(key, shape, dtype):
                return init(key, (*shape[:-2], shape[-2] * shape[-1]), dtype).reshape(shape)

            return draw

        kernel = logical(flat(kernel_init), axes[0], None, axes[1])
        self.kernel = nnx.Param(kernel(rngs.params(), (in_features, n, out_features), param_dtype))
        self.bias = nnx.data(None)
        if use_bias:
            bias = logical(nnx.initializers.zeros_init(), None, axes[1])
            self.bias = nnx.Param(bias(rngs.params(), (n, out_features), param_dtype))
        self.split_heads, self.dtype = split_heads, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        bias = None if self.bias is None else self.bias[...]
        x, kernel = nnx.nn.dtypes.promote_dtype((x, self.kernel[...]), dtype=self.dtype)
        rows = x.reshape(-1, x.shape[-1])
        if self.split_heads or jax.default_backend() in THREE_D_PLATFORMS:
            y = jax.lax.dot_general(rows, kernel, (((1,), (0,)), ((), ())))
        else:
            y = rows @ kernel.reshape(kernel.shape[0], -1)
            bias = None if bias is None else bias.reshape(-1)
        y = y if bias is None else precision.add_bias(y, bias)  # as Linear's
        return y.reshape(*x.shape[:-1], *kernel.shape[1:])
