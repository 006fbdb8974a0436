"""linear.Projections (attention's q/k/v and k/v): both matmul forms (and the one a TPU gets)
against a numpy reference,
its draws against nnx.Linear's, and on a tensor-split mesh of 4 simulated CPU devices an
attention layer whose heads are split computes the same values and gradients as on one device
with no collective but the output projection's all-reduce (the side-by-side kernel made GSPMD
gather and permute activations)."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from simulated_devices import run_script

from xformer.linear import Linear, Projections


def _kernel_ranks(fn, *args) -> list[int]:
    """The rank of the right operand of every dot_general fn traces to."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [e.invars[1].aval.ndim for e in jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize(
    "form, backend, split_heads, rank",
    [("side by side", "cpu", False, 2), ("split heads", "cpu", True, 3), ("TPU", "tpu", False, 3)],
)
@pytest.mark.parametrize("use_bias", [False, True])
def test_projections_match_numpy_with_gradients(
    form, backend, split_heads, rank, use_bias, monkeypatch
):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)  # a TPU's form, run on CPU
    rng = np.random.default_rng()
    with jax.enable_x64(True):
        proj = Projections(
            6, 3, 8, split_heads=split_heads, use_bias=use_bias, param_dtype=jnp.float64,
            rngs=nnx.Rngs(int(rng.integers(1 << 30))),
        )  # fmt: skip
        assert _kernel_ranks(proj, jax.ShapeDtypeStruct((2, 5, 6), jnp.float64)) == [rank], form
        kernel = rng.standard_normal((6, 3, 8))
        bias = rng.standard_normal((3, 8))
        proj.kernel[...] = jnp.asarray(kernel)
        if use_bias:
            proj.bias[...] = jnp.asarray(bias)
        x, cotangent = rng.standard_normal((2, 5, 6)), rng.standard_normal((2, 5, 3, 8))
        out, pullback = jax.vjp(proj, jnp.asarray(x))
        (grad_x,) = pullback(jnp.asarray(cotangent))
        want = np.einsum("bld,dne->blne", x, kernel) + (bias if use_bias else 0.0)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(
            grad_x, np.einsum("blne,dne->bld", cotangent, kernel), rtol=1e-12, atol=1e-12
        )
        _, grads = nnx.value_and_grad(lambda m: jnp.sum(m(jnp.asarray(x)) * cotangent))(proj)
        np.testing.assert_allclose(
            grads["kernel"][...],
            np.einsum("bld,blne->dne", x, cotangent),
            rtol=1e-12,
            atol=1e-12,  # sums of 10 products of O(1) terms: a near-0 entry's relative error
        )
        if use_bias:
            np.testing.assert_allclose(
                grads["bias"][...], cotangent.sum((0, 1)), rtol=1e-12, atol=1e-12
            )


def test_projections_draw_the_kernel_of_a_linear_of_n_times_the_features():
    seed = int(np.random.default_rng().integers(1 << 30))
    proj = Projections(16, 3, 16, rngs=nnx.Rngs(seed))
    linear = Linear(16, 48, rngs=nnx.Rngs(seed))
    np.testing.assert_array_equal(
        np.asarray(proj.kernel[...]).reshape(16, 48), np.asarray(linear.kernel[...])
    )
    assert proj.bias[...].shape == (3, 16) and not np.any(proj.bias[...])


def test_a_checkpoint_of_the_side_by_side_kernel_is_refused_with_its_cause(tmp_path):
    from xformer.checkpoint import Checkpointer

    old = {"kernel": jnp.asarray(np.random.default_rng().normal(size=(8, 24)))}
    checkpointer = Checkpointer(str(tmp_path))
    checkpointer.save(1, old)
    checkpointer.close()
    cause = r"until 2026-11-27 attention's q/k/v kernels were \[d, 3d\]"
    with pytest.raises(ValueError, match=cause):
        Checkpointer(str(tmp_path)).restore({"kernel": jnp.zeros((8, 3, 8))})


def test_split_heads_attention_needs_no_gathers(tmp_path):
    run_script(__file__, 4, str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    for kind in ("self", "memory"):
        split, side_by_side = report[kind]["split"], report[kind]["side_by_side"]
        assert split["gap"] < 1e-12 and side_by_side["gap"] < 1e-12, report
        # The output projection's all-reduce (forward) and the input gradient's (backward).
        assert set(split["collectives"]) == {"all-reduce"}, split
        # What split_heads avoids: without it GSPMD regroups the heads across devices.
        assert set(side_by_side["collectives"]) - {"all-reduce"}, side_by_side


def _worker(workdir: Path) -> None:
    from xformer import op_profile, sharding
    from xformer.attention import MultiHeadAttention

    assert jax.device_count() == 4, jax.devices()
    jax.config.update("jax_enable_x64", True)
    mesh = sharding.make_mesh({"tensor": 4})
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 6, 32))
    memory = rng.standard_normal((2, 3, 32))
    report = {}
    for kind in ("self", "memory"):
        report[kind] = {}
        mask = np.tril(np.ones((6, 6 + 3 * (kind == "memory")), bool), k=3 * (kind == "memory"))
        args = (x, mask[None, None], memory if kind == "memory" else None)
        reference = None
        for name, split_heads in (("split", True), ("side_by_side", False)):
            attn = MultiHeadAttention(
                32, 8, kind=kind, dropout=0.0, split_heads=split_heads,
                param_dtype=jnp.float64, rngs=nnx.Rngs(0),
            )  # fmt: skip
            graphdef, params, rest = nnx.split(attn, nnx.Param, ...)

            def loss(params, x, mask, memory, graphdef=graphdef, rest=rest):
                out = nnx.merge(graphdef, params, rest)(x, mask, memory=memory)
                return jnp.sum(jnp.sin(out))

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            one_device = jax.tree.leaves(step(params, *args))
            if reference is None:
                reference = one_device
            placed = jax.device_put(params, sharding.param_shardings(params, mesh))
            hlo = step.lower(placed, *args).compile().as_text()
            split_out = jax.tree.leaves(step(placed, *args))
            gap = max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(split_out + one_device, reference + reference, strict=True)
            )
            found = op_profile.collectives(hlo)
            report[kind][name] = {"gap": gap, "collectives": sorted(found)}
    (workdir / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
