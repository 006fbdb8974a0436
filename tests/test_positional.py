"""Every positional scheme against a direct numpy reference (pair by pair, no shift tricks),
masking schemes against truth tables, and length extrapolation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from references import numpy_attention, numpy_bucket

from xformer import masks
from xformer.attention import MultiHeadAttention
from xformer.language_model import LanguageModel, LMConfig
from xformer.layout import Layout
from xformer.positional import SCHEMES
from xformer.positional.alibi import alibi_slopes
from xformer.positional.base import BoundScheme
from xformer.positional.t5_bias import relative_bucket

jax.config.update("jax_default_matmul_precision", "highest")

CFG = LMConfig(
    vocab_size=31,
    d_model=16,
    num_heads=2,
    num_decoder_layers=2,
    d_ff=24,
    dropout=0.0,
    relu_dropout=0.0,
)


RELATIVE_SCHEMES = [n for n, s in SCHEMES.items() if not s.absolute]


SCHEME_CASES = [(n, {}) for n in RELATIVE_SCHEMES] + [
    ("relative", {"clamp_len": 3, "untie_relative_biases": True}),
    ("t5_bias", {"relative_buckets": 8, "relative_max_distance": 6}),
]
SETTINGS = ["memory", "encoder", "decode_step"]


@dataclasses.dataclass
class AttentionCase:
    """One attention call under a positional scheme, with its inputs (see attention_case)."""

    attn: MultiHeadAttention
    scheme: object
    layout: Layout
    x: np.ndarray
    memory: np.ndarray | None
    mask: jax.Array

    def __call__(self, x=None, memory=None, attn=None) -> jax.Array:
        x, memory = self.x if x is None else x, self.memory if memory is None else memory
        return (attn or self.attn)(
            jnp.asarray(x),
            self.mask,
            positional=BoundScheme.bind(self.scheme, self.layout),
            layer=1,
            memory=None if memory is None else jnp.asarray(memory),
        )

    def expected(self, name: str) -> np.ndarray:
        mask = np.asarray(self.mask)
        return numpy_attention(
            self.attn, self.scheme, name, self.x, self.memory, self.layout, mask, 1
        )

    def valid_rows(self) -> np.ndarray:
        """[B, Lq, 1]: queries that see at least one key (padded queries see none)."""
        return np.asarray(self.mask).any(-1)[..., 0, :, None]


def attention_case(name, overrides, setting, seed, dtype="float32", implementation="xla"):
    """Causal attention over [memory ; segment] with partly empty memory rows ("memory"),
    bidirectional attention over a padded row ("encoder"), or one query at a later position
    over a cache ("decode_step"), in layer 1 of 2, with `dtype` activations and parameters."""
    rng = np.random.default_rng(seed)
    cfg = dataclasses.replace(CFG, positional=name, dtype=dtype, param_dtype=dtype, **overrides)
    scheme = SCHEMES[name](cfg, 2, rngs=nnx.Rngs(seed))
    kind, memory = "memory", None
    if setting == "memory":
        layout = Layout.with_memory(4, 5)
        memory = rng.normal(size=(2, 5, 16))
        valid = masks.memory_key_valid(5, 4, jnp.asarray([5, 2]))
        mask = masks.attention_mask("causal", layout, key_valid=valid)
        x = rng.normal(size=(2, 4, 16))
    elif setting == "encoder":
        kind, layout = "self", Layout(6, 6, causal=False)
        segments = jnp.asarray([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
        mask = masks.attention_mask(
            "bidirectional", layout, q_segments=segments, k_segments=segments
        )
        x = rng.normal(size=(2, 6, 16))
    else:  # keys at cache slots 0..6, the query at position 4 (later slots masked)
        layout = Layout(1, 7, q_start=4)
        memory = rng.normal(size=(2, 6, 16))
        mask = masks.attention_mask("causal", Layout(1, 7, q_start=6))  # all keys are visible
        x = rng.normal(size=(2, 1, 16))
    attn = MultiHeadAttention(
        16,
        2,
        kind=kind,
        dropout=0.0,
        use_bias=setting != "memory",
        implementation=implementation,
        **cfg.dtypes,
        rngs=nnx.Rngs(seed),
    )
    as_dtype = lambda a: None if a is None else np.asarray(jnp.asarray(a, dtype))  # noqa: E731
    return AttentionCase(attn, scheme, layout, as_dtype(x), as_dtype(memory), mask)


@pytest.mark.parametrize("name,overrides", SCHEME_CASES)
@pytest.mark.parametrize("setting", SETTINGS)
def test_attention_under_each_scheme_matches_numpy(name, overrides, setting):
    case = attention_case(name, overrides, setting, int(np.random.default_rng().integers(1e6)))
    valid = case.valid_rows()
    np.testing.assert_allclose(
        np.where(valid, case(), 0), np.where(valid, case.expected(name), 0), atol=2e-4, rtol=2e-4
    )


@pytest.mark.parametrize("name", RELATIVE_SCHEMES)
@pytest.mark.parametrize("setting", SETTINGS)
def test_float64_attention_under_each_scheme_is_exact(name, setting):
    """A float64 model has no hidden float32 step: it matches the float64 reference to 1e-12."""
    with jax.enable_x64(True):
        seed = int(np.random.default_rng().integers(1e6))
        case = attention_case(name, {}, setting, seed, dtype="float64")
        out = case()
        assert out.dtype == jnp.float64
        valid = case.valid_rows()
        np.testing.assert_allclose(
            np.where(valid, out, 0), np.where(valid, case.expected(name), 0), atol=1e-12, rtol=0
        )


@pytest.mark.parametrize("setting", SETTINGS)
def test_both_forms_of_the_xl_position_term_are_exact(setting, use_form):
    """The XL position term with R W_kR shared by the batch (XLA:CPU's form) and broadcast over
    it (the other backends'): float64 attention equals the numpy reference to 1e-12 in each,
    and the gradients of a random projection of it (into x, the memory, W_kR, u and v) agree."""
    from xformer.positional import xl_relative

    rng = np.random.default_rng()
    with jax.enable_x64(True):
        case = attention_case("relative", {}, setting, int(rng.integers(1e6)), dtype="float64")
        inputs = {"x": jnp.asarray(case.x)}
        if case.memory is not None:
            inputs["memory"] = jnp.asarray(case.memory)
        g = jnp.asarray(rng.normal(size=case.x.shape))
        valid = case.valid_rows()

        def loss(scheme, inputs):
            out = case.attn(
                inputs["x"],
                case.mask,
                positional=BoundScheme.bind(scheme, case.layout),
                layer=1,
                memory=inputs.get("memory"),
            )
            return jnp.sum(jnp.where(valid, out, 0) * g), out

        results = {}
        for form in ("cpu", "other"):
            use_form(xl_relative, form)
            (_, out), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
                case.scheme, inputs
            )
            np.testing.assert_allclose(
                np.where(valid, out, 0), np.where(valid, case.expected("relative"), 0), atol=1e-12
            )
            results[form] = jax.tree.leaves(grads)
        assert len(results["cpu"]) >= 5  # W_kR of both layers, u, v and the inputs
        for want, got in zip(results["cpu"], results["other"], strict=True):
            np.testing.assert_allclose(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_xl_decoding_steps_slice_the_position_terms_that_prepare_computes(causal):
    """prepare_step's slice of the cached projections gives every step the bias `prepare` gives
    it, for steps of 1 to S queries; without causality also at keys after the queries."""
    rng = np.random.default_rng()
    scheme = SCHEMES["relative"](
        dataclasses.replace(CFG, positional="relative"), 2, rngs=nnx.Rngs(0)
    )
    mem_len, segment_length = 3, 5
    cached = scheme.prepare_cached(Layout.with_memory(segment_length, mem_len, causal))
    k_len = mem_len + segment_length
    for offset, n in [(0, 5), (0, 1), (2, 3), (4, 1), (1, 2)]:
        step = Layout(n, k_len, q_start=mem_len + offset, causal=causal)
        q, k = (
            jnp.asarray(rng.normal(size=(2, length, 2, 8)), jnp.float32) for length in (n, k_len)
        )
        got = scheme.logit_bias(scheme.prepare_step(cached, step), q, k, step, 1)
        want = scheme.logit_bias(scheme.prepare(step), q, k, step, 1)
        seen = np.asarray(step.distances() >= 0) if causal else np.ones((n, k_len), bool)
        np.testing.assert_allclose(np.where(seen, got, 0), np.where(seen, want, 0), atol=1e-5)


def test_rope_scores_depend_only_on_the_distance():
    rng = np.random.default_rng()
    scheme = SCHEMES["rope"](CFG, 1, rngs=nnx.Rngs(0))
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 2, 8)), jnp.float32) for _ in range(2))
    scores = [
        float(jnp.sum(scheme.rotate(q, start + 3) * scheme.rotate(k, start)))
        for start in (0, 5, 117)
    ]
    np.testing.assert_allclose(scores, scores[0], rtol=1e-4)
    assert abs(float(jnp.sum(q * k)) - scores[0]) > 1e-4  # and the rotation does something


def test_t5_buckets_known_values():
    """Values from the bucketing rule: 32 buckets, 16 per direction, exact below 8, log-spaced
    up to 128."""
    distances = jnp.asarray([0, 1, 7, 8, 16, 127, 1000, -1, -16, -1000])
    buckets = relative_bucket(distances, bidirectional=True, num_buckets=32, max_distance=128)
    np.testing.assert_array_equal(buckets, [0, 1, 7, 8, 10, 15, 15, 17, 26, 31])
    causal = relative_bucket(distances, bidirectional=False, num_buckets=32, max_distance=128)
    assert list(np.asarray(causal)[:4]) == [0, 1, 7, 8] and int(causal[-1]) == 0
    for d in range(-300, 300, 7):
        assert int(
            relative_bucket(jnp.asarray(d), bidirectional=True, num_buckets=32, max_distance=128)
        ) == numpy_bucket(d, True, 32, 128)


def test_alibi_slopes_follow_the_paper():
    np.testing.assert_allclose(alibi_slopes(8), [2.0**-i for i in range(1, 9)])
    half_steps = [2.0 ** -(i + 0.5) for i in range(4)]  # every other slope of 16 heads
    np.testing.assert_allclose(alibi_slopes(12), [2.0**-i for i in range(1, 9)] + half_steps)


def test_mask_truth_tables():
    def table(kind, layout, **kwargs):
        return np.asarray(masks.attention_mask(kind, layout, **kwargs))[0, 0].astype(int)

    square = Layout(4, 4)
    np.testing.assert_array_equal(table("causal", square), np.tril(np.ones((4, 4), int)))
    np.testing.assert_array_equal(table("bidirectional", square), np.ones((4, 4), int))
    np.testing.assert_array_equal(
        table("sliding_window", square, window=2),
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]],
    )
    np.testing.assert_array_equal(
        table("sliding_window", Layout(4, 4, causal=False), window=2),
        [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]],
    )
    np.testing.assert_array_equal(
        table("prefix_lm", square, prefix_length=2),
        [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]],
    )
    np.testing.assert_array_equal(  # memory of 2: each query sees itself and 1 key before
        table("same_length", Layout.with_memory(3, 2)),
        [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]],
    )
    segments = jnp.asarray([[1, 1, 2, 0]])  # packed examples and padding always compose in
    np.testing.assert_array_equal(
        table("sliding_window", square, window=3, q_segments=segments, k_segments=segments),
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]],
    )


def test_mask_schemes_own_where_they_apply_and_what_they_score():
    assert masks.names_for(masks.ENCODER) == ("bidirectional", "sliding_window")
    assert masks.names_for(masks.DECODER) == ("causal", "sliding_window")
    assert masks.names_for(masks.LM) == ("causal", "sliding_window", "prefix_lm", "same_length")
    cfg = dataclasses.replace(CFG, decoder_mask="prefix_lm", prefix_length=5)
    prefix, causal = masks.MASK_SCHEMES["prefix_lm"], masks.MASK_SCHEMES["causal"]
    assert prefix.unscored_targets(cfg) == 4 and causal.unscored_targets(CFG) == 0
    assert prefix.eval_stride(cfg, 12) == 8 and causal.eval_stride(CFG, 12) == 0
    with pytest.raises(ValueError, match=r"'prefix_lm' cannot be used with a memory"):
        prefix.check("model.decoder_mask", cfg, mem_len=4, segment_length=12)
    with pytest.raises(ValueError, match=r"score at most .* = 8"):
        prefix.check("eval.decoder_mask", cfg, mem_len=0, segment_length=12, sliding_stride=9)
    with pytest.raises(ValueError, match=r"'same_length' needs a memory"):
        masks.MASK_SCHEMES["same_length"].check("x", CFG, mem_len=0, segment_length=12)


def test_absolute_schemes_refuse_a_memory_in_one_place():
    for name, scheme in SCHEMES.items():
        if scheme.absolute:
            with pytest.raises(ValueError, match=rf"cannot be used with model.positional='{name}'"):
                scheme.check_memory(3)
            model = LanguageModel(dataclasses.replace(CFG, positional=name), rngs=nnx.Rngs(0))
            with pytest.raises(ValueError, match="cannot be used with"):
                model.init_memory(2, 3)
        else:
            scheme.check_memory(3)


@pytest.mark.parametrize("name", SCHEMES)
def test_length_extrapolation(name):
    """A model built for 8 positions runs on 16 unless its positions are a learned table,
    which fails with a clear error; causal outputs of the first 8 tokens do not change."""
    cfg = dataclasses.replace(CFG, positional=name, max_len=8)
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng().integers(0, 31, (2, 16)), jnp.int32)
    short, _ = model(tokens[:, :8], tokens[:, :8])
    if name == "learned":
        with pytest.raises(ValueError, match=r"exceeds the learned position table"):
            model(tokens, tokens)
        return
    long, _ = model(tokens, tokens)
    np.testing.assert_allclose(long[:, :8], short, atol=1e-5)
    assert np.isfinite(np.asarray(long)).all()


@pytest.mark.parametrize("name", ["rope", "sinusoidal"])
def test_prefix_lm_sees_its_prefix_both_ways_and_nothing_after(name):
    cfg = dataclasses.replace(CFG, positional=name, decoder_mask="prefix_lm", prefix_length=3)
    model = LanguageModel(cfg, rngs=nnx.Rngs(1))
    tokens = jnp.asarray(np.random.default_rng().integers(0, 31, (1, 8)), jnp.int32)
    base, _ = model(tokens, tokens)
    in_prefix, _ = model(tokens.at[0, 2].set((tokens[0, 2] + 1) % 31), tokens)
    assert abs(float(in_prefix[0, 0] - base[0, 0])) > 1e-5  # position 0 sees position 2
    later, _ = model(tokens.at[0, 5].set((tokens[0, 5] + 1) % 31), tokens)
    np.testing.assert_allclose(later[:, :5], base[:, :5], atol=1e-6)
    # The first token after the prefix is seen by no prefix position (nor one prefix longer).
    after, _ = model(tokens.at[0, 3].set((tokens[0, 3] + 1) % 31), tokens)
    np.testing.assert_allclose(after[:, :3], base[:, :3], atol=1e-6)
    assert abs(float(after[0, 3] - base[0, 3])) > 1e-5  # (it sees itself)
