"""A tiny Transformer memorises a handful of real Multi30k pairs and greedy-decodes them back."""

import gzip

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from xformer.data.pipeline import EncodedPairs
from xformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, train_tokenizer
from xformer.decoding import beam_search, greedy_search
from xformer.losses import cross_entropy
from xformer.models import EncoderDecoder, TransformerConfig
from xformer.tasks.translation import padded_batches


def _lines(path, n):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [next(f).rstrip("\n") for _ in range(n)]


@pytest.mark.slow
def test_tiny_model_overfits_real_pairs(multi30k_dir, tmp_path):
    en = _lines(multi30k_dir / "raw" / "train.en.gz", 3000)
    de = _lines(multi30k_dir / "raw" / "train.de.gz", 3000)
    tok = train_tokenizer(en + de, str(tmp_path / "spm.model"), vocab_size=400)
    rng = np.random.default_rng()
    idx = rng.choice(3000, 6, replace=False)
    src_text, tgt_text = [en[i] for i in idx], [de[i] for i in idx]
    (batch,) = padded_batches(EncodedPairs.from_text(src_text, tgt_text, tok, tok), 6)

    cfg = TransformerConfig(
        src_vocab_size=tok.vocab_size,
        tgt_vocab_size=tok.vocab_size,
        d_model=64,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=128,
        dropout=0.0,
    )
    model = EncoderDecoder(cfg, rngs=nnx.Rngs(int(rng.integers(1e6))))
    graphdef, params, rng_state = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(3e-3)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        def loss_fn(p):
            m = nnx.merge(graphdef, p, rng_state)
            logits = m(batch["src"], batch["tgt_in"])
            loss, _ = cross_entropy(logits, batch["tgt_out"], batch["tgt_segments"] > 0)
            return loss / (batch["tgt_segments"] > 0).sum()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    for _ in range(300):
        params, opt_state, loss = step(params, opt_state)
    assert float(loss) < 0.01

    expected = [tok.decode(row) for row in batch["tgt_out"]]  # batches are length-sorted
    # SentencePiece collapses runs of spaces (a few Multi30k lines have double spaces).
    assert sorted(expected) == sorted(" ".join(t.split()) for t in tgt_text)
    model = nnx.merge(graphdef, params, rng_state)
    model.eval()
    src = jnp.asarray(batch["src"])
    max_len = batch["tgt_out"].shape[1] + 2
    greedy = greedy_search(
        model.decode_step, model.init_decode_cache(src, max_len), 6, max_len, BOS_ID, EOS_ID, PAD_ID
    )
    assert [tok.decode(row) for row in np.asarray(greedy)] == expected
    beams, _ = beam_search(
        model.decode_step,
        model.init_decode_cache(src, max_len),
        6,
        3,
        max_len,
        BOS_ID,
        EOS_ID,
        0.6,
        PAD_ID,
    )
    assert [tok.decode(row) for row in np.asarray(beams[:, 0])] == expected
