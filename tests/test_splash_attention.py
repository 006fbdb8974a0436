"""TPU splash attention (`attention_impl="fused"` on TPU) against the XLA reference, run on the
CPU by Pallas' interpreter on a pretend TPU: every structured mask, whole models, a mesh that
splits rows and heads, and the calls it must leave to XLA."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from simulated_devices import run_script
from test_precision import (
    TINY_LM,
    TINY_TRANSLATION,
    TOLERANCE,
    _assert_models_agree,
    _model_loss_and_grads,
    _settings,
    assert_close,
    same_seed_models,
    translation_loss,
)

import xformer
from xformer import masks, splash_attention
from xformer.attention import dot_product_attention
from xformer.language_model import LanguageModel
from xformer.layout import Layout
from xformer.model_config import LMConfig, TransformerConfig
from xformer.models import EncoderDecoder


@pytest.fixture
def pretend_tpu(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(splash_attention, "INTERPRET", True)


def packed_segments(rng, rows: int, length: int) -> np.ndarray:
    """[rows, length] segment ids: 1..n in contiguous runs of random lengths, then padding 0."""
    segments = np.zeros((rows, length), np.int32)
    for row in segments:
        cuts = np.sort(rng.choice(np.arange(1, length - 8), size=2, replace=False))
        row[: cuts[0]], row[cuts[0] : cuts[1]] = 1, 2
        row[cuts[1] : length - rng.integers(1, 8)] = 3
    return segments


SELF_ATTENTION_CASES = {  # case -> (mask scheme, causal layout, packed rows)
    "causal_packed": ("causal", True, True),
    "bidirectional_packed": ("bidirectional", False, True),
    "causal_unpacked": ("causal", True, False),
    "causal_window_packed": ("sliding_window", True, True),
    "bidirectional_window_packed": ("sliding_window", False, True),
}
WINDOW = 40  # keys fewer than 40 positions away: windows that straddle the kernel's blocks


def structured_mask(case: str, rng) -> tuple[masks.StructuredMask, int, int]:
    """(mask, Lq, Lk) of one kind of call the models make."""
    if case == "cross":  # 128 target positions over 256 source positions
        q_segments, k_segments = packed_segments(rng, 2, 128), packed_segments(rng, 2, 256)
        mask = masks.cross_mask(jnp.asarray(q_segments), jnp.asarray(k_segments))
        return mask, 128, 256
    kind, causal, packed = SELF_ATTENTION_CASES[case]
    length = 256
    segments = jnp.asarray(packed_segments(rng, 2, length)) if packed else None
    mask = masks.attention_mask(
        kind,
        Layout(length, length, causal=causal),
        window=WINDOW,
        q_segments=segments,
        k_segments=segments,
        structured=True,
    )
    return mask, length, length


def attention_grads(q, k, v, mask, weights, implementation: str):
    """(output, dq, dk, dv) of sum(attention * weights), compiled."""

    def loss(q, k, v):
        out = dot_product_attention(q, k, v, mask, implementation=implementation)
        return (out.astype(jnp.float32) * weights).sum(), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, *grads


def pallas_calls(fn, *args) -> int:
    """Pallas calls in fn's program, counted through every nested program (the printed text
    names a repeated sub-program once)."""

    def count(jaxpr) -> int:
        calls = 0
        for eqn in jaxpr.eqns:
            calls += eqn.primitive.name == "pallas_call"
            for param in eqn.params.values():
                for sub in param if isinstance(param, list | tuple) else [param]:
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        calls += count(sub)
        return calls

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [*SELF_ATTENTION_CASES, "cross"])
def test_splash_equals_reference_on_real_rows(case, dtype, pretend_tpu):
    """Output and dq, dk, dv of a random weighting of the real (non-padding) query rows: the
    splash kernel against the einsum reference, on packed rows with padding, with and without
    a sliding window, and on unpacked rows and cross-attention. In bfloat16 both
    are compared with the float32 reference of the same inputs, splash allowed twice the
    bfloat16 reference's own error (or TOLERANCE): each rounds its own way."""
    rng = np.random.default_rng()
    mask, q_len, k_len = structured_mask(case, rng)
    q = jnp.asarray(rng.normal(size=(2, q_len, 2, 32)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(2, k_len, 2, 32)), dtype) for _ in range(2))
    real = np.ones((2, q_len), bool) if mask.q_segments is None else mask.q_segments > 0
    weights = rng.normal(size=q.shape) * np.asarray(real)[:, :, None, None]
    fused = attention_grads(q, k, v, mask, weights, "fused")
    reference = attention_grads(q, k, v, mask, weights, "xla")
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    exact = attention_grads(*wide, mask, weights, "xla")
    attend = lambda q: dot_product_attention(q, k, v, mask, implementation="fused")  # noqa: E731
    assert pallas_calls(jax.grad(lambda q: attend(q).astype(jnp.float32).sum()), q) == 3
    assert fused[0].dtype == jnp.dtype(dtype)
    rows = np.asarray(real)[:, :, None, None]
    on_rows = lambda x: np.where(rows, x, 0)  # noqa: E731
    fused, reference, exact = ((on_rows(out), *grads) for out, *grads in (fused, reference, exact))
    for name, got, want, wanted in zip(
        ("out", "dq", "dk", "dv"), fused, reference, exact, strict=True
    ):
        own_error = np.abs(np.subtract(want, wanted, dtype=float)).max() / np.abs(wanted).max()
        assert_close(got, wanted, dtype, name, max(TOLERANCE[dtype], 2 * own_error))


def test_splash_leaves_to_xla_what_it_cannot_serve(pretend_tpu):
    """A bias, a length that is not a multiple of 128, a dense (unstructured) mask and float64
    each give their reason and take the XLA path, whose result is the reference's."""
    rng = np.random.default_rng()
    mask, length, _ = structured_mask("causal_packed", rng)
    q, k, v = (jnp.asarray(rng.normal(size=(2, length, 2, 32)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.normal(size=(1, 2, length, length)), jnp.float32)
    short = masks.attention_mask("causal", Layout(64, 64), structured=True)
    calls = {
        "adds a bias": (q, k, v, mask, bias),
        "not multiples of 128": (q[:, :64], k[:, :64], v[:, :64], short, None),
        "not a StructuredMask": (q, k, v, mask.dense, None),
    }
    for reason, (q_, k_, v_, mask_, bias_) in calls.items():
        assert reason in splash_attention.unsupported(q_, k_, mask_, bias_)

        def fused(q, k=k_, v=v_, mask=mask_, bias=bias_):
            return dot_product_attention(q, k, v, mask, bias=bias, implementation="fused")

        assert pallas_calls(fused, q_) == 0
        reference = dot_product_attention(q_, k_, v_, mask_, bias=bias_)
        np.testing.assert_allclose(fused(q_), reference, rtol=2e-5, atol=2e-5)
    assert "dtype float64" in splash_attention.unsupported(
        jax.ShapeDtypeStruct(q.shape, jnp.float64), k, mask, None
    )
    assert splash_attention.unsupported(q, k, mask, None) is None


def test_a_jax_without_the_kernel_takes_xla(pretend_tpu, monkeypatch):
    """If a jax's Pallas no longer has the kernel where splash_attention.py imports it, fused
    attention on a TPU takes the XLA path (and logs why) instead of failing."""
    monkeypatch.delitem(sys.modules, "xformer.splash_attention")
    monkeypatch.delattr(xformer, "splash_attention")
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.ops.tpu.splash_attention", None)
    rng = np.random.default_rng()
    mask, length, _ = structured_mask("causal_packed", rng)
    q, k, v = (jnp.asarray(rng.normal(size=(2, length, 2, 32)), jnp.float32) for _ in range(3))

    def fused(q):
        return dot_product_attention(q, k, v, mask, implementation="fused")

    assert pallas_calls(fused, q) == 0
    reference = dot_product_attention(q, k, v, mask)
    np.testing.assert_allclose(fused(q), reference, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "dtype,remat", [("float32", "none"), ("bfloat16", "none"), ("float32", "dots")]
)
def test_encoder_decoder_on_splash_trains_like_xla(dtype, remat, pretend_tpu):
    """Loss and every gradient of a whole encoder-decoder (rotary positions: no bias) on rows
    of 128 packing three examples and padding: splash serves all three attention kinds, also
    inside remat's recomputed layers ("dots" recomputes attention in the backward pass)."""
    rng = np.random.default_rng()
    src_segments, tgt_segments = (jnp.asarray(packed_segments(rng, 2, 128)) for _ in "st")
    models = same_seed_models(
        EncoderDecoder,
        TransformerConfig,
        _settings(dtype),
        **TINY_TRANSLATION | dict(d_model=32, num_encoder_layers=1, num_decoder_layers=1, d_ff=48),
        dropout=0.0,
        positional="rope",
        remat=remat,
    )
    loss = translation_loss(src_segments, tgt_segments)
    assert [pallas_calls(loss, m) for m in models] == [0, 3] + [0] * (dtype == "bfloat16")
    results = [_model_loss_and_grads(m, loss) for m in models]
    # Rows of 128 positions, 16x the other model tests': a kernel's or bias's gradient sums 256
    # rows of bfloat16 cotangents, which each path rounds its own way (seen against xla's: 4.3e-2
    # of a bias's scale; 1.13e-1 of an FFN kernel's, once in ~30 suites; 25 fresh draws:
    # 0.24-0.72 of 2x TOLERANCE). The float32 cases hold the paths to 2e-5.
    _assert_models_agree(results, dtype, tolerance=4 * TOLERANCE[dtype])


def test_language_model_on_splash_trains_like_xla(pretend_tpu):
    """A causal LM without memory (learned positions) on splash: loss and gradients equal the
    XLA path's (one splash call a layer)."""
    tokens = jnp.asarray(np.random.default_rng().integers(0, 29, size=(2, 257)))
    models = same_seed_models(
        LanguageModel,
        LMConfig,
        [("xla", "float32"), ("fused", "float32")],
        **TINY_LM | dict(d_model=32, d_ff=48),
        dropout=0.0,
        positional="learned",
        max_len=256,
    )
    loss = lambda model: model(tokens[:, :-1], tokens[:, 1:])[0].mean()  # noqa: E731
    assert [pallas_calls(loss, m) for m in models] == [0, 2]
    _assert_models_agree([_model_loss_and_grads(m, loss) for m in models], "float32")


SHARDED_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from unittest import mock
from xformer import masks, sharding, splash_attention
from xformer.attention import dot_product_attention
from xformer.layout import Layout

splash_attention.INTERPRET = True
rng = np.random.default_rng()
segments = jnp.asarray([np.repeat([1, 2, 0], [100, 150, 6]), np.repeat([1, 0], [250, 6])] * 2)
mask = masks.attention_mask(
    "causal", Layout(256, 256), q_segments=segments, k_segments=segments, structured=True
)
q, k, v = (jnp.asarray(rng.normal(size=(4, 256, 4, 32)), jnp.float32) for _ in range(3))
weights = rng.normal(size=q.shape) * np.asarray(segments > 0)[:, :, None, None]
mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2})
rows = jax.sharding.NamedSharding(mesh, sharding.batch_spec(mesh))
q, k, v = (jax.device_put(x, rows) for x in (q, k, v))

def grads(q, k, v, implementation):
    loss = lambda q, k, v: (dot_product_attention(q, k, v, mask, implementation=implementation)
                            * weights).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

with mock.patch.object(jax, "default_backend", lambda: "tpu"):
    sharded = jax.jit(sharding.traced_on(mesh, lambda q, k, v: grads(q, k, v, "fused")))
    program = str(jax.make_jaxpr(sharded)(q, k, v))
    got = sharded(q, k, v)
want = grads(q, k, v, "xla")
assert "shard_map" in program and program.count("pallas_call") == 3, program[:2000]
for g, w in zip(got, want):
    error = float(jnp.abs(g - w).max() / jnp.abs(w).max())
    assert error < 2e-5, error
print("ok")
"""


def test_splash_under_a_mesh_runs_per_row_and_head_shard(tmp_path):
    """On 4 simulated devices (data 2 x tensor 2), the kernel runs in a shard_map over rows and
    heads, and its gradients equal the one-device reference."""
    script = tmp_path / "sharded_splash.py"
    script.write_text(SHARDED_SCRIPT)
    assert run_script(str(script), 4).strip().endswith("ok")
