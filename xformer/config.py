"""The config schema: every key a config may set, its default, and validation before compute.

Config files in configs/ start from `base_config()` and override values; `validate` rejects keys
that are not in the schema and options that cannot work together, naming the key.
"""

from collections.abc import Mapping
from typing import Any

import ml_collections

from xformer.positional import SCHEMES

ALLOWED = {
    "model.family": ("encoder_decoder", "decoder_only"),
    "model.positional": tuple(SCHEMES),
    "model.layer_norm": ("post", "pre"),
    "data.vocab": ("joint", "separate"),
    "train.schedule": ("rsqrt", "cosine", "constant"),
}


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.family = "encoder_decoder"  # translation; "decoder_only": language modelling
    c.model.d_model = 512
    c.model.num_heads = 8
    c.model.num_encoder_layers = 6
    c.model.num_decoder_layers = 6  # also the depth of decoder-only language models
    c.model.d_ff = 2048
    c.model.dropout = 0.1  # embeddings and residual branches
    c.model.attention_dropout = 0.0
    c.model.relu_dropout = 0.0
    # none | sinusoidal | learned | relative (Transformer-XL) | rope | t5_bias | alibi
    c.model.positional = "sinusoidal"  # in every self-attention stack
    c.model.max_len = 256  # learned position table size
    c.model.rope_base = 10000.0
    c.model.relative_buckets = 32  # t5_bias: buckets per direction pair, log-spaced beyond
    c.model.relative_max_distance = 128  # half of them, up to this distance
    c.model.encoder_mask = "bidirectional"  # or sliding_window
    c.model.decoder_mask = "causal"  # or sliding_window; decoder-only: prefix_lm, same_length
    c.model.attention_window = 0  # sliding_window: keys fewer than this many positions away
    c.model.prefix_length = 0  # prefix_lm: the first positions of a segment see each other
    c.model.layer_norm = "post"  # "post": the paper; "pre": LayerNorm inside the residual
    c.model.share_embeddings = True  # source/target share one table (needs data.vocab="joint")
    c.model.tie_output = True  # output projection = target embedding transposed
    # Transformer-XL: recurrence (decoder_only, any scheme that is not absolute)
    c.model.mem_len = 0  # cached states per layer during training (0 = no recurrence)
    c.model.clamp_len = 0  # relative: distances beyond this share one encoding (0 = off)
    c.model.untie_relative_biases = False  # relative: u, v per layer (TF) or shared (PyTorch)
    # Adaptive input and softmax (decoder_only): vocab ids are sorted by frequency
    c.model.d_embed = 0  # embedding size of the head cluster (0 = d_model)
    c.model.adaptive_cutoffs = ()  # e.g. (20000, 40000, 200000); () = plain softmax
    c.model.div_val = 1  # cluster i embeds in d_embed // div_val**i dims
    c.model.tie_projs = ()  # per cluster, share the softmax and embedding projections

    c.data = ml_collections.ConfigDict()
    c.data.dataset = "multi30k"  # xformer builder name, or a TFDS catalog name
    c.data.source_lang = "en"
    c.data.target_lang = "de"
    c.data.train_split = "train"
    c.data.eval_split = "val"
    c.data.test_split = "test_2016_flickr"
    c.data.data_dir = (
        ""  # where TFDS writes prepared array_record files ("" = ~/tensorflow_datasets)
    )
    c.data.manual_dir = ""  # local copy of the raw files ("" = $XFORMER_DATA_DIR, ../shared/data)
    c.data.vocab = "joint"  # one SentencePiece model for both languages, or one per language
    c.data.vocab_size = 8000  # language modelling: keep the most frequent (0 = all types)
    c.data.vocab_dir = ""  # where SentencePiece models are cached ("" = <workdir>/vocab)
    c.data.max_corpus_chars = 10_000_000  # SentencePiece training text budget per model
    c.data.max_train_length = 64  # packed row length; longer training pairs are dropped
    c.data.segment_length = 128  # language modelling: tokens per row per training step
    c.data.num_packing_bins = 0  # first-fit bins per packing round (0 = 4 * train.batch_size)

    c.train = ml_collections.ConfigDict()
    c.train.seed = 0
    c.train.batch_size = 64  # packed rows per step (global, divided over devices)
    c.train.num_steps = 100_000
    c.train.max_train_seconds = 0.0  # stop (and checkpoint) after this much time (0 = off)
    c.train.learning_rate = 7e-4  # peak rate; the paper's d_model**-0.5 * warmup**-0.5
    c.train.schedule = "rsqrt"  # rsqrt: linear warm-up then 1/sqrt(step), as in the paper
    c.train.warmup_steps = 4000
    c.train.b1 = 0.9
    c.train.b2 = 0.98
    c.train.eps = 1e-9
    c.train.weight_decay = 0.0
    c.train.grad_clip_norm = 0.0  # 0 = off
    c.train.label_smoothing = 0.1
    c.train.log_every = 50
    c.train.eval_every = 1000  # validation loss and BLEU
    c.train.checkpoint_every = 1000
    c.train.keep_checkpoints = 2

    c.eval = ml_collections.ConfigDict()
    c.eval.batch_size = 64  # sentences per decoding batch
    c.eval.beam_size = 4
    c.eval.length_penalty = 0.6  # GNMT alpha
    c.eval.max_decode_extra = 50  # decode at most source length + this many tokens
    c.eval.bleu_sentences = 0  # in-training BLEU on the first N eval sentences (0 = all)
    # Language modelling: evaluation lengths independent of training (-1 / 0 = as in training)
    c.eval.segment_length = 0  # tokens scored per row per step (0 = data.segment_length)
    c.eval.mem_len = -1  # the paper evaluates with a much longer memory
    c.eval.clamp_len = -1
    c.eval.decoder_mask = ""  # "" = as trained; e.g. same_length with a longer memory
    c.eval.sliding_stride = 0  # > 0: memoryless sliding windows of segment_length tokens that
    # score their last sliding_stride tokens (1 = one forward pass per token, Al-Rfou et al.)
    return c


def lm_base_config(dataset: str) -> ml_collections.ConfigDict:
    """`base_config()` set up for Transformer-XL language modelling on `dataset`: relative
    positions, train/valid/test splits, the full training vocabulary, and the paper's optimizer
    (Adam, cosine decay, gradient clipping at 0.25, no label smoothing)."""
    c = base_config()
    c.model.family = "decoder_only"
    c.model.positional = "relative"
    c.data.dataset = dataset
    c.data.train_split, c.data.eval_split, c.data.test_split = "train", "valid", "test"
    c.data.vocab_size = 0
    c.train.schedule = "cosine"
    c.train.b2 = 0.999
    c.train.eps = 1e-8
    c.train.grad_clip_norm = 0.25
    c.train.label_smoothing = 0.0
    c.train.eval_every = 1000
    c.train.checkpoint_every = 1000
    c.eval.batch_size = 10
    return c


def override(config: ml_collections.ConfigDict, values: dict) -> ml_collections.ConfigDict:
    """Set dotted keys ({"model.positional": "rope"}), refusing keys the config lacks."""
    for key, value in values.items():
        section, _, name = key.rpartition(".")
        node = config
        for part in section.split(".") if section else []:
            node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
        if not isinstance(node, ml_collections.ConfigDict) or name not in node:
            raise ValueError(f"unknown config key {key!r}")
        node[name] = value
    return config


def with_variant(
    config: ml_collections.ConfigDict, variant: str, variants: dict[str, dict]
) -> ml_collections.ConfigDict:
    """Apply the named variants of a config file, joined by "," ("" = the base config):
    `--config=configs/ptb_xl.py:vanilla` calls get_config("vanilla")."""
    for name in filter(None, variant.split(",")):
        if name not in variants:
            raise ValueError(f"unknown config variant {name!r}; known: {sorted(variants)}")
        override(config, variants[name])
    return config


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model": {"d_model": 512}} or a ConfigDict -> {"model.d_model": 512} (dotted keys)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping | ml_collections.ConfigDict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def validate(config: ml_collections.ConfigDict) -> None:
    """Raise ValueError naming the offending key before any data is read or compiled."""
    schema, given = flatten(base_config()), flatten(config)
    for key in given:
        if key not in schema:
            section = key.rsplit(".", 1)[0]
            known = sorted(k for k in schema if k.startswith(section + "."))
            raise ValueError(f"unknown config key {key!r}; known keys in {section!r}: {known}")
    for key, default in schema.items():
        if key not in given:
            raise ValueError(f"config is missing key {key!r} (start configs from base_config())")
        value = given[key]
        if (
            isinstance(default, bool) != isinstance(value, bool)
            or (isinstance(default, int | float) and not isinstance(value, int | float))
            or (isinstance(default, str) and not isinstance(value, str))
            or (isinstance(default, tuple) and not isinstance(value, tuple | list))
        ):
            raise ValueError(f"config key {key!r} must be {type(default).__name__}, got {value!r}")
    for key, allowed in ALLOWED.items():
        if given[key] not in allowed:
            raise ValueError(f"config key {key!r} is {given[key]!r}; allowed values: {allowed}")

    m, d, t = config.model, config.data, config.train
    if m.d_model % m.num_heads:
        raise ValueError(
            f"model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads}"
        )
    _validate_positions_and_masks(m)
    if m.family == "decoder_only":
        _validate_language_model(config)
    if m.share_embeddings and d.vocab != "joint" and m.family == "encoder_decoder":
        raise ValueError("model.share_embeddings=True needs data.vocab='joint'")
    if m.positional == "learned" and d.max_train_length > m.max_len:
        raise ValueError(
            f"data.max_train_length={d.max_train_length} exceeds the learned position table "
            f"model.max_len={m.max_len}"
        )
    for key in ("d_model", "num_heads", "d_ff", "max_len"):
        if m[key] <= 0:
            raise ValueError(f"model.{key} must be positive, got {m[key]}")
    for key in ("dropout", "attention_dropout", "relu_dropout"):
        if not 0.0 <= m[key] < 1.0:
            raise ValueError(f"model.{key} must be in [0, 1), got {m[key]}")
    if d.source_lang == d.target_lang and m.family == "encoder_decoder":
        raise ValueError("data.source_lang and data.target_lang must differ")
    for key in ("batch_size", "num_steps", "log_every", "eval_every", "checkpoint_every"):
        if t[key] <= 0:
            raise ValueError(f"train.{key} must be positive, got {t[key]}")
    if not 0.0 <= t.label_smoothing < 1.0:
        raise ValueError(f"train.label_smoothing must be in [0, 1), got {t.label_smoothing}")
    if config.eval.beam_size < 1:
        raise ValueError(f"eval.beam_size must be >= 1, got {config.eval.beam_size}")


MASKS_BY_STACK = {  # which masking schemes each stack may use
    ("encoder_decoder", "encoder_mask"): ("bidirectional", "sliding_window"),
    ("encoder_decoder", "decoder_mask"): ("causal", "sliding_window"),
    ("decoder_only", "decoder_mask"): ("causal", "sliding_window", "prefix_lm", "same_length"),
}


def _validate_positions_and_masks(m: ml_collections.ConfigDict) -> None:
    for (family, key), allowed in MASKS_BY_STACK.items():
        if m.family == family and m[key] not in allowed:
            raise ValueError(
                f"model.{key}={m[key]!r} cannot be used by a {family} model; allowed values: "
                f"{allowed}"
            )
    if m.family == "decoder_only" and m.encoder_mask != "bidirectional":
        raise ValueError("model.encoder_mask is for encoder_decoder models (decoder_only has none)")
    masks = (m.encoder_mask, m.decoder_mask) if m.family == "encoder_decoder" else (m.decoder_mask,)
    windowed = "sliding_window" in masks
    if windowed != (m.attention_window > 0):
        raise ValueError(
            f"model.attention_window={m.attention_window} must be > 0 exactly when a mask is "
            f"'sliding_window' (masks: {masks})"
        )
    if (m.decoder_mask == "prefix_lm") != (m.prefix_length > 0) or m.prefix_length < 0:
        raise ValueError(
            f"model.prefix_length={m.prefix_length} must be > 0 exactly when "
            f"model.decoder_mask='prefix_lm' (it is {m.decoder_mask!r})"
        )
    head_dim = m.d_model // m.num_heads
    if m.positional == "rope" and (head_dim % 2 or m.rope_base <= 1):
        raise ValueError(
            f"model.positional='rope' needs an even head size (d_model / num_heads = {head_dim})"
            f" and model.rope_base > 1 (got {m.rope_base})"
        )
    if m.positional in ("sinusoidal", "relative") and m.d_model % 2:
        raise ValueError(
            f"model.positional={m.positional!r} needs an even d_model, got {m.d_model}"
        )
    if m.positional == "t5_bias" and (
        m.relative_buckets < 4 or m.relative_max_distance <= m.relative_buckets // 2
    ):
        raise ValueError(
            "model.positional='t5_bias' needs model.relative_buckets >= 4 and "
            "model.relative_max_distance > relative_buckets / 2; got "
            f"{m.relative_buckets}, {m.relative_max_distance}"
        )
    if m.positional != "relative" and (m.clamp_len or m.untie_relative_biases):
        raise ValueError(
            "model.clamp_len and model.untie_relative_biases are for model.positional="
            f"'relative' (Transformer-XL), not {m.positional!r}"
        )


def _validate_language_model(config: ml_collections.ConfigDict) -> None:
    m, d, e = config.model, config.data, config.eval
    for key in ("mem_len", "clamp_len", "d_embed"):
        if m[key] < 0:
            raise ValueError(f"model.{key} must be >= 0, got {m[key]}")
    eval_mem_len = m.mem_len if e.mem_len < 0 else e.mem_len
    absolute = SCHEMES[m.positional].absolute
    if absolute and (m.mem_len or eval_mem_len):
        raise ValueError(
            f"a memory (model.mem_len={m.mem_len}, eval.mem_len={e.mem_len}) cannot be used "
            f"with model.positional={m.positional!r}: it adds absolute positions to the "
            "embeddings, which repeat across segments; use a relative scheme "
            "(relative, rope, t5_bias, alibi) or none"
        )
    if m.positional == "learned" and max(d.segment_length, e.segment_length) > m.max_len:
        raise ValueError("segment lengths exceed the learned position table model.max_len")
    if e.sliding_stride and eval_mem_len:
        raise ValueError("eval.sliding_stride needs a memoryless evaluation (eval.mem_len=0)")
    eval_mask = e.decoder_mask or m.decoder_mask
    if eval_mask not in MASKS_BY_STACK[("decoder_only", "decoder_mask")]:
        raise ValueError(f"eval.decoder_mask={e.decoder_mask!r} is not a decoder-only mask")
    if (eval_mask == "prefix_lm") != (m.decoder_mask == "prefix_lm"):
        raise ValueError("eval.decoder_mask can switch prefix_lm neither on nor off")
    if m.decoder_mask == "same_length" and not m.mem_len:
        raise ValueError("model.decoder_mask='same_length' needs model.mem_len > 0")
    if eval_mask == "same_length" and not eval_mem_len:
        raise ValueError("decoder_mask 'same_length' needs an evaluation memory (eval.mem_len)")
    if m.decoder_mask == "prefix_lm":
        if m.mem_len or eval_mem_len:
            raise ValueError("model.decoder_mask='prefix_lm' cannot be used with a memory")
        eval_length = e.segment_length or d.segment_length
        if m.prefix_length >= min(d.segment_length, eval_length):
            raise ValueError("model.prefix_length must be shorter than the segment lengths")
        if e.sliding_stride > eval_length - m.prefix_length + 1:
            raise ValueError(
                f"eval.sliding_stride={e.sliding_stride}: prefix_lm windows can score at most "
                f"segment length - prefix_length + 1 = {eval_length - m.prefix_length + 1} "
                "tokens (the others are visible inside the prefix)"
            )
    cutoffs = list(m.adaptive_cutoffs)
    if cutoffs != sorted(set(cutoffs)) or any(c <= 0 for c in cutoffs):
        raise ValueError(f"model.adaptive_cutoffs must be increasing and positive, got {cutoffs}")
    if m.div_val < 1:
        raise ValueError(f"model.div_val must be >= 1, got {m.div_val}")
    if m.tie_projs and len(m.tie_projs) != len(cutoffs) + 1:
        raise ValueError(
            f"model.tie_projs needs one entry per cluster ({len(cutoffs) + 1}), got {m.tie_projs}"
        )
    if d.segment_length <= 0 or e.segment_length < 0:
        raise ValueError("data.segment_length must be > 0 and eval.segment_length >= 0")
    if e.sliding_stride < 0 or e.sliding_stride > (e.segment_length or d.segment_length):
        raise ValueError("eval.sliding_stride must be in [0, eval segment length]")
