"""Attention and masks against a direct numpy reference; no leaks from future or padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xformer import masks
from xformer.attention import MultiHeadAttention, dot_product_attention
from xformer.layout import Layout
from xformer.models import EncoderDecoder, TransformerConfig
from xformer.positional import SCHEMES

SLOW = pytest.mark.slow  # heavy variants: `pytest -m "not slow"` keeps a representative few


def numpy_attention(q, k, v, mask):
    """Loop-free but fully explicit reference: softmax over allowed keys only."""
    d = q.shape[-1]
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    logits = np.where(mask, logits, -np.inf)
    logits -= logits.max(-1, keepdims=True)
    w = np.exp(logits)
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", w, v)


def test_dot_product_attention_matches_numpy():
    rng = np.random.default_rng()
    b, lq, lk, h, d = 3, 5, 7, 4, 8
    q, k, v = (rng.standard_normal((b, n, h, d)).astype(np.float32) for n in (lq, lk, lk))
    mask = rng.random((b, 1, lq, lk)) < 0.7
    mask[..., 0] = True  # every query sees at least one key
    out = dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    np.testing.assert_allclose(out, numpy_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_masks_truth_tables():
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    pos = masks.positions_from_segments(seg)
    np.testing.assert_array_equal(pos, [[0, 1, 0, 1, 2, 0]])
    layout = Layout(6, 6)
    m = np.asarray(masks.attention_mask("causal", layout, q_segments=seg, k_segments=seg))[0, 0]
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 0],
        ],
        bool,
    )
    np.testing.assert_array_equal(m, expected)
    cross = np.asarray(masks.segment_mask(jnp.array([[1, 2, 0]]), jnp.array([[1, 1, 2, 0]])))[0, 0]
    np.testing.assert_array_equal(cross, [[1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])
    window = np.asarray(masks.attention_mask("sliding_window", layout, window=2))[0, 0]
    np.testing.assert_array_equal(window, np.tri(6, k=0, dtype=bool) & ~np.tri(6, k=-2, dtype=bool))
    with pytest.raises(ValueError, match="a sliding window needs window > 0, got 0"):
        masks.attention_mask("sliding_window", layout, window=0)  # no key: every key, softmaxed


def test_self_attention_module_matches_numpy():
    rng = np.random.default_rng()
    attn = MultiHeadAttention(
        16, 4, kind="self", dropout=0.0, rngs=nnx.Rngs(int(rng.integers(1e6)))
    )
    x = rng.standard_normal((2, 6, 16)).astype(np.float32)
    mask = np.tril(np.ones((6, 6), bool))[None, None].repeat(2, 0)
    kernel, bias = np.asarray(attn.qkv_proj.kernel[...]), np.asarray(attn.qkv_proj.bias[...])
    assert kernel.shape == (16, 3, 16) and bias.shape == (3, 16)  # [d, q/k/v, H * D]
    q, k, v = ((x @ kernel[:, i] + bias[i]).reshape(2, 6, 4, 4) for i in range(3))
    ref = numpy_attention(q, k, v, mask).reshape(2, 6, 16)
    ref = ref @ np.asarray(attn.out_proj.kernel[...]) + np.asarray(attn.out_proj.bias[...])
    np.testing.assert_allclose(attn(jnp.asarray(x), jnp.asarray(mask)), ref, rtol=1e-4, atol=1e-5)


def jitted(model):
    """model(...) compiled as one program: calling a model eagerly, op by op, is slow."""
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, *a, **k: nnx.merge(graphdef, state)(*a, **k))
    return lambda *a, **k: fn(state, *a, **k)


def tiny_model(seed: int, **overrides) -> EncoderDecoder:
    cfg = TransformerConfig(
        src_vocab_size=40,
        tgt_vocab_size=40,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=64,
        **overrides,
    )
    model = EncoderDecoder(cfg, rngs=nnx.Rngs(seed))
    model.eval()
    return model


@pytest.mark.parametrize("positional", SCHEMES)
@pytest.mark.parametrize("pre_norm", [False, True])
def test_no_information_from_future_or_padding(pre_norm, positional):
    """Perturbing future target tokens or padded source tokens leaves earlier logits unchanged."""
    rng = np.random.default_rng()
    model = tiny_model(
        int(rng.integers(1e6)), layer_norm="pre" if pre_norm else "post", positional=positional
    )
    src = rng.integers(4, 40, (2, 9))
    src[:, 6:] = 0  # padding
    tgt = rng.integers(4, 40, (2, 7))
    base = np.asarray(model(jnp.asarray(src), jnp.asarray(tgt)))

    src2 = src.copy()
    src2[:, 6:] = rng.integers(4, 40, (2, 3))  # change padded positions' tokens...
    src_seg = (src > 0).astype(np.int32)  # ...but keep them marked as padding
    out = model(jnp.asarray(src2), jnp.asarray(tgt), src_segments=jnp.asarray(src_seg))
    np.testing.assert_allclose(out, base, atol=1e-5)

    tgt2 = tgt.copy()
    tgt2[:, 4:] = rng.integers(4, 40, (2, 3))  # change the future
    out = np.asarray(model(jnp.asarray(src), jnp.asarray(tgt2)))
    np.testing.assert_allclose(out[:, :4], base[:, :4], atol=1e-5)
    assert np.abs(out[:, 4:] - base[:, 4:]).max() > 1e-3  # and the future does change


@pytest.mark.parametrize(  # fast: one absolute and one relative scheme
    "positional",
    [p if p in ("sinusoidal", "relative") else pytest.param(p, marks=SLOW) for p in SCHEMES],
)
def test_packed_rows_equal_separate_examples(positional):
    """Two pairs packed into one row give the same logits as each pair alone."""
    rng = np.random.default_rng()
    model = tiny_model(int(rng.integers(1e6)), positional=positional)
    call = jitted(model)
    s1, s2 = rng.integers(4, 40, 5), rng.integers(4, 40, 3)
    t1, t2 = rng.integers(4, 40, 4), rng.integers(4, 40, 6)
    alone = [
        np.asarray(call(jnp.asarray(s[None]), jnp.asarray(t[None])))[0]
        for s, t in ((s1, t1), (s2, t2))
    ]
    src = jnp.asarray(np.concatenate([s1, s2, [0, 0]])[None])
    tgt = jnp.asarray(np.concatenate([t1, t2, [0]])[None])
    src_seg = jnp.asarray([[1] * 5 + [2] * 3 + [0, 0]])
    tgt_seg = jnp.asarray([[1] * 4 + [2] * 6 + [0]])
    packed = np.asarray(
        call(
            src,
            tgt,
            src_seg,
            tgt_seg,
            masks.positions_from_segments(src_seg),
            masks.positions_from_segments(tgt_seg),
        )
    )[0]
    np.testing.assert_allclose(packed[:4], alone[0], atol=1e-4)
    np.testing.assert_allclose(packed[4:10], alone[1], atol=1e-4)


@pytest.mark.parametrize(  # fast: an absolute scheme, XL's relative one and both sliding windows
    "positional,overrides",  # (every relative scheme's decode step: test_positional.py, fast)
    [
        (n, {}) if n in ("sinusoidal", "relative") else pytest.param(n, {}, marks=SLOW)
        for n in SCHEMES
    ]
    + [
        pytest.param("rope", {"layer_norm": "pre"}, marks=SLOW),
        pytest.param(
            "relative",
            {"layer_norm": "pre", "untie_relative_biases": True, "clamp_len": 3},
            marks=SLOW,
        ),
        ("alibi", {"decoder_mask": "sliding_window", "attention_window": 3}),
        ("t5_bias", {"encoder_mask": "sliding_window", "attention_window": 2}),
    ],
)
def test_cached_decoding_equals_full_decoding(positional, overrides):
    rng = np.random.default_rng()
    model = tiny_model(
        int(rng.integers(1e6)),
        positional=positional,
        share_embeddings=False,
        tie_output=False,
        **overrides,
    )
    src = rng.integers(4, 40, (3, 8))
    src[0, 5:] = 0
    tgt = rng.integers(4, 40, (3, 6))
    full = jax.nn.log_softmax(model(jnp.asarray(src), jnp.asarray(tgt)))
    cache = model.init_decode_cache(jnp.asarray(src), max_len=10)
    step = jax.jit(lambda t, c, i: model.decode_step(t, c, i))
    for i in range(6):
        log_probs, cache = step(jnp.asarray(tgt[:, i]), cache, jnp.int32(i))
        np.testing.assert_allclose(log_probs, full[:, i], atol=1e-4)
