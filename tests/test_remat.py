"""model.remat: recomputing each layer's activations in the backward pass changes what a train
step keeps, not what it computes. Both families, dropout on (the recomputed forward must draw
the forward's masks), the real train_step over consecutive steps in float64: "full" and "dots"
give the "none" steps; and the gradient program recomputes what each policy does not keep."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_grad_accum import TOLERANCE, run_steps, tiny_task

from xformer import config as config_lib
from xformer import model_config
from xformer.models import EncoderDecoder
from xformer.remat import POLICIES, apply_layer

DROPOUT = {"model.dropout": 0.2, "model.attention_dropout": 0.2, "model.relu_dropout": 0.2}


@pytest.mark.parametrize("family", ["translation", "language_modeling"])
def test_remat_steps_equal_the_plain_steps(family, tmp_path):
    """Loss, metric sums, parameters, Adam state and the XL memory after 3 steps agree to 1e-10
    relative (TOLERANCE: a parameter whose gradient is 0 up to rounding moves by noise) with
    remat "full" and "dots" against "none"; with dropout at 0.2 on embeddings, residual
    branches, attention weights and the FFN, so masks redrawn differently would not."""
    seed = np.random.SeedSequence().entropy % 2**32
    with jax.enable_x64(True):
        runs = {
            remat: run_steps(
                tiny_task(family, str(tmp_path / remat), **DROPOUT, **{"model.remat": remat}), seed
            )
            for remat in ("none", "full", "dots")
        }
    for remat in ("full", "dots"):
        for step, ((state, metrics), (state_r, metrics_r)) in enumerate(
            zip(runs["none"], runs[remat], strict=True)
        ):
            for name in metrics:
                np.testing.assert_allclose(
                    metrics_r[name], metrics[name], rtol=1e-10, err_msg=f"{remat} {step} {name}"
                )
            for (path, leaf), leaf_r in zip(
                jax.tree.leaves_with_path(state), jax.tree.leaves(state_r), strict=True
            ):
                what = f"{remat}, step {step + 1}: {jax.tree_util.keystr(path)}"
                np.testing.assert_allclose(leaf_r, leaf, **TOLERANCE, err_msg=what)
    # dropout was on: the loss differs from a run without it
    with jax.enable_x64(True):
        plain = run_steps(tiny_task(family, str(tmp_path / "nodrop")), seed)
    assert not np.isclose(plain[0][1]["loss_sum"], runs["none"][0][1]["loss_sum"], rtol=1e-6)


def test_remat_recomputes_what_its_policy_does_not_keep():
    """The gradient program before XLA's optimizations (what a GPU or TPU compiles; XLA:CPU
    removes optimization barriers, and its CSE then merges the recomputation back): "full"
    recomputes every layer's forward matmuls, "dots" none of them (it keeps their outputs);
    both wrap each of the 2 + 2 layers' inputs in an optimization barrier."""
    config = config_lib.base_config()
    overrides = {
        "model.d_model": 16,
        "model.num_heads": 2,
        "model.d_ff": 32,
        "model.num_encoder_layers": 2,
        "model.num_decoder_layers": 2,
    }
    config_lib.override(config, overrides)
    rng = np.random.default_rng(0)
    src, tgt = (jnp.asarray(rng.integers(1, 50, (4, 8)), jnp.int32) for _ in range(2))

    def program(remat: str) -> str:
        config.model.remat = remat
        cfg = model_config.from_config(config.model, src_vocab_size=50, tgt_vocab_size=50)
        graphdef, params, rest = nnx.split(EncoderDecoder(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)

        def loss(params):
            model = nnx.merge(graphdef, params, rest, copy=True)
            return jax.nn.log_softmax(model(src, tgt)).mean()

        return jax.jit(jax.grad(loss)).lower(params).as_text()

    text = {remat: program(remat) for remat in POLICIES}
    dots = {remat: t.count("stablehlo.dot_general") for remat, t in text.items()}
    barriers = {remat: t.count("stablehlo.optimization_barrier") for remat, t in text.items()}
    # forward dots per layer: encoder 2 (q/k/v, out) + 2 (scores, values) + 2 (FFN) = 6;
    # decoder 6 + 5 (cross: q, k/v, out, scores, values) = 11
    assert dots["full"] - dots["none"] == 2 * 6 + 2 * 11, dots
    assert dots["dots"] - dots["none"] == 2 * 2 + 2 * 4, dots  # batched ones: attention
    assert barriers == {"none": 0, "full": 4, "dots": 4}, barriers


def test_unknown_remat_is_refused():
    config = config_lib.base_config()
    config.model.remat = "some"
    with pytest.raises(ValueError, match="model.remat"):
        config_lib.validate(config)
    with pytest.raises(ValueError, match="model.remat='some' not in"):
        apply_layer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), lambda m, x: m(x), jnp.ones(2), "some")
