"""Generation (xformer/generate.py, sample.py): cached decoding (Transformer-XL memory + key/value
cache, or the vanilla model's cache) draws the same tokens from the same log-probabilities as a
full forward pass over the whole sequence at every step; top-k / top-p draw only from the set a
numpy computation allows, with its probabilities; temperature 0 is argmax; seeds repeat."""

import dataclasses
import gzip
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_language_modeling import SHARED, run, train_cmd
from test_train_eval import shared_vocab_dir

from xformer.data.vocab import ByteVocab, CharVocab, WordVocab
from xformer.generate import (
    Sampling,
    check_generation,
    decode_tokens,
    encode_prompt,
    filter_logits,
    make_generator,
    sample_tokens,
)
from xformer.language_model import LanguageModel
from xformer.model_config import LMConfig

VOCAB_SIZE = 29


def tiny_model(seed: int, **overrides) -> LanguageModel:
    cfg = LMConfig(
        vocab_size=VOCAB_SIZE,
        d_model=16,
        num_heads=2,
        num_decoder_layers=2,
        d_ff=24,
        dropout=0.0,
        **overrides,
    )
    model = LanguageModel(cfg, rngs=nnx.Rngs(seed))
    model.eval()
    return model


def full_forward_log_probs(model, tokens, mem_len: int, segment_length: int) -> jax.Array:
    """The evaluation path, independent of any cache: `hidden` over the whole sequence [B, T],
    in segments of segment_length through the memory (one segment without a memory) ->
    log-probabilities of the next token at every position [B, T, V]."""
    batch_size, length = tokens.shape
    memory = model.init_memory(batch_size, mem_len)
    step = segment_length if mem_len else length
    out = []
    for start in range(0, length, step):
        hidden, memory = model.hidden(tokens[:, start : start + step], memory)
        out.append(model.softmax.log_probs(hidden))
    return jnp.concatenate(out, axis=1)


def reference_generation(model, context, key, sampling, n, mem_len, segment_length):
    """At every step a full forward pass over the whole sequence so far (right-padded to its
    final length so that one program serves every step; the model is causal), then the same
    draw as generate.py -> (tokens [B, n], log-probs [B, n, V])."""
    forward = jax.jit(lambda t: full_forward_log_probs(model, t, mem_len, segment_length))
    batch_size, context_len = context.shape
    sequence = np.zeros((batch_size, context_len + n - 1), np.int32)
    sequence[:, :context_len] = context
    tokens, log_probs = [], []
    for t in range(n):
        step_log_probs = forward(sequence)[:, context_len - 1 + t]
        token = np.asarray(sample_tokens(jax.random.fold_in(key, t), step_log_probs, sampling))
        if t < n - 1:
            sequence[:, context_len + t] = token
        tokens.append(token)
        log_probs.append(np.asarray(step_log_probs))
    return np.stack(tokens, 1), np.stack(log_probs, 1)


# (model overrides, mem_len, segment_length, context length, sampling): contexts that span
# several segments, end mid-segment or exactly at a segment's end, and generation that crosses
# segment boundaries.
XL = ({"positional": "relative"}, 5, 4, 11, Sampling(temperature=1.0))
XL_OPTIONS = (
    {
        "positional": "relative",
        "clamp_len": 3,
        "untie_relative_biases": True,
        "layer_norm": "pre",
        "decoder_mask": "same_length",
    },
    6,
    3,
    9,
    Sampling(temperature=0.8, top_k=10),
)
VANILLA_SINUSOIDAL = ({"positional": "sinusoidal"}, 0, 0, 7, Sampling(temperature=0.0))
VANILLA_ROPE = ({"positional": "rope"}, 0, 0, 5, Sampling(temperature=1.2, top_p=0.9))
CASES = {
    "xl": XL,
    "xl_clamp_untied_pre_same_length": XL_OPTIONS,
    "vanilla_sinusoidal_greedy": VANILLA_SINUSOIDAL,
    "vanilla_rope": VANILLA_ROPE,
    "vanilla_alibi": ({"positional": "alibi"}, 0, 0, 6, Sampling(top_k=5, top_p=0.8)),
    "vanilla_learned": ({"positional": "learned", "max_len": 32}, 0, 0, 4, Sampling()),
    "vanilla_sliding_window": (
        {"positional": "t5_bias", "decoder_mask": "sliding_window", "attention_window": 4},
        0,
        0,
        6,
        Sampling(),
    ),
    "rope_with_memory_pre_ln": ({"positional": "rope", "layer_norm": "pre"}, 4, 5, 8, Sampling()),
    "t5_bias_with_memory": ({"positional": "t5_bias"}, 7, 3, 10, Sampling(temperature=0.5)),
    "prefix_lm_relative": (
        {"positional": "relative", "decoder_mask": "prefix_lm", "prefix_length": 4},
        0,
        0,
        6,
        Sampling(),
    ),
    "prefix_lm_t5_bias": (
        {"positional": "t5_bias", "decoder_mask": "prefix_lm", "prefix_length": 5},
        0,
        0,
        5,
        Sampling(temperature=0.7),
    ),
}
SLOW = {"vanilla_alibi", "vanilla_learned", "vanilla_sliding_window", "rope_with_memory_pre_ln"}
SLOW |= {"t5_bias_with_memory", "prefix_lm_t5_bias"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES],
)
def test_cached_generation_equals_a_full_forward_pass_per_step(name):
    overrides, mem_len, segment_length, context_len, sampling = CASES[name]
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    model = tiny_model(seed, **overrides)
    context = rng.integers(0, VOCAB_SIZE, (3, context_len)).astype(np.int32)
    key, n = jax.random.key(seed), 13
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    generator = make_generator(
        graphdef,
        sampling,
        max_new_tokens=n,
        mem_len=mem_len,
        segment_length=segment_length,
        return_log_probs=True,
    )
    got = generator(params, rest, context, key)
    tokens, log_probs = reference_generation(
        model, context, key, sampling, n, mem_len, segment_length
    )
    np.testing.assert_array_equal(np.asarray(got.tokens), tokens, err_msg=f"seed {seed}")
    np.testing.assert_allclose(np.asarray(got.log_probs), log_probs, atol=2e-5, rtol=0)
    if sampling.temperature == 0:
        np.testing.assert_array_equal(tokens, log_probs.argmax(-1))


def test_same_seed_same_tokens_other_seed_other_tokens():
    overrides, mem_len, segment_length, context_len, sampling = XL
    model = tiny_model(0, **overrides)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    generator = make_generator(
        graphdef, sampling, max_new_tokens=20, mem_len=mem_len, segment_length=segment_length
    )
    context = np.random.default_rng().integers(0, VOCAB_SIZE, (4, context_len)).astype(np.int32)
    first, again, other = (
        np.asarray(generator(params, rest, context, jax.random.key(seed)).tokens)
        for seed in (7, 7, 8)
    )
    np.testing.assert_array_equal(first, again)
    assert (first != other).mean() > 0.5  # near-uniform tiny model: most draws differ
    assert first.shape == (4, 20) and first.min() >= 0 and first.max() < VOCAB_SIZE
    assert len({tuple(row) for row in first}) == 4  # rows of one batch draw independently


# Filtering and sampling ------------------------------------------------------------------------


def allowed_probs(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """numpy, float64: the distribution that temperature, top-k then top-p leave [B, V]."""
    z = logits.astype(np.float64) / sampling.temperature
    keep = np.ones_like(z, bool)
    if sampling.top_k:
        keep &= z >= np.sort(z, axis=-1)[:, -sampling.top_k][:, None]
    p = np.where(keep, np.exp(z - z.max(-1, keepdims=True)), 0.0)
    p /= p.sum(-1, keepdims=True)
    if sampling.top_p < 1:
        for row in range(len(p)):
            order = np.argsort(-p[row])
            before = np.cumsum(p[row, order]) - p[row, order]
            nucleus = np.zeros(p.shape[1], bool)
            nucleus[order[before < sampling.top_p]] = True
            p[row] = np.where(nucleus, p[row], 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(top_k=5),
        Sampling(top_p=0.6),
        Sampling(temperature=0.7, top_k=12, top_p=0.8),
        Sampling(temperature=1.5, top_p=0.95),
        Sampling(top_p=1e-4),  # only the most likely token
    ],
)
@pytest.mark.parametrize("vocab", [40, 300])  # one block; three of 128, the last padded
def test_top_k_top_p_draw_only_from_the_allowed_set(sampling, vocab):
    rng = np.random.default_rng()
    logits = (rng.normal(size=(3, vocab)) * 2.5).astype(np.float32)
    expected = allowed_probs(logits, sampling)
    filtered = jax.nn.softmax(filter_logits(jnp.asarray(logits), sampling), axis=-1)
    np.testing.assert_allclose(np.asarray(filtered), expected, atol=1e-6)

    draws = 4000
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), draws)
    tokens = np.asarray(jax.vmap(lambda k: sample_tokens(k, jnp.asarray(logits), sampling))(keys))
    for row in range(len(logits)):
        allowed = expected[row] > 0
        assert allowed[tokens[:, row]].all()
        counts = np.bincount(tokens[:, row], minlength=logits.shape[1]) / draws
        sigma = np.sqrt(expected[row] * (1 - expected[row]) / draws)
        assert (np.abs(counts - expected[row]) <= 5 * sigma + 1e-3).all()
    # 64 copies of a row in one batch draw independently (their own noise in both draws of
    # the blocked path): all alike has probability max(p)^63 at most, < 1e-6 here.
    if expected[0].max() < 0.8:
        copies = jnp.asarray(np.broadcast_to(logits[:1], (64, vocab)))
        drawn = np.asarray(sample_tokens(keys[0], copies, sampling))
        assert len(set(drawn.tolist())) > 1, drawn


def test_temperature_zero_is_argmax_and_low_temperature_sampling_matches_it():
    rng = np.random.default_rng()
    logits = np.stack([rng.permutation(50) * 0.1 for _ in range(6)]).astype(np.float32)
    greedy = np.asarray(sample_tokens(jax.random.key(0), jnp.asarray(logits), Sampling(0.0)))
    np.testing.assert_array_equal(greedy, logits.argmax(-1))
    keys = jax.random.split(jax.random.key(1), 200)
    cold = Sampling(temperature=1e-3)  # logit gaps of 0.1 become 100
    draws = jax.vmap(lambda k: sample_tokens(k, jnp.asarray(logits), cold))(keys)
    np.testing.assert_array_equal(np.asarray(draws), np.broadcast_to(greedy, (200, 6)))
    # Near-uniform log-probabilities (all below -5.2) over a tiny temperature: every one
    # divided by it overflows to -inf, where a draw returned token 0.
    log_probs = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(6, 200)) * 0.01, jnp.float32))
    assert float(log_probs.max()) < -5.2
    draws = jax.vmap(lambda k: sample_tokens(k, log_probs, Sampling(1.5e-38)))(keys)
    np.testing.assert_array_equal(draws, np.broadcast_to(log_probs.argmax(-1), (200, 6)))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"top_p": 0.0}, "top_p must lie in"),
        ({"top_p": 1.5}, "top_p must lie in"),
    ],
)
def test_bad_sampling_settings_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


def test_generation_settings_the_model_cannot_serve_fail_before_compute():
    base = tiny_model(0).cfg
    learned = dataclasses.replace(base, positional="learned", max_len=16)
    check_generation(learned, context_len=6, max_new_tokens=11, mem_len=0, segment_length=0)
    with pytest.raises(ValueError, match="model.max_len=16"):
        check_generation(learned, context_len=6, max_new_tokens=12, mem_len=0, segment_length=0)
    sinusoidal = dataclasses.replace(base, positional="sinusoidal")
    with pytest.raises(ValueError, match="memory"):
        check_generation(sinusoidal, context_len=3, max_new_tokens=5, mem_len=8, segment_length=4)
    prefix = dataclasses.replace(base, decoder_mask="prefix_lm", prefix_length=4)
    with pytest.raises(ValueError, match="prefix_length=4"):
        check_generation(prefix, context_len=3, max_new_tokens=5, mem_len=0, segment_length=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        check_generation(base, context_len=3, max_new_tokens=0, mem_len=0, segment_length=0)
    xl = dataclasses.replace(base, positional="relative")
    with pytest.raises(ValueError, match="segment_length"):
        check_generation(xl, context_len=3, max_new_tokens=5, mem_len=4, segment_length=0)


# Prompts and text ---------------------------------------------------------------------------


def test_prompt_words_encode_with_unknown_words_as_unk_and_an_empty_prompt_as_the_boundary():
    vocab = WordVocab(["the", "<eos>", "cat", "<unk>", "sat"])
    ids, unknown = encode_prompt(vocab, "the dog sat\n cat  ", boundary_id=1)
    np.testing.assert_array_equal(ids, [1, 0, 3, 4, 1, 2])
    assert unknown == ["dog"]
    ids, unknown = encode_prompt(vocab, "", boundary_id=1)
    np.testing.assert_array_equal(ids, [1])
    assert unknown == []
    assert decode_tokens(vocab, np.array([0, 2, 1, 4, 1, 1, 0])) == "the cat\nsat\n\nthe"
    with pytest.raises(ValueError, match="dog"):
        encode_prompt(WordVocab(["the", "<eos>"]), "the dog", boundary_id=1)


def test_character_and_byte_prompts():
    chars = CharVocab(["a", " ", "b"])
    ids, _ = encode_prompt(chars, "ab a", boundary_id=1)
    np.testing.assert_array_equal(ids, [1, 0, 2, 1, 0])
    assert decode_tokens(chars, np.array([2, 1, 0])) == "b a"
    with pytest.raises(ValueError, match="'z'"):
        encode_prompt(chars, "abz", boundary_id=1)
    ids, _ = encode_prompt(ByteVocab(), "é!", boundary_id=10)
    np.testing.assert_array_equal(ids, [10, 0xC3, 0xA9, ord("!")])
    assert decode_tokens(ByteVocab(), np.array([0xC3, 0xA9])) == "é"


# sample.py as a user runs it ---------------------------------------------------------------------


@pytest.mark.slow
def test_sample_py_on_a_tiny_trained_ptb_workdir(tmp_path, tfds_dir):
    if not (SHARED / "ptb").exists():
        pytest.skip(f"real data not found at {SHARED / 'ptb'}")
    workdir = tmp_path / "xl"
    trained = run(train_cmd(workdir, tfds_dir, "--config.train.num_steps=2"))
    assert trained.returncode == 0, trained.stderr[-3000:]

    def sample(name, *extra):
        args = [
            "sample.py",
            f"--workdir={workdir}",
            "--prompt=the company said qwzx it",
            "--num_samples=3",
            "--max_new_tokens=30",
            "--mem_len=16",
            "--segment_length=8",  # the context and the samples cross segments
            "--top_k=100",
            "--top_p=0.95",
            f"--output={tmp_path / name}",
            *extra,
        ]
        result = run(args)
        assert result.returncode == 0, result.stderr[-3000:]
        return result, json.loads((tmp_path / name).read_text())

    result, first = sample("a.json", "--seed=5")
    _, again = sample("b.json", "--seed=5")
    _, other = sample("c.json", "--seed=6")
    assert "1 prompt word(s) not in the vocabulary became <unk>: qwzx" in result.stderr
    assert "generated 3 x 30 tokens in" in result.stdout and "tokens/s" in result.stdout
    assert first["samples"] == again["samples"] and first["tokens"] == again["tokens"]
    assert first["samples"] != other["samples"]
    vocab = (Path(shared_vocab_dir(tfds_dir)) / "ptb.vocab").read_text().split()
    assert np.array(first["tokens"]).shape == (3, 30)
    for text in first["samples"]:
        assert text in result.stdout
        assert all(word in vocab for word in text.split())

    bad = run(["sample.py", f"--workdir={workdir}", "--top_p=0"])
    assert bad.returncode != 0 and "top_p must lie in (0, 1]" in bad.stderr
    # Flags that cannot be used: one line, before any generation.
    truncated = tmp_path / "prompt.txt.gz"
    truncated.write_bytes(gzip.compress(b"the company said\n" * 50)[:30])
    for flags, message in [
        (["--step=7"], f"no checkpoint 7 in {workdir / 'checkpoints'} (it holds [2])"),
        ([f"--output={tmp_path}"], f"--output={tmp_path} is a directory, not a file"),
        ([f"--prompt_file={truncated}"], f"{truncated}: not a complete gzip file"),
        (["--mem_len=0", "--segment_length=8"], "--segment_length sets the segments"),
    ]:
        bad = run(["sample.py", f"--workdir={workdir}", *flags])
        assert bad.returncode == 1 and f"sample.py: {message}" in bad.stderr, flags
        assert "Traceback" not in bad.stderr and "generated" not in bad.stdout
    translation = tmp_path / "translation"
    translation.mkdir()
    config = json.loads((workdir / "config.json").read_text())
    config["model"]["family"] = "encoder_decoder"
    (translation / "config.json").write_text(json.dumps(config))
    bad = run(["sample.py", f"--workdir={translation}"])
    assert bad.returncode != 0 and "holds a translation model" in bad.stderr
