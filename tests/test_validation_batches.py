"""Translation's validation batches: every pair once, within a learned position table."""

import numpy as np
from flax import nnx
from scipy.special import log_softmax
from test_attention import jitted

from xformer.data.pipeline import EncodedPairs
from xformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from xformer.models import EncoderDecoder, TransformerConfig
from xformer.tasks.translation import loss_terms, padded_batches

MAX_LEN = 40  # not a multiple of the 16-token length buckets


def _random_pairs(rng, n: int, lengths=None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    def sentence():  # some longer than MAX_LEN
        length = int(rng.integers(1, 60) if lengths is None else rng.choice(lengths))
        return np.concatenate([rng.integers(4, 50, length), [EOS_ID]]).astype(np.int32)

    return [sentence() for _ in range(n)], [sentence() for _ in range(n)]


def _cut(src: np.ndarray, tgt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(src) > MAX_LEN:
        src = np.concatenate([src[: MAX_LEN - 1], [EOS_ID]])
    return src, tgt[:MAX_LEN]


def test_batches_hold_every_pair_cut_to_the_table():
    rng = np.random.default_rng()
    src, tgt = _random_pairs(rng, 29)
    assert max(map(len, src + tgt)) > MAX_LEN
    batches = padded_batches(EncodedPairs.from_sequences(src, tgt), 8, max_length=MAX_LEN)
    seen = []
    for batch in batches:
        length = batch["src"].shape[1]
        assert length <= MAX_LEN and batch["tgt_out"].shape == (8, length)
        assert (batch["tgt_in"][:, 0] == BOS_ID).all()
        np.testing.assert_array_equal(batch["tgt_in"][:, 1:], batch["tgt_out"][:, :-1])
        for s, t in zip(batch["src"], batch["tgt_out"], strict=True):
            if (s != PAD_ID).any():
                seen.append((tuple(s[s != PAD_ID]), tuple(t[t != PAD_ID])))
    expected = [tuple(map(tuple, _cut(s, t))) for s, t in zip(src, tgt, strict=True)]
    assert sorted(seen) == sorted(expected)
    # Without a table nothing is cut.
    batches = padded_batches(EncodedPairs.from_sequences(src, tgt), 8)
    assert sum(int((b["tgt_out"] != PAD_ID).sum()) for b in batches) == sum(map(len, tgt))


def test_learned_positions_score_the_cut_pairs_like_one_pair_at_a_time():
    """The batched validation NLL of a model with a 40-row position table equals the NLL of
    each (cut) pair run alone, unpadded, summed."""
    rng = np.random.default_rng()
    src, tgt = _random_pairs(rng, 12, lengths=(3, 20, 55))  # few shapes: fewer compilations
    cfg = TransformerConfig(
        src_vocab_size=50,
        tgt_vocab_size=50,
        d_model=16,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        d_ff=32,
        dropout=0.0,
        positional="learned",
        max_len=MAX_LEN,
    )
    model = EncoderDecoder(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    batches = padded_batches(EncodedPairs.from_sequences(src, tgt), 4, max_length=MAX_LEN)
    # Both sides jitted (one program per shape), where op-by-op dispatch compiled each op of
    # each shape alone: 10.6 s a run eager, a median of 4.7 s jitted (middle kind, 2026-12-03).
    nll_sum = nnx.jit(lambda model, batch: loss_terms(model, batch, 0.0)[1]["nll_sum"])
    nll = sum(float(nll_sum(model, b)) for b in batches)
    forward = jitted(model)
    expected = 0.0
    for s, t in zip(src, tgt, strict=True):
        s, t = _cut(s, t)
        t_in = np.concatenate([[BOS_ID], t[:-1]]).astype(np.int32)
        logits = np.asarray(forward(s[None], t_in[None])[0], np.float64)
        log_probs = log_softmax(logits, axis=-1)
        expected -= log_probs[np.arange(len(t)), t].sum()
    np.testing.assert_allclose(nll, expected, rtol=1e-5)
