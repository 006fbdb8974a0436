"""Translation with the encoder-decoder: packed training pairs, loss, validation BLEU."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from xformer import distributed, model_config, sharding
from xformer import experiment as experiment_lib
from xformer.bleu import bleu_report
from xformer.data.pipeline import (
    EncodedPairs,
    ShardBatches,
    bucket_length,
    packed_train_dataset,
    pad_rows,
    sorted_batches,
)
from xformer.data.tokenizer import BOS_ID, EOS_ID
from xformer.data.translation import encoded_split, load_tokenizers, split_text
from xformer.dispatch import DispatchWindow
from xformer.losses import cross_entropy
from xformer.models import EncoderDecoder
from xformer.translate import Translator, position_limit

MODEL_INPUTS = ("src", "tgt_in", "src_segments", "tgt_segments", "src_positions", "tgt_positions")


def loss_terms(model, batch: dict, label_smoothing: float) -> tuple[jax.Array, dict]:
    logits = model(*(batch[k] for k in MODEL_INPUTS))
    weights = (batch["tgt_segments"] > 0).astype(jnp.float32)
    loss_sum, nll_sum = cross_entropy(logits, batch["tgt_out"], weights, label_smoothing)
    tokens = weights.sum()
    input_tokens = (batch["src_segments"] > 0).sum().astype(jnp.float32) + tokens
    return loss_sum, {"nll_sum": nll_sum, "tokens": tokens, "input_tokens": input_tokens}


def padded_batches(
    pairs: EncodedPairs, batch_size: int, max_length: int | None = None
) -> list[dict[str, np.ndarray]]:
    """Every pair exactly once, in fixed-size batches of similar length (no length filter).

    `max_length` (learned positions: the table's rows) bounds the padded length; a longer side
    is cut to it: a source to its first max_length - 1 tokens and EOS (as translation cuts its
    inputs), a target to the first max_length tokens, the ones scored."""
    batches, lengths = [], np.maximum(pairs.src.lengths, pairs.tgt.lengths)
    for idx in sorted_batches(lengths, batch_size):
        length = bucket_length(int(lengths[idx].max()))
        if max_length:
            length = min(length, max_length)
        tgt_out = pad_rows([pairs.tgt[i][:length] for i in idx], length, batch_size)
        tgt_in = np.concatenate([np.full((batch_size, 1), BOS_ID, np.int32), tgt_out[:, :-1]], 1)
        segments = (tgt_out > 0).astype(np.int32)
        positions = np.broadcast_to(np.arange(length, dtype=np.int32), tgt_out.shape)
        src = pad_rows([_cut_source(pairs.src[i], length) for i in idx], length, batch_size)
        batches.append(
            {
                "src": src,
                "src_segments": (src > 0).astype(np.int32),
                "src_positions": positions,
                "tgt_in": tgt_in,
                "tgt_out": tgt_out,
                "tgt_segments": segments,
                "tgt_positions": positions,
            }
        )
    return batches


def _cut_source(ids: np.ndarray, length: int) -> np.ndarray:
    if len(ids) <= length:
        return ids
    return np.concatenate([ids[: length - 1], [EOS_ID]]).astype(np.int32)


def model_cfg_for(
    config: ml_collections.ConfigDict, src_vocab_size: int, tgt_vocab_size: int
) -> model_config.TransformerConfig:
    """The model's dataclass, with what the data decides: vocabulary sizes and the most
    segments a packed row holds (data.max_pairs_per_row)."""
    return model_config.from_config(
        config.model,
        src_vocab_size=src_vocab_size,
        tgt_vocab_size=tgt_vocab_size,
        max_segments=config.data.max_pairs_per_row,
    )


class TranslationTask:
    carry_batch_axes: dict = {}  # no carry

    def __init__(
        self, config: ml_collections.ConfigDict, workdir: str, *, train_if_missing: bool = True
    ):
        self.config, self.workdir = config, workdir
        with distributed.main_process_first("prepare data and vocabulary"):
            self.src_tok, self.tgt_tok = load_tokenizers(
                config, workdir, train_if_missing=train_if_missing
            )
        model_cfg = model_cfg_for(config, self.src_tok.vocab_size, self.tgt_tok.vocab_size)
        self.exp = experiment_lib.setup(config, workdir, EncoderDecoder, model_cfg)
        self._evaluator = None

    def translator(self) -> Translator:
        e = self.config.eval
        return Translator(
            self.exp.eval_graphdef,
            self.exp.model_cfg,
            self.src_tok,
            self.tgt_tok,
            beam_size=e.beam_size,
            length_penalty=e.length_penalty,
            max_decode_extra=e.max_decode_extra,
            batch_size=e.batch_size,
            batch_sharding=self.exp.batch_sharding,
            max_input_tokens=e.max_input_tokens,
            max_tokens_per_batch=e.max_tokens_per_batch,
        )

    def train_batches(self):
        c = self.config
        pairs = encoded_split(c, c.data.train_split, self.src_tok, self.tgt_tok, self.workdir)
        block, blocks = sharding.process_row_block(self.exp.mesh)
        num_shards = c.data.input_shards or blocks
        per_block = num_shards // blocks
        shards = range(block * per_block, (block + 1) * per_block)
        dataset = packed_train_dataset(
            pairs,
            batch_size=c.train.batch_size,
            max_length=c.data.max_train_length,
            seed=c.train.seed,
            num_packing_bins=c.data.num_packing_bins,
            max_pairs_per_row=c.data.max_pairs_per_row,
            num_shards=num_shards,
            shards=shards,
        )
        return ShardBatches(dataset, num_shards, shards)

    def init_carry(self) -> dict:
        return {}

    def loss_terms(self, model, batch: dict, carry: dict) -> tuple[jax.Array, dict, dict]:
        loss_sum, sums = loss_terms(model, batch, self.config.train.label_smoothing)
        return loss_sum, sums, carry

    def prepare_evaluation(self) -> None:
        """Read and encode the validation split (data.eval_split) now, not at the first
        evaluation."""
        if self._evaluator is None:
            self._evaluator = Evaluator(self, self.config.data.eval_split)

    def evaluate(self, params, rng_state) -> tuple[dict, str]:
        self.prepare_evaluation()
        val = self._evaluator.loss(params, rng_state)
        bleu, hyps = self._evaluator.bleu(params, rng_state, self.config.eval.bleu_sentences)
        val.update(bleu=bleu["sacrebleu"], lc_tok_bleu=bleu["lc_tok_bleu"])
        summary = (
            f"nll {val['nll']:.3f} | ppl {val['perplexity']:.2f} | BLEU {val['bleu']:.2f} | "
            f"lc-tok BLEU {val['lc_tok_bleu']:.2f}"
        )
        return {**val, "samples": "\n\n".join(hyps[:5])}, summary


def _eval_step(graphdef, params, rng_state, batch: dict) -> dict:
    model = nnx.merge(graphdef, params, rng_state)
    _, sums = loss_terms(model, batch, 0.0)
    return sums


class Evaluator:
    """Validation NLL/perplexity over every pair of a split, and BLEU of its translations."""

    def __init__(self, task: TranslationTask, split: str):
        c, self.exp = task.config, task.exp
        self.src_lines, self.ref_lines = split_text(c, split)
        pairs = EncodedPairs.from_text(self.src_lines, self.ref_lines, task.src_tok, task.tgt_tok)
        limit = position_limit(self.exp.model_cfg)
        self.batches = padded_batches(pairs, c.eval.batch_size, limit)
        longest = np.maximum(pairs.src.lengths, pairs.tgt.lengths)
        if limit and (cut := int((longest > limit).sum())):
            logging.warning(
                "%d of %d %s pairs have a side longer than the learned position table "
                "(model.max_len=%d; the longest has %d tokens): the validation loss sees their "
                "sources cut to %d tokens and EOS and scores their first %d target tokens",
                cut,
                len(pairs),
                split,
                limit,
                int(longest.max()),
                limit - 1,
                limit,
            )
        step = functools.partial(_eval_step, self.exp.eval_graphdef)
        self._eval_step = jax.jit(sharding.traced_on(self.exp.mesh, step))
        self.translator = task.translator()
        self.target_lang = c.data.target_lang

    def loss(self, params, rng_state) -> dict:
        totals, window = None, DispatchWindow()
        for batch in self.batches:
            out = self._eval_step(params, rng_state, jax.device_put(batch, self.exp.batch_sharding))
            totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
            window.push(totals)
        nll = float(totals["nll_sum"] / totals["tokens"])
        return {"nll": nll, "perplexity": float(np.exp(nll))}

    def bleu(self, params, rng_state, num_sentences: int = 0) -> tuple[dict, list[str]]:
        n = num_sentences or len(self.src_lines)
        hyps = self.translator.translate(params, rng_state, self.src_lines[:n]).lines
        report = bleu_report(hyps, self.ref_lines[:n], self.target_lang)
        return report.as_dict(), hyps
