"""Language modelling with Transformer-XL or the vanilla decoder-only baseline.

Training serves the token stream segment by segment (data/lm_stream.py) and carries the XL
memory from step to step inside the train state, sharded with the batch. Evaluation scores
every token of a split (or of a user's text file, `encode_text_file`) once, with its own
segment length, memory length and clamp_len.
"""

import collections
import dataclasses
import functools
import hashlib
import math
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding

from xformer import config as config_lib
from xformer import distributed, model_config, sharding
from xformer import experiment as experiment_lib
from xformer.data.encoded_cache import cached_arrays, file_digest, record_files
from xformer.data.errors import DataFileNotFoundError, DataValueError
from xformer.data.lm_stream import TrainStream, eval_segments, sliding_windows
from xformer.data.readers import corpus_source, corpus_text
from xformer.data.registry import LM_CORPORA
from xformer.data.text import BOM, decode_utf8, read_bytes, read_input_lines
from xformer.data.vocab import ByteVocab, CharVocab, Vocab, WordVocab, build_vocab
from xformer.dispatch import DispatchWindow
from xformer.language_model import MEMORY_BATCH_AXES, LanguageModel, empty_memory, reset_memory
from xformer.masks import MASK_SCHEMES


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How a split is scored: rows, tokens per step, memory, mask and position settings.
    sliding_stride > 0: memoryless windows of segment_length tokens that score their last
    sliding_stride tokens (a masking scheme may require this, e.g. prefix_lm)."""

    batch_size: int
    segment_length: int
    mem_len: int
    clamp_len: int
    decoder_mask: str = "causal"
    sliding_stride: int = 0

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> "EvalSettings":
        m, e = config.model, config.eval
        length = e.segment_length or config.data.segment_length
        mask = e.decoder_mask or m.decoder_mask
        required = MASK_SCHEMES[mask].eval_stride(m, length)
        return cls(
            batch_size=e.batch_size,
            segment_length=length,
            mem_len=m.mem_len if e.mem_len < 0 else e.mem_len,
            clamp_len=m.clamp_len if e.clamp_len < 0 else e.clamp_len,
            decoder_mask=mask,
            sliding_stride=e.sliding_stride or required,
        )


@dataclasses.dataclass(frozen=True)
class EncodedText:
    """A text file as a language model scores it: every token of `stream` once."""

    stream: np.ndarray  # int32 token ids
    oov_tokens: int  # tokens outside the vocabulary, scored as <unk>


def _memory_sharding(mesh) -> dict:
    return {
        name: NamedSharding(mesh, sharding.batch_spec(mesh, axis))
        for name, axis in MEMORY_BATCH_AXES.items()
    }


def loss_terms(model, batch: dict, carry: dict) -> tuple[jax.Array, dict, dict]:
    """(summed NLL, sums, new memory) of a batch ("inputs", "targets", "weights" [B, L], "reset"
    [B]) whose rows continue from the memory `carry` ({} = none)."""
    memory = reset_memory(carry or None, batch["reset"])
    nll, memory = model(batch["inputs"], batch["targets"], memory)
    # Leave out the leading targets the masking scheme lets the queries see (prefix_lm).
    unscored = MASK_SCHEMES[model.cfg.decoder_mask].unscored_targets(model.cfg)
    positions = np.arange(batch["weights"].shape[1])
    weights = jnp.where(positions < unscored, 0, batch["weights"])
    nll_sum, tokens = (nll * weights).sum(), weights.sum()
    sums = {"nll_sum": nll_sum, "tokens": tokens, "input_tokens": batch["weights"].sum()}
    return nll_sum, sums, memory or {}


class LanguageModelingTask:
    carry_batch_axes = MEMORY_BATCH_AXES  # the carry is the XL memory

    def __init__(
        self, config: ml_collections.ConfigDict, workdir: str, *, train_if_missing: bool = True
    ):
        self.config = config
        d = config.data
        self.corpus = LM_CORPORA[d.dataset]
        self._streams: dict[str, np.ndarray] = {}
        self._vocab_dir = d.vocab_dir or os.path.join(workdir, "vocab")
        self._vocab_path = ""  # none for bytes
        self._eval_steps: dict[tuple, Callable] = {}  # compiled once per model variant
        with distributed.main_process_first("prepare data and vocabulary"):
            self.vocab = self._load_vocab(workdir, train_if_missing)
        cutoffs = config.model.adaptive_cutoffs
        if cutoffs and cutoffs[-1] >= len(self.vocab):
            raise config_lib.ConfigError(
                f"model.adaptive_cutoffs={tuple(cutoffs)} must be below the vocabulary size "
                f"{len(self.vocab)} of {d.dataset}"
            )
        model_cfg = model_config.from_config(config.model, vocab_size=len(self.vocab))
        self.exp = experiment_lib.setup(config, workdir, LanguageModel, model_cfg)
        self.mem_len = config.model.mem_len
        self.boundary_id = _boundary_id(self.vocab)

    def _load_vocab(self, workdir: str, train_if_missing: bool):
        d = self.config.data
        if self.corpus.tokenization == "byte":
            return ByteVocab()
        name = f"{d.dataset}-{d.vocab_size}" if d.vocab_size else d.dataset
        if d.vocab_dir and d.train_split != "train":  # a shared directory: one per slice
            name += "-" + hashlib.sha256(d.train_split.encode()).hexdigest()[:12]
        path = self._vocab_path = os.path.join(self._vocab_dir, f"{name}.vocab")
        if os.path.exists(path):
            return (WordVocab if self.corpus.tokenization == "whitespace" else CharVocab).load(path)
        if not train_if_missing:
            raise DataFileNotFoundError(
                f"{path} not found: train.py writes it when a run starts, and a workdir with "
                "checkpoints needs the one it was trained with (put it back, or use a new workdir)"
            )
        train_text = corpus_text(d.dataset, self._source(d.train_split))
        vocab = build_vocab(self.corpus, train_text, max_size=d.vocab_size)
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            vocab.save(path)
        return vocab

    def _source(self, split: str):
        d = self.config.data
        return corpus_source(
            d.dataset, split, data_dir=d.data_dir or None, manual_dir=d.manual_dir or None
        )

    def stream(self, split: str) -> np.ndarray:
        """The split as one int32 token stream (whitespace corpora: <eos> after every line),
        encoded once into <vocab dir>/encoded and memory-mapped (data/encoded_cache.py)."""
        if split not in self._streams:
            d, source = self.config.data, self._source(split)
            vocab_id = file_digest(self._vocab_path) if self._vocab_path else repr(self.vocab)
            fingerprint = {"files": record_files(source), "vocab": vocab_id}

            def encode() -> dict[str, np.ndarray]:  # (WordVocab.encode is encode_lines)
                try:
                    return {"ids": self.vocab.encode(corpus_text(d.dataset, source))}
                except DataValueError as e:
                    raise DataValueError(f"{d.dataset} split {split!r}: {e}") from None

            cache_dir = os.path.join(self._vocab_dir, "encoded")
            name = f"{d.dataset}-{split}"
            self._streams[split] = cached_arrays(cache_dir, name, fingerprint, encode)["ids"]
        return self._streams[split]

    # Training ---------------------------------------------------------------------------------

    def train_batches(self) -> TrainStream:
        c = self.config
        block, blocks = sharding.process_row_block(self.exp.mesh)
        local = c.train.batch_size // blocks
        rows = slice(block * local, (block + 1) * local)
        stream = self.stream(c.data.train_split)
        return TrainStream(stream, c.train.batch_size, c.data.segment_length, rows)

    def init_carry(self) -> dict:
        if not self.mem_len:
            return {}
        init = functools.partial(
            empty_memory, self.exp.model_cfg, self.config.train.batch_size, self.mem_len
        )
        return jax.jit(init, out_shardings=_memory_sharding(self.exp.mesh))()

    def loss_terms(self, model, batch: dict, carry: dict) -> tuple[jax.Array, dict, dict]:
        return loss_terms(model, batch, carry)

    # Evaluation -------------------------------------------------------------------------------

    def prepare_evaluation(self) -> None:
        """Read and encode the validation split (data.eval_split) now, not at the first
        evaluation: a split the vocabulary cannot encode fails before training."""
        self.stream(self.config.data.eval_split)

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
        """NLL of every token of `split` exactly once, its perplexity and, for character (and
        byte) corpora, bits per character."""
        return self.score_stream(params, rng_state, self.stream(split), settings, log_every_s)

    def score_stream(
        self,
        params,
        rng_state,
        stream: np.ndarray,
        settings: EvalSettings | None = None,
        log_every_s: float = 0.0,
    ) -> dict:
        """NLL of every token of `stream` (int32 ids) exactly once; see `score`."""
        if not len(stream):
            raise DataValueError("there are no tokens to score")
        s = settings or EvalSettings.from_config(self.config)
        model_cfg = dataclasses.replace(
            self.exp.model_cfg, clamp_len=s.clamp_len, decoder_mask=s.decoder_mask
        )
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
            init = functools.partial(empty_memory, model_cfg, s.batch_size, s.mem_len)
            memory = jax.jit(init, out_shardings=_memory_sharding(mesh))()
        key = (model_cfg, s.sliding_stride)
        if key not in self._eval_steps:
            graphdef = self.exp.graphdef_for(model_cfg)
            step_fn = functools.partial(eval_step, graphdef, score_last=s.sliding_stride or None)
            self._eval_steps[key] = jax.jit(sharding.traced_on(mesh, step_fn))
        step = self._eval_steps[key]
        sums = []  # per-batch (nll, tokens) on device; summed in float64 at the end
        window = DispatchWindow()
        start = last_log = time.time()
        for i, batch in enumerate(batches):
            batch = jax.device_put(batch, self.exp.batch_sharding)
            *batch_sums, memory = step(params, rng_state, memory, batch)
            sums.append(batch_sums)
            window.push(batch_sums)
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
        bits = {"bpc": nll / math.log(2)} if self.corpus.metric == "bpc" else {}  # per symbol
        return {
            "nll": nll,
            "perplexity": float(np.exp(nll)),  # inf, not OverflowError, past 709 nats
            **bits,
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
        }


def encode_text_file(vocab: Vocab, path: str) -> EncodedText:
    """A user's text file in the corpus's own format (plain or gzip), as one token stream:
    word corpora read its lines (the line contract of data/text.py, strict UTF-8) with
    <eos> after each and map words outside the vocabulary to <unk>, counted; byte corpora
    read its bytes; character corpora its UTF-8 characters. Raises ValueError naming the
    file (line and column) when the text is not valid UTF-8, or when it holds symbols
    outside a vocabulary that has no <unk> (e.g. a character model's alphabet)."""
    if isinstance(vocab, ByteVocab):
        return EncodedText(vocab.encode(read_bytes(path)), 0)
    if isinstance(vocab, WordVocab):
        lines = read_input_lines(path)
        unknown = vocab.unknown_tokens(lines)
        if unknown and vocab.unk_id is None:
            where = functools.partial(_first_token, lines)
            raise DataValueError(_unknown_symbols(path, unknown, vocab, where))
        return EncodedText(vocab.encode_lines(lines), sum(unknown.values()))
    text = decode_utf8(read_bytes(path), path).removeprefix(BOM)
    unknown = vocab.unknown_chars(text)
    if unknown:
        where = functools.partial(_first_char, text)
        raise DataValueError(_unknown_symbols(path, unknown, vocab, where))
    return EncodedText(vocab.encode(text), 0)


def _first_token(lines: list[str], token: str) -> str:
    for line_no, line in enumerate(lines, 1):
        tokens = line.split()
        if token in tokens:
            return f"line {line_no}, token {tokens.index(token) + 1}"
    return "nowhere"


def _first_char(text: str, char: str) -> str:
    i = text.index(char)
    line_no = text.count("\n", 0, i) + 1
    column = i - text.rfind("\n", 0, i)  # 1-based: rfind is -1 on the first line
    return f"line {line_no}, column {column}"


def _unknown_symbols(path: str, unknown: collections.Counter, vocab, where) -> str:
    """The error for symbols outside a vocabulary that has no <unk>: the most frequent ones
    with their counts and first positions (`where(symbol)`)."""
    shown = [f"{s!r} x{n} (first at {where(s)})" for s, n in unknown.most_common(5)]
    more = f", and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    return (
        f"{path}: {sum(unknown.values())} symbols are outside the model's vocabulary of "
        f"{len(vocab)}, which has no <unk> to score them as: {', '.join(shown)}{more}"
    )


def _boundary_id(vocab) -> int:
    """The token the first prediction of a split is conditioned on: a line end."""
    if isinstance(vocab, WordVocab):
        return vocab.eos_id
    if isinstance(vocab, ByteVocab):
        return ord("\n")
    return int(vocab.encode(" ")[0]) if " " in vocab.chars else 0


def eval_step(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rng_state: nnx.State,
    memory: dict | None,
    batch: dict,
    *,
    score_last: int | None = None,
) -> tuple[jax.Array, jax.Array, dict | None]:
    """(summed NLL, scored tokens, updated memory) of one batch ("inputs", "targets", "weights"
    [B, L]; optional "reset" [B], "positions", "key_valid"). score_last: only the last this many
    positions of each row go through the softmax (sliding windows); None scores every position.
    """
    model = nnx.merge(graphdef, params, rng_state)
    extra = {k: batch[k] for k in ("positions", "key_valid") if k in batch}
    memory = reset_memory(memory, batch["reset"]) if "reset" in batch else memory
    hidden, memory = model.hidden(batch["inputs"], memory, **extra)
    targets, weights = batch["targets"], batch["weights"]
    if score_last is not None:
        hidden, targets, weights = (x[:, -score_last:] for x in (hidden, targets, weights))
    nll = model.softmax.nll(hidden, targets)
    return (nll * weights).sum(), weights.sum(), memory
