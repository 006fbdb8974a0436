"""Language modelling with Transformer-XL or the vanilla decoder-only baseline.

Training serves the token stream segment by segment (data/lm_stream.py) and carries the XL
memory from step to step inside the train state, sharded with the batch. Evaluation scores
every token of a split once, with its own segment length, memory length and clamp_len.
"""

import dataclasses
import functools
import math
import os
import time
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from xformer import experiment as experiment_lib
from xformer.data.lm_stream import TrainStream, eval_segments, sliding_windows
from xformer.data.readers import read_corpus
from xformer.data.registry import LM_CORPORA
from xformer.data.vocab import ByteVocab, CharVocab, WordVocab, build_vocab
from xformer.language_model import LanguageModel, LMConfig, reset_memory


def lm_config(config: ml_collections.ConfigDict, vocab_size: int) -> LMConfig:
    m = config.model
    return LMConfig(
        vocab_size=vocab_size,
        d_model=m.d_model,
        num_heads=m.num_heads,
        num_layers=m.num_decoder_layers,
        d_ff=m.d_ff,
        dropout=m.dropout,
        attention_dropout=m.attention_dropout,
        relu_dropout=m.relu_dropout,
        positional=m.positional,
        max_len=m.max_len,
        pre_norm=m.layer_norm == "pre",
        mask=m.decoder_mask,
        attention_window=m.attention_window,
        prefix_length=m.prefix_length,
        clamp_len=m.clamp_len,
        untie_relative_biases=m.untie_relative_biases,
        rope_base=m.rope_base,
        relative_buckets=m.relative_buckets,
        relative_max_distance=m.relative_max_distance,
        d_embed=m.d_embed,
        adaptive_cutoffs=tuple(m.adaptive_cutoffs),
        div_val=m.div_val,
        tie_output=m.tie_output,
        tie_projs=tuple(m.tie_projs),
    )


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How a split is scored: rows, tokens per step, memory, mask and position settings.

    prefix_lm models are scored with sliding windows whose prefix is context only."""

    batch_size: int
    segment_length: int
    mem_len: int
    clamp_len: int
    mask: str = "causal"
    sliding_stride: int = 0

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> "EvalSettings":
        m, e = config.model, config.eval
        length = e.segment_length or config.data.segment_length
        stride = e.sliding_stride
        if m.decoder_mask == "prefix_lm" and not stride:
            stride = length - m.prefix_length + 1
        return cls(
            batch_size=e.batch_size,
            segment_length=length,
            mem_len=m.mem_len if e.mem_len < 0 else e.mem_len,
            clamp_len=m.clamp_len if e.clamp_len < 0 else e.clamp_len,
            mask=e.decoder_mask or m.decoder_mask,
            sliding_stride=stride,
        )


def _memory_sharding(mesh) -> dict:
    return {
        "states": NamedSharding(mesh, P(None, "data")),
        "filled": NamedSharding(mesh, P("data")),
    }


class LanguageModelingTask:
    def __init__(
        self, config: ml_collections.ConfigDict, workdir: str, *, train_if_missing: bool = True
    ):
        self.config = config
        d = config.data
        if d.dataset not in LM_CORPORA:
            raise ValueError(
                f"data.dataset={d.dataset!r} is not a language-modelling corpus; "
                f"known: {sorted(LM_CORPORA)}"
            )
        self.corpus = LM_CORPORA[d.dataset]
        self._streams: dict[str, np.ndarray] = {}
        self._eval_steps: dict[tuple, Callable] = {}  # compiled once per model variant
        self.vocab = self._load_vocab(workdir, train_if_missing)
        cutoffs = config.model.adaptive_cutoffs
        if cutoffs and cutoffs[-1] >= len(self.vocab):
            raise ValueError(
                f"model.adaptive_cutoffs={tuple(cutoffs)} must be below the vocabulary size "
                f"{len(self.vocab)} of {d.dataset}"
            )
        model_cfg = lm_config(config, len(self.vocab))
        self.exp = experiment_lib.setup(config, workdir, LanguageModel, model_cfg)
        self.mem_len = config.model.mem_len
        self.boundary_id = _boundary_id(self.vocab)

    def _load_vocab(self, workdir: str, train_if_missing: bool):
        d = self.config.data
        if self.corpus.tokenization == "byte":
            return ByteVocab()
        name = f"{d.dataset}-{d.vocab_size}" if d.vocab_size else d.dataset
        path = os.path.join(d.vocab_dir or os.path.join(workdir, "vocab"), f"{name}.vocab")
        if os.path.exists(path):
            return (WordVocab if self.corpus.tokenization == "whitespace" else CharVocab).load(path)
        if not train_if_missing:
            raise FileNotFoundError(f"{path} not found: the vocabulary is written by train.py")
        vocab = build_vocab(self.corpus, self._read(d.train_split), max_size=d.vocab_size)
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            vocab.save(path)
        return vocab

    def _read(self, split: str):
        d = self.config.data
        return read_corpus(
            d.dataset, split, data_dir=d.data_dir or None, manual_dir=d.manual_dir or None
        )

    def stream(self, split: str) -> np.ndarray:
        """The split as one int32 token stream (whitespace corpora: <eos> after every line)."""
        if split not in self._streams:
            data = self._read(split)
            if isinstance(self.vocab, WordVocab):
                self._streams[split] = self.vocab.encode_lines(data)
            else:
                self._streams[split] = self.vocab.encode(data)
        return self._streams[split]

    # Training ---------------------------------------------------------------------------------

    def train_batches(self) -> TrainStream:
        c = self.config
        local = c.train.batch_size // jax.process_count()
        rows = slice(jax.process_index() * local, (jax.process_index() + 1) * local)
        stream = self.stream(c.data.train_split)
        return TrainStream(stream, c.train.batch_size, c.data.segment_length, rows)

    def init_carry(self) -> dict:
        if not self.mem_len:
            return {}
        model = nnx.eval_shape(lambda: self.exp.make_model(experiment_lib.model_rngs(0)))
        init = functools.partial(model.init_memory, self.config.train.batch_size, self.mem_len)
        return jax.jit(init, out_shardings=_memory_sharding(self.exp.mesh))()

    def loss_terms(self, model, batch: dict, carry: dict) -> tuple[jax.Array, dict, dict]:
        memory = reset_memory(carry or None, batch["reset"])
        nll, memory = model(batch["inputs"], batch["targets"], memory)
        weights = batch["weights"]
        if model.cfg.mask == "prefix_lm":  # targets inside the prefix are visible to it
            weights = weights.at[:, : model.cfg.prefix_length - 1].set(0)
        nll_sum, tokens = (nll * weights).sum(), weights.sum()
        sums = {"nll_sum": nll_sum, "tokens": tokens, "input_tokens": batch["weights"].sum()}
        return nll_sum, sums, memory or {}

    # Evaluation -------------------------------------------------------------------------------

    def evaluate(self, params, rng_state) -> tuple[dict, str]:
        result = self.score(params, rng_state, self.config.data.eval_split)
        return result, self.summary(result)

    def summary(self, result: dict) -> str:
        metric = self.corpus.metric
        main = f"bpc {result['bpc']:.4f}" if metric == "bpc" else f"ppl {result['perplexity']:.2f}"
        return f"nll {result['nll']:.4f} | {main} | {result['tokens']} tokens"

    def score(
        self,
        params,
        rng_state,
        split: str,
        settings: EvalSettings | None = None,
        log_every_s: float = 0.0,
    ) -> dict:
        """NLL of every token of `split` exactly once; perplexity and bits per token."""
        s = settings or EvalSettings.from_config(self.config)
        stream = self.stream(split)
        model_cfg = dataclasses.replace(self.exp.model_cfg, clamp_len=s.clamp_len, mask=s.mask)
        if s.sliding_stride:
            batches = sliding_windows(
                stream, s.batch_size, s.segment_length, s.sliding_stride, self.boundary_id
            )
            num_batches = math.ceil(math.ceil(len(stream) / s.sliding_stride) / s.batch_size)
        else:
            batches = eval_segments(stream, s.batch_size, s.segment_length, self.boundary_id)
            num_batches = len(batches)
        mesh = self.exp.mesh
        memory = None
        if s.mem_len and not s.sliding_stride:
            model = nnx.eval_shape(
                lambda: LanguageModel(model_cfg, rngs=experiment_lib.model_rngs(0))
            )
            init = functools.partial(model.init_memory, s.batch_size, s.mem_len)
            memory = jax.jit(init, out_shardings=_memory_sharding(mesh))()
        key = (model_cfg, s.sliding_stride)
        if key not in self._eval_steps:
            graphdef = self.exp.graphdef_for(model_cfg)
            step_fn = functools.partial(_eval_step, graphdef, score_last=s.sliding_stride)
            self._eval_steps[key] = jax.jit(step_fn)
        step = self._eval_steps[key]
        sums = []  # per-batch (nll, tokens) on device; summed in float64 at the end
        start = last_log = time.time()
        for i, batch in enumerate(batches):
            batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
            *batch_sums, memory = step(params, rng_state, memory, batch)
            sums.append(batch_sums)
            if log_every_s and time.time() - last_log > log_every_s:
                last_log = time.time()
                elapsed = last_log - start
                logging.info(
                    "scored %d/%d batches | ETA %.0fs",
                    i + 1,
                    num_batches,
                    elapsed * num_batches / (i + 1) - elapsed,
                )
        nll_sum, tokens = np.sum(np.asarray(jax.device_get(sums), np.float64), axis=0)
        seconds = time.time() - start
        tokens = int(tokens)
        if tokens != len(stream):
            raise AssertionError(f"scored {tokens} tokens of {len(stream)}")
        nll = float(nll_sum) / tokens
        return {
            "nll": nll,
            "perplexity": math.exp(nll),
            "bpc": nll / math.log(2),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
        }


def _boundary_id(vocab) -> int:
    """The token the first prediction of a split is conditioned on: a line end."""
    if isinstance(vocab, WordVocab):
        return vocab.eos_id
    if isinstance(vocab, ByteVocab):
        return ord("\n")
    return int(vocab.encode(" ")[0]) if " " in vocab.chars else 0


def _eval_step(graphdef, params, rng_state, memory, batch: dict, *, score_last: int = 0):
    """Summed NLL and token count of one batch, and the updated memory. With score_last > 0
    (sliding windows) only the last score_last positions of each row go through the softmax."""
    model = nnx.merge(graphdef, params, rng_state)
    extra = {k: batch[k] for k in ("positions", "key_valid") if k in batch}
    memory = reset_memory(memory, batch["reset"]) if "reset" in batch else memory
    hidden, memory = model.hidden(batch["inputs"], memory, **extra)
    targets, weights = batch["targets"], batch["weights"]
    if score_last:
        hidden, targets, weights = (x[:, -score_last:] for x in (hidden, targets, weights))
    nll = model.softmax.nll(hidden, targets)
    return (nll * weights).sum(), weights.sum(), memory
