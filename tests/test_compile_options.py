"""train_lib.compile_step: the train step's XLA options by platform (on a GPU, no Triton GEMM
fusions), where XLA_FLAGS has the last word and an option the installed XLA does not know is
dropped with a warning, never a failed run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformer import train_lib


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
