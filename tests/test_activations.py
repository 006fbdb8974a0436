"""xformer.activations.relu: the CPU's form (autodiff's ReLU) and the others' (the backward
mask read from the output behind a barrier) against a numpy formula, values and gradients,
with exact zeros among the inputs; the FFN trains alike under both."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xformer import activations
from xformer.blocks import FeedForward


@pytest.mark.parametrize("form", ["cpu", "other"])
@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 24)])  # widths the custom VJP takes
def test_value_and_gradient_match_numpy(shape, form, use_form):
    use_form(activations, form)
    rng = np.random.default_rng()
    x = rng.normal(size=shape)
    x.flat[rng.choice(x.size, 5, replace=False)] = 0.0  # the gradient at 0 is 0
    g = rng.normal(size=shape)
    with jax.enable_x64(True):
        y, vjp = jax.vjp(activations.relu, jnp.asarray(x))
        (dx,) = vjp(jnp.asarray(g))
    np.testing.assert_array_equal(y, np.maximum(x, 0.0))
    np.testing.assert_array_equal(dx, np.where(x > 0, g, 0.0))


def test_the_output_masked_form_applies_only_to_multiples_of_8(use_form):
    """Off CPU, widths XLA:GPU pads (not a multiple of 8) keep autodiff's ReLU; the others get
    the custom VJP (its barrier is in the gradient's jaxpr)."""
    use_form(activations, "other")
    for width, custom in ((16, True), (12, False)):
        jaxpr = str(
            jax.make_jaxpr(jax.grad(lambda x: activations.relu(x).sum()))(jnp.ones((2, width)))
        )
        assert ("optimization_barrier" in jaxpr) == custom, (width, jaxpr)


def test_feed_forward_gradients_equal_under_both_forms(use_form):
    """One FFN, fresh random input and cotangent: the two forms give identical outputs and
    parameter and input gradients (the masks are the same bits)."""
    rng = np.random.default_rng()
    ffn = FeedForward(8, 32, dropout=0.0, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    x = jnp.asarray(rng.normal(size=(4, 6, 8)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(4, 6, 8)), jnp.float32)
    graphdef, params, rest = nnx.split(ffn, nnx.Param, ...)

    def loss(params, x):
        return (nnx.merge(graphdef, params, rest)(x) * g).sum()

    results = {}
    for form in ("cpu", "other"):
        use_form(activations, form)
        results[form] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
    cpu, other = jax.tree.leaves(results["cpu"]), jax.tree.leaves(results["other"])
    for a, b in zip(cpu, other, strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(jnp.abs(results["cpu"][1][1]).sum()) > 0
