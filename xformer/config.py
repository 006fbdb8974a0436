"""The config schema: every key a config may set, its default, and validation before compute.

Config files in configs/ start from `base_config()` and override values; `validate` rejects keys
that are not in the schema and options that cannot work together, naming the key.
"""

import ml_collections

ALLOWED = {
    "model.family": ("encoder_decoder", "decoder_only"),
    "model.positional": ("sinusoidal", "learned", "relative"),
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
    c.model.positional = "sinusoidal"  # absolute; "relative": Transformer-XL (decoder_only)
    c.model.max_len = 256  # learned position table size
    c.model.layer_norm = "post"  # "post": the paper; "pre": LayerNorm inside the residual
    c.model.share_embeddings = True  # source/target share one table (needs data.vocab="joint")
    c.model.tie_output = True  # output projection = target embedding transposed
    # Transformer-XL (decoder_only with positional="relative")
    c.model.mem_len = 0  # cached states per layer during training (0 = no recurrence)
    c.model.clamp_len = 0  # relative distances beyond this share one encoding (0 = off)
    c.model.same_length = False  # every query attends to exactly mem_len keys
    c.model.untie_relative_biases = False  # u, v per layer (TF scripts) or shared (PyTorch)
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
    c.eval.same_length = False
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


def _flatten(c: ml_collections.ConfigDict, prefix: str = "") -> dict:
    out = {}
    for key, value in c.items():
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def validate(config: ml_collections.ConfigDict) -> None:
    """Raise ValueError naming the offending key before any data is read or compiled."""
    schema, given = _flatten(base_config()), _flatten(config)
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
    if m.family == "decoder_only":
        _validate_language_model(config)
    elif m.positional == "relative":
        raise ValueError("model.positional='relative' needs model.family='decoder_only'")
    if m.d_model % m.num_heads:
        raise ValueError(
            f"model.d_model={m.d_model} must be divisible by model.num_heads={m.num_heads}"
        )
    if m.positional == "sinusoidal" and m.d_model % 2:
        raise ValueError(f"model.positional='sinusoidal' needs an even d_model, got {m.d_model}")
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


def _validate_language_model(config: ml_collections.ConfigDict) -> None:
    m, d, e = config.model, config.data, config.eval
    for key in ("mem_len", "clamp_len", "d_embed"):
        if m[key] < 0:
            raise ValueError(f"model.{key} must be >= 0, got {m[key]}")
    if m.positional != "relative":
        if m.mem_len or e.mem_len > 0:
            raise ValueError(
                f"a memory (model.mem_len={m.mem_len}, eval.mem_len={e.mem_len}) needs "
                f"model.positional='relative'; absolute positions ({m.positional!r}) repeat "
                "across segments"
            )
        if m.positional == "learned" and max(d.segment_length, e.segment_length) > m.max_len:
            raise ValueError("segment lengths exceed the learned position table model.max_len")
    elif e.sliding_stride:
        raise ValueError("eval.sliding_stride is for memoryless (absolute-position) models")
    if m.same_length and not m.mem_len:
        raise ValueError("model.same_length=True needs model.mem_len > 0")
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
