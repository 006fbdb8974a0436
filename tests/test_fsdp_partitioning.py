"""FSDP splits the batch rows and the parameters' d_model over one mesh axis; the model pins
every layer's input and output to the row split (sharding.constrain_rows), so that XLA's SPMD
partitioner gathers weights, not activations. Running this file as a script compiles the train
step of both families on 4 simulated devices (fsdp=4) and reports its collectives."""

import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from simulated_devices import run_script

from xformer import op_profile, sharding

# Activations [16384, 64] and wider: 8x the bytes of all the weights. (With d_model 16 the
# partitioner split even an unconstrained step by rows.)
ROWS, LENGTH, VOCAB = 512, 32, 256
WIDTHS = {"model.d_model": 64, "model.num_heads": 4, "model.d_ff": 256}


def _constraints(fn, x) -> list[P]:
    jaxpr = jax.make_jaxpr(fn)(x)
    return [e.params["sharding"].spec for e in jaxpr.eqns if "sharding" in e.primitive.name]


def test_constrain_rows_splits_rows_only_under_a_mesh_that_splits_them():
    x = jnp.asarray(np.random.default_rng().normal(size=(8, 3, 5)))
    assert _constraints(sharding.constrain_rows, x) == []  # no mesh: x as it is
    tensor_only = sharding.abstract_mesh((1, 1, 4))
    assert _constraints(sharding.traced_on(tensor_only, sharding.constrain_rows), x) == []
    rows = sharding.abstract_mesh((2, 4, 1))
    free = P.UNCONSTRAINED
    constrained = sharding.traced_on(rows, sharding.constrain_rows)
    assert _constraints(constrained, x) == [P(("data", "fsdp"), free, free)]
    np.testing.assert_array_equal(jax.jit(constrained)(x), x)


@pytest.mark.slow  # a subprocess on 4 simulated devices: ~10 s
def test_fsdp_step_gathers_weights_not_activations(tmp_path):
    """fsdp=4, float32, 512 rows of 32 tokens: each device receives per step at most 4x the
    parameter bytes (the weights gathered forward and backward, the gradients reduced; 2.4x
    and 2.1x measured); one activation of the whole batch is 8x. Without the row constraints
    the translation step received 441x: 255x all-gathered, 167x all-reduced, 20x all-to-all
    (the language model's was split by rows already)."""
    run_script(__file__, 4, str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    for family, found in report.items():
        params = found["param_bytes"]
        activation = ROWS * LENGTH * found["d_model"] * 4
        assert activation > 4 * params, found  # the bound below tells the two apart
        received = sum(c["gb"] * 1e9 for c in found["collectives"].values())
        assert received <= 4 * params, (family, found)
        assert "all-gather" in found["collectives"], found  # the weights are gathered


def _worker(workdir: Path) -> None:
    from test_grad_accum import tiny_task

    from xformer.train_lib import train_step

    assert jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng()
    report = {}
    for family in ("translation", "language_modeling"):
        task = tiny_task(
            family,
            str(workdir / family),
            vocab=VOCAB,
            **WIDTHS,
            **{"model.dtype": "float32", "model.param_dtype": "float32"},
            **{"train.batch_size": ROWS, "eval.batch_size": ROWS, "mesh.data": 1},
            **{"mesh.fsdp": 4},
            **({"data.segment_length": LENGTH} if family == "language_modeling" else {}),
        )
        exp = task.exp
        small = task.batch(rng)  # [8, 8] entries (rows of a reset flag: [8])
        batch = {
            k: np.tile(x, (ROWS // x.shape[0], *[LENGTH // n for n in x.shape[1:]]))
            for k, x in small.items()
        }
        carry = {}
        for name, x in task.carry(rng).items():
            axis = task.carry_batch_axes[name]
            reps = [1] * x.ndim
            reps[axis] = ROWS // x.shape[axis]
            where = NamedSharding(exp.mesh, sharding.batch_spec(exp.mesh, axis))
            carry[name] = jax.device_put(np.tile(x, reps), where)  # float64 -> float32
        state = exp.abstract_state(carry)
        batch = jax.device_put(batch, exp.batch_sharding)
        step = jax.jit(functools.partial(train_step, task))
        hlo = step.lower(state, exp.rng_state, batch).compile().as_text()
        report[family] = {
            "param_bytes": sum(x.size * 4 for x in jax.tree.leaves(exp.abstract_params)),
            "d_model": exp.model_cfg.d_model,
            "collectives": op_profile.collectives(hlo),
        }
    (workdir / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
