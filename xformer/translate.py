"""Batched translation of text with a trained encoder-decoder (greedy or beam search)."""

import functools
import time

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xformer.data.pipeline import bucket_length, pad_rows, sorted_batches
from xformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from xformer.decoding import ban_tokens, beam_search, greedy_search
from xformer.models import TransformerConfig


class Translator:
    """Translates lists of sentences; one output line for every input line, in input order.

    Sentences are sorted by length into fixed-size batches whose length is rounded up to a
    multiple of 16, so only a few shapes are compiled.
    """

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
    ):
        self.src_tok, self.tgt_tok = src_tok, tgt_tok
        self.beam_size, self.alpha = beam_size, length_penalty
        self.max_decode_extra, self.batch_size = max_decode_extra, batch_size
        self.batch_sharding = batch_sharding
        self.max_positions = model_cfg.max_len if model_cfg.positional == "learned" else None
        # The tokens come back on every device: each process reads every row of the batch.
        self._decode = jax.jit(
            functools.partial(self._decode_fn, graphdef),
            static_argnums=3,
            out_shardings=NamedSharding(batch_sharding.mesh, P()),
        )

    def _decode_fn(self, graphdef, params, rng_state, src, max_len: int) -> jax.Array:
        model = nnx.merge(graphdef, params, rng_state)
        cache = model.init_decode_cache(src, max_len)
        step_fn = ban_tokens(model.decode_step, (PAD_ID, BOS_ID))
        b = src.shape[0]
        if self.beam_size == 1:
            return greedy_search(step_fn, cache, b, max_len, BOS_ID, EOS_ID, PAD_ID)
        tokens, _ = beam_search(
            step_fn, cache, b, self.beam_size, max_len, BOS_ID, EOS_ID, self.alpha, PAD_ID
        )
        return tokens[:, 0]

    def translate(
        self, params: nnx.State, rng_state: nnx.State, lines: list[str], log_every: int = 0
    ) -> list[str]:
        """Translate `lines` with the given model parameters and non-parameter state."""
        ids = self.src_tok.encode(lines)
        too_long = [
            i for i, x in enumerate(ids) if self.max_positions and len(x) > self.max_positions
        ]
        if too_long:
            raise ValueError(
                f"line {too_long[0] + 1} has {len(ids[too_long[0]])} tokens, more than the learned "
                f"position table (model.max_len={self.max_positions})"
            )
        out: list[str] = [""] * len(lines)
        batches = sorted_batches([len(x) for x in ids], self.batch_size)
        start = time.time()
        for n, batch in enumerate(batches):
            src_len = bucket_length(max(len(ids[i]) for i in batch))
            max_len = src_len + self.max_decode_extra
            if self.max_positions:
                max_len = min(max_len, self.max_positions)
            src = pad_rows([ids[i] for i in batch], src_len, self.batch_size)
            src = jax.device_put(src, self.batch_sharding)
            tokens = np.asarray(self._decode(params, rng_state, src, max_len))
            for row, i in enumerate(batch):
                out[i] = self.tgt_tok.decode(tokens[row]).replace("\n", " ")
            if log_every and (n + 1) % log_every == 0:
                done = sum(len(b) for b in batches[: n + 1])
                rate = done / (time.time() - start)
                logging.info(
                    "translated %d/%d sentences, %.1f sent/s, ETA %.0fs",
                    done,
                    len(lines),
                    rate,
                    (len(lines) - done) / rate,
                )
        return out
