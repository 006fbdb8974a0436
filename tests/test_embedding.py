"""xformer.embedding.Embed: nnx.Embed's values and parameters, gradients accumulated in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xformer.embedding import Embed

VOCAB, FEATURES = 50, 16


def tables(dtype):
    """(ours, nnx.Embed) with the same parameters."""
    kwargs = dict(dtype=dtype, param_dtype=jnp.float32)
    return tuple(cls(VOCAB, FEATURES, **kwargs, rngs=nnx.Rngs(0)) for cls in (Embed, nnx.Embed))


def embedding_grad(table, ids, cotangent) -> np.ndarray:
    def loss(table):
        return jnp.sum(table(ids).astype(jnp.float32) * cotangent.astype(jnp.float32))

    return np.asarray(nnx.grad(loss)(table).embedding[...], np.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_parameters_are_nnx_embeds(dtype):
    ours, theirs = tables(dtype)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (4, 7)), jnp.uint16)
    out = ours(ids)
    assert out.dtype == dtype and out.shape == (4, 7, FEATURES)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(theirs(ids), np.float32))
    assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(nnx.state(theirs))


def test_bfloat16_gradient_sums_in_float32():
    """Each row's gradient sums ~50 bfloat16 cotangents: in float32 it matches a float64 sum of
    the same cotangents; nnx.Embed's bfloat16 scatter-add rounds at every add."""
    rng = np.random.default_rng(2)
    ids = jnp.asarray(rng.integers(0, VOCAB, (8, 300)))
    cotangent = jnp.asarray(rng.normal(size=(8, 300, FEATURES)), jnp.bfloat16)
    exact = np.zeros((VOCAB, FEATURES))
    np.add.at(exact, np.asarray(ids), np.asarray(cotangent, np.float64))
    ours, theirs = tables(jnp.bfloat16)
    scale = np.abs(exact).max()
    assert np.abs(embedding_grad(ours, ids, cotangent) - exact).max() / scale < 1e-6
    assert np.abs(embedding_grad(theirs, ids, cotangent) - exact).max() / scale > 1e-3


def test_rejects_float_ids():
    with pytest.raises(ValueError, match="must be integers"):
        tables(jnp.float32)[0](jnp.ones((2, 3)))
