"""Gradient accumulation (train.grad_accum_steps): a step over k micro-batches is the one-big-batch
step (loss, metric sums, parameters, Adam state and the Transformer-XL memory, over consecutive
steps), and with dropout on its micro-batches draw different masks.

Tiny models of both families on random batches (no data files), through the real train_step,
the tasks' own loss_terms and carry layout, in float64 so that only the summation order differs.
Running this file as a script repeats the comparison on 4 simulated devices.
"""

import dataclasses
import functools
import os
import sys
from collections.abc import Callable

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from simulated_devices import run_script

from xformer import config as config_lib
from xformer import experiment as experiment_lib
from xformer import model_config, sharding
from xformer.language_model import LanguageModel
from xformer.models import EncoderDecoder
from xformer.tasks import language_modeling, translation
from xformer.tasks.language_modeling import LanguageModelingTask
from xformer.tasks.translation import TranslationTask
from xformer.train_lib import join_rows, split_rows, train_step

VOCAB, ROWS, LENGTH, MEM_LEN, STEPS = 29, 8, 8, 6, 3
# float64: summation order is the only difference. atol: Adam moves a parameter by lr * g /
# (|g| + eps), so one whose gradient is 0 up to rounding (the key bias) moves by noise ~1e-10.
TOLERANCE = {"rtol": 1e-10, "atol": 1e-9}
TINY = {
    "model.d_model": 16,
    "model.num_heads": 2,
    "model.d_ff": 32,
    "model.num_decoder_layers": 2,
    "model.dropout": 0.0,
    "model.attention_dropout": 0.0,
    "model.relu_dropout": 0.0,
    "model.dtype": "float64",
    "model.param_dtype": "float64",
    "train.batch_size": ROWS,
    "eval.batch_size": ROWS,
    "train.learning_rate": 1e-2,
    "train.warmup_steps": 1,
}


@dataclasses.dataclass
class TinyTask:
    """What train_step reads of a task: the real task's loss and carry layout, random batches."""

    exp: experiment_lib.Experiment
    loss_terms: Callable
    carry_batch_axes: dict
    batch: Callable[[np.random.Generator], dict]  # a fresh random global batch
    carry: Callable[[np.random.Generator], dict]  # a random initial carry


def tiny_task(family: str, workdir: str, vocab: int = VOCAB, **overrides) -> TinyTask:
    if family == "translation":
        config = config_lib.base_config()
        overrides = {"model.num_encoder_layers": 1, "model.num_decoder_layers": 1, **overrides}
    else:
        config = config_lib.lm_base_config("ptb")
        overrides = {"model.mem_len": MEM_LEN, "data.segment_length": LENGTH, **overrides}
    config_lib.override(config, {**TINY, **overrides})
    config_lib.validate(config)
    if family == "translation":
        cfg = model_config.from_config(config.model, src_vocab_size=vocab, tgt_vocab_size=vocab)
        exp = experiment_lib.setup(config, workdir, EncoderDecoder, cfg)

        def loss_terms(model, batch: dict, carry: dict) -> tuple:
            return *translation.loss_terms(model, batch, config.train.label_smoothing), carry

        axes = TranslationTask.carry_batch_axes
        batches = functools.partial(translation_batch, vocab=vocab)
        return TinyTask(exp, loss_terms, axes, batches, no_carry)
    cfg = model_config.from_config(config.model, vocab_size=vocab)
    exp = experiment_lib.setup(config, workdir, LanguageModel, cfg)
    return TinyTask(
        exp,
        language_modeling.loss_terms,
        LanguageModelingTask.carry_batch_axes,
        functools.partial(lm_batch, vocab=vocab),
        functools.partial(random_memory, cfg),
    )


def with_accumulation(task: TinyTask, k: int) -> TinyTask:
    config = task.exp.config.copy_and_resolve_references()
    config.train.grad_accum_steps = k
    return dataclasses.replace(task, exp=dataclasses.replace(task.exp, config=config))


def packed_segments(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Segment ids [ROWS, LENGTH] (two packed examples, then padding: every row has its own
    token count) and the positions within each segment."""
    first = rng.integers(1, LENGTH - 1, (ROWS, 1))
    end = rng.integers(first + 1, LENGTH + 1)
    offsets = np.arange(LENGTH)
    segments = np.where(offsets < first, 1, np.where(offsets < end, 2, 0))
    positions = np.where(segments == 2, offsets - first, np.where(segments == 1, offsets, 0))
    return segments.astype(np.int32), positions.astype(np.int32)


def translation_batch(rng: np.random.Generator, vocab: int = VOCAB) -> dict:
    src_segments, src_positions = packed_segments(rng)
    tgt_segments, tgt_positions = packed_segments(rng)

    def tokens(segments):
        return np.where(segments > 0, rng.integers(1, vocab, segments.shape), 0).astype(np.int32)

    return {
        "src": tokens(src_segments),
        "src_segments": src_segments,
        "src_positions": src_positions,
        "tgt_in": tokens(tgt_segments),
        "tgt_out": tokens(tgt_segments),
        "tgt_segments": tgt_segments,
        "tgt_positions": tgt_positions,
    }


def lm_batch(rng: np.random.Generator, vocab: int = VOCAB) -> dict:
    return {
        "inputs": rng.integers(0, vocab, (ROWS, LENGTH)).astype(np.int32),
        "targets": rng.integers(0, vocab, (ROWS, LENGTH)).astype(np.int32),
        "weights": (rng.random((ROWS, LENGTH)) < 0.8).astype(np.float64),  # uneven token counts
        "reset": rng.random(ROWS) < 0.25,  # some rows' streams restart
    }


def no_carry(rng: np.random.Generator) -> dict:
    return {}


def random_memory(cfg, rng: np.random.Generator) -> dict:
    """A memory of cfg.mem_len states that already differs row by row, partly filled ({}, as
    the train loop's, without one)."""
    if not cfg.mem_len:
        return {}
    shape = (cfg.num_layers, ROWS, cfg.mem_len, cfg.d_model)
    return {
        "states": rng.normal(size=shape),
        "filled": rng.integers(0, cfg.mem_len + 1, ROWS).astype(np.int32),
    }


def run_steps(task: TinyTask, seed: int) -> list[tuple[dict, dict]]:
    """(state, metrics) after each of STEPS train steps from the same start and batches."""
    rng, mesh = np.random.default_rng(seed), task.exp.mesh
    carry = {  # sharded with its rows over the data axis, as in the train loop
        name: jax.device_put(
            x, NamedSharding(mesh, sharding.batch_spec(mesh, task.carry_batch_axes[name]))
        )
        for name, x in task.carry(rng).items()
    }
    state = task.exp.init_state(carry)
    step = jax.jit(functools.partial(train_step, task))
    out = []
    for _ in range(STEPS):
        batch = jax.device_put(task.batch(rng), task.exp.batch_sharding)
        state, metrics = step(state, task.exp.rng_state, batch)
        out.append(jax.device_get((state, metrics)))
    return out


def assert_same_steps(task: TinyTask, k: int, seed: int) -> None:
    """k micro-batches per step give the one-big-batch steps (dropout off)."""
    expected, actual = run_steps(task, seed), run_steps(with_accumulation(task, k), seed)
    for i, ((state, metrics), (state_k, metrics_k)) in enumerate(
        zip(expected, actual, strict=True)
    ):
        assert metrics.keys() == metrics_k.keys() >= {"loss_sum", "nll_sum", "tokens", "grad_norm"}
        for name in metrics:
            what = f"seed {seed}, step {i + 1}, k={k}: {name}"
            np.testing.assert_allclose(metrics_k[name], metrics[name], **TOLERANCE, err_msg=what)
        assert jax.tree.structure(state_k) == jax.tree.structure(state)
        for (path, leaf), leaf_k in zip(
            jax.tree.leaves_with_path(state), jax.tree.leaves(state_k), strict=True
        ):
            what = f"seed {seed}, step {i + 1}, k={k}: {jax.tree_util.keystr(path)}"
            np.testing.assert_allclose(leaf_k, leaf, **TOLERANCE, err_msg=what)
        assert state_k["carry"].keys() == task.carry_batch_axes.keys()  # the XL memory compared


@pytest.mark.parametrize("family", ["translation", "language_modeling"])
def test_accumulated_step_equals_one_big_batch(family, tmp_path):
    """grad_accum_steps = 2 and 4 against 1 over 3 steps (the XL memory carried across them):
    loss and every metric sum, parameters, Adam state, step counter and new memory agree to
    1e-10 relative in float64. The batches have uneven token counts per row, so averaging
    per-micro-batch means instead of dividing by the whole batch's tokens would fail."""
    with jax.enable_x64(True):
        task = tiny_task(family, str(tmp_path))
        for k in (2, 4):
            assert_same_steps(task, k, seed=np.random.SeedSequence().entropy % 2**32)


def test_micro_batches_draw_different_dropout_masks(tmp_path):
    """Two identical micro-batches (rows 2j and 2j + 1 equal, k = 2): each one's loss is in the
    sums as loss_sum and its square, so 2 * sum(l_i^2) - sum(l_i)^2 = (l_0 - l_1)^2 is 0 exactly
    when both drew the same masks. It is (numerically) 0 with dropout off and clearly not with
    dropout on, for the largest of 4 random batches (different masks can move one batch's loss
    very little: (l_0 - l_1)^2 < 1e-6 * loss^2 for 2 of 40 batches, measured)."""
    rng = np.random.default_rng()
    halves = [translation_batch(rng) for _ in range(4)]
    batches = [{k: np.repeat(x[: ROWS // 2], 2, axis=0) for k, x in h.items()} for h in halves]

    def spreads(dropout: float) -> list[float]:
        """(l_0 - l_1)^2 / loss^2 of each batch."""
        base = tiny_task("translation", str(tmp_path / str(dropout)), **{"model.dropout": dropout})

        def loss_terms(model, batch, carry):
            loss_sum, sums, carry = base.loss_terms(model, batch, carry)
            return loss_sum, {**sums, "loss_sq": loss_sum**2}, carry

        task = with_accumulation(dataclasses.replace(base, loss_terms=loss_terms), 2)
        step, state = jax.jit(functools.partial(train_step, task)), task.exp.init_state()
        out = []
        for batch in batches:
            _, metrics = step(state, task.exp.rng_state, batch)
            loss = float(metrics["loss_sum"])
            out.append((float(2 * metrics["loss_sq"]) - loss**2) / loss**2)
        return out

    with jax.enable_x64(True):
        off, on = spreads(0.0), spreads(0.3)
    assert max(abs(x) for x in off) < 1e-9
    assert max(on) > 1e-6


def test_split_and_join_rows_are_inverse():
    """Micro-batch i holds rows i, i + k, ...: a device's contiguous shard of rows splits into
    its own part of every micro-batch. join_rows puts every row back in place, on any axis."""
    x = np.arange(8 * 3).reshape(8, 3)
    np.testing.assert_array_equal(split_rows(x, 0, 2)[1], x[1::2])
    memory = np.random.default_rng().normal(size=(2, 8, 3, 4)).astype(np.float32)  # rows: axis 1
    split = split_rows(memory, 1, 4)
    assert split.shape == (4, 2, 2, 3, 4)
    np.testing.assert_array_equal(split[3], memory[:, 3::4])
    np.testing.assert_array_equal(join_rows(split, 1), memory)


@pytest.mark.slow  # a subprocess: ~20 s, most of it compiling
def test_accumulated_step_equals_one_big_batch_on_four_devices(tmp_path):
    """The comparison with k = 2 on 4 simulated devices, in a subprocess: batch and memory
    sharded over their rows as in the train loop, each micro-batch's 4 rows one per device."""
    assert "4 devices: equal" in run_script(__file__, 4, str(tmp_path))


@pytest.mark.parametrize("family", ["translation", "lm"])
def test_dropout_streams_made_from_shapes_train_like_a_built_models(family, tmp_path):
    """setup makes the RNG-stream state from the shapes alone (no model trace); the train step
    re-keys every stream, so steps with it equal steps with a constructed model's own state."""
    dropout = {"model.dropout": 0.3, "model.attention_dropout": 0.2, "model.relu_dropout": 0.1}
    with jax.enable_x64(True):
        task = tiny_task(family, str(tmp_path), **dropout)
        exp = task.exp
        built = nnx.state(
            exp.model_cls(exp.model_cfg, rngs=experiment_lib.model_rngs(0)), nnx.Not(nnx.Param)
        )
        assert jax.tree.structure(built) == jax.tree.structure(exp.rng_state)
        rng = np.random.default_rng()
        carry, batches = task.carry(rng), [task.batch(rng) for _ in range(2)]
        step = jax.jit(functools.partial(train_step, task))
        runs = []
        for rng_state in (exp.rng_state, built):
            state = exp.init_state(carry)
            for batch in batches:
                state, metrics = step(state, rng_state, batch)
            runs.append((state["params"], metrics))
        jax.tree.map(np.testing.assert_array_equal, *runs)


def test_a_model_keeping_another_rng_stream_is_refused(tmp_path):
    """Only dropout streams are re-keyed by the train step: a model keeping any other stream
    would draw the same numbers at every step, so setup refuses it."""

    class KeepsParamsStream(nnx.Module):
        def __init__(self, cfg, *, rngs: nnx.Rngs):
            self.linear = nnx.Linear(2, 2, rngs=rngs)
            self.noise = rngs["params"].fork()

    with pytest.raises(ValueError, match=r"RNG streams \['params'\]"):
        experiment_lib.setup(config_lib.base_config(), str(tmp_path), KeepsParamsStream, None)


if __name__ == "__main__":
    assert jax.device_count() == 4, jax.devices()
    with jax.enable_x64(True):
        for family in ("translation", "language_modeling"):
            task = tiny_task(family, os.path.join(sys.argv[1], family))
            assert_same_steps(task, 2, seed=0)
    print("4 devices: equal")
