"""Model FLOPs (xformer/flops.py, the numerator of train.py's MFU) against the matmuls of the
compiled train step, and the device peaks (its denominator).

The reference is brute force: every matrix-matrix product of the train step as XLA:CPU
compiles it, 2 x output elements x contracted size each (op_profile), loops times their trip
count. Matrix-vector products are left out: XLA:CPU's forms of LayerNorm and loss reductions,
which model FLOPs do not count. So are the adaptive softmax's padding rows (its head's weights
and gathered rows in multiples of adaptive.ROW_MULTIPLE, executed FLOPs that the model does not
need): the programs are compiled with ROW_MULTIPLE = 1.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from test_grad_accum import LENGTH, ROWS, tiny_task

from xformer import adaptive, flops, op_profile
from xformer.train_lib import train_step


@pytest.fixture(autouse=True)
def no_padding_rows(monkeypatch):
    monkeypatch.setattr(adaptive, "ROW_MULTIPLE", 1)


def compiled_matmul_flops(task) -> float:
    rng = np.random.default_rng(0)
    state = task.exp.init_state(task.carry(rng))
    step = jax.jit(functools.partial(train_step, task))
    hlo = step.lower(state, task.exp.rng_state, task.batch(rng)).compile().as_text()

    def matrix_matrix(op: op_profile.Op) -> bool:
        dims = op_profile._dims(op.shape)
        return op.kind == "matmul" and len(dims) >= 2 and 1 not in dims

    # the cheaper branch of a conditional: the adaptive softmax's capacity path, not its fallback
    ran = op_profile.kernels(hlo, costliest=False)
    return sum(op.flops * times for op, times in ran if matrix_matrix(op))


# Language models with one layer compile faster; the encoder-decoder case counts layers.
ONE_LAYER = {"model.num_decoder_layers": 1}
ADAPTIVE = {
    **ONE_LAYER,
    "model.adaptive_cutoffs": (10, 20),
    "model.div_val": 2,
    "model.d_embed": 16,
}
CASES = {
    "translation, relative, 2 + 1 layers": (
        "translation",
        {"model.positional": "relative", "model.num_encoder_layers": 2},
    ),
    "rope with memory, untied, 4 heads": (
        "language_modeling",
        {**ONE_LAYER, "model.positional": "rope", "model.tie_output": False, "model.num_heads": 4},
    ),
    "prefix_lm, relative, no memory (distances of both signs)": (
        "language_modeling",
        {
            **ONE_LAYER,
            "model.decoder_mask": "prefix_lm",
            "model.prefix_length": 3,
            "model.mem_len": 0,
        },
    ),
    "xl, adaptive, div_val 2": ("language_modeling", ADAPTIVE),
    "xl, adaptive, div_val 1, d_embed 32": (
        "language_modeling",
        {**ADAPTIVE, "model.div_val": 1, "model.d_embed": 32},
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_model_flops_are_the_compiled_steps_matmuls(case, tmp_path):
    """Exactly: projections, FFN, output layer, attention scores and values, XL's relative
    terms (an encoder's distances of both signs), adaptive input and output projections,
    memory positions as keys."""
    family, overrides = CASES[case]
    with jax.enable_x64(True):
        task = tiny_task(family, str(tmp_path), vocab=40, **overrides)
        counted = compiled_matmul_flops(task)
    model = flops.train_step_flops(task.exp.model_cfg, ROWS, LENGTH)
    assert model.attention > 0 and model.matmul > 0
    assert model.total == counted, (model, counted)


def test_capacity_counts_the_gathered_rows(tmp_path):
    """The capacity path scores each tail cluster on C = ceil(capacity x N) gathered rows; its
    backward pass recomputes those rows' projection, 2 x C x d_i x d_model executed FLOPs per
    tail that are not model FLOPs."""
    with jax.enable_x64(True):
        task = tiny_task(
            "language_modeling",
            str(tmp_path),
            vocab=40,
            **ADAPTIVE,
            **{"model.adaptive_capacity": 0.25},
        )
        counted = compiled_matmul_flops(task)
    rows, cfg = 16, task.exp.model_cfg  # ceil(0.25 x 64) of 64 positions
    recompute = sum(2 * rows * (cfg.d_embed // cfg.div_val**i) * cfg.d_model for i in (1, 2))
    model = flops.train_step_flops(cfg, ROWS, LENGTH)
    assert model.total == counted - recompute
    dense = flops.train_step_flops(dataclasses.replace(cfg, adaptive_capacity=0.0), ROWS, LENGTH)
    assert model.total < dense.total


def test_peak_by_device_kind():
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert flops.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert flops.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert flops.peak_tflops("TPU v5 lite") == flops.peak_tflops("TPU v5e") == 197.0
    assert flops.peak_tflops("TPU v5") == flops.peak_tflops("TPU v5p") == 459.0
    assert flops.peak_tflops("TPU v4") == 275.0
    assert flops.peak_tflops("TPU v4 lite") is None  # not a v4
    assert flops.peak_tflops("cpu") is None
    assert flops.peak_tflops("cpu", override=0.1) == 0.1
