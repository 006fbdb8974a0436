"""How the train step compiles by platform. train_lib.compile_step: its XLA options (on a GPU, no
Triton GEMM fusions), where XLA_FLAGS has the last word and an option the installed XLA does not
know is dropped with a warning, never a failed run. train_lib.lower_train_step: where the
compiler lays out the train state (a TPU), and in_step_layouts, which moves a state into it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from test_grad_accum import tiny_task

from xformer import train_lib

FLOAT32 = {"model.dtype": "float32", "model.param_dtype": "float32"}


class RecordingLowered:
    """A real lowered program that records the compiler options of each compile call."""

    def __init__(self, lowered, error: Exception | None = None):
        self.lowered, self.error, self.options = lowered, error, []

    def compile(self, compiler_options=None):
        self.options.append(compiler_options)
        if self.error is not None:
            raise self.error
        return self.lowered.compile(compiler_options=compiler_options)


@pytest.fixture
def program():
    """(lowered tanh(a @ b), its operands, numpy's result)."""
    rng = np.random.default_rng()
    a, b = rng.standard_normal((5, 7), np.float32), rng.standard_normal((7, 3), np.float32)
    lowered = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(a, b)
    return lowered, (a, b), np.tanh(a.astype(np.float64) @ b)


def _user_flags(monkeypatch, *flags: str) -> None:
    """XLA_FLAGS as the conftest set it, plus `flags` (this process read it long ago: only
    compile_step's check of the environment sees the change)."""
    monkeypatch.setenv("XLA_FLAGS", " ".join(["--xla_backend_optimization_level=0", *flags]))


def test_a_gpu_step_compiles_without_triton_gemm_fusions(monkeypatch, program):
    lowered, operands, want = program
    _user_flags(monkeypatch)
    recording = RecordingLowered(lowered)
    compiled = train_lib.compile_step(recording, "gpu")
    assert recording.options == [{"xla_gpu_enable_triton_gemm": False}]
    np.testing.assert_allclose(compiled(*operands), want, rtol=1e-5, atol=1e-6)


def test_other_platforms_compile_with_xla_defaults(monkeypatch, program):
    _user_flags(monkeypatch)
    for platform in ("cpu", "tpu"):
        recording = RecordingLowered(program[0])
        train_lib.compile_step(recording, platform)
        assert recording.options == [None]


def test_this_xla_knows_every_option(program):
    """Straight to XLA, no fallback: a jax whose XLA drops one of them fails here, not quietly."""
    lowered, operands, want = program
    for platform, options in train_lib.STEP_COMPILER_OPTIONS.items():
        compiled = lowered.compile(compiler_options=options)
        np.testing.assert_allclose(
            compiled(*operands), want, rtol=1e-5, atol=1e-6, err_msg=platform
        )


def test_xla_flags_overrule_the_default(monkeypatch, program):
    _user_flags(monkeypatch, "--xla_gpu_enable_triton_gemm=true")
    recording = RecordingLowered(program[0])
    train_lib.compile_step(recording, "gpu")
    assert recording.options == [None]
    # Only the flag of that name: one whose name starts with it leaves the default (it did).
    _user_flags(monkeypatch, "--xla_gpu_enable_triton_gemm_any=false")
    recording = RecordingLowered(program[0])
    train_lib.compile_step(recording, "gpu")
    assert recording.options == [{"xla_gpu_enable_triton_gemm": False}]


def test_an_option_unknown_to_xla_is_dropped(monkeypatch, program):
    lowered, operands, want = program
    _user_flags(monkeypatch)
    monkeypatch.setitem(train_lib.STEP_COMPILER_OPTIONS, "gpu", {"xla_no_such_option": True})
    recording = RecordingLowered(lowered)
    compiled = train_lib.compile_step(recording, "gpu")
    assert recording.options == [{"xla_no_such_option": True}, None]
    np.testing.assert_allclose(compiled(*operands), want, rtol=1e-5, atol=1e-6)


def test_other_compile_errors_are_raised(monkeypatch, program):
    _user_flags(monkeypatch)
    error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory while compiling")
    recording = RecordingLowered(program[0], error)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        train_lib.compile_step(recording, "gpu")
    assert recording.options == [{"xla_gpu_enable_triton_gemm": False}]


def _column_major(x: jax.Array) -> jax.Array:
    """A copy of `x` laid out with its first dimension minor-most (2-D and larger arrays)."""
    if x.ndim < 2:
        return x.copy()
    return jax.device_put(x, Format(Layout(tuple(reversed(range(x.ndim)))), x.sharding))


def test_the_compiler_lays_out_the_state_on_auto_layout_platforms(monkeypatch, tmp_path):
    """On AUTO_LAYOUT_PLATFORMS (a TPU; here the CPU stands in) the train step takes the state
    in the layouts XLA picks, and gives it back in them; `in_step_layouts` moves a state that
    arrives otherwise (column-major here, as a TPU lays out some shapes by default) into them
    once. Two steps then equal the default-layout step's bit for bit, and a checkpoint of the
    column-major state restores to the same values."""
    task = tiny_task("language_modeling", str(tmp_path), **FLOAT32)
    rng = np.random.default_rng()
    exp = task.exp
    state = exp.init_state(jax.device_put(task.carry(rng), exp.replicated))
    batches = [jax.device_put(task.batch(rng), exp.batch_sharding) for _ in range(2)]
    arriving = jax.tree.map(_column_major, state)
    exp.checkpointer.save(1, arriving)
    exp.checkpointer.wait()
    restored, _ = exp.checkpointer.restore(exp.abstract_state(state["carry"]))
    jax.tree.map(np.testing.assert_array_equal, restored, state)

    steps = {}
    for name, platforms, start in (("auto", {"cpu"}, arriving), ("default", set(), state)):
        monkeypatch.setattr(train_lib, "AUTO_LAYOUT_PLATFORMS", frozenset(platforms))
        lowered = train_lib.lower_train_step(task, start, exp.rng_state, batches[0], "cpu")
        steps[name] = (lowered.compile(), start)
    compiled, start = steps["auto"]
    formats = jax.tree.leaves(compiled.input_formats[0][0])
    assert jax.tree.leaves(compiled.output_formats[0]) == formats
    # XLA:CPU's own choice is row-major, so the arguments' column-major layouts were not kept
    assert all(
        f.layout.major_to_minor == tuple(range(len(f.layout.major_to_minor))) for f in formats
    )
    with pytest.raises(ValueError, match="layouts"):
        compiled(start, exp.rng_state, batches[0])
    placed = train_lib.in_step_layouts(start, compiled)
    assert [x.format for x in jax.tree.leaves(placed)] == formats
    for before, after in zip(jax.tree.leaves(start), jax.tree.leaves(placed), strict=True):
        assert (after is before) == (before.ndim < 2)  # only the relaid arrays are new

    results = {}
    for name, (compiled, start) in steps.items():
        state_now = placed if name == "auto" else start
        for batch in batches:
            state_now, metrics = compiled(state_now, exp.rng_state, batch)
        results[name] = jax.device_get((state_now, metrics))
    jax.tree.map(np.testing.assert_array_equal, results["auto"], results["default"])
