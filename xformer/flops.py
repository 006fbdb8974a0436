"""Model FLOPs of a train step and accelerators' peak rates: model FLOPs utilisation (MFU).

MFU = model FLOPs of a step x steps/s / (devices x the device's dense bfloat16 peak). Model FLOPs
count the work the model needs, whatever the program executes: 6 per multiply-add of every
matmul of the forward pass over every position of the batch (2 forward, 4 backward; 4 for
Transformer-XL's projection of the relative encodings and its memory's keys and values,
constants with no input gradient), padding
included, attention scores and weighted values over the full [queries, keys] grid (masks do
not reduce it), and no recomputation (`model.remat` raises the executed FLOPs, which XLA's cost
analysis counts, not the model FLOPs; so are the adaptive softmax's padding rows, which only
round matmul widths up to multiples of 8). Embedding lookups, softmaxes, LayerNorm, dropout, the
loss and the optimizer are left out (a few percent at d_model 512).
"""

import dataclasses
import re
from typing import Any

import ml_collections

from xformer import masks
from xformer.adaptive import capacity_rows
from xformer.model_config import LMConfig, StackConfig, TransformerConfig

# Dense bfloat16 TFLOP/s of one device, by a pattern that jax's device_kind matches (re.search;
# the first match wins). Datasheet figures, without sparsity.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0),  # the H100's compute with more and faster memory
    ("A100", 312.0),
    ("^TPU v4$", 275.0),
    ("^TPU v5( lite|e)$", 197.0),
    ("^TPU v5p?$", 459.0),
    ("^TPU v6( lite|e)$", 918.0),  # Trillium
)


def peak_tflops(device_kind: str, override: float = 0.0) -> float | None:
    """The dense bfloat16 peak of one device of this kind (TFLOP/s): `override` if > 0, else
    PEAK_TFLOPS's, None if not known."""
    if override > 0:
        return override
    for pattern, value in PEAK_TFLOPS:
        if re.search(pattern, device_kind):
            return value
    return None


def executed_flops(compiled: Any, devices: int, loop_trips: int = 1) -> float:
    """XLA's FLOP count of a compiled step over all its devices: its cost analysis counts one
    device's program (SPMD) and a loop body once (`loop_trips`: the micro-batch scan's length;
    the optimizer update, outside the loop, then counts that often too: a negligible part)."""
    return (compiled.cost_analysis() or {}).get("flops", 0.0) * devices * loop_trips


def row_length(config: ml_collections.ConfigDict) -> int:
    """Positions of a training row: data.segment_length for a language model, else
    data.max_train_length (source and target rows each)."""
    if config.model.family == "decoder_only":
        return config.data.segment_length
    return config.data.max_train_length


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one train step: weight matmuls (projections, FFN, embeddings' and output
    layers' matmuls) and attention (scores and weighted values)."""

    matmul: float
    attention: float

    @property
    def total(self) -> float:
        return self.matmul + self.attention


def train_step_flops(cfg: StackConfig, rows: int, length: int) -> StepFlops:
    """Model FLOPs of a train step over `rows` rows of `length` positions (source and target
    each for the encoder-decoder; the segment for a language model, whose keys also span
    `mem_len` memory positions)."""
    d, pos = cfg.d_model, rows * length
    if isinstance(cfg, TransformerConfig):
        encoder = _self_attention(cfg, rows, length, length, causal=False) + _ffn(cfg, pos)
        cross = _Macs(weights=4 * pos * d * d, attention=2 * rows * length * length * d)
        decoder = _self_attention(cfg, rows, length, length) + cross + _ffn(cfg, pos)
        output = _Macs(weights=pos * d * cfg.tgt_vocab_size)
        macs = encoder * cfg.num_encoder_layers + decoder * cfg.num_decoder_layers + output
    elif isinstance(cfg, LMConfig):
        causal = not masks.MASK_SCHEMES[cfg.decoder_mask].sees_later_keys  # (prefix_lm: not)
        layer = _self_attention(cfg, rows, length, length, causal, cfg.mem_len) + _ffn(cfg, pos)
        macs = layer * cfg.num_layers + _Macs(weights=_adaptive_macs(cfg, pos))
    else:
        raise TypeError(f"no FLOP count for {type(cfg).__name__}")
    return StepFlops(
        matmul=6.0 * macs.weights + 4.0 * macs.constant_inputs, attention=6.0 * macs.attention
    )


@dataclasses.dataclass(frozen=True)
class _Macs:
    """Multiply-adds of a forward pass: weight matmuls, weight matmuls of constant inputs
    (no input gradient), attention."""

    weights: int = 0
    constant_inputs: int = 0
    attention: int = 0

    def __add__(self, other: "_Macs") -> "_Macs":
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        return _Macs(*(a + b for a, b in pairs))

    def __mul__(self, n: int) -> "_Macs":
        return _Macs(*(a * n for a in dataclasses.astuple(self)))


def _ffn(cfg: StackConfig, positions: int) -> _Macs:
    return _Macs(weights=positions * 2 * cfg.d_model * cfg.d_ff)


def _self_attention(
    cfg: StackConfig, rows: int, queries: int, keys: int, causal: bool = True, memory: int = 0
) -> _Macs:
    """One self-attention layer: q and output projections over the queries, k and v over the
    keys and over the `memory` positions (a constant input: no input gradient), attention over
    both; with relative positions also the sinusoid of every distance through W_kR and
    (q + v) . R for every (query, distance): keys + memory distances in a causal stack, keys +
    memory + queries - 1 (both signs) in an encoder or where queries see later keys
    (prefix_lm)."""
    d = cfg.d_model
    weights = rows * queries * 2 * d * d + rows * keys * 2 * d * d
    memory_kv = rows * memory * 2 * d * d
    keys += memory
    attention = rows * queries * keys * 2 * d
    if cfg.positional != "relative":
        return _Macs(weights=weights, constant_inputs=memory_kv, attention=attention)
    distances = keys if causal else keys + queries - 1
    return _Macs(
        weights=weights,
        constant_inputs=memory_kv + distances * d * d,
        attention=attention + rows * queries * distances * d,
    )


def _adaptive_macs(cfg: LMConfig, positions: int) -> int:
    """Multiply-adds of the (adaptive) input projections and output softmax: the head over
    every position, each tail cluster over every position (dense) or over
    ceil(adaptive_capacity x positions) gathered rows."""
    d_embed = cfg.d_embed or cfg.d_model
    edges = (0, *cfg.adaptive_cutoffs, cfg.vocab_size)
    tails = len(edges) - 2
    macs = 0
    for i, (start, end) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        dim = d_embed // cfg.div_val**i
        proj = dim * cfg.d_model if dim != cfg.d_model else 0
        if i == 0 or cfg.div_val > 1:  # the input side projects every table's lookup
            macs += positions * proj
        rows = positions
        if i and cfg.adaptive_capacity:
            rows = capacity_rows(cfg.adaptive_capacity, positions)
        macs += rows * (proj + dim * (end - start + (tails if i == 0 else 0)))
    return macs
