"""Sampling text from a decoder-only language model (Transformer-XL or the vanilla baseline).

    generator = make_generator(graphdef, Sampling(temperature=0.8, top_p=0.9), max_new_tokens=100,
                               mem_len=70, segment_length=70)
    tokens = generator(params, rng_state, context, jax.random.key(0)).tokens  # [B, 100]

One jit-compiled program with fixed shapes: the context is prefilled (whole segments through
the Transformer-XL memory, the rest into the key/value cache, see LanguageModel.prefill), then
a `lax.scan` emits one token per step, each step attending to the memory and the cached keys
and values (LanguageModel.decode_step) instead of running the context again.

Sampling at each step: log-probabilities / temperature, then top-k, then top-p (nucleus) over
what top-k kept, then one categorical draw per row with the key `fold_in(key, step)`; the same
key gives the same tokens. Temperature 0 is greedy (argmax).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xformer.data.vocab import EOS, UNK, ByteVocab, CharVocab, Vocab, WordVocab
from xformer.language_model import LanguageModel
from xformer.model_config import LMConfig
from xformer.positional import SCHEMES


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature: 0 = greedy, else log-probabilities are divided by it; top_k: keep the k most
    likely tokens (0 = all); top_p: keep the smallest set of most likely tokens whose
    probability reaches top_p (1 = all)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1] (1 = off), got {self.top_p}")


def filter_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """logits [B, V] -> (logits - row max) / temperature [B, V] (float32 or wider: the same
    distribution as logits / temperature), -inf outside the kept set.

    Top-k keeps the tokens whose logit is at least the k-th largest. Top-p then keeps, in the
    distribution top-k left, a token when the tokens more likely than it hold less than top_p
    of the probability (so at least the most likely one); ties at either cut are all kept.
    """
    temperature = sampling.temperature or 1.0
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    # Shifted first: at a tiny temperature every logit / temperature can overflow to -inf, and
    # a draw over a row of -inf returns token 0; shifted, the most likely token stays at 0.
    logits = (logits - logits.max(-1, keepdims=True)) / temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if sampling.top_p < 1:
        ordered = -jnp.sort(-logits, axis=-1)  # descending
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
        cutoff = jnp.min(jnp.where(before < sampling.top_p, ordered, jnp.inf), -1, keepdims=True)
        logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return logits


SAMPLING_BLOCK = 128  # vocabulary entries per block of `sample_tokens`' first draw


def sample_tokens(key: jax.Array, log_probs: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row [B] int32 from log_probs [B, V] (argmax at temperature 0).

    Two exact Gumbel-max draws: a block of SAMPLING_BLOCK entries with probability its mass
    (over the blocks' log-sum-exps), then an entry of that block (over its logits). The same
    distribution as one draw over all V entries, from V / 128 + 128 random numbers a row
    instead of V (on CPU, threefry bits for every entry took 1.7 ms a draw of [8, 10000]).
    """
    if sampling.temperature == 0:
        return jnp.argmax(log_probs, axis=-1).astype(jnp.int32)
    logits = filter_logits(log_probs, sampling)
    rows, vocab = logits.shape
    num_blocks = -(-vocab // SAMPLING_BLOCK)
    if num_blocks == 1:
        return jax.random.categorical(key, logits).astype(jnp.int32)
    padded = jnp.pad(
        logits, ((0, 0), (0, num_blocks * SAMPLING_BLOCK - vocab)), constant_values=-jnp.inf
    )
    blocks = padded.reshape(rows, num_blocks, SAMPLING_BLOCK)
    block_key, entry_key = jax.random.split(key)
    block = jax.random.categorical(block_key, jax.nn.logsumexp(blocks, axis=-1))  # [B]
    chosen = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, 128]
    entry = jax.random.categorical(entry_key, chosen)
    return (block * SAMPLING_BLOCK + entry).astype(jnp.int32)


class Generation(NamedTuple):
    tokens: jax.Array  # [B, N] int32
    log_probs: jax.Array | None  # [B, N, V]: the model's, before temperature and filtering


def generate(
    model: LanguageModel,
    context: jax.Array,
    key: jax.Array,
    sampling: Sampling,
    *,
    max_new_tokens: int,
    mem_len: int,
    segment_length: int,
    return_log_probs: bool = False,
) -> Generation:
    """context [B, C] int32 -> N = max_new_tokens tokens per row, drawn one at a time.

    With a memory (mem_len > 0) the sequence is cut into segments of segment_length tokens
    from the start of the context; without one, the key/value cache covers all C + N - 1
    positions. Token t (0-based) is drawn with the key fold_in(key, t).
    """
    context_len = context.shape[1]
    window = segment_length if mem_len else context_len + max_new_tokens - 1
    log_probs, cache = model.prefill(context, mem_len, window)
    first = sample_tokens(jax.random.fold_in(key, 0), log_probs, sampling)

    def step(carry, t):
        token, cache = carry
        log_probs, cache = model.decode_step(token, cache)
        new = sample_tokens(jax.random.fold_in(key, t), log_probs, sampling)
        return (new, cache), (new, log_probs if return_log_probs else None)

    steps = jnp.arange(1, max_new_tokens, dtype=jnp.int32)
    _, (tokens, all_log_probs) = jax.lax.scan(step, (first, cache), steps)
    tokens = jnp.concatenate([first[:, None], tokens.T], axis=1)
    if return_log_probs:
        all_log_probs = jnp.concatenate([log_probs[:, None], all_log_probs.swapaxes(0, 1)], 1)
    return Generation(tokens, all_log_probs)


def make_generator(
    graphdef: nnx.GraphDef,
    sampling: Sampling,
    *,
    max_new_tokens: int,
    mem_len: int,
    segment_length: int,
    return_log_probs: bool = False,
) -> Callable[[nnx.State, nnx.State, jax.Array, jax.Array], Generation]:
    """`generate` for the model `graphdef` (in evaluation mode), jit-compiled:
    (params, rng_state, context [B, C], key) -> Generation."""

    def run(params, rng_state, context, key):
        model = nnx.merge(graphdef, params, rng_state)
        return generate(
            model,
            context,
            key,
            sampling,
            max_new_tokens=max_new_tokens,
            mem_len=mem_len,
            segment_length=segment_length,
            return_log_probs=return_log_probs,
        )

    return jax.jit(run)


def check_generation(
    cfg: LMConfig, *, context_len: int, max_new_tokens: int, mem_len: int, segment_length: int
) -> None:
    """Raise ValueError, before any compute, when this model cannot generate this way."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if mem_len < 0:
        raise ValueError(f"mem_len must be >= 0, got {mem_len}")
    scheme = SCHEMES[cfg.positional]
    scheme.check_memory(mem_len, "mem_len")
    if mem_len and segment_length < 1:
        raise ValueError(f"segment_length must be >= 1 with a memory, got {segment_length}")
    if not mem_len:  # every position of the sequence is encoded (its own check and message)
        positional = nnx.eval_shape(lambda: scheme(cfg, cfg.num_layers, rngs=nnx.Rngs(0)))
        positional.check_length(context_len + max_new_tokens - 1)
    if cfg.decoder_mask == "prefix_lm" and context_len < cfg.prefix_length:
        raise ValueError(
            f"a prefix_lm model sees its first model.prefix_length={cfg.prefix_length} positions "
            f"both ways: the context (boundary token + prompt, {context_len} tokens) must fill them"
        )


def encode_prompt(vocab: Vocab, text: str, boundary_id: int) -> tuple[np.ndarray, list[str]]:
    """The context of a prompt: the boundary token (a line end), then the prompt's tokens, as
    evaluation conditions the start of a text. Returns (ids [C] int32, the prompt's symbols that
    are not in the vocabulary).

    Word vocabularies: whitespace tokens, a line break inside the prompt is <eos>, unknown words
    become <unk> (an error without one). Bytes: the UTF-8 bytes. Characters: unknown ones are an
    error (there is no <unk>).
    """
    if isinstance(vocab, ByteVocab):
        return np.concatenate([[boundary_id], vocab.encode(text.encode("utf-8"))]).astype(
            np.int32
        ), []
    if isinstance(vocab, CharVocab):
        unknown = sorted({c for c in text if c not in vocab.chars})
        if unknown:
            raise ValueError(f"prompt characters not in the vocabulary: {unknown[:10]}")
        return np.concatenate([[boundary_id], vocab.encode(text)]).astype(np.int32), []
    lines = text.split("\n")
    words = [w for i, line in enumerate(lines) for w in ([EOS] if i else []) + line.split()]
    unknown = [w for w in words if w not in vocab]
    if unknown and vocab.unk_id is None:
        raise ValueError(f"prompt words not in the vocabulary, which has no {UNK}: {unknown[:10]}")
    ids = vocab.encode_lines([" ".join(words)])[:-1]  # unknown words -> <unk>; no final <eos>
    return np.concatenate([[boundary_id], ids]).astype(np.int32), unknown


def decode_tokens(vocab: Vocab, ids: np.ndarray) -> str:
    """Generated ids [N] -> text (word vocabularies: <eos> as a line break)."""
    if isinstance(vocab, ByteVocab):
        return vocab.decode(ids).decode("utf-8", errors="replace")
    if isinstance(vocab, WordVocab):
        text = ""
        for word in (vocab.tokens[i] for i in ids):
            text += "\n" if word == EOS else word if not text or text[-1] == "\n" else " " + word
        return text
    return vocab.decode(ids)
