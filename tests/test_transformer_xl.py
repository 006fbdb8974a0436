"""Transformer-XL pieces against independent references: relative shift, relative attention,
recurrence, masks, and the vanilla baseline."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xformer import masks
from xformer.language_model import LanguageModel, LMConfig
from xformer.positional import sinusoidal_encoding
from xformer.relative_attention import (
    RelativeBiases,
    RelativeMultiHeadAttention,
    rel_shift,
    relative_encoding,
)

jax.config.update("jax_default_matmul_precision", "highest")

TINY = LMConfig(
    vocab_size=37,
    d_model=16,
    num_heads=2,
    num_layers=3,
    d_ff=24,
    dropout=0.0,
    relu_dropout=0.0,
)


@pytest.mark.parametrize("q_len,k_len", [(5, 5), (4, 11), (1, 6), (7, 9)])
def test_rel_shift_equals_explicit_gather(q_len, k_len):
    rng = np.random.default_rng(q_len * 100 + k_len)
    x = rng.normal(size=(2, 3, q_len, k_len)).astype(np.float32)
    shifted = np.asarray(rel_shift(jnp.asarray(x)))
    mem = k_len - q_len
    for i in range(q_len):
        for j in range(k_len):
            distance = mem + i - j
            if distance >= 0:  # column c of x holds distance k_len - 1 - c
                np.testing.assert_array_equal(shifted[..., i, j], x[..., i, k_len - 1 - distance])


def test_relative_encoding_clamps_distances():
    r = np.asarray(relative_encoding(10, 8, clamp_len=3))
    direct = np.asarray(sinusoidal_encoding(jnp.asarray([min(d, 3) for d in range(9, -1, -1)]), 8))
    np.testing.assert_allclose(r, direct, atol=1e-6)
    assert not np.allclose(r[0], np.asarray(relative_encoding(10, 8))[0])


def _numpy_relative_attention(attn, biases, x, memory, clamp_len, mask):
    """Score every (query, key) pair from the paper's formula with R[distance] looked up
    directly, no shift trick."""
    w = {k: np.asarray(getattr(attn, k).kernel[...]) for k in ("q_proj", "kv_proj", "r_proj")}
    u, v = np.asarray(biases.u[...]), np.asarray(biases.v[...])
    h, dh = attn.num_heads, attn.head_dim
    context = np.concatenate([memory, x], axis=1)
    b, lq, _ = x.shape
    lk = context.shape[1]
    q = (x @ w["q_proj"]).reshape(b, lq, h, dh)
    kv = (context @ w["kv_proj"]).reshape(b, lk, 2, h, dh)
    k, val = kv[:, :, 0], kv[:, :, 1]
    out = np.zeros((b, lq, h, dh))
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                scores = np.full(lk, -np.inf)
                for j in range(lk):
                    if not mask[min(bi, mask.shape[0] - 1), 0, i, j]:
                        continue
                    distance = lk - lq + i - j
                    r = np.asarray(
                        sinusoidal_encoding(jnp.asarray([min(distance, clamp_len or distance)]), 16)
                    )[0]
                    rk = (r @ w["r_proj"]).reshape(h, dh)[hi]
                    scores[j] = (q[bi, i, hi] + u[hi]) @ k[bi, j, hi] + (q[bi, i, hi] + v[hi]) @ rk
                p = np.exp((scores - scores.max()) / np.sqrt(dh))
                p /= p.sum()
                out[bi, i, hi] = p @ val[bi, :, hi]
    return out.reshape(b, lq, h * dh) @ np.asarray(attn.out_proj.kernel[...])


@pytest.mark.parametrize("clamp_len,same_length", [(0, False), (3, False), (0, True)])
def test_relative_attention_matches_the_formula(clamp_len, same_length):
    rngs = nnx.Rngs(1)
    attn = RelativeMultiHeadAttention(16, 2, dropout=0.0, own_biases=False, rngs=rngs)
    biases = RelativeBiases(2, 8, rngs=rngs)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 4, 16)).astype(np.float32)
    memory = rng.normal(size=(2, 6, 16)).astype(np.float32)
    filled = jnp.asarray([6, 2])  # row 1 has only 2 valid memory slots
    mask = masks.memory_causal_mask(4, 6, filled, window=6 if same_length else 0)
    r = relative_encoding(10, 16, clamp_len)
    out = attn(jnp.asarray(x), jnp.asarray(memory), r, mask, biases)
    expected = _numpy_relative_attention(attn, biases, x, memory, clamp_len, np.asarray(mask))
    np.testing.assert_allclose(np.asarray(out), expected, atol=1e-4, rtol=1e-4)


def test_memory_causal_mask_follows_the_paper():
    mask = np.asarray(masks.memory_causal_mask(3, 4, jnp.asarray([4, 1]), window=4))[:, 0]
    for b, filled in enumerate([4, 1]):
        for i in range(3):
            for j in range(7):
                distance = 4 + i - j
                expected = 0 <= distance < 4 and j >= 4 - filled
                assert mask[b, i, j] == expected, (b, i, j)
    full = np.asarray(masks.memory_causal_mask(5, 8, 8, window=8))[0, 0]
    np.testing.assert_array_equal(full.sum(-1), 8)  # same_length: every query sees mem_len keys


def _tokens(seed, shape, vocab=TINY.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"pre_norm": True, "untie_relative_biases": True},
        {"adaptive_cutoffs": (10, 20), "div_val": 2},
    ],
)
def test_recurrence_equals_one_pass_over_the_concatenation(overrides):
    cfg = dataclasses.replace(TINY, **overrides)
    model = LanguageModel(cfg, rngs=nnx.Rngs(3))
    tokens, targets = _tokens(4, (2, 11)), _tokens(5, (2, 11))
    full, _ = model(tokens, targets)
    memory = model.init_memory(2, mem_len=9)  # longer than the first two segments together
    pieces = []
    for start, stop in [(0, 3), (3, 7), (7, 11)]:
        nll, memory = model(tokens[:, start:stop], targets[:, start:stop], memory)
        pieces.append(nll)
    np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(memory["filled"], [9, 9])


def test_memory_keeps_the_most_recent_states():
    model = LanguageModel(TINY, rngs=nnx.Rngs(6))
    tokens = _tokens(7, (1, 10))
    memory = model.init_memory(1, mem_len=4)
    _, memory = model.hidden(tokens[:, :6], memory)
    _, memory = model.hidden(tokens[:, 6:], memory)
    # Layer 0's memory holds the last 4 input embeddings (not the first ones: the argument
    # order bug of the original `_update_mems` would keep the wrong window when ext_len > 0).
    np.testing.assert_allclose(memory["states"][0, 0], model.embed(tokens[:, 6:])[0], atol=1e-6)


def test_no_gradient_reaches_the_previous_segment():
    model = LanguageModel(TINY, rngs=nnx.Rngs(8))
    tokens, targets = _tokens(9, (2, 8)), _tokens(10, (2, 8))
    params = nnx.state(model, nnx.Param)
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    def second_segment_loss(p, frozen_memory=None):
        m = nnx.merge(graphdef, p, rest)
        memory = m.init_memory(2, 4)
        _, memory = m(tokens[:, :4], targets[:, :4], memory)
        if frozen_memory is not None:
            memory = frozen_memory
        nll, _ = m(tokens[:, 4:], targets[:, 4:], memory)
        return nll.sum()

    m = nnx.merge(graphdef, params, rest)
    _, memory = m(tokens[:, :4], targets[:, :4], m.init_memory(2, 4))
    constant = jax.tree.map(np.asarray, memory)
    through = jax.grad(second_segment_loss)(params)
    constant_grads = jax.grad(second_segment_loss)(params, constant)
    for a, b in zip(jax.tree.leaves(through), jax.tree.leaves(constant_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(through))


def test_same_length_and_clamp_change_only_what_they_should():
    model = LanguageModel(TINY, rngs=nnx.Rngs(11))
    tokens, targets = _tokens(12, (2, 6)), _tokens(13, (2, 6))
    _, state = nnx.split(model)
    for overrides in ({"clamp_len": 100}, {"same_length": True}):
        # clamp beyond every distance, or a window wider than the context: no change
        variant = nnx.merge(
            nnx.split(LanguageModel(dataclasses.replace(TINY, **overrides), rngs=nnx.Rngs(0)))[0],
            state,
        )
        memory = variant.init_memory(2, 8)
        a, _ = variant(tokens, targets, memory)
        b, _ = model(tokens, targets, model.init_memory(2, 8))
        np.testing.assert_allclose(a, b, atol=1e-6)
    clamped = nnx.merge(
        nnx.split(LanguageModel(dataclasses.replace(TINY, clamp_len=1), rngs=nnx.Rngs(0)))[0],
        state,
    )
    a, _ = clamped(tokens, targets)
    b, _ = model(tokens, targets)
    np.testing.assert_allclose(a[:, :2], b[:, :2], atol=1e-6)  # distances <= 1 only
    assert np.abs(np.asarray(a[:, 2:] - b[:, 2:])).max() > 1e-4


def test_vanilla_model_is_causal_and_uses_absolute_positions():
    cfg = dataclasses.replace(TINY, positional="sinusoidal")
    model = LanguageModel(cfg, rngs=nnx.Rngs(14))
    tokens, targets = _tokens(15, (2, 9)), _tokens(16, (2, 9))
    full = np.asarray(model(tokens, targets)[0])
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % cfg.vocab_size)
    after = np.asarray(model(changed, targets)[0])
    np.testing.assert_allclose(after[:, :6], full[:, :6], atol=1e-6)
    assert np.abs(after[:, 6:] - full[:, 6:]).max() > 1e-4
    # Left padding hidden by key_valid and positions restarting at 0 give the unpadded result.
    padded = jnp.concatenate([jnp.zeros((2, 3), jnp.int32), tokens], 1)
    positions = jnp.broadcast_to(jnp.maximum(jnp.arange(12) - 3, 0), (2, 12))
    valid = jnp.broadcast_to(jnp.arange(12) >= 3, (2, 12))
    out = model(
        padded, jnp.concatenate([targets[:, :3], targets], 1), positions=positions, key_valid=valid
    )[0]
    np.testing.assert_allclose(np.asarray(out)[:, 3:], full, atol=1e-5)
    with pytest.raises(ValueError, match="memory"):
        model.init_memory(2, 4)


def test_log_probs_are_normalised_and_match_nll():
    model = LanguageModel(dataclasses.replace(TINY, adaptive_cutoffs=(12,)), rngs=nnx.Rngs(17))
    tokens, targets = _tokens(18, (2, 5)), _tokens(19, (2, 5))
    log_probs = model.log_probs(tokens)
    np.testing.assert_allclose(jax.scipy.special.logsumexp(log_probs, -1), 0.0, atol=1e-5)
    nll, _ = model(tokens, targets)
    gathered = -jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(nll, gathered, atol=1e-5)
