"""xformer.layer_norm.LayerNorm: nnx.LayerNorm's function and parameters with a hand-written
backward. Forward against a direct numpy formula and nnx.LayerNorm; gradients (input, scale,
bias) against autodiff of a plain jnp formula, in float64 on fresh random inputs, scales and
cotangents; bfloat16 inputs keep their dtype with float32 statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xformer import layer_norm
from xformer.layer_norm import LayerNorm

EPS = 1e-6


def numpy_layer_norm(x, scale, bias):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * scale + bias


def plain_layer_norm(x, scale, bias):
    """The same function in jnp, differentiated by JAX itself."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + EPS) * scale + bias


def random_layer(rng, d, dtype=jnp.float64) -> LayerNorm:
    layer = LayerNorm(d, epsilon=EPS, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    layer.scale[...] = jnp.asarray(rng.normal(1.0, 0.5, d), dtype)
    layer.bias[...] = jnp.asarray(rng.normal(0.0, 0.5, d), dtype)
    return layer


@pytest.mark.parametrize("form", ["cpu", "other"])
@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 32)])
def test_forward_and_gradients_match_references(shape, form, use_form):
    """Both forms: XLA:CPU's (normalized kept, products with scale) and the others' (x and
    its statistics kept, row reductions)."""
    use_form(layer_norm, form)
    rng = np.random.default_rng()
    with jax.enable_x64(True):
        layer = random_layer(rng, shape[-1])
        x = rng.normal(0.3, 2.0, shape)
        g = rng.normal(size=shape)
        scale, bias = np.asarray(layer.scale[...]), np.asarray(layer.bias[...])
        y = layer(jnp.asarray(x))
        np.testing.assert_allclose(y, numpy_layer_norm(x, scale, bias), rtol=1e-12, atol=1e-12)

        graphdef, state = nnx.split(layer)

        def ours(x, scale, bias):
            module = nnx.merge(graphdef, state, copy=True)  # a module of this trace level
            module.scale[...], module.bias[...] = scale, bias
            return (module(x) * g).sum()

        def reference(x, scale, bias):
            return (plain_layer_norm(x, scale, bias) * g).sum()

        args = (jnp.asarray(x), jnp.asarray(scale), jnp.asarray(bias))
        got = jax.grad(ours, argnums=(0, 1, 2))(*args)
        want = jax.grad(reference, argnums=(0, 1, 2))(*args)
        for name, a, b in zip(("x", "scale", "bias"), got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)


def test_matches_nnx_layer_norm_in_float32():
    rng = np.random.default_rng()
    x = jnp.asarray(rng.normal(size=(4, 9, 24)), jnp.float32)
    ours = random_layer(rng, 24, jnp.float32)
    theirs = nnx.LayerNorm(24, epsilon=EPS, rngs=nnx.Rngs(0))
    theirs.scale[...], theirs.bias[...] = ours.scale[...], ours.bias[...]
    np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(nnx.state(theirs))


@pytest.mark.parametrize("form", ["cpu", "other"])
def test_bfloat16_inputs_keep_their_dtype_with_float32_statistics(form, use_form):
    use_form(layer_norm, form)
    rng = np.random.default_rng()
    x32 = rng.normal(5.0, 0.2, (6, 64))  # large mean, small spread: bf16 statistics would fail
    layer = random_layer(rng, 64, jnp.bfloat16)
    layer.param_dtype = jnp.float32
    x = jnp.asarray(x32, jnp.bfloat16)
    y = layer(x)
    assert y.dtype == jnp.bfloat16
    want = numpy_layer_norm(
        np.asarray(x, np.float32),
        np.asarray(layer.scale[...], np.float32),
        np.asarray(layer.bias[...], np.float32),
    )
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2e-2, atol=2e-2)
    g = rng.normal(size=x.shape)
    dx = jax.grad(lambda x: (layer(x).astype(jnp.float32) * g).sum())(x)
    assert dx.dtype == jnp.bfloat16
    with jax.enable_x64(True):
        args = (
            np.asarray(x, np.float64),
            *(np.asarray(p[...], np.float64) for p in (layer.scale, layer.bias)),
        )
        want = np.asarray(jax.grad(lambda *a: (plain_layer_norm(*a) * g).sum())(*args))
    error = np.abs(np.asarray(dx, np.float64) - want).max() / np.abs(want).max()
    assert error < 1e-2, error  # under three bfloat16 steps of the largest entry (~2.5e-3 seen)


def test_one_pass_variance_of_bfloat16_rows_is_within_an_ulp_of_two_passes(use_form):
    """Off CPU, 16-bit inputs get the variance as E[x^2] - E[x]^2: on bfloat16 rows whose mean
    lies up to 100 standard deviations from 0, the output is the two-pass form's to one
    bfloat16 ulp of max(|y|, 1) (float32 and float64 inputs keep the two-pass form)."""
    rng = np.random.default_rng()
    rows = 64
    spread = rng.uniform(0.1, 10.0, (rows, 1))
    offset = rng.uniform(-100.0, 100.0, (rows, 1)) * spread
    x = jnp.asarray(rng.normal(size=(rows, 256)) * spread + offset, jnp.bfloat16)
    layer = random_layer(rng, 256, jnp.bfloat16)
    outputs = {}
    for form in ("cpu", "other"):
        use_form(layer_norm, form)
        outputs[form] = np.asarray(jax.jit(lambda v: layer(v))(x), np.float64)
    gap = np.abs(outputs["cpu"] - outputs["other"])
    ulp = 2.0**-7 * np.maximum(np.abs(outputs["cpu"]), 1.0)  # bfloat16 keeps 8 bits
    assert np.all(gap <= ulp) and (gap > 0).mean() < 0.05, (gap.max(), (gap > 0).mean())
