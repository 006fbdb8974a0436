"""Search with the real model: cached greedy = uncached greedy; beam size 1 = greedy; a cache
grown in phases = one loop over the whole cache; the beam search loop never copies the
cross-attention cache."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from xformer import translate
from xformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from xformer.decoding import ban_tokens, beam_search, greedy_search, phase_sizes
from xformer.models import EncoderDecoder, TransformerConfig


def _model(seed, positional="learned"):
    cfg = TransformerConfig(
        src_vocab_size=30,
        tgt_vocab_size=30,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ff=64,
        positional=positional,
        max_len=32,
    )
    model = EncoderDecoder(cfg, rngs=nnx.Rngs(seed))
    model.eval()
    return model


def _src(rng):
    src = rng.integers(4, 30, (4, 7))
    src[1, 4:] = PAD_ID
    src[2, 2:] = PAD_ID
    return jnp.asarray(src)


def uncached_greedy(model, src, max_len):
    """Re-run the full decoder on the whole prefix at every step: no cache at all. One jitted
    forward over a fixed [B, max_len] buffer that is PAD after the prefix; step t reads the
    logits at position t (the decoder is causal and PAD keys are masked)."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, src, tgt: nnx.merge(graphdef, state)(src, tgt))
    tokens = np.full((src.shape[0], max_len), PAD_ID)
    tokens[:, 0] = BOS_ID
    done = np.zeros(src.shape[0], bool)
    out = []
    for t in range(max_len):
        logits = np.array(forward(state, src, jnp.asarray(tokens)))[:, t]
        logits[:, [PAD_ID, BOS_ID]] = -np.inf  # as ban_tokens does
        nxt = np.where(done, PAD_ID, logits.argmax(-1))
        out.append(nxt)
        done |= nxt == EOS_ID
        if t + 1 < max_len:
            tokens[:, t + 1] = nxt
    return np.stack(out, 1)


def test_cached_greedy_equals_uncached_greedy():
    rng = np.random.default_rng()
    model, src = _model(int(rng.integers(1e6))), _src(rng)
    step_fn = ban_tokens(model.decode_step, (PAD_ID, BOS_ID))  # as the Translator does
    cached = greedy_search(step_fn, model.init_decode_cache(src, 12), 4, 12, BOS_ID, EOS_ID, PAD_ID)
    np.testing.assert_array_equal(cached, uncached_greedy(model, src, 12))


def test_beam_size_one_equals_greedy():
    rng = np.random.default_rng()
    model, src = _model(int(rng.integers(1e6))), _src(rng)
    greedy = greedy_search(
        model.decode_step, model.init_decode_cache(src, 12), 4, 12, BOS_ID, EOS_ID, PAD_ID
    )
    beam, _ = beam_search(
        model.decode_step,
        model.init_decode_cache(src, 12),
        4,
        1,
        12,
        BOS_ID,
        EOS_ID,
        alpha=0.0,
        pad_id=PAD_ID,
    )
    np.testing.assert_array_equal(beam[:, 0], greedy)


def test_beam_search_equals_one_that_reorders_every_cache_leaf():
    """Beam search keeps the leaves the step returns unchanged (the cross-attention cache) as
    they are; a step that returns them as new arrays has them reordered like the rest."""
    rng = np.random.default_rng()
    model, src = _model(int(rng.integers(1e6))), _src(rng)

    def copying_step(tokens, cache, index):
        log_probs, cache = model.decode_step(tokens, cache, index)
        return log_probs, {**cache, "cross": jax.tree.map(jnp.copy, cache["cross"])}

    results = [
        beam_search(step, model.init_decode_cache(src, 10), 4, 3, 10, BOS_ID, EOS_ID)
        for step in (model.decode_step, copying_step)
    ]
    for kept, reordered in zip(*results, strict=True):
        np.testing.assert_array_equal(kept, reordered)


def test_beam_search_over_a_cache_grown_in_phases_equals_one_loop():
    """Steps 0-3 over 4 slots, 4-7 over 8, 8-13 over 14 (the model's grow_decode_cache in
    between): the tokens of one loop over 14 slots, and its scores to float rounding. EOS is
    banned, so that every hypothesis runs through all three phases."""
    rng = np.random.default_rng()
    model, src = _model(int(rng.integers(1e6))), _src(rng)
    step_fn = ban_tokens(model.decode_step, (PAD_ID, BOS_ID, EOS_ID))
    results = []
    for phases in ((), (4, 8, 14)):
        cache = model.init_decode_cache(src, phases[0] if phases else 14)
        phased = {"cache_phases": phases, "grow_cache": model.grow_decode_cache}
        results.append(beam_search(step_fn, cache, 4, 3, 14, BOS_ID, EOS_ID, 0.6, PAD_ID, **phased))
    np.testing.assert_array_equal(results[1][0], results[0][0])
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-6)
    assert (np.asarray(results[0][0]) != PAD_ID).all()  # every step decoded
    cache = model.init_decode_cache(src, 4)
    cache["self"][0]["k"] = cache["self"][0]["k"] + 1.0  # slots as a step would fill them
    grown = model.grow_decode_cache(cache, 8)
    for old, new in zip(
        jax.tree.leaves(cache["self"]), jax.tree.leaves(grown["self"]), strict=True
    ):
        assert new.shape == (*old.shape[:2], 8, old.shape[3])
        np.testing.assert_array_equal(new[:, :, :4], old)
        assert not np.asarray(new[:, :, 4:]).any()
    assert grown["cross"] is cache["cross"] and grown["src_valid"] is cache["src_valid"]


def test_translate_search_decodes_in_phases_of_doubling_cache_size():
    """eval.py's beam search over 50 steps runs over 32 and then 50 cache slots."""
    rng = np.random.default_rng()
    model, src = _model(int(rng.integers(1e6)), positional="sinusoidal"), _src(rng)
    graphdef, state = nnx.split(model)
    assert phase_sizes(50) == (32, 50)

    def search(state, src):
        return translate.search(nnx.merge(graphdef, state), src, 50, 3, alpha=0.6)

    hlo = jax.jit(search).lower(state, src).compile().as_text()
    # the self-attention caches [B * beam, H, slots, D] of each phase
    assert "f32[12,4,32,8]" in hlo and "f32[12,4,50,8]" in hlo


def _loop_body_ops(hlo: str) -> list[tuple[str, str]]:
    """(opcode, output shape) of every instruction in the bodies of the while loops of an
    optimized HLO module's text."""
    bodies = set(re.findall(r"\bwhile\(.*?body=%?([\w.-]+)", hlo))
    ops, current = [], None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%?([\w.-]+) \(.*\{$", line)
        if header:
            current = header.group(1)
        elif current in bodies and (op := re.match(r"\s+(?:ROOT )?%?\S+ = (\S+) (\S+?)\(", line)):
            ops.append((op.group(2), op.group(1)))
    return ops


@pytest.mark.parametrize("beam_size", [1, 3])
def test_search_loop_reads_the_cross_attention_cache_in_place(beam_size):
    """The encoder's keys and values [B * beam, H, Ls, D] are the same in every beam of a row and
    at every step: the compiled loop of eval.py's search (greedy or beam) neither reorders them
    by beam nor transposes them (stored [B, Ls, H, D], or with XLA free to cancel the transposes
    in and out of [B, H, Ls, D], it transposed every layer's at every step on CPU). Ls = 7 and
    D = 8 appear together in no other array of the loop."""
    rng = np.random.default_rng()
    model, src = _model(int(rng.integers(1e6))), _src(rng)
    graphdef, state = nnx.split(model)

    def search(state, src):
        return translate.search(nnx.merge(graphdef, state), src, 10, beam_size, alpha=0.6)

    hlo = jax.jit(search).lower(state, src).compile().as_text()
    ops = _loop_body_ops(hlo)
    assert any(opcode == "dot" or opcode == "fusion" for opcode, _ in ops)  # the loop was found
    moves = [
        (opcode, shape)
        for opcode, shape in ops
        if opcode not in ("parameter", "get-tuple-element", "tuple", "bitcast", "dot")
        and {"7", "8"} <= set(re.findall(r"\d+", shape.split("{")[0]))
    ]
    assert moves == []
