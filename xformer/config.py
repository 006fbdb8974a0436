"""The config schema: every key a config may set, its default, and validation before compute.

Config files in configs/ start from `base_config()` and override values; `validate` rejects keys
that are not in the schema and options that cannot work together, naming the key. The `model`
keys are the fields of the model dataclasses (model_config.py): their defaults, types, allowed
values and meanings live there; masking and positional schemes check their own requirements
(masks.MaskScheme.check, PositionalScheme.check_config / check_memory).
"""

import numbers
import re
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from xformer import masks, model_config, positional, sharding
from xformer.data.registry import LM_CORPORA, corpus_info
from xformer.positional import SCHEMES

ALLOWED = {  # data and train keys; the model keys' allowed values are in model_config.py
    "data.vocab": ("joint", "separate"),
    "train.schedule": ("rsqrt", "cosine", "constant"),
    "train.nonfinite": ("stop", "skip"),
}


class ConfigError(ValueError):
    """A config that cannot run (with its workdir, devices or data); the message names the keys.
    train.py prints it as one line."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.model = ml_collections.ConfigDict()
    c.model.family = "encoder_decoder"  # translation; "decoder_only": language modelling
    for name, field in model_config.config_keys().items():  # documented in model_config.py
        c.model[name] = field.default

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
    c.data.num_packing_bins = 0  # first-fit bins per packing round (0 = 4 x rows per shard)
    # The most pairs a packed row holds (0 = no limit). It also sizes cuDNN's segment slots
    # under model.attention_impl=fused_packed (without it: one slot per position).
    c.data.max_pairs_per_row = 0
    # Translation: each training batch joins this many independent packed streams (disjoint
    # shares of the pairs, train.batch_size / input_shards rows each); a process reads those of
    # its block of rows (one block per process, unless mesh.tensor spans processes: they share
    # one); 0 = one stream per block. Fix it to get the same batches from any number of
    # processes.
    c.data.input_shards = 0

    c.train = ml_collections.ConfigDict()
    c.train.seed = 0
    c.train.batch_size = 64  # packed rows per step (global, divided over devices)
    # Micro-batches per step: the rows are split into this many parts, run one after another,
    # and their gradients added up before the one update (the same step with less memory)
    c.train.grad_accum_steps = 1
    c.train.num_steps = 100_000
    # Stop (and checkpoint) once the run has spent this much wall time in its training loop,
    # validation passes excluded, summed over every start of a resumed run (0 = off)
    c.train.max_train_seconds = 0.0
    c.train.learning_rate = 7e-4  # peak rate; the paper's d_model**-0.5 * warmup**-0.5
    c.train.schedule = "rsqrt"  # rsqrt: linear warm-up then 1/sqrt(step), as in the paper
    c.train.warmup_steps = 4000
    c.train.b1 = 0.9
    c.train.b2 = 0.98
    c.train.eps = 1e-9
    c.train.weight_decay = 0.0  # AdamW's decoupled decay of weights and embedding tables (not
    # of biases or normalisation scales: xformer/optim.py NO_DECAY), scaled by the rate
    c.train.grad_clip_norm = 0.0  # 0 = off
    # A step whose loss or gradient is not finite never updates the parameters or Adam's state.
    # "stop": exit with an error naming the step, saving no checkpoint after it; "skip": go on
    # (the step counts as done), counting skipped steps in the metrics (train/nonfinite_steps)
    c.train.nonfinite = "stop"
    c.train.label_smoothing = 0.1
    c.train.log_every = 50
    c.train.eval_every = 1000  # validation loss and BLEU
    c.train.checkpoint_every = 1000
    c.train.keep_checkpoints = 2
    # "100:105": a jax.profiler trace of the steps with counter 100..104 (logged as steps 101-105)
    # in <workdir>/profile, for TensorBoard's profile plugin or Perfetto ("" = off)
    c.train.profile_steps = ""
    # Dense bfloat16 peak of one device in TFLOP/s, the denominator of the logged MFU (model
    # FLOPs utilisation, xformer/flops.py); 0 = by device kind (GPUs and TPUs it knows; on others
    # no MFU is logged)
    c.train.peak_tflops = 0.0

    # The device mesh (xformer/sharding.py): batch rows are split over data x fsdp; parameters
    # and Adam's moments are sharded over fsdp; attention heads, the FFN's inner width and
    # vocabularies are split over tensor. One size may be -1: the devices left over.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1

    c.eval = ml_collections.ConfigDict()
    c.eval.batch_size = 64  # sentences per decoding batch
    c.eval.beam_size = 4
    c.eval.length_penalty = 0.6  # GNMT alpha
    c.eval.max_decode_extra = 50  # decode at most source length + this many tokens
    c.eval.bleu_sentences = 0  # in-training BLEU on the first N eval sentences (0 = all)
    # Translation: longer inputs are cut to this many tokens (EOS included; with learned
    # positions at most model.max_len), translated and counted, never dropped
    c.eval.max_input_tokens = 512
    # Translation: a decoding batch holds rows x padded source length <= this many tokens (at
    # most eval.batch_size rows; long inputs come in small batches, down to one row per shard)
    c.eval.max_tokens_per_batch = 8192
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
    `--config=configs/ptb_xl.py:vanilla` calls get_config("vanilla"). Like the override flags,
    a later variant sets a key over an earlier one; each such key is logged."""
    set_by: dict[str, str] = {}  # key -> the variant that set it last
    for name in filter(None, variant.split(",")):
        if name not in variants:
            raise ValueError(f"unknown config variant {name!r}; known: {sorted(variants)}")
        for key, value in variants[name].items():
            earlier = set_by.get(key)
            if earlier and not same_value(value, variants[earlier][key]):
                logging.warning(
                    "config variant %r sets %s=%r over %r from variant %r (the later one wins)",
                    name,
                    key,
                    value,
                    variants[earlier][key],
                    earlier,
                )
            set_by[key] = name
        override(config, variants[name])
    return config


# The least value of an evaluation length given as a flag of eval.py or sample.py: below it
# are the config's "as trained" values (segment_length 0, mem_len and clamp_len -1).
EVAL_FLAG_MINIMUMS = {"segment_length": 1, "mem_len": 0, "clamp_len": 0, "sliding_stride": 0}


def set_eval_flags(config: ml_collections.ConfigDict, values: Mapping[str, Any]) -> None:
    """Set eval.<key> to each flag value given (None: not given), refusing lengths below
    EVAL_FLAG_MINIMUMS (a flag that is left out keeps the training setting)."""
    with config.unlocked():
        for key, value in values.items():
            if value is None:
                continue
            least = EVAL_FLAG_MINIMUMS.get(key)
            if least is not None and value < least:
                raise ValueError(
                    f"--{key} must be >= {least}, got {value} (leave it out to use the "
                    "workdir's setting)"
                )
            config.eval[key] = value


def with_defaults(stored: Mapping[str, Any]) -> tuple[ml_collections.ConfigDict, list[str]]:
    """A workdir's stored config (config.json, perhaps written by an older xformer) with every
    key of base_config() (lm_base_config() for a language model) that it lacks set to its
    default, and the dotted keys so added. Keys are added with defaults that keep the earlier
    behaviour, so an older run resumes, evaluates and compares as the run it was."""
    config = ml_collections.ConfigDict(stored)
    present = flatten(config)
    dataset = present.get("data.dataset")
    lm = present.get("model.family") == "decoder_only" and dataset in LM_CORPORA
    defaults = lm_base_config(dataset) if lm else base_config()  # e.g. data.test_split
    added = [key for key in flatten(defaults) if key not in present]
    for key in added:
        node, parts = config, key.split(".")
        default = defaults
        for part in parts[:-1]:
            default = default[part]
            if part not in node:
                node[part] = ml_collections.ConfigDict()
            node = node[part]
        node[parts[-1]] = default[parts[-1]]
    return config, added


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
        if key.startswith("model."):
            continue  # typed by the model dataclasses (_validate_model)
        if (
            isinstance(default, bool) != isinstance(value, bool)
            or (isinstance(default, float) and not isinstance(value, numbers.Real))
            or (isinstance(default, int) and not isinstance(value, numbers.Integral))
            or (isinstance(default, str) and not isinstance(value, str))
            or (isinstance(default, tuple) and not isinstance(value, tuple | list))
        ):
            raise ValueError(f"config key {key!r} must be {type(default).__name__}, got {value!r}")
    for key, allowed in ALLOWED.items():
        if given[key] not in allowed:
            raise ValueError(f"config key {key!r} is {given[key]!r}; allowed values: {allowed}")

    cfg = _validate_model(config.model)
    m, d, t = config.model, config.data, config.train
    if isinstance(cfg, model_config.LMConfig) != (d.dataset in LM_CORPORA):
        wanted = "a language-modelling corpus" if m.family == "decoder_only" else "translation data"
        raise ValueError(
            f"model.family={m.family!r} needs {wanted}; data.dataset={d.dataset!r} is not "
            f"(language-modelling corpora: {sorted(LM_CORPORA)})"
        )
    if isinstance(cfg, model_config.LMConfig):
        _validate_language_model(config, cfg)
    elif m.share_embeddings and d.vocab != "joint":
        raise ValueError("model.share_embeddings=True needs data.vocab='joint'")
    elif d.vocab_size <= 4:
        raise ValueError(
            f"data.vocab_size must be > 4 (the tokenizer's 4 special pieces), got {d.vocab_size}"
        )
    if (
        m.family == "encoder_decoder"
        and m.positional == "learned"
        and d.max_train_length > m.max_len
    ):
        raise ValueError(
            f"data.max_train_length={d.max_train_length} exceeds the learned position table "
            f"model.max_len={m.max_len}"
        )
    if m.family == "encoder_decoder":
        if d.source_lang == d.target_lang:
            raise ValueError("data.source_lang and data.target_lang must differ")
        from xformer.bleu import sacrebleu_metric  # imported for translation configs only

        try:  # e.g. Japanese needs MeCab: fail now, not after training
            sacrebleu_metric(d.target_lang)
        except ValueError as e:
            raise ValueError(f"data.target_lang={d.target_lang!r}: {e}") from None
    other = _OTHER[m.family]
    for key in FAMILY_KEYS[other]:
        if not same_value(given[key], schema[key]):
            raise ValueError(
                f"{key} is for {other} runs; a {m.family} run does not read it (it is "
                f"{given[key]!r}, leave it at {schema[key]!r})"
            )
    for key in ("max_pairs_per_row", "num_packing_bins", "input_shards"):
        if d[key] < 0:
            raise ValueError(f"data.{key} must be >= 0, got {d[key]}")
    for key in ("max_train_length", "max_corpus_chars"):
        if d[key] <= 0:
            raise ValueError(f"data.{key} must be positive, got {d[key]}")
    for key in (
        "batch_size",
        "num_steps",
        "log_every",
        "eval_every",
        "checkpoint_every",
        "keep_checkpoints",
    ):
        if t[key] <= 0:
            raise ValueError(f"train.{key} must be positive, got {t[key]}")
    k = t.grad_accum_steps
    if not isinstance(k, int) or k < 1 or t.batch_size % k:
        raise ValueError(
            f"train.grad_accum_steps={k!r} must be an integer >= 1 that divides "
            f"train.batch_size={t.batch_size} (a micro-batch has batch_size / grad_accum_steps "
            "rows)"
        )
    sizes = [config.mesh[axis] for axis in sharding.MESH_AXES]
    if any(not isinstance(n, int) or n == 0 or n < -1 for n in sizes) or sizes.count(-1) > 1:
        raise ValueError(
            f"mesh sizes (mesh.data, mesh.fsdp, mesh.tensor) = {tuple(sizes)} must be integers "
            ">= 1, at most one of them -1 (the devices left over)"
        )
    profile = profile_range(t.profile_steps)
    if profile and profile[1] > t.num_steps:
        raise ValueError(
            f"train.profile_steps={t.profile_steps!r} goes beyond train.num_steps={t.num_steps}: "
            "stop is exclusive and at most num_steps (step counters run from 0 to num_steps - 1)"
        )
    if t.learning_rate <= 0:
        raise ValueError(f"train.learning_rate must be positive, got {t.learning_rate}")
    for key in ("warmup_steps", "eps", "weight_decay", "grad_clip_norm", "max_train_seconds"):
        if t[key] < 0:  # (a negative clip norm would flip the gradient)
            raise ValueError(f"train.{key} must be >= 0, got {t[key]}")
    for key in ("b1", "b2", "label_smoothing"):
        if not 0.0 <= t[key] < 1.0:
            raise ValueError(f"train.{key} must be in [0, 1), got {t[key]}")
    if t.peak_tflops < 0:
        raise ValueError(
            f"train.peak_tflops must be >= 0 (0 = by device kind), got {t.peak_tflops}"
        )
    for key, least in EVAL_MINIMUMS.items():
        if config.eval[key] < least:
            raise ValueError(f"eval.{key} must be >= {least}, got {config.eval[key]}")


# The least value of each evaluation setting (max_input_tokens: a token and EOS).
EVAL_MINIMUMS = {
    "batch_size": 1,
    "beam_size": 1,
    "length_penalty": 0.0,
    "max_decode_extra": 0,
    "bleu_sentences": 0,
    "max_input_tokens": 2,
    "max_tokens_per_batch": 1,
}

# The data and eval keys only one family reads; the other's configs leave them at their
# defaults (as the model keys, _validate_model).
FAMILY_KEYS = {
    "encoder_decoder": (
        "data.source_lang",
        "data.target_lang",
        "data.vocab",
        "data.max_corpus_chars",
        "data.max_train_length",
        "data.num_packing_bins",
        "data.max_pairs_per_row",
        "data.input_shards",
        "eval.beam_size",
        "eval.length_penalty",
        "eval.max_decode_extra",
        "eval.bleu_sentences",
        "eval.max_input_tokens",
        "eval.max_tokens_per_batch",
    ),
    "decoder_only": (
        "data.segment_length",
        "eval.segment_length",
        "eval.mem_len",
        "eval.clamp_len",
        "eval.decoder_mask",
        "eval.sliding_stride",
    ),
}
_OTHER = {"encoder_decoder": "decoder_only", "decoder_only": "encoder_decoder"}


# What a resumed run may change without changing what it computes: how long it trains, how
# it logs, checkpoints, evaluates, shards and reads files. Entries ending in "." are sections.
RESUMABLE = (
    "train.num_steps",
    "train.max_train_seconds",
    "train.log_every",
    "train.eval_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.profile_steps",
    "train.peak_tflops",
    "train.nonfinite",
    "eval.",
    "mesh.",
    "model.attention_impl",
    "model.remat",
    "data.data_dir",
    "data.manual_dir",
    "data.vocab_dir",
    "data.eval_split",
    "data.test_split",
)


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple]:
    """{dotted key: (old value, new value)} for every key whose value differs (a missing key
    counts as None; tuples and JSON lists compare equal)."""

    def plain(value):
        return list(map(plain, value)) if isinstance(value, list | tuple) else value

    a, b = flatten(old), flatten(new)
    return {
        key: (a.get(key), b.get(key))
        for key in sorted(set(a) | set(b))
        if plain(a.get(key)) != plain(b.get(key))
    }


def unresumable_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple]:
    """The changes (config_changes) outside RESUMABLE: they change the model, the data or the
    optimisation, so the checkpoint would continue a different run. train.num_steps is one of
    them under the cosine schedule, whose decay it sets."""
    cosine = flatten(new).get("train.schedule") == "cosine"
    return {
        key: change
        for key, change in config_changes(old, new).items()
        if not any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE)
        or (key == "train.num_steps" and cosine)
    }


def format_changes(changes: dict[str, tuple]) -> str:
    return "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in changes.items())


def check_devices(
    config: ml_collections.ConfigDict,
    num_devices: int,
    num_processes: int = 1,
    *,
    training: bool = True,
    evaluating: bool = True,
) -> None:
    """Raise ValueError naming the keys when the mesh (mesh.data, mesh.fsdp, mesh.tensor) does
    not fit `num_devices`, the batches do not divide over its data x fsdp row shards
    (for `evaluating` eval.batch_size; for `training` train.batch_size and each micro-batch of
    it, train.grad_accum_steps), the processes (`num_processes`, their devices in a row as
    make_mesh lays them) cannot each read whole row shards (sharding.row_blocks), or, for
    `training`, the input shards (data.input_shards) do not divide over the row blocks the
    processes read."""
    sizes = sharding.mesh_shape(config.mesh, num_devices)
    data, fsdp, _ = sizes
    shards = data * fsdp
    where = f"the {shards} row shards of the mesh (mesh.data x mesh.fsdp = {data} x {fsdp})"
    t = config.train
    batches = {"train.batch_size": t.batch_size} if training else {}
    if evaluating:
        batches["eval.batch_size"] = config.eval.batch_size
    for key, rows in batches.items():
        if rows % shards:
            raise ValueError(f"{key}={rows} must be divisible by {where}")
    owners = np.arange(num_devices).reshape(sizes) // (num_devices // num_processes)
    _, readers = sharding.row_blocks(owners)
    if not training:
        return
    if (t.batch_size // t.grad_accum_steps) % shards:
        raise ValueError(
            f"a micro-batch of train.batch_size / train.grad_accum_steps = {t.batch_size} / "
            f"{t.grad_accum_steps} = {t.batch_size // t.grad_accum_steps} rows must be divisible "
            f"by {where} (lower train.grad_accum_steps or raise the batch size)"
        )
    shards = config.data.input_shards
    if shards < 0 or (shards and (shards % readers or t.batch_size % shards)):
        raise ValueError(
            f"data.input_shards={shards} must be 0 (one per row block) or a multiple of the "
            f"{readers} blocks of rows the processes read that divides "
            f"train.batch_size={t.batch_size}"
        )


def profile_range(value: str) -> tuple[int, int] | None:
    """train.profile_steps "start:stop" -> (start, stop): the steps that run with the train
    state's step counter in [start, stop), counted from 0 (logged as steps start+1 .. stop);
    "" -> None (off). Raises ValueError naming the key."""
    if value == "":
        return None
    match = re.fullmatch(r"(\d+):(\d+)", value)
    if not match or int(match[1]) >= int(match[2]):
        raise ValueError(
            f"train.profile_steps={value!r} must be 'start:stop' with integers 0 <= start < stop "
            "(e.g. '100:105'), or '' (off)"
        )
    return int(match[1]), int(match[2])


def _validate_model(m: ml_collections.ConfigDict) -> model_config.StackConfig:
    """Types and allowed values from the family's dataclass; the other family's keys must
    keep their defaults; then what the positional and masking schemes require."""
    families = tuple(model_config.FAMILIES)
    if m.family not in families:
        raise ValueError(f"config key 'model.family' is {m.family!r}; allowed values: {families}")
    own = model_config.FAMILIES[m.family].fields()
    for name, field in model_config.config_keys().items():
        if name in own:
            shared = name in model_config.StackConfig.fields()
            model_config.check_value(name, own[name], m[name], "" if shared else m.family)
        elif not same_value(m[name], field.default):
            owners = [f for f, cls in model_config.FAMILIES.items() if name in cls.fields()]
            raise ValueError(
                f"model.{name} is for {' and '.join(owners)} models; a {m.family} model has none "
                f"(it is {m[name]!r}, leave it at {field.default!r})"
            )
    cfg = model_config.from_config(m)
    layers = [key for key in ("num_encoder_layers", "num_decoder_layers") if key in own]
    for key in ("d_model", "num_heads", "d_ff", "max_len", *layers):
        if m[key] <= 0:
            raise ValueError(f"model.{key} must be positive, got {m[key]}")
    if cfg.d_model % cfg.num_heads:
        raise ValueError(
            f"model.d_model={cfg.d_model} must be divisible by model.num_heads={cfg.num_heads}"
        )
    if "float64" in (m.dtype, m.param_dtype) and not jax.config.jax_enable_x64:
        raise ValueError("model.dtype/param_dtype 'float64' needs JAX_ENABLE_X64=1 (environment)")
    for key in ("dropout", "attention_dropout", "relu_dropout"):
        if not 0.0 <= m[key] < 1.0:
            raise ValueError(f"model.{key} must be in [0, 1), got {m[key]}")
    if not m.init_std >= 0:  # (NaN too)
        raise ValueError(f"model.init_std must be >= 0 (0 = LeCun normal), got {m.init_std}")
    positional.check_config(cfg)
    chosen = {k: m[k] for k in ("encoder_mask", "decoder_mask") if k in own}
    sized: dict[str, list[str]] = {}  # model key -> the masking schemes it sizes
    for scheme in masks.MASK_SCHEMES.values():
        if scheme.size_key:
            sized.setdefault(scheme.size_key, []).append(scheme.name)
    for key, names in sized.items():
        if any(n in names for n in chosen.values()) != (m[key] > 0) or m[key] < 0:
            raise ValueError(
                f"model.{key}={m[key]} must be > 0 exactly when a mask is "
                f"{' or '.join(map(repr, names))} (masks: {chosen})"
            )
    return cfg


def same_value(value: Any, wanted: Any) -> bool:
    """Equal config values: tuples and lists (JSON) compare by items, True is not 1."""
    if isinstance(wanted, tuple | list):
        return isinstance(value, tuple | list) and list(value) == list(wanted)
    return value == wanted and isinstance(value, bool) == isinstance(wanted, bool)


def _validate_language_model(config: ml_collections.ConfigDict, cfg) -> None:
    m, d, e = config.model, config.data, config.eval
    if config.train.label_smoothing:
        raise ValueError(
            f"train.label_smoothing={config.train.label_smoothing} is for translation: the "
            "language-model loss is the plain NLL (set it to 0)"
        )
    for key in ("mem_len", "clamp_len", "d_embed"):
        if m[key] < 0:
            raise ValueError(f"model.{key} must be >= 0, got {m[key]}")
    if d.segment_length <= 0 or e.segment_length < 0:
        raise ValueError("data.segment_length must be > 0 and eval.segment_length >= 0")
    if e.mem_len < -1:
        raise ValueError(f"eval.mem_len must be >= 0, or -1 (as trained); got {e.mem_len}")
    if d.vocab_size == 1 or d.vocab_size < 0:
        raise ValueError(
            f"data.vocab_size must be 0 (every type) or >= 2 (<eos>, <unk>), got {d.vocab_size}"
        )
    tokenization = corpus_info(d.dataset).tokenization
    if d.vocab_size and tokenization != "whitespace":
        raise ValueError(
            f"data.vocab_size={d.vocab_size} caps word vocabularies; {d.dataset!r} is read as "
            f"{tokenization}s, every one a token (leave it at 0)"
        )
    eval_length = e.segment_length or d.segment_length
    eval_mem_len = m.mem_len if e.mem_len < 0 else e.mem_len
    scheme = SCHEMES[m.positional]
    if e.clamp_len < -1:
        raise ValueError(f"eval.clamp_len must be >= 0, or -1 (as trained); got {e.clamp_len}")
    if e.clamp_len >= 0 and "clamp_len" not in scheme.own_options:
        raise ValueError(
            f"eval.clamp_len={e.clamp_len} is for model.positional='relative', not "
            f"{m.positional!r} (it clamps Transformer-XL's relative distances)"
        )
    scheme.check_memory(m.mem_len, "model.mem_len")
    scheme.check_memory(eval_mem_len, "eval.mem_len")
    if m.positional == "learned" and max(d.segment_length, eval_length) > m.max_len:
        raise ValueError(
            f"data.segment_length={d.segment_length} / eval segment length {eval_length} exceed "
            f"the learned position table (model.max_len={m.max_len} rows); learned positions "
            "cannot score longer segments: evaluate at <= model.max_len or use another scheme"
        )
    if e.sliding_stride and eval_mem_len:
        raise ValueError("eval.sliding_stride needs a memoryless evaluation (eval.mem_len=0)")
    if e.sliding_stride < 0 or e.sliding_stride > eval_length:
        raise ValueError("eval.sliding_stride must be in [0, eval segment length]")

    train_mask = masks.MASK_SCHEMES[m.decoder_mask]
    train_mask.check("model.decoder_mask", cfg, mem_len=m.mem_len, segment_length=d.segment_length)
    if e.decoder_mask and e.decoder_mask not in masks.names_for(masks.LM):
        raise ValueError(f"eval.decoder_mask={e.decoder_mask!r} is not a decoder-only mask")
    eval_mask = masks.MASK_SCHEMES[e.decoder_mask or m.decoder_mask]
    for mask in {train_mask, eval_mask}:  # a scheme that decides what is scored stays on
        shapes_scoring = mask.unscored_targets(cfg) or mask.eval_stride(cfg, eval_length)
        if shapes_scoring and eval_mask != train_mask:
            raise ValueError(
                f"eval.decoder_mask can switch {mask.name} neither on nor off (it decides "
                "which targets are scored)"
            )
    eval_mask.check(
        "eval.decoder_mask" if e.decoder_mask else "model.decoder_mask",
        cfg,
        mem_len=eval_mem_len,
        segment_length=eval_length,
        sliding_stride=e.sliding_stride,
    )

    cutoffs = list(m.adaptive_cutoffs)
    if cutoffs != sorted(set(cutoffs)) or any(c <= 0 for c in cutoffs):
        raise ValueError(f"model.adaptive_cutoffs must be increasing and positive, got {cutoffs}")
    if not 0.0 <= m.adaptive_capacity <= 1.0:
        raise ValueError(f"model.adaptive_capacity must be in [0, 1], got {m.adaptive_capacity}")
    if m.div_val < 1:
        raise ValueError(f"model.div_val must be >= 1, got {m.div_val}")
    if m.tie_projs and len(m.tie_projs) != len(cutoffs) + 1:
        raise ValueError(
            f"model.tie_projs needs one entry per cluster ({len(cutoffs) + 1}), got {m.tie_projs}"
        )
