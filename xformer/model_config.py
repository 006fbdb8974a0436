"""The model dataclasses: the one source of every `model.*` config key.

Each config field is declared with `option(default, doc, allowed)`: its name is the config key,
its annotation the type validation checks, `allowed` the values validation accepts, and `doc`
what it means. `config.base_config()` builds the `model` section from these fields and
`from_config` builds the dataclass of a validated config's family. Fields declared without
`option` (vocabulary sizes) come from the data, not from the config.

    cfg = from_config(config.model, vocab_size=10_000)  # an LMConfig for decoder_only configs
"""

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from xformer import attention, masks
from xformer.positional import SCHEMES


def option(default: Any, doc: str, allowed: tuple | None = None) -> Any:
    """A dataclass field that is also the config key `model.<name>`."""
    return dataclasses.field(default=default, metadata={"doc": doc, "allowed": allowed})


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackConfig:
    """Fields shared by both families."""

    d_model: int = option(512, "model width")
    num_heads: int = option(8, "attention heads (d_model must divide by it)")
    num_decoder_layers: int = option(6, "decoder layers; the depth of a decoder-only LM")
    d_ff: int = option(2048, "inner width of the position-wise FFN")
    dropout: float = option(0.1, "on embeddings and residual branches (XL: also R, last state)")
    attention_dropout: float = option(0.0, "on attention weights")
    relu_dropout: float = option(0.0, "inside the FFN, after the ReLU")
    positional: str = option(
        "sinusoidal", "positional scheme of every self-attention stack", tuple(SCHEMES)
    )
    max_len: int = option(256, "learned: size of the position table")
    rope_base: float = option(10000.0, "rope: angle base")
    relative_buckets: int = option(32, "t5_bias: buckets (log-spaced beyond half of them)")
    relative_max_distance: int = option(128, "t5_bias: distance of the last bucket")
    clamp_len: int = option(0, "relative: distances beyond this share one encoding (0 = off)")
    untie_relative_biases: bool = option(False, "relative: u, v per layer (TF) or shared")
    attention_window: int = option(0, "sliding_window: keys fewer than this many positions away")
    prefix_length: int = option(0, "prefix_lm: the first positions of a segment see each other")
    layer_norm: str = option(
        "post", "post: the paper; pre: LayerNorm inside the residual", ("post", "pre")
    )
    tie_output: bool = option(True, "output projection = (target) embedding transposed")
    init_std: float = option(
        0.0,
        "dense kernels (attention, FFN, XL's W_kR, an untied output layer) drawn from "
        "N(0, init_std), as Transformer-XL's reference does with 0.02; 0: LeCun normal, "
        "Flax's default",
    )
    dtype: str = option(
        "float32",
        "activations and matmuls (norm statistics, softmaxes and the loss stay >= float32; "
        "float64 needs JAX_ENABLE_X64=1)",
        ("float32", "bfloat16", "float64"),
    )
    param_dtype: str = option(
        "float32", "stored parameters (and optimizer state)", ("float32", "bfloat16", "float64")
    )
    attention_impl: str = option(
        "xla",
        "xla: einsum attention (the reference); fused: flash attention where it can serve "
        "(cuDNN on GPU, Pallas splash on TPU), jax.nn.dot_product_attention's XLA path "
        "elsewhere; fused_packed: fused, and on GPU packed rows reach cuDNN as segment "
        "lengths and offsets instead of a mask (segment ids must be ascending contiguous runs, "
        "as xformer's batches are)",
        attention.IMPLEMENTATIONS,
    )
    remat: str = option(
        "none",
        "training: recompute each layer's activations in the backward pass (remat.py): none, "
        "full (keep layer inputs only) or dots (keep matmul outputs)",
        ("none", "full", "dots"),
    )
    # Not a config key: the device mesh splits the heads (mesh.tensor > 1; experiment.setup).
    split_heads: bool = False

    @classmethod
    def fields(cls) -> dict[str, dataclasses.Field]:
        """The fields that are config keys (`model.<name>`), by name."""
        return {f.name: f for f in dataclasses.fields(cls) if "doc" in f.metadata}

    @property
    def dtypes(self) -> dict[str, jnp.dtype]:
        """{"dtype", "param_dtype"}: the keyword arguments that set every layer's precision."""
        return {"dtype": jnp.dtype(self.dtype), "param_dtype": jnp.dtype(self.param_dtype)}

    @property
    def kernel_init(self) -> Callable:
        """The initializer of every dense kernel (init_std)."""
        if self.init_std:
            return nnx.initializers.normal(self.init_std)
        return nnx.nn.linear.default_kernel_init

    @property
    def pre_norm(self) -> bool:
        return self.layer_norm == "pre"

    @property
    def absolute(self) -> bool:
        """Positions are added to the embeddings (so states cannot be reused as a memory)."""
        return SCHEMES[self.positional].absolute


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig(StackConfig):
    """The encoder-decoder (`model.family = "encoder_decoder"`)."""

    src_vocab_size: int
    tgt_vocab_size: int
    num_encoder_layers: int = option(6, "encoder layers")
    encoder_mask: str = option(
        "bidirectional", "encoder masking scheme", masks.names_for(masks.ENCODER)
    )
    decoder_mask: str = option(
        "causal", "decoder self-attention masking scheme", masks.names_for(masks.DECODER)
    )
    share_embeddings: bool = option(True, "source and target share one table (joint vocab)")
    # Not a config key: the most segments a packed row holds (data.max_pairs_per_row; 0 = no
    # limit), which sizes cuDNN's segment slots under attention_impl="fused_packed".
    max_segments: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig(StackConfig):
    """The decoder-only LM, Transformer-XL or vanilla (`model.family = "decoder_only"`)."""

    vocab_size: int
    decoder_mask: str = option("causal", "masking scheme", masks.names_for(masks.LM))
    mem_len: int = option(0, "XL memory: cached states per layer in training (0 = none)")
    d_embed: int = option(0, "adaptive: embedding size of the head cluster (0 = d_model)")
    adaptive_cutoffs: tuple[int, ...] = option((), "adaptive softmax cutoffs; () = plain")
    div_val: int = option(1, "adaptive: cluster i embeds in d_embed // div_val**i dims")
    tie_projs: tuple[bool, ...] = option((), "adaptive: per cluster, tie the projections")
    adaptive_capacity: float = option(
        0.0,
        "adaptive softmax: each tail cluster scores at most this fraction of the positions "
        "(those whose target is in it; each device's own when the mesh splits rows); a batch "
        "that overflows is scored densely (0 = dense)",
    )

    @property
    def num_layers(self) -> int:
        return self.num_decoder_layers


FAMILIES: dict[str, type[StackConfig]] = {
    "encoder_decoder": TransformerConfig,  # translation
    "decoder_only": LMConfig,  # language modelling
}


def config_keys() -> dict[str, dataclasses.Field]:
    """Every `model.*` key of every family (one field per name; families agree on defaults)."""
    keys: dict[str, dataclasses.Field] = {}
    for cls in FAMILIES.values():
        for name, field in cls.fields().items():
            if name in keys and keys[name].default != field.default:
                raise TypeError(
                    f"model.{name} has two defaults: {keys[name].default!r}, {field.default!r}"
                )
            keys.setdefault(name, field)
    return keys


def check_value(name: str, field: dataclasses.Field, value: Any, family: str = "") -> None:
    """Raise ValueError naming `model.<name>` if `value` has the wrong type or is not allowed
    (for a `family` model, where the families allow different values)."""
    kind = typing.get_origin(field.type) or field.type
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind is tuple:
        item = typing.get_args(field.type)[0]
        ok = isinstance(value, tuple | list) and all(
            isinstance(v, item) and (item is bool or not isinstance(v, bool)) for v in value
        )
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        kind_name = field.type.__name__ if isinstance(field.type, type) else field.type
        raise ValueError(f"config key 'model.{name}' must be {kind_name}, got {value!r}")
    allowed = field.metadata["allowed"]
    if allowed is not None and value not in allowed:
        where = f" for {family} models" if family else ""
        raise ValueError(
            f"config key 'model.{name}' is {value!r}; allowed values{where}: {allowed}"
        )


def from_config(model: Mapping[str, Any], **data_fields: int) -> StackConfig:
    """The family's dataclass from a validated `config.model` and the fields the data decides
    (src_vocab_size and tgt_vocab_size, or vocab_size; 0 where not given, as in validation)."""
    cls = FAMILIES[model["family"]]
    values = {
        name: tuple(model[name]) if isinstance(model[name], list) else model[name]
        for name in cls.fields()
    }
    unset = {
        f.name: 0
        for f in dataclasses.fields(cls)
        if f.name not in values and f.default is dataclasses.MISSING
    }
    return cls(**values, **{**unset, **data_fields})
