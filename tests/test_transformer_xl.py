"""Transformer-XL pieces against independent references: relative shift, recurrence under
every scheme that allows a memory, memory masks, and the vanilla baseline. (Relative attention
itself is checked against a pairwise numpy formula in test_positional.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xformer import masks
from xformer.language_model import LanguageModel, LMConfig
from xformer.layout import Layout
from xformer.positional.absolute import sinusoidal_encoding
from xformer.positional.xl_relative import (
    XLRelativePositions,
    relative_distances,
    relative_shift,
)

jax.config.update("jax_default_matmul_precision", "highest")

TINY = LMConfig(
    vocab_size=37,
    d_model=16,
    num_heads=2,
    num_decoder_layers=3,
    positional="relative",
    d_ff=24,
    dropout=0.0,
    relu_dropout=0.0,
)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len,k_len,q_start", [(5, 5, 0), (4, 11, 7), (1, 6, 5), (7, 9, 2)])
def test_relative_shift_equals_explicit_gather(q_len, k_len, q_start, causal):
    layout = Layout(q_len, k_len, q_start=q_start, causal=causal)
    distances = np.asarray(relative_distances(layout))  # what column c of the scores holds
    rng = np.random.default_rng()
    x = rng.normal(size=(2, 3, q_len, len(distances))).astype(np.float32)
    shifted = np.asarray(relative_shift(jnp.asarray(x), k_len))
    checked = 0
    for i in range(q_len):
        for j in range(k_len):
            distance = q_start + i - j
            if distance >= 0 or not causal:
                (column,) = np.flatnonzero(distances == distance)
                np.testing.assert_array_equal(shifted[..., i, j], x[..., i, column])
                checked += 1
    assert checked >= q_len


def test_relative_encoding_clamps_distances():
    cfg = dataclasses.replace(TINY, dropout=0.0)
    layout = Layout(4, 10, q_start=6, causal=False)
    clamped = XLRelativePositions(dataclasses.replace(cfg, clamp_len=3), 1, rngs=nnx.Rngs(0))
    r = np.asarray(clamped.prepare(layout))
    distances = np.clip(np.asarray(relative_distances(layout)), -3, 3)
    np.testing.assert_allclose(r, sinusoidal_encoding(jnp.asarray(distances), 16), atol=1e-6)
    unclamped = XLRelativePositions(cfg, 1, rngs=nnx.Rngs(0)).prepare(layout)
    assert not np.allclose(r[0], np.asarray(unclamped)[0])


def test_memory_masks_follow_the_paper():
    layout = Layout.with_memory(3, 4)
    valid = masks.memory_key_valid(4, 3, jnp.asarray([4, 1]))
    mask = np.asarray(masks.attention_mask("same_length", layout, key_valid=valid))[:, 0]
    for b, filled in enumerate([4, 1]):
        for i in range(3):
            for j in range(7):
                distance = 4 + i - j
                expected = 0 <= distance < 4 and j >= 4 - filled
                assert mask[b, i, j] == expected, (b, i, j)
    full = np.asarray(masks.attention_mask("same_length", Layout.with_memory(5, 8)))[0, 0]
    np.testing.assert_array_equal(full.sum(-1), 8)  # same_length: every query sees mem_len keys


def jitted(model, method="__call__"):
    """model.<method> compiled as one program: calling a model eagerly, op by op, is slow."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, *a, **k: getattr(nnx.merge(graphdef, state), method)(*a, **k))
    return lambda *a, **k: fn(state, *a, **k)


def _tokens(seed, shape, vocab=TINY.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(  # fast: XL's scheme, adaptive softmax, a sliding window (every
    "overrides",  # relative scheme's attention over a memory: test_positional.py, fast)
    [
        {},
        pytest.param({"layer_norm": "pre", "untie_relative_biases": True}, marks=SLOW),
        {"adaptive_cutoffs": (10, 20), "div_val": 2},
        pytest.param({"positional": "rope"}, marks=SLOW),
        pytest.param({"positional": "t5_bias"}, marks=SLOW),
        pytest.param({"positional": "alibi"}, marks=SLOW),
        pytest.param({"positional": "none"}, marks=SLOW),
        {"positional": "rope", "decoder_mask": "sliding_window", "attention_window": 5},
    ],
)
def test_recurrence_equals_one_pass_over_the_concatenation(overrides):
    cfg = dataclasses.replace(TINY, **overrides)
    model = LanguageModel(cfg, rngs=nnx.Rngs(3))
    call = jitted(model)
    tokens, targets = _tokens(4, (2, 11)), _tokens(5, (2, 11))
    full, _ = call(tokens, targets)
    memory = model.init_memory(2, mem_len=9)  # longer than the first two segments together
    pieces = []
    for start, stop in [(0, 3), (3, 7), (7, 11)]:
        nll, memory = call(tokens[:, start:stop], targets[:, start:stop], memory)
        pieces.append(nll)
    np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(memory["filled"], [9, 9])


def test_hidden_keys_of_a_segment_with_a_memory_are_hidden_as_in_one_pass():
    """key_valid [B, L] covers the segment's keys; the memory's stay visible by `filled`."""
    model = LanguageModel(TINY, rngs=nnx.Rngs(8))
    hidden = jitted(model, "hidden")
    tokens = _tokens(9, (2, 9))
    valid = np.ones((2, 9), bool)
    valid[0, 5], valid[1, 7] = False, False  # keys of the second segment (positions 4-8)
    full, _ = hidden(tokens, key_valid=jnp.asarray(valid))
    _, memory = hidden(tokens[:, :4], model.init_memory(2, mem_len=4))
    second, _ = hidden(tokens[:, 4:], memory, key_valid=jnp.asarray(valid[:, 4:]))
    np.testing.assert_allclose(second, full[:, 4:], atol=1e-5, rtol=1e-5)
    unhidden, _ = hidden(tokens[:, 4:], memory)
    assert not np.allclose(unhidden[0, 2:], second[0, 2:], atol=1e-3)  # (the key did count)


def test_memory_keeps_the_most_recent_states():
    model = LanguageModel(TINY, rngs=nnx.Rngs(6))
    tokens = _tokens(7, (1, 10))
    memory = model.init_memory(1, mem_len=4)
    hidden = jitted(model, "hidden")
    _, memory = hidden(tokens[:, :6], memory)
    _, memory = hidden(tokens[:, 6:], memory)
    # Layer 0's memory holds the last 4 input embeddings (not the first ones: the argument
    # order bug of the original `_update_mems` would keep the wrong window when ext_len > 0).
    embedded = jitted(model, "embed")(tokens[:, 6:])[0]
    np.testing.assert_allclose(memory["states"][0, 0], embedded, atol=1e-6)


def test_no_gradient_reaches_the_previous_segment():
    model = LanguageModel(TINY, rngs=nnx.Rngs(8))
    tokens, targets = _tokens(9, (2, 8)), _tokens(10, (2, 8))
    params = nnx.state(model, nnx.Param)
    graphdef, _, rng_state = nnx.split(model, nnx.Param, ...)

    def second_segment_loss(p, frozen_memory=None):
        m = nnx.merge(graphdef, p, rng_state)
        memory = m.init_memory(2, 4)
        _, memory = m(tokens[:, :4], targets[:, :4], memory)
        if frozen_memory is not None:
            memory = frozen_memory
        nll, _ = m(tokens[:, 4:], targets[:, 4:], memory)
        return nll.sum()

    m = nnx.merge(graphdef, params, rng_state)
    _, memory = jitted(m)(tokens[:, :4], targets[:, :4], m.init_memory(2, 4))
    constant = jax.tree.map(np.asarray, memory)
    grad = jax.jit(jax.grad(second_segment_loss))
    through = grad(params)
    constant_grads = grad(params, constant)
    for a, b in zip(jax.tree.leaves(through), jax.tree.leaves(constant_grads), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(through))


def test_same_length_and_clamp_change_only_what_they_should():
    model = LanguageModel(TINY, rngs=nnx.Rngs(11))
    tokens, targets = _tokens(12, (2, 6)), _tokens(13, (2, 6))
    _, state = nnx.split(model)
    call = jitted(model)
    for overrides in ({"clamp_len": 100}, {"decoder_mask": "same_length"}):
        # clamp beyond every distance, or a window wider than the context: no change
        variant = nnx.merge(
            nnx.split(LanguageModel(dataclasses.replace(TINY, **overrides), rngs=nnx.Rngs(0)))[0],
            state,
        )
        memory = variant.init_memory(2, 8)
        a, _ = jitted(variant)(tokens, targets, memory)
        b, _ = call(tokens, targets, model.init_memory(2, 8))
        np.testing.assert_allclose(a, b, atol=1e-6)
    clamped = nnx.merge(
        nnx.split(LanguageModel(dataclasses.replace(TINY, clamp_len=1), rngs=nnx.Rngs(0)))[0],
        state,
    )
    a, _ = jitted(clamped)(tokens, targets)
    b, _ = call(tokens, targets)
    np.testing.assert_allclose(a[:, :2], b[:, :2], atol=1e-6)  # distances <= 1 only
    assert np.abs(np.asarray(a[:, 2:] - b[:, 2:])).max() > 1e-4


def test_vanilla_model_is_causal_and_uses_absolute_positions():
    cfg = dataclasses.replace(TINY, positional="sinusoidal")
    model = LanguageModel(cfg, rngs=nnx.Rngs(14))
    call = jitted(model)
    tokens, targets = _tokens(15, (2, 9)), _tokens(16, (2, 9))
    full = np.asarray(call(tokens, targets)[0])
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % cfg.vocab_size)
    after = np.asarray(call(changed, targets)[0])
    np.testing.assert_allclose(after[:, :6], full[:, :6], atol=1e-6)
    assert np.abs(after[:, 6:] - full[:, 6:]).max() > 1e-4
    # Left padding hidden by key_valid and positions restarting at 0 give the unpadded result.
    padded = jnp.concatenate([jnp.zeros((2, 3), jnp.int32), tokens], 1)
    positions = jnp.broadcast_to(jnp.maximum(jnp.arange(12) - 3, 0), (2, 12))
    valid = jnp.broadcast_to(jnp.arange(12) >= 3, (2, 12))
    out = call(
        padded, jnp.concatenate([targets[:, :3], targets], 1), positions=positions, key_valid=valid
    )[0]
    np.testing.assert_allclose(np.asarray(out)[:, 3:], full, atol=1e-5)
    with pytest.raises(ValueError, match="memory"):
        model.init_memory(2, 4)


def test_log_probs_are_normalised_and_match_nll():
    model = LanguageModel(dataclasses.replace(TINY, adaptive_cutoffs=(12,)), rngs=nnx.Rngs(17))
    tokens, targets = _tokens(18, (2, 5)), _tokens(19, (2, 5))
    log_probs = jitted(model, "log_probs")(tokens)
    np.testing.assert_allclose(jax.scipy.special.logsumexp(log_probs, -1), 0.0, atol=1e-5)
    nll, _ = jitted(model)(tokens, targets)
    gathered = -jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(nll, gathered, atol=1e-5)


def test_adaptive_capacity_reaches_the_loss_and_changes_no_value():
    """model.adaptive_capacity goes to the adaptive softmax; the capacity-limited loss and its
    gradients equal the dense ones (same parameters), whether the tails fit or overflow."""
    dense_cfg = dataclasses.replace(TINY, adaptive_cutoffs=(12, 24), div_val=2)
    dense = LanguageModel(dense_cfg, rngs=nnx.Rngs(20))
    rng = np.random.default_rng()
    tokens = _tokens(int(rng.integers(1 << 30)), (3, 8))
    targets = _tokens(int(rng.integers(1 << 30)), (3, 8))

    def loss_and_grads(model):
        def loss(model):
            return model(tokens, targets)[0].sum()

        return nnx.jit(lambda m: nnx.value_and_grad(loss)(m))(model)

    expected, expected_grads = loss_and_grads(dense)
    for capacity in (0.5, 0.05):  # 0.05: one slot per tail, so the tails overflow
        sparse = LanguageModel(
            dataclasses.replace(dense_cfg, adaptive_capacity=capacity), rngs=nnx.Rngs(0)
        )
        assert sparse.softmax.capacity == capacity
        nnx.update(sparse, nnx.state(dense, nnx.Param))
        got, grads = loss_and_grads(sparse)
        np.testing.assert_allclose(got, expected, rtol=1e-5)
        for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
            # float32 sums in another order: errors relative to the tensor's scale (a random
            # draw once gave 1.1e-6 at an entry of 7e-4 beside entries of 0.15)
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5 * np.abs(e).max())
