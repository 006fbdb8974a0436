"""Positional encoding, loss, dropout and schedule against direct formulas."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from xformer import config as config_lib
from xformer import model_config
from xformer.dropout import Dropout
from xformer.language_model import LanguageModel
from xformer.losses import cross_entropy
from xformer.optim import learning_rate_schedule, make_optimizer
from xformer.positional.absolute import sinusoidal_encoding


def test_sinusoidal_encoding_equals_paper_formula():
    rng = np.random.default_rng()
    d = 18
    positions = rng.integers(0, 500, (2, 7))
    pe = np.asarray(sinusoidal_encoding(jnp.asarray(positions), d))
    for b, t in np.ndindex(2, 7):
        for j in range(d):
            angle = positions[b, t] / 10000 ** ((j - j % 2) / d)
            expected = np.sin(angle) if j % 2 == 0 else np.cos(angle)
            assert pe[b, t, j] == pytest.approx(expected, abs=2e-4)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_label_smoothed_cross_entropy_matches_numpy(smoothing):
    rng = np.random.default_rng()
    v = 11
    logits = rng.standard_normal((2, 5, v)).astype(np.float32)
    targets = rng.integers(0, v, (2, 5))
    weights = (rng.random((2, 5)) < 0.7).astype(np.float32)
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    q = np.full((2, 5, v), smoothing / (v - 1))
    np.put_along_axis(q, targets[..., None], 1 - smoothing, -1)
    kl = (q * (np.log(np.where(q > 0, q, 1)) - log_p)).sum(-1)  # KL(q || p) = xent - H(q)
    nll = -np.take_along_axis(log_p, targets[..., None], -1)[..., 0]
    loss_sum, nll_sum = cross_entropy(
        jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), smoothing
    )
    np.testing.assert_allclose(loss_sum, (kl * weights).sum(), rtol=1e-5)
    np.testing.assert_allclose(nll_sum, (nll * weights).sum(), rtol=1e-5)


def test_dropout_rate_scale_and_independence():
    from flax import nnx

    rng = np.random.default_rng()
    drop = Dropout(0.3, rngs=nnx.Rngs(dropout=int(rng.integers(1e6))))
    x = jnp.asarray(rng.normal(size=(512, 512)), jnp.float32)  # nonzero: a zero output is a drop
    a, b = np.asarray(drop(x)), np.asarray(drop(x))
    kept = a != 0
    np.testing.assert_allclose(a[kept], np.asarray(x)[kept] / 0.7, rtol=1e-6)  # kept values, scaled
    assert abs((a == 0).mean() - 0.3) < 0.005
    assert abs(((a == 0) & (b == 0)).mean() - 0.09) < 0.005  # successive masks independent
    assert abs(np.corrcoef((a[:, :-1] == 0).ravel(), (a[:, 1:] == 0).ravel())[0, 1]) < 0.01
    drop.deterministic = True
    np.testing.assert_array_equal(drop(x), x)


@pytest.mark.parametrize("schedule", ["rsqrt", "cosine", "constant"])
def test_update_n_applies_the_rate_logged_at_step_n(schedule):
    """Adam on a constant gradient moves each parameter by exactly the rate (m and v are bias
    corrected): update n must use learning_rate_schedule(n), the rate logged at step n."""
    t = ml_collections.ConfigDict(
        dict(learning_rate=0.01, warmup_steps=3, schedule=schedule, num_steps=8, b1=0.9, b2=0.98)
    )
    t.update(eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)
    optimizer, lr = make_optimizer(t), learning_rate_schedule(t)
    grad = jnp.asarray(np.random.default_rng().normal(size=5), jnp.float32)
    params = jnp.zeros(5)
    state = optimizer.init(params)
    for step in range(1, t.num_steps + 1):
        updates, state = optimizer.update(grad, state, params)
        rate = float(lr(jnp.asarray(step)))
        assert rate > 0, (step, rate)  # no update wasted at a zero rate, first or last
        np.testing.assert_allclose(-updates / jnp.sign(grad), rate, rtol=1e-5, err_msg=str(step))
    assert float(lr(jnp.asarray(t.warmup_steps))) == pytest.approx(0.01)  # the peak


@pytest.mark.parametrize("positional,own", [("relative", {"u", "v"}), ("t5_bias", {"table"})])
def test_weight_decay_shrinks_weights_and_embeddings_not_biases_or_scales(positional, own):
    """A zero gradient leaves Adam's step at 0, so one AdamW update is the decay alone:
    p * (1 - rate * weight_decay) for weights and embeddings, nothing for biases, layer-norm
    scales, Transformer-XL's u and v and T5's table of attention-logit biases."""
    config = config_lib.lm_base_config("ptb")
    config_lib.override(
        config,
        {
            "model.positional": positional,
            "model.d_model": 16,
            "model.num_heads": 2,
            "model.d_ff": 24,
            "model.num_decoder_layers": 1,
            "train.weight_decay": 0.1,
            "train.schedule": "constant",
            "train.warmup_steps": 1,
            "train.learning_rate": 0.5,
        },
    )
    model = LanguageModel(model_config.from_config(config.model, vocab_size=30), rngs=nnx.Rngs(0))
    rng = np.random.default_rng()  # random values everywhere: biases start at 0
    params = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), nnx.state(model, nnx.Param)
    )
    optimizer = make_optimizer(config.train)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zeros, optimizer.init(params), params)
    updates = dict(jax.tree.leaves_with_path(updates))
    seen = set()
    for path, p in jax.tree.leaves_with_path(params):
        name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
        seen.add(name)
        want = 0 * p if name in {"bias", "scale", *own} else -0.5 * 0.1 * p
        np.testing.assert_allclose(updates[path], want, rtol=1e-6, err_msg=str(path))
    assert {"kernel", "bias", "scale", *own} <= seen  # and the embedding tables, 0, 1, ...


@pytest.mark.parametrize("init_std", [0.0, 0.02])
def test_dense_kernels_are_drawn_with_init_std(init_std):
    """model.init_std=0.02 draws every dense kernel (q/k/v, output, FFN, XL's W_kR, an untied
    output layer) from N(0, 0.02), as Transformer-XL's reference does; 0 keeps LeCun normal,
    std 1 / sqrt(fan_in). Measured on fresh draws of every kernel of both families."""
    from xformer.models import EncoderDecoder

    seed = int(np.random.default_rng().integers(2**31))
    widths = {"model.d_model": 128, "model.num_heads": 4, "model.d_ff": 256}
    lm = config_lib.lm_base_config("ptb")
    config_lib.override(lm, {**widths, "model.num_decoder_layers": 1, "model.init_std": init_std})
    mt = config_lib.base_config()
    config_lib.override(
        mt,
        {
            **widths,
            "model.num_encoder_layers": 1,
            "model.num_decoder_layers": 1,
            "model.tie_output": False,
            "model.init_std": init_std,
        },
    )
    models = [
        LanguageModel(model_config.from_config(lm.model, vocab_size=64), rngs=nnx.Rngs(seed)),
        EncoderDecoder(
            model_config.from_config(mt.model, src_vocab_size=64, tgt_vocab_size=64),
            rngs=nnx.Rngs(seed),
        ),
    ]
    names = set()
    for model in models:
        for path, kernel in jax.tree.leaves_with_path(nnx.state(model, nnx.Param)):
            keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
            if keys[-1] != "kernel":
                continue
            names.add(keys[-2] if not keys[-2].isdigit() else keys[-3])
            kernel = np.asarray(kernel)
            want = init_std or 1 / np.sqrt(kernel.shape[0])  # fan_in: the input features
            assert abs(kernel.std() / want - 1) < 0.05, (keys, kernel.std(), want, seed)
            assert abs(kernel.mean()) < 0.05 * want, (keys, kernel.mean(), seed)
    assert {"qkv_proj", "q_proj", "kv_proj", "out_proj", "up", "down", "r_proj", "output"} <= names


def test_rsqrt_schedule_is_the_papers():
    t = ml_collections.ConfigDict(
        dict(learning_rate=0.002, warmup_steps=100, schedule="rsqrt", num_steps=1000)
    )
    lr = learning_rate_schedule(t)
    d_model = 0.002**-2 / 100  # peak = d^-0.5 * warmup^-0.5
    for step in (1, 50, 100, 400, 1000):
        paper = d_model**-0.5 * min(step**-0.5, step * 100**-1.5)
        assert float(lr(jnp.asarray(step))) == pytest.approx(paper, rel=1e-5)
    assert jax.numpy.isfinite(lr(jnp.asarray(0)))
