"""Every shipped config validates; the WMT14 base model trains a few steps on Multi30k data."""

import importlib.util
import json
import logging
from pathlib import Path

import jax
import pytest
from flax import nnx
from test_train_eval import shared_vocab_dir

from xformer import config as config_lib
from xformer import model_config
from xformer.language_model import LanguageModel
from xformer.model_config import from_config
from xformer.models import EncoderDecoder
from xformer.train_lib import train_and_evaluate

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.py"))


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_validates_and_documents_its_command(path):
    module = load(path)
    config_lib.validate(module.get_config())
    assert f"python train.py --config=configs/{path.name}" in module.__doc__


LM_CONFIGS = [p for p in CONFIGS if load(p).get_config().model.family == "decoder_only"]


@pytest.mark.parametrize("path", LM_CONFIGS, ids=lambda p: p.stem)
def test_evaluation_lengths_follow_the_training_lengths(path):
    """A language model validates (and eval.py scores) at its training lengths unless eval.*
    says otherwise: overriding model.mem_len or data.segment_length moves both (the configs
    wrote the lengths into eval.* too, which kept the old ones)."""
    from xformer.tasks.language_modeling import EvalSettings

    config = load(path).get_config()
    trained = EvalSettings.from_config(config)
    assert (trained.segment_length, trained.mem_len) == (
        config.data.segment_length,
        config.model.mem_len,
    )
    length, memory = config.data.segment_length + 7, config.model.mem_len + 9
    config = config_lib.override(config, {"data.segment_length": length, "model.mem_len": memory})
    moved = EvalSettings.from_config(config)
    assert (moved.segment_length, moved.mem_len) == (length, memory)


VARIANTS = [(p, v) for p in CONFIGS for v in getattr(load(p), "VARIANTS", {})]


@pytest.mark.parametrize("path,variant", VARIANTS, ids=lambda x: getattr(x, "stem", x))
def test_config_variants_validate(path, variant):
    module = load(path)
    base, varied = config_lib.flatten(module.get_config()), module.get_config(variant)
    config_lib.validate(varied)
    changed = {k for k, v in config_lib.flatten(varied).items() if base[k] != v}
    assert changed and changed <= set(module.VARIANTS[variant])
    assert variant in module.__doc__


def test_unknown_variants_and_override_keys_are_named(caplog):
    module = load(CONFIGS[0].parent / "ptb_xl.py")
    with pytest.raises(ValueError, match=r"unknown config variant 'vanila'; known: \['alibi'"):
        module.get_config("vanila")
    combined = module.get_config("vanilla,short")
    assert combined.model.positional == "sinusoidal" and combined.train.num_steps == 750
    with caplog.at_level(logging.WARNING):  # a later variant wins, named in the log
        assert module.get_config("short,vanilla").train.num_steps == 6600
    warning = "config variant 'vanilla' sets train.num_steps=6600 over 750 from variant 'short'"
    assert warning in caplog.text
    with pytest.raises(ValueError, match=r"unknown config key 'model.positionl'"):
        config_lib.override(module.get_config(), {"model.positionl": "rope"})


@pytest.mark.slow
def test_wmt14_base_model_trains_on_multi30k_data(tmp_path, tfds_dir, multi30k_dir):
    config = load(Path(__file__).resolve().parents[1] / "configs" / "wmt14_ende.py").get_config()
    multi30k = load(Path(__file__).resolve().parents[1] / "configs" / "multi30k_ende.py")
    config.data = multi30k.get_config().data
    config.data.data_dir = tfds_dir
    config.data.vocab_dir = shared_vocab_dir(tfds_dir)
    config.data.vocab_size = 400  # the TINY runs' size: their shared model
    config.data.eval_split = "val[:2]"  # decoding a base model unoptimized (-O0) is slow
    config.data.max_train_length = 32
    config.train.batch_size = 2
    config.train.num_steps = 3
    config.train.log_every = 1
    config.eval.batch_size = 2
    config.eval.max_decode_extra = 3
    config.eval.bleu_sentences = 2
    result = train_and_evaluate(config, str(tmp_path))
    assert result["step"] == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)
    assert (tmp_path / "tensorboard").is_dir()
    model = nnx.eval_shape(  # shapes only: building 44M parameters eagerly takes ~5 s
        lambda: EncoderDecoder(
            from_config(config.model, src_vocab_size=1000, tgt_vocab_size=1000), rngs=nnx.Rngs(0)
        )
    )
    n_params = sum(v.size for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # 6+6 layers of d_model 512 / d_ff 2048: 44.14M parameters besides the shared embedding
    # (the paper's 65M includes its 37k-token embedding).
    assert n_params - 1000 * 512 == 44_138_496


@pytest.mark.parametrize(
    "name,vocab,expected",
    [
        # paper Table 1: 151M (+ 410: the adaptive table's padding row, 267,736 = 8 x 33,467)
        ("wt103_xl_base", 267_735, 151_107_948),
        ("enwik8_xl_base", 256, 41_082_112),  # paper Table 2: 41M
    ],
)
def test_transformer_xl_paper_configs_have_the_paper_sizes(name, vocab, expected):
    config = load(Path(__file__).resolve().parents[1] / "configs" / f"{name}.py").get_config()
    model = nnx.eval_shape(
        lambda: LanguageModel(from_config(config.model, vocab_size=vocab), rngs=nnx.Rngs(0))
    )
    assert sum(v.size for v in jax.tree.leaves(nnx.state(model, nnx.Param))) == expected


def test_model_keys_come_from_the_model_dataclasses():
    """base_config().model is exactly the dataclass fields (defaults included), each documented,
    and a config converts to its family's dataclass with every value carried over."""
    model = config_lib.base_config().model
    fields = model_config.config_keys()
    assert set(model) == {"family", *fields}
    for name, field in fields.items():
        assert model[name] == field.default and field.metadata["doc"], name
    data_fields = {
        "encoder_decoder": {"src_vocab_size": 5, "tgt_vocab_size": 7},
        "decoder_only": {"vocab_size": 7},
    }
    for family, cls in model_config.FAMILIES.items():
        config = config_lib.lm_base_config("ptb")
        config.model.family, config.model.d_ff, config.model.layer_norm = family, 96, "pre"
        cfg = model_config.from_config(config.model, **data_fields[family])
        assert type(cfg) is cls and cfg.d_ff == 96 and cfg.pre_norm
        values = {name: getattr(cfg, name) for name in cls.fields()}
        assert values == {name: config.model[name] for name in cls.fields()}


def test_model_dataclass_defaults_agree_across_families():
    shared = set(model_config.TransformerConfig.fields()) & set(model_config.LMConfig.fields())
    assert {"relu_dropout", "max_len", "decoder_mask", "positional"} <= shared
    for name in shared:
        lm = model_config.LMConfig.fields()[name].default
        assert model_config.TransformerConfig.fields()[name].default == lm, name
