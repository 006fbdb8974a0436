"""Batched translation of text with a trained encoder-decoder (greedy or beam search).

Every input line gets exactly one output line, in input order (``Translator.translate``):

* Lines are normalised first (``text.normalize_line``: control and format characters,
  whitespace). An empty or whitespace-only line is not decoded: its output is "".
* An input longer than the model's reach is cut to ``input_limit`` tokens (the last one
  EOS): ``eval.max_input_tokens``, and with learned positions at most ``model.max_len``. It is
  translated, never dropped; ``Translations.truncated`` counts such lines.
* Batches hold rows x padded length <= ``eval.max_tokens_per_batch`` source tokens
  (``pipeline.budget_batches``), at most ``eval.batch_size`` rows, longest inputs first: long
  lines come in small batches, so memory stays bounded whatever the input. The rows of a
  batch depend only on its padded length, so there is one compiled shape per length bucket.
* Decoding stops at EOS or after the input's own length (EOS included) +
  ``eval.max_decode_extra`` tokens (with learned positions at most ``model.max_len``), so an
  output never depends on the other lines of its batch; ``Translations.hit_length_cap``
  counts outputs that stopped at that cap instead of at EOS.
* An output never contains a line break (``text.one_line``).
"""

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xformer import sharding
from xformer.data.pipeline import budget_batches, pad_rows
from xformer.data.text import normalize_line, one_line
from xformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from xformer.decoding import ban_tokens, beam_search, greedy_search, phase_sizes
from xformer.models import TransformerConfig
from xformer.timing import format_duration


@dataclasses.dataclass(frozen=True)
class Translations:
    """What `Translator.translate` returns: one output per input line, and what happened."""

    lines: list[str]  # in input order; "" for an empty input; no line breaks
    empty: int  # empty or whitespace-only inputs (not decoded)
    truncated: int  # inputs longer than input_limit tokens, cut to it
    longest_input: int  # tokens of the longest input before any cut (EOS included)
    input_limit: int  # tokens an input is cut to (EOS included)
    hit_length_cap: int  # outputs that stopped at the decoding cap instead of at EOS


def search(
    model: nnx.Module,
    src: jax.Array,
    max_len: int,
    beam_size: int,
    alpha: float,
    top_k: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]] = jax.lax.top_k,
    phases: tuple[int, ...] | None = None,
    row_limits: jax.Array | None = None,
) -> jax.Array:
    """The best output [B, max_len] for each row of src [B, Ls] (PAD after EOS): beam search
    with length penalty `alpha`, or greedy search when beam_size is 1, over the model's
    cached decoding steps; PAD and BOS are never generated. `row_limits` [B]: each row's own
    maximum output length (None: max_len). Beam search grows its self-attention cache in
    `phases` (default `decoding.phase_sizes(max_len)`; (max_len,): one loop over the whole
    cache)."""
    step_fn = ban_tokens(model.decode_step, (PAD_ID, BOS_ID))
    b = src.shape[0]
    if beam_size == 1:
        cache = model.init_decode_cache(src, max_len)
        return greedy_search(
            step_fn, cache, b, max_len, BOS_ID, EOS_ID, PAD_ID, row_limits=row_limits
        )
    phases = phases or phase_sizes(max_len)
    tokens, _ = beam_search(
        step_fn,
        model.init_decode_cache(src, phases[0]),
        b,
        beam_size,
        max_len,
        BOS_ID,
        EOS_ID,
        alpha,
        PAD_ID,
        top_k=top_k,
        cache_phases=phases,
        row_limits=row_limits,
        grow_cache=model.grow_decode_cache,
    )
    return tokens[:, 0]


def position_limit(model_cfg: TransformerConfig) -> int | None:
    """model.max_len with learned positions (no later position has an embedding), else None."""
    return model_cfg.max_len if model_cfg.positional == "learned" else None


def decode_length(source_length: int, max_decode_extra: int, max_positions: int | None) -> int:
    """Steps a search runs at most for sources padded to source_length: source_length +
    max_decode_extra, and at most max_positions (`position_limit`) where there is one."""
    steps = source_length + max_decode_extra
    return min(steps, max_positions) if max_positions else steps


class ProgressLog:
    """Logs "translated n/N sentences | x sentences/s | ETA" after the first batch, then at
    most every `every_s` seconds (0 = never). The ETA scales the time so far by the source
    tokens left, since batches come longest first."""

    def __init__(self, sentences: int, tokens: int, every_s: float):
        self.sentences, self.tokens, self.every_s = sentences, tokens, every_s
        self.done_sentences = self.done_tokens = 0
        self.start = time.time()
        self.last_log: float | None = None

    def update(self, sentences: int, tokens: int) -> None:
        self.done_sentences += sentences
        self.done_tokens += tokens
        now = time.time()
        if not self.every_s or (self.last_log is not None and now - self.last_log < self.every_s):
            return
        self.last_log = now
        elapsed = max(now - self.start, 1e-9)
        left = elapsed * (self.tokens - self.done_tokens) / max(self.done_tokens, 1)
        logging.info(
            "translated %d/%d sentences | %.1f sentences/s | ETA %s",
            self.done_sentences,
            self.sentences,
            self.done_sentences / elapsed,
            format_duration(left),
        )


class Translator:
    """Translates lists of sentences; one output line for every input line, in input order
    (the contract in the module docstring)."""

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        model_cfg: TransformerConfig,
        src_tok: Tokenizer,
        tgt_tok: Tokenizer,
        *,
        beam_size: int,
        length_penalty: float,
        max_decode_extra: int,
        batch_size: int,
        batch_sharding: NamedSharding,
        max_input_tokens: int,
        max_tokens_per_batch: int,
    ):
        self.src_tok, self.tgt_tok = src_tok, tgt_tok
        self.beam_size, self.alpha = beam_size, length_penalty
        self.max_decode_extra, self.batch_size = max_decode_extra, batch_size
        self.max_input_tokens, self.max_tokens_per_batch = max_input_tokens, max_tokens_per_batch
        self.batch_sharding = batch_sharding
        self.row_multiple = sharding.batch_rows(batch_sharding.mesh)
        self.max_positions = position_limit(model_cfg)
        self.input_limit = min(max_input_tokens, self.max_positions or max_input_tokens)
        # The tokens come back on every device: each process reads every row of the batch.
        self._decode = jax.jit(
            sharding.traced_on(batch_sharding.mesh, functools.partial(self._decode_fn, graphdef)),
            static_argnums=3,
            out_shardings=NamedSharding(batch_sharding.mesh, P()),
        )

    def _decode_fn(self, graphdef, params, rng_state, src, max_len: int) -> jax.Array:
        """max_len: the batch's cap (its padded length's); each row stops at its own."""
        model = nnx.merge(graphdef, params, rng_state)
        top_k = sharding.row_local_top_k(self.batch_sharding.mesh)
        limits = (src != PAD_ID).sum(axis=1) + self.max_decode_extra  # (capped at max_len)
        return search(model, src, max_len, self.beam_size, self.alpha, top_k, row_limits=limits)

    def translate(
        self, params: nnx.State, rng_state: nnx.State, lines: list[str], log_every_s: float = 0.0
    ) -> Translations:
        """Translate `lines` with the given model parameters and non-parameter state; progress
        is logged every `log_every_s` seconds (0 = never)."""
        texts = [normalize_line(line) for line in lines]
        todo = [i for i, text in enumerate(texts) if text]  # the inputs that are decoded
        ids = self.src_tok.encode([texts[i] for i in todo])
        longest = max(map(len, ids), default=0)
        ids, truncated = self._truncate(ids)
        lengths = [len(x) for x in ids]
        out = [""] * len(lines)
        progress = ProgressLog(len(todo), sum(lengths), log_every_s)
        hit_cap = 0
        for batch in budget_batches(
            lengths,
            self.batch_size,
            self.max_tokens_per_batch,
            self.row_multiple,
            max_length=self.max_positions,
        ):
            max_len = decode_length(batch.length, self.max_decode_extra, self.max_positions)
            src = pad_rows([ids[k] for k in batch.indices], batch.length, batch.rows)
            src = jax.device_put(src, self.batch_sharding)
            tokens = np.asarray(self._decode(params, rng_state, src, max_len))
            tokens = tokens[: len(batch.indices)]
            hit_cap += int((~(tokens == EOS_ID).any(axis=1)).sum())
            for row, k in enumerate(batch.indices):
                out[todo[k]] = one_line(self.tgt_tok.decode(tokens[row]))
            progress.update(len(batch.indices), sum(lengths[k] for k in batch.indices))
        return Translations(
            lines=out,
            empty=len(lines) - len(todo),
            truncated=truncated,
            longest_input=longest,
            input_limit=self.input_limit,
            hit_length_cap=hit_cap,
        )

    def _truncate(self, ids: list[np.ndarray]) -> tuple[list[np.ndarray], int]:
        """Inputs cut to input_limit tokens (ending in EOS), and how many were cut; logs a
        warning that counts them."""
        limit = self.input_limit
        long = [k for k, x in enumerate(ids) if len(x) > limit]
        if not long:
            return ids, 0
        logging.warning(
            "%d of %d inputs have more than %d tokens (eval.max_input_tokens=%d%s; the longest "
            "has %d): each is cut to its first %d tokens and EOS, and translated",
            len(long),
            len(ids),
            limit,
            self.max_input_tokens,
            f", learned positions model.max_len={self.max_positions}" if self.max_positions else "",
            max(len(ids[k]) for k in long),
            limit - 1,
        )
        cut = list(ids)
        for k in long:
            cut[k] = np.concatenate([ids[k][: limit - 1], [EOS_ID]]).astype(np.int32)
        return cut, len(long)
