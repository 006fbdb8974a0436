"""Precision and the attention backend: float64 models match the numpy references to 1e-12,
bfloat16 models compute in bfloat16 with float32 softmaxes and loss and train like float32
ones, mask fill values are safe in every dtype, and attention_impl="fused"
(jax.nn.dot_product_attention) equals the einsum reference, forward and gradients, for every
positional and masking scheme, with padding, packing, memory and cached decoding."""

import dataclasses
import functools
import re
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from references import numpy_encoder_decoder, numpy_language_model
from test_configs import load
from test_language_modeling import tiny_config
from test_positional import RELATIVE_SCHEMES, SETTINGS, attention_case
from test_train_eval import shared_vocab_dir

from xformer import masks, precision
from xformer.attention import dot_product_attention
from xformer.language_model import LanguageModel
from xformer.layout import Layout
from xformer.linear import Linear, Projections
from xformer.losses import cross_entropy
from xformer.model_config import LMConfig, TransformerConfig
from xformer.models import EncoderDecoder
from xformer.positional import SCHEMES
from xformer.positional.base import BoundScheme

ROOT = Path(__file__).resolve().parents[1]
SLOW = pytest.mark.slow
TINY_TRANSLATION = dict(  # the model tests' encoder-decoder (TransformerConfig keywords)
    src_vocab_size=23,
    tgt_vocab_size=23,
    d_model=16,
    num_heads=2,
    num_encoder_layers=2,
    num_decoder_layers=2,
    d_ff=24,
)
TINY_LM = dict(vocab_size=29, d_model=16, num_heads=2, num_decoder_layers=2, d_ff=24)
TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2}  # fused vs xla, relative to the values' scale
BFLOAT16_STEP = 2.0**-8  # one rounding step of bfloat16 (8 significant bits), relative


def fresh_seed() -> int:
    return int(np.random.default_rng().integers(1e6))


def assert_close(actual, expected, dtype: str, what: str = "", tolerance: float = 0) -> None:
    """|actual - expected| <= (tolerance or TOLERANCE[dtype]) * max|expected| (bfloat16 rounds
    relative to the largest values it meets, so elementwise rtol would be meaningless near 0)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(np.abs(expected).max(), 1e-30)
    error = np.abs(actual - expected).max() / scale
    assert error <= (tolerance or TOLERANCE[dtype]), f"{what}: max error {error:.2e} of {scale:.2e}"


# Mask fill values ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_mask_value_is_safe_in_every_dtype(dtype):
    with jax.enable_x64(dtype == "float64"):
        fill = jnp.asarray(precision.mask_value(dtype), dtype)
        assert np.isfinite(np.asarray(fill, np.float64))
        row = jnp.asarray(np.random.default_rng().normal(size=6), dtype)
        masked = jnp.where(jnp.arange(6) < 2, row, fill)
        probs = np.asarray(jax.nn.softmax(masked.astype(jnp.float32)), np.float64)
        assert (probs[2:] == 0).all() and np.isclose(probs.sum(), 1.0)
        empty = np.asarray(jax.nn.softmax(jnp.full((6,), fill)), np.float64)  # fully masked
        np.testing.assert_allclose(empty, 1 / 6, rtol=1e-2)


def test_fully_masked_queries_give_finite_outputs_in_half_precision():
    rng = np.random.default_rng()
    for dtype in (jnp.float16, jnp.bfloat16):
        q, k, v = (jnp.asarray(rng.normal(size=(1, 3, 2, 8)), dtype) for _ in range(3))
        mask = jnp.asarray([[True, False, False], [False] * 3, [True, True, True]])[None, None]
        for implementation in ("xla", "fused"):
            out = dot_product_attention(q, k, v, mask, implementation=implementation)
            assert out.dtype == dtype and np.isfinite(np.asarray(out, np.float32)).all()
            got, v64 = np.asarray(out[0], np.float64), np.asarray(v[0], np.float64)  # [L, H, D]
            np.testing.assert_allclose(got[1], v64.mean(0), atol=2e-2)  # fully masked: the mean
            np.testing.assert_allclose(got[0], v64[0], atol=2e-2)  # sees key 0 alone
            q64, k64 = np.asarray(q[0, 2], np.float64), np.asarray(k[0], np.float64)
            logits = np.einsum("hd,khd->hk", q64, k64) / np.sqrt(8)  # query 2 sees every key
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            np.testing.assert_allclose(got[2], np.einsum("hk,khd->hd", probs, v64), atol=2e-2)


# Float64 end to end ----------------------------------------------------------------------------


def float64_translation(seed: int, **overrides) -> EncoderDecoder:
    cfg = TransformerConfig(
        **TINY_TRANSLATION,
        dtype="float64",
        param_dtype="float64",
        **overrides,
    )
    model = EncoderDecoder(cfg, rngs=nnx.Rngs(seed))
    model.eval()
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "positional": "t5_bias",
            "layer_norm": "pre",
            "tie_output": False,
            "attention_impl": "fused",
        },
    ],
    ids=["sinusoidal-post", "t5-pre-untied-fused"],
)
def test_float64_encoder_decoder_matches_numpy(overrides):
    rng = np.random.default_rng()
    with jax.enable_x64(True):
        model = float64_translation(fresh_seed(), **overrides)
        src = rng.integers(1, 23, size=(2, 7))
        tgt_in = rng.integers(1, 23, size=(2, 5))
        src[1, 5:], tgt_in[1, 3:] = 0, 0  # padding at the end of the second row
        logits = model(jnp.asarray(src), jnp.asarray(tgt_in))
        assert logits.dtype == jnp.float64
        expected = numpy_encoder_decoder(model, src, tgt_in)
        valid = (tgt_in > 0)[..., None]
        np.testing.assert_allclose(
            np.where(valid, logits, 0), np.where(valid, expected, 0), atol=1e-12, rtol=0
        )


@pytest.mark.parametrize("positional, attention_impl", [("relative", "xla"), ("alibi", "fused")])
def test_float64_transformer_xl_matches_numpy_over_two_segments(positional, attention_impl):
    """Two segments through the memory: the second attends over the first's layer inputs.
    The fused path too stays float64 (jax's XLA form of it would compute in float32)."""
    rng = np.random.default_rng()
    with jax.enable_x64(True):
        cfg = LMConfig(
            **TINY_LM,
            mem_len=5,
            positional=positional,
            attention_impl=attention_impl,
            dtype="float64",
            param_dtype="float64",
        )
        model = LanguageModel(cfg, rngs=nnx.Rngs(fresh_seed()))
        model.eval()
        tokens = rng.integers(0, 29, size=(2, 11))
        memory, ref_memory = model.init_memory(2, 5), None
        assert memory["states"].dtype == jnp.float64
        for s in (slice(0, 5), slice(5, 10)):
            nll, memory = model(jnp.asarray(tokens[:, s]), jnp.asarray(tokens[:, 1:][:, s]), memory)
            expected, ref_memory = numpy_language_model(
                model, tokens[:, s], tokens[:, 1:][:, s], ref_memory
            )
            assert nll.dtype == jnp.float64
            np.testing.assert_allclose(nll, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("positional", ["relative", "t5_bias", "alibi", "rope"])
def test_float64_prefix_lm_matches_numpy(positional):
    """Prefix queries see later prefix keys: their position terms at negative distances."""
    rng = np.random.default_rng()
    with jax.enable_x64(True):
        cfg = LMConfig(
            **TINY_LM,
            positional=positional,
            decoder_mask="prefix_lm",
            prefix_length=5,
            dtype="float64",
            param_dtype="float64",
        )
        model = LanguageModel(cfg, rngs=nnx.Rngs(fresh_seed()))
        model.eval()
        tokens = rng.integers(0, 29, size=(2, 9))
        nll, _ = model(jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]))
        expected, _ = numpy_language_model(model, tokens[:, :-1], tokens[:, 1:])
        np.testing.assert_allclose(nll, expected, atol=1e-12, rtol=0)


# bfloat16 plumbing -----------------------------------------------------------------------------


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_bfloat16_computes_in_bfloat16_and_scores_in_float32(param_dtype):
    rng = np.random.default_rng()
    src, tgt = (jnp.asarray(rng.integers(1, 23, size=(2, 6))) for _ in range(2))
    cfg = TransformerConfig(
        src_vocab_size=23,
        tgt_vocab_size=23,
        d_model=16,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        d_ff=24,
        dtype="bfloat16",
        param_dtype=param_dtype,
        positional="relative",
    )
    model = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
    model.eval()  # no dropout draws inside eval_shape
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {p.dtype for p in params} == {jnp.dtype(param_dtype)}
    segments = (src > 0).astype(jnp.int32)
    positions = masks.positions_from_segments(segments)
    shape = jax.eval_shape  # dtypes from tracing alone
    assert shape(lambda: model.encode(src, segments, positions)).dtype == jnp.bfloat16
    # the logits stay bfloat16 up to the loss, which upcasts them inside its custom VJP
    assert shape(lambda: model(src, tgt)).dtype == jnp.bfloat16
    loss = shape(lambda: cross_entropy(model(src, tgt), tgt, jnp.ones(tgt.shape), 0.1))
    assert loss[0].dtype == jnp.float32
    log_probs, cache = shape(
        lambda: model.decode_step(tgt[:, 0], model.init_decode_cache(src, 4), jnp.asarray(0))
    )
    assert log_probs.dtype == jnp.float32 and cache["self"][0]["k"].dtype == jnp.bfloat16


def test_bfloat16_transformer_xl_keeps_its_memory_in_bfloat16():
    cfg = LMConfig(
        **TINY_LM,
        mem_len=4,
        positional="relative",
        dtype="bfloat16",
    )
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    model.eval()  # no dropout draws inside eval_shape
    tokens = jnp.zeros((2, 4), jnp.int32)
    nll, memory = jax.eval_shape(lambda: model(tokens, tokens, model.init_memory(2, 4)))
    assert nll.dtype == jnp.float32 and memory["states"].dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_wide_einsum_accumulates_wide_and_differentiates_in_the_operands_dtype(dtype):
    with jax.enable_x64(dtype == "float64"):
        rng = np.random.default_rng()
        spec = "bqhd,bkhd->bhqk"
        x, y = (jnp.asarray(rng.normal(size=(2, n, 3, 8)), dtype) for n in (5, 7))
        x64, y64 = (np.asarray(a, np.float64) for a in (x, y))
        wide = precision.at_least_float32(dtype)
        out, vjp = jax.vjp(functools.partial(precision.wide_einsum, spec), x, y)
        assert out.dtype == wide
        tolerance = {"bfloat16": 1e-5, "float32": 1e-5, "float64": 1e-12}[dtype]
        np.testing.assert_allclose(out, np.einsum(spec, x64, y64), rtol=tolerance, atol=tolerance)
        g = jnp.asarray(rng.normal(size=out.shape), wide)
        dx, dy = vjp(g)
        assert dx.dtype == dy.dtype == jnp.dtype(dtype)
        # Reference: the cotangent rounded to the operands' dtype, the products in float64.
        g64 = np.asarray(g.astype(dtype), np.float64)
        tolerance = {"bfloat16": 1e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
        for got, want in (
            (dx, np.einsum("bhqk,bkhd->bqhd", g64, y64)),
            (dy, np.einsum("bhqk,bqhd->bkhd", g64, x64)),
        ):
            got = np.asarray(got, np.float64)
            assert np.abs(got - want).max() <= tolerance * np.abs(want).max()
        if dtype != "bfloat16":  # the plain einsum's own gradients, bit for bit
            plain = jax.vjp(functools.partial(jnp.einsum, spec), x, y)[1](g)
            for got, want in zip((dx, dy), plain, strict=True):
                np.testing.assert_array_equal(got, want)


_DOT = re.compile(r"stablehlo\.dot_general[^\n]*:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)")


def float32_matmuls(program: str) -> list[str]:
    """The dot_generals of a lowered program whose operands are both float32 matrices (rank >=
    2: a LayerNorm's float32 matrix-vector reductions are left out)."""
    found = []
    for operands in _DOT.findall(program):
        if all(t.endswith("xf32>") and t.count("x") >= 2 for t in operands):
            found.append(" . ".join(operands))
    return found


def _gradient_program(model, loss) -> str:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad = jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest)))
    return jax.jit(grad).lower(params).as_text()


@pytest.mark.parametrize("family", ["translation", "language_modeling"])
def test_bfloat16_backward_pass_has_no_float32_matmul(family):
    """Logits accumulate in float32, but their gradients multiply in bfloat16
    (precision.wide_einsum): the attention logits on the xla path, the XL relative-position
    terms, the adaptive softmax's clusters (dense and gathered). Only the float32 LayerNorm
    reductions remain float32 dots. Before wide_einsum a bfloat16 model's backward pass upcast
    the other operand and multiplied in float32: 4 float32 matmuls per attention layer, 2 per
    adaptive cluster."""
    rng = np.random.default_rng()
    dims = dict(d_model=16, num_heads=2, d_ff=24, dtype="bfloat16", positional="relative")
    if family == "translation":
        cfg = TransformerConfig(
            src_vocab_size=23, tgt_vocab_size=23, num_encoder_layers=1, num_decoder_layers=1, **dims
        )
        model = EncoderDecoder(cfg, rngs=nnx.Rngs(0))
        src, tgt = (jnp.asarray(rng.integers(1, 23, size=(2, 6))) for _ in range(2))
        weights = jnp.ones(tgt.shape)

        def loss(m):
            return cross_entropy(m(src, tgt), tgt, weights, label_smoothing=0.1)[0]
    else:
        cfg = LMConfig(
            vocab_size=64,
            num_decoder_layers=2,
            mem_len=4,
            adaptive_cutoffs=(8, 24),
            div_val=2,
            adaptive_capacity=0.5,  # the gathered tail rows and their dense fallback
            **dims,
        )
        model = LanguageModel(cfg, rngs=nnx.Rngs(0))
        tokens, targets = (jnp.asarray(rng.integers(0, 64, size=(2, 6))) for _ in range(2))
        memory = model.init_memory(2, 4)

        def loss(m):
            return m(tokens, targets, memory)[0].sum()

    model.eval()  # dropout off: only the matmuls matter here
    program = _gradient_program(model, loss)
    assert len(_DOT.findall(program)) > 20  # the pattern reads this jax's program text
    assert float32_matmuls(program) == []


# Fused attention equals the reference ---------------------------------------------------------


def _values_and_grads(case):
    """Attention output and the gradients of a random weighting of its valid rows with respect
    to the queries' states, the memory and every parameter (projections and scheme)."""
    graphdef, params, rest = nnx.split((case.attn, case.scheme), nnx.Param, ...)
    weights = np.random.default_rng(0).normal(size=case.x.shape) * case.valid_rows()

    def loss(params, x, memory):
        attn, scheme = nnx.merge(graphdef, params, rest)
        out = dataclasses.replace(case, attn=attn, scheme=scheme)(x, memory)
        return (out.astype(jnp.float32) * weights).sum(), out

    memory = None if case.memory is None else jnp.asarray(case.memory)
    grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(
        params, jnp.asarray(case.x), memory
    )
    return out * case.valid_rows(), grads


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", RELATIVE_SCHEMES)
def test_fused_attention_equals_reference_under_each_positional_scheme(name, setting, dtype):
    """Biases from ALiBi, T5, Transformer-XL (q-dependent, learned), rotations (rope), a padded
    encoder row, a memory with empty slots, and one cached decoding step."""
    seed = fresh_seed()
    (out, grads), (fused_out, fused_grads) = (
        _values_and_grads(attention_case(name, {}, setting, seed, dtype, implementation))
        for implementation in ("xla", "fused")
    )
    assert fused_out.dtype == jnp.dtype(dtype)
    assert_close(fused_out, out, dtype, "output")
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert_close(_at(fused_grads, path), g, dtype, jax.tree_util.keystr(path))


def _at(tree, path):
    for key in path:
        tree = tree[getattr(key, "key", getattr(key, "idx", None))]
    return tree


MASK_CASES = {  # mask scheme -> (layout, attention_mask keywords)
    "causal": (Layout(8, 8), {}),
    "bidirectional": (Layout(8, 8, causal=False), {}),
    "sliding_window": (Layout(8, 8), {"window": 3}),
    "prefix_lm": (Layout(8, 8), {"prefix_length": 3}),
    "same_length": (Layout.with_memory(8, 4), {}),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", list(MASK_CASES))
def test_fused_attention_equals_reference_under_each_mask(kind, dtype):
    """Every masking scheme, on packed rows (two examples and padding) with a T5 bias."""
    assert set(MASK_CASES) == set(masks.MASK_SCHEMES)
    rng = np.random.default_rng()
    layout, keywords = MASK_CASES[kind]
    segments = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 0, 0]])
    if layout.k_len > layout.q_len:  # memory slots, all filled, belong to every example
        k_segments = jnp.concatenate([jnp.ones((2, 4), jnp.int32), segments], 1)
        mask = masks.attention_mask(kind, layout, key_valid=k_segments > 0, **keywords)
        mask = mask & (segments > 0)[:, None, :, None]
    else:
        mask = masks.attention_mask(
            kind, layout, q_segments=segments, k_segments=segments, **keywords
        )
    scheme = SCHEMES["t5_bias"](
        LMConfig(vocab_size=8, d_model=16, num_heads=2, positional="t5_bias"), 1, rngs=nnx.Rngs(0)
    )
    bias = BoundScheme.bind(scheme, layout).bias(None, None, 0)
    q = jnp.asarray(rng.normal(size=(2, layout.q_len, 2, 8)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(2, layout.k_len, 2, 8)), dtype) for _ in range(2))
    weights = rng.normal(size=q.shape) * np.asarray(mask.any(-1))[:, 0, :, None, None]

    def loss(q, k, v, bias, implementation):
        out = dot_product_attention(q, k, v, mask, bias=bias, implementation=implementation)
        return (out.astype(jnp.float32) * weights).sum(), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True), static_argnums=4)
    (grads, out), (fused_grads, fused_out) = (grad(q, k, v, bias, i) for i in ("xla", "fused"))
    valid = np.asarray(mask.any(-1))[:, 0, :, None, None]
    assert_close(np.where(valid, fused_out, 0), np.where(valid, out, 0), dtype, "output")
    for name, g, fused_g in zip("qkvb", grads, fused_grads, strict=True):
        assert_close(fused_g, g, dtype, f"d{name}")


def _fused_and_xla_gradients(stand_in, q, k, v, bias, mask, monkeypatch) -> tuple:
    """(loss, dq, dk, dv, dbias) of sum(attention * fresh weights), twice: through the fused
    path on a pretend GPU whose jax.nn.dot_product_attention is `stand_in`, and through jax's
    own XLA call with the true scale (no dbias where `bias` is None)."""
    real = jax.nn.dot_product_attention
    weights = np.random.default_rng().normal(size=q.shape)

    def grads(attention):
        def loss(q, k, v, bias):
            return (attention(q, k, v, bias).astype(jnp.float32) * weights).sum()

        return jax.tree.leaves(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias))

    scale = 1 / np.sqrt(q.shape[-1])
    want = grads(lambda *qkvb: real(*qkvb, mask, scale=scale, implementation="xla"))
    with monkeypatch.context() as patch:
        patch.setattr(jax.nn, "dot_product_attention", stand_in)
        patch.setattr(jax, "default_backend", lambda: "gpu")
        got = grads(
            lambda q, k, v, bias: dot_product_attention(
                q, k, v, mask, bias=bias, implementation="fused"
            )
        )
    names = ["loss", "dq", "dk", "dv", "dbias"][: 4 + (bias is not None)]
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
    return got, want


@pytest.mark.parametrize("head_size", [5, 8, 41])
def test_cudnn_gets_head_sizes_padded_to_a_multiple_of_8(head_size, monkeypatch):
    """On a GPU, a head size cuDNN refuses (not a multiple of 8: WikiText-103's 41) is
    zero-padded for it, with the true size's scale. Here a stand-in for cuDNN on the CPU
    refuses what cuDNN refuses (head size, dtype) and otherwise computes jax's XLA attention
    of what it is given; output and gradients (q, k, v, bias) equal jax's unpadded call."""
    real = jax.nn.dot_product_attention
    calls = []

    def fake_cudnn(
        q, k, v, bias=None, mask=None, *, scale=None, is_causal=False, implementation=None
    ):
        if implementation == "cudnn":
            if q.shape[-1] % 8 or q.dtype not in (jnp.bfloat16, jnp.float16):
                raise ValueError(f"cuDNN refuses head size {q.shape[-1]} in {q.dtype}")
            calls.append(q.shape[-1])
        return real(q, k, v, bias, mask, scale=scale, is_causal=is_causal, implementation="xla")

    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.normal(size=(2, 6, 3, head_size)), jnp.bfloat16) for _ in "qkv")
    bias = jnp.asarray(rng.normal(size=(1, 3, 6, 6)), jnp.bfloat16)
    mask = jnp.tril(jnp.ones((6, 6), bool))[None, None]
    got, want = _fused_and_xla_gradients(fake_cudnn, q, k, v, bias, mask, monkeypatch)
    assert calls and set(calls) == {-(-head_size // 8) * 8}  # cuDNN served every call
    for name, g, w in zip(["loss", "dq", "dk", "dv", "dbias"], got, want, strict=True):
        # The same arithmetic, but a CPU with native bfloat16 dots (AVX512-BF16, AMX) may take
        # another kernel for the padded shape and round one bfloat16 step differently; a wrong
        # scale or nonzero padding is off by far more (the scale alone by 1 - sqrt(5/8) = 21%).
        assert_close(g, w, "bfloat16", name, tolerance=BFLOAT16_STEP)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("q_len,k_len", [(8, 8), (6, 8)])
def test_cudnn_never_sees_a_query_that_sees_no_key(q_len, k_len, dtype, monkeypatch):
    """Padding queries of packed rows see no key. cuDNN's backward can return NaN for such a
    row (see attention._without_empty_rows), so the fused path hands cuDNN (a stand-in here
    that records its mask and computes jax's XLA attention) every such row with all keys, a
    zero query and zero bias; output and gradients (q, k, v, bias) still equal jax's call with
    the original mask, on every row (the weights of the loss count them too): the uniform
    average of the values, zero dq and dk."""
    real = jax.nn.dot_product_attention
    given_masks = []

    def fake_cudnn(
        q, k, v, bias=None, mask=None, *, scale=None, is_causal=False, implementation=None
    ):
        if implementation == "cudnn":
            given_masks.append(np.asarray(mask))
        return real(q, k, v, bias, mask, scale=scale, is_causal=is_causal, implementation="xla")

    rng = np.random.default_rng()
    q = jnp.asarray(rng.normal(size=(2, q_len, 2, 8)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(2, k_len, 2, 8)), dtype) for _ in "kv")
    bias = jnp.asarray(rng.normal(size=(1, 2, q_len, k_len)), dtype)
    q_segments = jnp.asarray([[1, 1, 2, 2, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]])[:, :q_len]
    k_segments = jnp.asarray([[1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])[:, :k_len]
    mask = masks.segment_mask(q_segments, k_segments)
    assert not np.asarray(mask.any(-1)).all()  # rows that see nothing are in the case
    got, want = _fused_and_xla_gradients(fake_cudnn, q, k, v, bias, mask, monkeypatch)
    assert given_masks and all(m.any(-1).all() for m in given_masks)
    for name, g, w in zip(["loss", "dq", "dk", "dv", "dbias"], got, want, strict=True):
        # In bfloat16, dbias may differ by a rounding step: the where broadcasts the bias over
        # the batch, so its gradient's batch sum is rounded in another order.
        assert_close(g, w, dtype, name, tolerance=1e-6 if dtype == "float32" else 2 * BFLOAT16_STEP)


@pytest.mark.parametrize("with_bias", [False, True])
def test_cudnn_is_asked_for_no_gradient_of_a_mask(with_bias, monkeypatch):
    """jax before 0.11 asks cuDNN's backward pass for the gradient of the bias a boolean mask
    becomes (`should_export_dbias`, read when the call is traced, is always True there). For a
    call whose only bias is the mask, the fused path has it answer False while the call is
    traced, and restores it after; a call with a real bias keeps the gradient, which the
    bias's own gradient needs. The stand-in for cuDNN records the answer; output and
    gradients equal jax's XLA call."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_module

    if not hasattr(cudnn_module, "should_export_dbias"):
        pytest.skip(f"jax {jax.__version__} asks for no gradient of a mask by itself")
    real = jax.nn.dot_product_attention
    original = cudnn_module.should_export_dbias
    answers = []

    def fake_cudnn(
        q, k, v, bias=None, mask=None, *, scale=None, is_causal=False, implementation=None
    ):
        if implementation == "cudnn":
            answers.append(cudnn_module.should_export_dbias(q.shape, q.shape, None))
        return real(q, k, v, bias, mask, scale=scale, is_causal=is_causal, implementation="xla")

    rng = np.random.default_rng()
    q, k, v = (jnp.asarray(rng.normal(size=(2, 8, 2, 8)), jnp.float32) for _ in "qkv")
    bias = jnp.asarray(rng.normal(size=(1, 2, 8, 8)), jnp.float32) if with_bias else None
    mask = masks.segment_mask(*[jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 2], [1] * 8])] * 2)
    got, want = _fused_and_xla_gradients(fake_cudnn, q, k, v, bias, mask, monkeypatch)
    assert answers and set(answers) == {with_bias}
    assert cudnn_module.should_export_dbias is original
    for name, g, w in zip(["loss", "dq", "dk", "dv", "dbias"], got, want, strict=False):
        assert_close(g, w, "float32", name, tolerance=1e-6)


def test_a_bias_gradient_is_not_lost_to_another_threads_mask_only_call(monkeypatch):
    """While one thread traces a mask-only cuDNN call (should_export_dbias answers False), a
    call with a real bias traced by another thread waits for it and is asked for its bias
    gradient (the answer it records is True)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_module

    if not hasattr(cudnn_module, "should_export_dbias"):
        pytest.skip(f"jax {jax.__version__} asks for no gradient of a mask by itself")
    real = jax.nn.dot_product_attention
    answers, other = {}, []
    rng = np.random.default_rng()
    q = jnp.asarray(rng.normal(size=(1, 4, 2, 8)), jnp.float32)
    mask = jnp.tril(jnp.ones((4, 4), bool))[None, None]
    real_bias = jnp.asarray(rng.normal(size=(1, 2, 4, 4)), jnp.float32)
    attend = functools.partial(dot_product_attention, q, q, q, mask, implementation="fused")

    def fake_cudnn(
        q, k, v, bias=None, mask=None, *, scale=None, is_causal=False, implementation=None
    ):
        kind = "mask only" if bias is None else "bias"
        answers[kind] = cudnn_module.should_export_dbias(q.shape, q.shape, None)
        if kind == "mask only":
            other.append(threading.Thread(target=lambda: attend(bias=real_bias)))
            other[0].start()
            other[0].join(1.0)  # it cannot trace its call while this one is traced
        return real(q, k, v, bias, mask, scale=scale, is_causal=is_causal, implementation="xla")

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake_cudnn)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    attend()
    other[0].join()
    assert answers == {"mask only": False, "bias": True}


# Whole models: fused equals xla, bfloat16 trains like float32 -----------------------------------


def _model_loss_and_grads(model, loss_fn):
    """loss_fn(model) and its gradients with respect to every parameter, compiled. (A copy of
    the model's state is merged, so that a remat layer may update its RNG counts there.)"""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def run(params):
        model = lambda p: nnx.merge(graphdef, p, rest, copy=True)  # noqa: E731
        return jax.value_and_grad(lambda p: loss_fn(model(p)))(params)

    return run(params)


def _settings(dtype: str) -> list[tuple[str, str]]:
    """(attention_impl, dtype) of the models to compare: xla and fused in `dtype`, and for
    bfloat16 the xla model in float32 too, which measures the bfloat16 rounding itself."""
    return [("xla", dtype), ("fused", dtype)] + [("xla", "float32")] * (dtype == "bfloat16")


def _assert_models_agree(results: list, dtype: str, tolerance: float = 0) -> None:
    """(loss, gradients) of the models of `_settings(dtype)`: fused's equal xla's to
    `tolerance` (default TOLERANCE[dtype]) of each one's scale. A gradient whose terms cancel
    (a bias's, the sum of dq over positions) is rounded by bfloat16 far beyond its own size,
    by either path; given the float32 model's (the same parameters), each may also differ by
    3x xla's own error against them."""
    (loss, grads), (fused_loss, fused_grads), *float32 = results
    leaves = [
        dict(jax.tree_util.tree_leaves_with_path(g)) for g in (grads, *(f[1] for f in float32))
    ]
    compared = [("loss", fused_loss, loss, *(f[0] for f in float32))] + [
        (jax.tree_util.keystr(path), g, *(leaf[path] for leaf in leaves))
        for path, g in jax.tree_util.tree_leaves_with_path(fused_grads)
    ]
    for name, got, want, *exact in compared:
        allowed = tolerance or TOLERANCE[dtype]
        if exact:
            own_error = np.abs(np.subtract(want, exact[0], dtype=float)).max()
            allowed = max(allowed, 3 * own_error / max(np.abs(want).max(), 1e-30))
        assert_close(got, want, dtype, name, allowed)


def same_seed_models(model_cls, config_cls, settings: list, **config) -> list:
    """One model per (attention_impl, dtype) of `settings`, all from one fresh seed."""
    seed = fresh_seed()
    return [
        model_cls(config_cls(**config, attention_impl=impl, dtype=dtype), rngs=nnx.Rngs(seed))
        for impl, dtype in settings
    ]


def translation_loss(src_segments: jax.Array, tgt_segments: jax.Array, vocab: int = 23):
    """loss(model): label-smoothed cross-entropy of an encoder-decoder on fresh random tokens
    laid out by the segment ids [B, L] (0 = padding)."""
    rng = np.random.default_rng()
    src = jnp.asarray(rng.integers(1, vocab, size=src_segments.shape)) * (src_segments > 0)
    tgt_in = jnp.asarray(rng.integers(1, vocab, size=tgt_segments.shape)) * (tgt_segments > 0)
    tgt_out = jnp.asarray(rng.integers(1, vocab, size=tgt_segments.shape))

    def loss(model):
        logits = model(src, tgt_in, src_segments, tgt_segments)
        return cross_entropy(logits, tgt_out, (tgt_segments > 0).astype(jnp.float32), 0.1)[0]

    return loss


@pytest.mark.parametrize(
    "dtype,positional",
    [
        ("float32", "t5_bias"),
        ("bfloat16", "rope"),
        pytest.param("float32", "sinusoidal", marks=SLOW),
        pytest.param("bfloat16", "alibi", marks=SLOW),
    ],
)
def test_fused_encoder_decoder_equals_xla_on_packed_rows(dtype, positional):
    """Loss and every gradient of the whole model on rows packing two examples and padding."""
    src_segments = jnp.asarray([[1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 0, 0]])
    tgt_segments = jnp.asarray([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
    models = same_seed_models(
        EncoderDecoder,
        TransformerConfig,
        _settings(dtype),
        **TINY_TRANSLATION,
        dropout=0.0,
        positional=positional,
    )
    loss = translation_loss(src_segments, tgt_segments)
    _assert_models_agree([_model_loss_and_grads(m, loss) for m in models], dtype)


def test_packed_rows_reach_cudnn_without_empty_rows_and_train_like_xla(monkeypatch):
    """The whole encoder-decoder on packed rows with padding, bfloat16, on a pretend GPU whose
    cuDNN is a stand-in (jax's XLA attention of what it is given): every attention call of
    the three kinds takes the cuDNN branch, none is handed a query row that sees no key
    (attention._without_empty_rows), and loss and gradients equal the XLA path's."""
    real = jax.nn.dot_product_attention
    served, empty_rows = [], []

    def fake_cudnn(
        q, k, v, bias=None, mask=None, *, scale=None, is_causal=False, implementation=None
    ):
        if implementation == "cudnn":
            served.append(q.shape)
            jax.debug.callback(empty_rows.append, jnp.sum(~jnp.any(mask, axis=-1)))
        return real(q, k, v, bias, mask, scale=scale, is_causal=is_causal, implementation="xla")

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake_cudnn)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    test_fused_encoder_decoder_equals_xla_on_packed_rows("bfloat16", "rope")
    assert len(served) == 2 * 2 + 2  # encoder self, decoder self and cross, 2 layers each
    assert len(empty_rows) == len(served) and not any(empty_rows)


def test_whole_causal_rows_reach_cudnn_as_its_causal_mask(monkeypatch):
    """A language model without a memory (whole causal rows: no segments, no padding) on a
    pretend GPU, bfloat16: every attention call reaches cuDNN (a stand-in computing jax's XLA
    attention of what it is given) with no mask to read as a bias and is_causal set, and loss
    and gradients equal the XLA path's. With a memory, the mask is kept."""
    real = jax.nn.dot_product_attention
    calls = []

    def fake_cudnn(
        q, k, v, bias=None, mask=None, *, scale=None, is_causal=False, implementation=None
    ):
        if implementation == "cudnn":
            calls.append((mask is None, is_causal))
        return real(q, k, v, bias, mask, scale=scale, is_causal=is_causal, implementation="xla")

    monkeypatch.setattr(jax.nn, "dot_product_attention", fake_cudnn)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    tokens = jnp.asarray(np.random.default_rng().integers(0, 29, size=(2, 13)))
    models = same_seed_models(
        LanguageModel,
        LMConfig,
        _settings("bfloat16"),
        **TINY_LM,
        dropout=0.0,
        positional="learned",
        max_len=12,
    )
    loss = lambda model: model(tokens[:, :-1], tokens[:, 1:])[0].mean()  # noqa: E731
    results = [_model_loss_and_grads(model, loss) for model in models]
    assert calls == [(True, True)] * 2
    _assert_models_agree(results, "bfloat16")
    calls.clear()
    [model] = same_seed_models(
        LanguageModel,
        LMConfig,
        [("fused", "bfloat16")],
        **TINY_LM | dict(num_decoder_layers=1),
        dropout=0.0,
        mem_len=4,
        positional="relative",
    )
    model(tokens[:, :6], tokens[:, 1:7], model.init_memory(2, 4))
    assert calls == [(False, False)]


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=SLOW)])
def test_fused_transformer_xl_equals_xla_through_the_memory(dtype):
    """Loss and gradients of a second segment attending over the first's memory."""
    tokens = jnp.asarray(np.random.default_rng().integers(0, 29, size=(2, 13)))
    models = same_seed_models(
        LanguageModel,
        LMConfig,
        _settings(dtype),
        **TINY_LM,
        dropout=0.0,
        mem_len=6,
        positional="relative",
    )

    def loss(model):
        _, memory = model(tokens[:, :6], tokens[:, 1:7], model.init_memory(2, 6))
        nll, _ = model(tokens[:, 6:12], tokens[:, 7:13], memory)
        return nll.mean()

    _assert_models_agree([_model_loss_and_grads(m, loss) for m in models], dtype)


def _tiny_real_config(family: str, tfds_dir: str, dtype: str):
    if family == "language_modeling":
        config = tiny_config(tfds_dir)
    else:
        config = load(ROOT / "configs" / "multi30k_ende.py").get_config()
        config.data.data_dir, config.data.vocab_dir = tfds_dir, shared_vocab_dir(tfds_dir)
        config.data.vocab_size, config.data.max_train_length = 400, 32
        for key, value in dict(d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1).items():
            config.model[key] = value
        config.model.num_decoder_layers = 1
        config.train.batch_size = 16
    config.model.dtype = dtype
    config.train.learning_rate, config.train.warmup_steps = 3e-3, 1
    return config


@SLOW
@pytest.mark.parametrize("family", ["translation", "language_modeling"])
def test_bfloat16_training_tracks_float32_on_real_data(family, tmp_path, tfds_dir, multi30k_dir):
    """Six real optimizer steps on Multi30k / PTB from the same initial parameters: the bfloat16
    model's training loss stays within 2% of the float32 model's at every step."""
    from xformer.tasks import make_task
    from xformer.train_lib import train_step

    losses = {}
    for dtype in ("float32", "bfloat16"):
        task = make_task(_tiny_real_config(family, tfds_dir, dtype), str(tmp_path))
        state, rng_state = task.exp.init_state(task.init_carry()), task.exp.rng_state
        step, batches, losses[dtype] = jax.jit(functools.partial(train_step, task)), None, []
        batches = task.train_batches()
        for _ in range(6):
            state, metrics = step(state, rng_state, next(batches))
            losses[dtype].append(float(metrics["loss_sum"] / metrics["tokens"]))
    assert losses["float32"][-1] < losses["float32"][0] - 0.1  # real steps: the loss falls
    np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=0.02)


def test_add_bias_sums_a_float32_bias_gradient_in_float32():
    """bfloat16 x + float32 b is bfloat16; b's gradient is the float32 sum of the bfloat16
    cotangent's rows (4,096 rows of ~1: a bfloat16 sum is 4,096 on XLA:CPU, off by up to 16)."""
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((4096, 8)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(8), jnp.float32)
    g = jnp.asarray(1.0 + 0.1 * rng.standard_normal((4096, 8)), jnp.bfloat16)
    y, vjp = jax.vjp(precision.add_bias, x, b)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(y, x + b.astype(jnp.bfloat16))
    dx, db = vjp(g)
    assert dx.dtype == jnp.bfloat16 and db.dtype == jnp.float32
    np.testing.assert_array_equal(dx, g)
    np.testing.assert_allclose(db, np.asarray(g, np.float64).sum(0), rtol=1e-6)
    # A bfloat16 bias (model.param_dtype="bfloat16") too: summed in float32, rounded once (in
    # the program: XLA:CPU happens to widen a bfloat16 sum itself, XLA:GPU's split sums do not)
    b16 = b.astype(jnp.bfloat16)
    _, vjp16 = jax.vjp(precision.add_bias, x, b16)
    sums = [e for e in jax.make_jaxpr(vjp16)(g).eqns if e.primitive.name == "reduce_sum"]
    assert [str(e.outvars[0].aval.dtype) for e in sums] == ["float32"]
    db16 = vjp16(g)[1]
    assert db16.dtype == jnp.bfloat16
    expected = np.asarray(g, np.float64).sum(0)
    np.testing.assert_allclose(np.asarray(db16, np.float64), expected, rtol=2**-8)  # one rounding


@pytest.mark.parametrize("layer", ["linear", "projections", "projections split"])
def test_bfloat16_layers_sum_float32_bias_gradients_in_float32(layer):
    """A bfloat16 layer with float32 parameters (every dense layer of a bfloat16 model): its
    bias's gradient is the float32 sum over 4,096 rows of the bfloat16 output cotangent."""
    rngs, kw = nnx.Rngs(0), {"dtype": jnp.bfloat16, "param_dtype": jnp.float32}
    if layer == "linear":
        module = Linear(8, 6, rngs=rngs, **kw)
    else:
        module = Projections(8, 3, 2, split_heads=layer.endswith("split"), rngs=rngs, **kw)
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((4, 1024, 8)), jnp.bfloat16)
    y = module(x)
    assert y.dtype == jnp.bfloat16
    g = jnp.asarray(1.0 + 0.1 * rng.standard_normal(y.shape), jnp.bfloat16)
    grads = nnx.grad(lambda m: (m(x).astype(jnp.float32) * g.astype(jnp.float32)).sum())(module)
    d_bias = grads["bias"][...]
    assert d_bias.dtype == jnp.float32
    want = np.asarray(g, np.float64).reshape(-1, *module.bias.shape).sum(0)
    np.testing.assert_allclose(d_bias, want, rtol=1e-6)


def test_bfloat16_relative_positions_sum_the_v_bias_gradient_in_float32():
    """Transformer-XL's position bias v (float32 in a bfloat16 model) is added to every query:
    its gradient is the float32 sum of the bfloat16 cotangent over 64 x 64 queries (a bfloat16
    sum is off by ~1e-3 of the terms' total)."""
    cfg = LMConfig(**TINY_LM, positional="relative", dropout=0.0, dtype="bfloat16")
    scheme = SCHEMES["relative"](cfg, 2, rngs=nnx.Rngs(fresh_seed()))
    assert scheme.v[...].dtype == jnp.float32
    rng = np.random.default_rng()
    layout = Layout(64, 64, causal=False)
    q, k = (jnp.asarray(rng.standard_normal((64, 64, 2, 8)), jnp.bfloat16) for _ in range(2))
    g = jnp.asarray(rng.standard_normal((64, 2, 64, 64)), jnp.float32)

    def loss(scheme, q):
        return (scheme.logit_bias(scheme.prepare(layout), q, k, layout, 1) * g).sum()

    grads, dq = nnx.grad(loss, argnums=(0, 1))(scheme, q)
    dv = grads["v"][...]
    assert dv.dtype == jnp.float32
    terms = np.asarray(dq, np.float64)  # q + v: v's gradient is the sum of q's over (b, q)
    want = terms.sum((0, 1))
    error = np.abs(np.asarray(dv, np.float64) - want).max() / np.abs(terms).sum((0, 1)).min()
    assert error < 1e-6, error
