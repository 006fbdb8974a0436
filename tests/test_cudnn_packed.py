"""attention_impl="fused_packed": packed rows reach cuDNN as segment lengths and offsets
(xformer/cudnn_packed.py). On the CPU, a pretend GPU's cuDNN is a stand-in that builds the mask
those lengths and offsets mean (independently of xformer's segment masks) and, like a kernel
that leaves memory it does not compute unwritten, returns NaN at every position outside its
segments, forward and backward. Output and gradients must equal the einsum reference on every
query that sees a key, the others must be zeros, and xformer's batches must meet the mode's
contract (ascending contiguous runs, no empty side)."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_packing import SETTINGS, random_pairs
from test_precision import (
    BFLOAT16_STEP,
    TINY_TRANSLATION,
    _assert_models_agree,
    _model_loss_and_grads,
    assert_close,
    same_seed_models,
    translation_loss,
)

from xformer import attention, cudnn_packed, masks
from xformer.attention import dot_product_attention
from xformer.data.pipeline import EncodedPairs, packed_train_dataset
from xformer.layout import Layout
from xformer.model_config import TransformerConfig
from xformer.models import EncoderDecoder
from xformer.tasks.translation import padded_batches


def random_segments(rng: np.random.Generator, rows: int, length: int) -> np.ndarray:
    """[rows, length] ascending contiguous runs of 1-5 tokens, 1..m then padding; one row may
    start with padding, one is all padding, and some ids are skipped (an empty segment)."""
    out = np.zeros((rows, length), np.int32)
    for row in range(rows - 1):
        position = int(rng.integers(0, 3)) if row == 0 else 0
        segment = 0
        while position < length - int(rng.integers(0, 4)):
            segment += 1 + int(rng.random() < 0.2)  # now and then an id with no tokens
            size = int(rng.integers(1, 6))
            out[row, position : position + size] = segment
            position += size
    return out


def mask_from_runs(lengths, offsets, k_lengths, k_offsets, q_len, k_len, causal) -> jax.Array:
    """[B, 1, Lq, Lk]: what cuDNN's packed mode computes. Query i of slot j (a used slot: length
    >= 0) sees the keys of the key side's slot j, up to its own place in the segment if causal."""

    def inside(lengths, offsets, n):  # [B, M, n] and the place within the segment [B, M, n]
        place = jnp.arange(n)[None, None, :] - offsets[:, :-1, None]
        return (lengths[..., None] >= 0) & (place >= 0) & (place < lengths[..., None]), place

    (q_in, q_place), (k_in, k_place) = (
        inside(lengths, offsets, q_len),
        inside(k_lengths, k_offsets, k_len),
    )
    pair = q_in[:, :, :, None] & k_in[:, :, None, :]
    if causal:
        pair &= q_place[:, :, :, None] >= k_place[:, :, None, :]
    return pair.any(axis=1)[:, None]


def _nan_outside(x, inside):
    """x [B, L, H, D] with NaN at the positions not `inside` [B, L]."""
    return jnp.where(inside[:, :, None, None], x, jnp.nan)


@jax.custom_vjp
def _nan_gradient_outside(x, inside):
    return x


def _forward(x, inside):
    return x, inside


def _backward(inside, g):
    return _nan_outside(g, inside), None


_nan_gradient_outside.defvjp(_forward, _backward)


def packed_cudnn_stand_in(calls: list, float32: bool = False):
    """A stand-in for jax's private cuDNN call in packed mode: refuses what cuDNN refuses
    (float32, unless told to take it), records (mask type, shapes), and computes jax's XLA
    attention under the mask the lengths and offsets mean, with NaN outside the segments in
    the output and in dq, dk and dv."""
    real = jax.nn.dot_product_attention
    _, mask_type = cudnn_packed._private_call()

    def call(q, k, v, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets, *, scale, **kw):
        if q.dtype not in (jnp.bfloat16, jnp.float16) and not float32:
            raise NotImplementedError(f"cuDNN refuses {q.dtype}")
        assert bias is None and mask is None and q_seqlen.shape[1] == q_offsets.shape[1] - 1
        causal = kw["mask_type"] == mask_type.PADDING_CAUSAL
        calls.append((kw["mask_type"], q.shape, q_seqlen.shape))
        seen = mask_from_runs(
            q_seqlen, q_offsets, kv_seqlen, kv_offsets, q.shape[1], k.shape[1], causal
        )
        q_inside, k_inside = seen.any(-1)[:, 0], seen.any(-2)[:, 0]
        q = _nan_gradient_outside(q, q_inside)
        k, v = (_nan_gradient_outside(x, k_inside) for x in (k, v))
        out = real(q, k, v, None, seen, scale=scale, implementation="xla")
        return _nan_outside(out, q_inside)

    return call


def _pretend_gpu(monkeypatch, float32: bool) -> list:
    """A GPU whose packed cuDNN call is the stand-in; returns the list of its calls."""
    calls = []
    __import__(cudnn_packed.PRIVATE_CALL)
    monkeypatch.setattr(
        sys.modules[cudnn_packed.PRIVATE_CALL],
        "dot_product_attention",
        packed_cudnn_stand_in(calls, float32),
    )
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention, "_LOGGED", set())
    return calls


@pytest.fixture
def pretend_gpu(monkeypatch):
    return _pretend_gpu(monkeypatch, float32=False)


@pytest.fixture
def pretend_gpu_taking_float32(monkeypatch):
    return _pretend_gpu(monkeypatch, float32=True)


@pytest.mark.parametrize("bounded", [False, True])
@pytest.mark.parametrize("kind", ["self", "causal", "cross"])
def test_segment_runs_describe_the_segment_masks(kind, bounded):
    """The mask cuDNN computes from segment_runs equals xformer's segment mask (and causal) on
    every query that sees a key; the others (padding, a target whose source is empty) are
    exactly the ones left uncovered. Slots: one per position, or (bounded) the most ids a
    row has."""
    rng = np.random.default_rng()
    q_segments = random_segments(rng, 6, 24)
    k_segments = random_segments(rng, 6, 20) if kind == "cross" else q_segments
    q_segments, k_segments = jnp.asarray(q_segments), jnp.asarray(k_segments)
    want = masks.segment_mask(q_segments, k_segments)
    if kind == "causal":
        want &= jnp.tril(jnp.ones((24, 24), bool))
    slots = int(max(q_segments.max(), k_segments.max())) if bounded else 0
    runs = cudnn_packed.segment_runs(q_segments, k_segments, slots)
    assert runs.q_lengths.shape == (6, slots or 24) and runs.q_offsets.shape[1] == (slots or 24) + 1
    got = mask_from_runs(
        runs.q_lengths,
        runs.q_offsets,
        runs.k_lengths,
        runs.k_offsets,
        24,
        k_segments.shape[1],
        kind == "causal",
    )
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(runs.q_covered, want.any(-1)[:, 0])
    np.testing.assert_array_equal(runs.k_covered, want.any(-2)[:, 0])
    assert not np.asarray(runs.q_covered).all()  # padding and, for cross, empty sources


@pytest.mark.parametrize("head_size", [8, 12])
@pytest.mark.parametrize("kind", ["self", "causal", "cross"])
def test_fused_packed_equals_the_reference(kind, head_size, pretend_gpu):
    """bfloat16 q, k, v with padding and empty segments, and a loss over the queries that see
    a key: output and dq, dk, dv equal the einsum reference's, every other query's output is
    zero, and no NaN the stand-in leaves outside the segments gets through. Head size 12 is
    zero-padded to 16 for cuDNN."""
    rng = np.random.default_rng()
    q_segments = jnp.asarray(random_segments(rng, 4, 16))
    k_segments = jnp.asarray(random_segments(rng, 4, 12)) if kind == "cross" else q_segments
    layout_len = (q_segments.shape[1], k_segments.shape[1])
    if kind == "cross":
        mask = masks.cross_mask(q_segments, k_segments)
    else:
        layout = Layout(*layout_len, causal=kind == "causal")
        mask = masks.attention_mask(
            "causal" if kind == "causal" else "bidirectional",
            layout,
            q_segments=q_segments,
            k_segments=k_segments,
            structured=True,
        )
    shapes = [(4, n, 2, head_size) for n in (layout_len[0], *[layout_len[1]] * 2)]
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in shapes)
    sees = masks.dense(mask).any(-1)[:, 0, :, None, None]  # [B, Lq, 1, 1]
    assert not sees.all()
    weights = jnp.where(sees, jnp.asarray(rng.normal(size=shapes[0]), jnp.float32), 0)

    def loss(q, k, v, implementation):
        out = dot_product_attention(q, k, v, mask, implementation=implementation)
        return (out.astype(jnp.float32) * weights).sum(), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (grads, out), (packed_grads, packed_out) = (grad(q, k, v, i) for i in ("xla", "fused_packed"))
    mask_type = cudnn_packed._private_call()[1]
    want_type = mask_type.PADDING_CAUSAL if kind == "causal" else mask_type.PADDING
    assert [c[0] for c in pretend_gpu] == [want_type]  # traced once, served by the packed call
    assert pretend_gpu[0][1][-1] == (16 if head_size == 12 else 8)
    assert not np.asarray(jnp.where(sees, 0, packed_out), np.float32).any()
    # The stand-in computes XLA's attention, so the two differ by bfloat16 roundings only: a
    # looser bound (the default 3e-2) would let a wrong softmax scale of a few percent through.
    tight = 2 * BFLOAT16_STEP
    packed_out, out = (jnp.where(sees, x, 0) for x in (packed_out, out))
    assert_close(packed_out, out, "bfloat16", "output", tolerance=tight)
    for name, g, packed_g in zip("qkv", grads, packed_grads, strict=True):
        assert np.isfinite(np.asarray(packed_g, np.float32)).all(), name
        assert_close(packed_g, g, "bfloat16", f"d{name}", tolerance=tight)


def test_what_packed_mode_cannot_serve_takes_the_mask_path(pretend_gpu, monkeypatch):
    """float32 (cuDNN refuses it: XLA), a bias, a window and whole rows never reach the packed
    call; each reason that concerns packed rows is logged."""
    logged = []
    monkeypatch.setattr(attention.logging, "warning", lambda fmt, msg: logged.append(msg))
    segments = jnp.asarray([[1, 1, 2, 2, 2, 0, 0, 0]] * 2)
    rng = np.random.default_rng()
    q = jnp.asarray(rng.normal(size=(2, 8, 2, 8)), jnp.float32)
    structured = masks.StructuredMask(
        masks.segment_mask(segments, segments), segments, segments, causal=False
    )
    want = dot_product_attention(q, q, q, structured, implementation="xla")
    got = dot_product_attention(q, q, q, structured, implementation="fused_packed")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # XLA's fallback (float32)
    assert any("float32" in message for message in logged) and not pretend_gpu
    assert cudnn_packed.unsupported(structured, jnp.zeros((1, 2, 8, 8))) is not None
    windowed = masks.StructuredMask(structured.dense, segments, segments, causal=True, window=3)
    assert "window" in cudnn_packed.unsupported(windowed, None)
    whole_rows = masks.StructuredMask(structured.dense, None, None, causal=True)
    assert "no packed rows" in cudnn_packed.unsupported(whole_rows, None)
    one_slot = dataclasses.replace(structured, max_segments=1)
    assert "max_pairs_per_row=1" in cudnn_packed.unsupported(one_slot, None)
    assert cudnn_packed.unsupported(structured, None) is None


def test_encoder_decoder_with_fused_packed_trains_like_xla(pretend_gpu_taking_float32):
    """The whole encoder-decoder on packed rows with padding, with 3 segment slots a row
    (data.max_pairs_per_row): every attention call of the three kinds takes the packed call
    (decoder self-attention as PADDING_CAUSAL), and loss and every gradient equal the XLA
    path's. In float32 (the stand-in takes it), so that they agree to summation order;
    bfloat16 is the attention-level tests' case."""
    src_segments = jnp.asarray([[1, 1, 2, 2, 3, 3, 0], [1, 1, 1, 1, 1, 0, 0]])
    tgt_segments = jnp.asarray([[1, 1, 2, 2, 3, 0], [1, 1, 1, 1, 0, 0]])
    settings = [("xla", "float32"), ("fused_packed", "float32")]
    models = same_seed_models(
        EncoderDecoder,
        TransformerConfig,
        settings,
        **TINY_TRANSLATION,
        dropout=0.0,
        positional="rope",
        max_segments=3,
    )
    loss = translation_loss(src_segments, tgt_segments)
    results = [_model_loss_and_grads(m, loss) for m in models]
    mask_type = cudnn_packed._private_call()[1]
    calls = pretend_gpu_taking_float32
    kinds = sorted(str(c[0]) for c in calls)
    assert kinds == sorted(
        [str(mask_type.PADDING)] * 4 + [str(mask_type.PADDING_CAUSAL)] * 2
    )  # 2 layers x (encoder, cross; decoder)
    assert {c[2] for c in calls} == {(2, 3)}  # [B, M]: M = max_segments slots a row
    _assert_models_agree(results, "float32")


def _ascending_runs(segments: np.ndarray) -> bool:
    """Every row: ids in contiguous runs, non-decreasing over the non-padding tokens, and
    padding (0) only before the first or after the last token."""
    for row in segments:
        real = np.flatnonzero(row)
        if real.size and (
            np.any(row[real[0] : real[-1] + 1] == 0) or np.any(np.diff(row[real]) < 0)
        ):
            return False
    return True


def test_xformers_batches_meet_the_packed_mode_contract():
    """The packer's training rows and evaluation's padded batches: ascending contiguous runs
    (the helper itself refuses a row with a gap and a row with a repeated id), and every
    example's source and target have tokens (the tokenizer appends EOS to every sentence)."""
    assert not _ascending_runs(np.asarray([[1, 1, 0, 1]]))
    assert not _ascending_runs(np.asarray([[1, 2, 1, 0]]))
    pairs = random_pairs(np.random.default_rng(), 40)
    batches = iter(packed_train_dataset(pairs, **SETTINGS))
    most = 0
    for _ in range(10):
        batch = next(batches)
        assert _ascending_runs(batch["src_segments"]) and _ascending_runs(batch["tgt_segments"])
        for src_row, tgt_row in zip(batch["src_segments"], batch["tgt_segments"], strict=True):
            assert set(src_row) - {0} == set(tgt_row) - {0}  # both sides of every example
        most = max(most, batch["tgt_segments"].max())
    assert most > 1  # packed: several pairs in a row
    pairs = EncodedPairs.from_sequences(*(list(pairs.src[i] for i in range(40)),) * 2)
    for batch in padded_batches(pairs, 16):
        assert _ascending_runs(batch["src_segments"]) and _ascending_runs(batch["tgt_segments"])


def test_a_gpu_without_the_packed_layout_gets_cudnn_with_the_mask(pretend_gpu, monkeypatch):
    """Before Hopper, cuDNN has no packed layout (jax raises NotImplementedError): the call
    goes to cuDNN's mask form (a stand-in computing jax's XLA attention of what it is given),
    not to XLA, and equals the reference."""
    real, mask_calls = jax.nn.dot_product_attention, []

    def refuse(*args, **kwargs):
        raise NotImplementedError("Packed layout requires a GPU with at least Hopper")

    def fake_cudnn(q, k, v, bias=None, mask=None, *, scale=None, is_causal=False, **kw):
        mask_calls.append(kw.get("implementation"))
        return real(q, k, v, bias, mask, scale=scale, is_causal=is_causal, implementation="xla")

    monkeypatch.setattr(sys.modules[cudnn_packed.PRIVATE_CALL], "dot_product_attention", refuse)
    monkeypatch.setattr(jax.nn, "dot_product_attention", fake_cudnn)
    segments = jnp.asarray([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    mask = masks.cross_mask(segments, segments)
    q = jnp.asarray(np.random.default_rng().normal(size=(2, 6, 2, 8)), jnp.bfloat16)
    got = dot_product_attention(q, q, q, mask, implementation="fused_packed")
    want = dot_product_attention(q, q, q, mask, implementation="xla")
    assert mask_calls == ["cudnn"]
    real_rows = np.asarray(segments > 0)
    assert_close(
        np.asarray(got, np.float32)[real_rows],
        np.asarray(want, np.float32)[real_rows],
        "bfloat16",
        "output",
    )
