"""The data x fsdp x tensor mesh (xformer/sharding.py): the sizes and rules, then 8 simulated
devices in a subprocess: four meshes train like one device, parameters sit where the rules say,
per-device parameter + optimizer bytes shrink by fsdp x tensor, checkpoints restore onto
other meshes and device counts, and fsdp sharing a dimension with tensor trains exactly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_grad_accum import TOLERANCE, run_steps, tiny_task

from xformer import config as config_lib
from xformer import sharding
from xformer.checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("translation", "language_modeling")
MESHES = {  # the four 8-device meshes
    "data8": {"data": 8},
    "data2_fsdp4": {"data": 2, "fsdp": 4},
    "data2_tensor4": {"data": 2, "tensor": 4},
    "fsdp2_tensor4": {"fsdp": 2, "tensor": 4},
}
VOCAB = 32  # divides over every mesh axis, so every weight matrix can be split
# Widths fsdp=4 cannot split (18 = 2 x 9, 36 = 4 x 9 but not 8): at (fsdp=4, tensor=2) fsdp
# shares the vocabulary's rows with tensor
ODD_WIDTHS = {"model.d_model": 18, "model.num_heads": 2, "model.d_ff": 36}
SHARED_MESHES = {"data8": {"data": 8}, "fsdp4_tensor2": {"fsdp": 4, "tensor": 2}}


def mesh_overrides(shape: dict) -> dict:
    return {f"mesh.{axis}": shape.get(axis, 1) for axis in sharding.MESH_AXES}


def _task(family: str, workdir: str, shape: dict):
    return tiny_task(family, workdir, vocab=VOCAB, **mesh_overrides(shape))


def _leaves(tree) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree.leaves_with_path(tree)}


# Sizes and rules (one process, no devices needed) --------------------------------------------


def test_mesh_shape_fills_in_the_rest_and_rejects_misfits():
    assert sharding.mesh_shape({"data": -1, "fsdp": 4, "tensor": 1}, 8) == (2, 4, 1)
    assert sharding.mesh_shape({"data": 1, "fsdp": 2, "tensor": -1}, 8) == (1, 2, 4)
    for shape, message in [
        ({"data": 3, "fsdp": 1, "tensor": 1}, "the mesh has 3 devices, but there are 8"),
        ({"data": -1, "fsdp": 3, "tensor": 1}, "8 devices do not divide by 3"),
        ({"data": -1, "fsdp": -1, "tensor": 1}, "at most one -1"),
        ({"data": 0, "fsdp": 8, "tensor": 1}, "sizes must be >= 1"),
        ({"pipeline": 2}, "not mesh axes"),
    ]:
        with pytest.raises(ValueError, match=message):
            sharding.mesh_shape(shape, 8)


def test_mesh_spec_follows_the_rules():
    """Rules first; a dimension that does not divide is replicated; FSDP then takes the largest
    free dimension that divides when the rules gave it none, or else shares one with tensor."""
    mesh = sharding.abstract_mesh((2, 4, 2))  # data, fsdp, tensor

    def spec(names, shape):
        return sharding.mesh_spec(P(*names), shape, mesh)

    assert spec(("embed", "mlp"), (16, 32)) == P("fsdp", "tensor")
    assert spec(("heads", "embed"), (16, 16)) == P("tensor", "fsdp")
    assert spec(("vocab", "embed"), (29, 16)) == P(None, "fsdp")  # 29 types: not over tensor
    assert spec(("embed", "mlp"), (410, 2100)) == P(None, "tensor")  # 410 % 4: no FSDP
    assert spec(("vocab", None), (30, 12)) == P("tensor", "fsdp")  # FSDP on the free dim
    assert spec(("vocab", None), (31, 12)) == P(None, "fsdp")
    # No free dimension divides over fsdp: it shares the largest one tensor splits, if that
    # divides over both (WikiText-103's table; 2100 above does not, 2104 does)
    assert spec(("vocab", "embed"), (267_736, 410)) == P(("tensor", "fsdp"), None)
    assert spec(("embed", "mlp"), (410, 2104)) == P(None, ("tensor", "fsdp"))
    assert spec(("mlp",), (2104,)) == P("tensor")  # a vector: not worth a gather more
    assert spec(("vocab", "embed"), (267_735, 410)) == P(None, None)
    assert spec((), ()) == P()  # a scalar (Adam's count)
    fsdp8 = sharding.abstract_mesh((1, 8, 1))
    assert sharding.mesh_spec(P("embed", "mlp"), (410, 2104), fsdp8) == P(None, "fsdp")
    assert sharding.mesh_spec(P("embed", "mlp"), (410, 2100), fsdp8) == P(None, None)
    with pytest.raises(ValueError, match="no rule"):
        sharding.logical(nnx.initializers.zeros_init(), "embed", "width")


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("fsdp", 0, "must be integers >= 1"),
        ("tensor", -1, "at most one of them -1"),  # data is -1 already
        ("fsdp", 1.5, r"config key .mesh.fsdp. must be int, got 1.5"),
    ],
)
def test_bad_mesh_keys_are_refused_by_validate(key, value, message):
    config = config_lib.base_config()
    with config.ignore_type():
        config.mesh[key] = value
    with pytest.raises(ValueError, match=message):
        config_lib.validate(config)


def test_batches_must_divide_over_the_row_shards():
    config = config_lib.base_config()
    config.mesh.data, config.mesh.fsdp = 2, 4  # 8 row shards
    config.train.batch_size, config.eval.batch_size = 16, 12
    with pytest.raises(ValueError, match=r"eval.batch_size=12 .*mesh.data x mesh.fsdp = 2 x 4"):
        config_lib.check_devices(config, 8)
    config.mesh.data, config.mesh.tensor = 1, 2  # 4 row shards; tensor holds copies
    config_lib.check_devices(config, 8)
    with pytest.raises(ValueError, match="the mesh has 8 devices, but there are 2"):
        config_lib.check_devices(config, 2)


# 8 simulated devices ------------------------------------------------------------------------


def _eight_devices(workdir: Path, seed: int) -> dict:
    """Run this file as a script on 8 simulated devices (see `_worker`); its JSON report."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    result = subprocess.run(
        [sys.executable, __file__, str(workdir), str(seed)],
        cwd=ROOT,
        env={**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((workdir / "report.json").read_text())


def test_meshes_train_like_one_device_and_checkpoints_move_between_them(tmp_path):
    """Both families, 3 steps in float64 from the same start and batches (XL memory carried):
    on each mesh of MESHES every metric, parameter, Adam moment and memory equals the
    one-device run (TOLERANCE of test_grad_accum: only summation order differs). Each
    parameter's sharding is its rules' (qkv [d, 3, d] is ("fsdp", None, "tensor") on
    fsdp2_tensor4), and
    per-device parameter + Adam bytes are at least 85% of the way to total / (fsdp x tensor).
    Checkpoints: the one-device final state restores onto fsdp2_tensor4 and data8 with their
    shardings; one saved on a 4-device fsdp mesh restores onto a 2-device data mesh and the
    reverse; the fsdp2_tensor4 final state restores here on one device. All values exact."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    with jax.enable_x64(True):
        expected = {}
        for family in FAMILIES:
            task = _task(family, str(tmp_path / family), {"data": 1})
            steps = run_steps(task, seed)
            expected[family] = [_leaves(step) for step in steps]
            ckpt = Checkpointer(str(tmp_path / "one_device" / family))
            state = {k: v for k, v in steps[-1][0].items() if k != "carry"}
            ckpt.save(3, state)
            ckpt.close()
        report = _eight_devices(tmp_path, seed)
        for family in FAMILIES:
            for name, shape in MESHES.items():
                got = np.load(tmp_path / f"{family}_{name}.npz")
                for i, step in enumerate(expected[family]):
                    for key, value in step.items():
                        what = f"{family} on {name}, step {i + 1}: {key}"
                        np.testing.assert_allclose(
                            got[f"{i}/{key}"], value, **TOLERANCE, err_msg=what
                        )
                factor = shape.get("fsdp", 1) * shape.get("tensor", 1)
                sizes = report["bytes"][f"{family}_{name}"]
                assert sizes["max"] <= sizes["total"] / (0.85 * factor), (family, name, sizes)
                assert sizes["max"] == sizes["max_from_shards"]  # per_device_bytes is right
            for where in ("fsdp2_tensor4", "data8"):
                restored = np.load(tmp_path / f"{family}_restored_{where}.npz")
                final = expected[family][-1]
                for key in restored.files:
                    np.testing.assert_array_equal(restored[key], final[f"[0]{key}"], err_msg=key)
            # the fsdp2_tensor4 run's checkpoint, restored onto this one device
            task = _task(family, str(tmp_path / "restore_here" / family), {"data": 1})
            target = task.exp.init_state()
            target.pop("carry")
            state, _ = Checkpointer(str(tmp_path / "fsdp2_tensor4" / family)).restore(target)
            got = np.load(tmp_path / f"{family}_fsdp2_tensor4.npz")
            for key, value in _leaves(state).items():
                np.testing.assert_array_equal(value, got[f"2/[0]{key}"], err_msg=key)
        assert report["specs"]["translation_fsdp2_tensor4"]["qkv"] == ["fsdp", None, "tensor"]
        assert report["specs"]["translation_data2_tensor4"]["ffn_down"] == ["tensor", None]
        assert report["specs"]["translation_data2_fsdp4"]["ffn_down"] == [None, "fsdp"]
        for family in FAMILIES:
            assert report["moves"][family] == ["fsdp4->data2", "data2->fsdp4"]
            # fsdp sharing a dimension with tensor trains like parameters held whole
            assert report["shared"][family], report["shared"]  # e.g. the table's rows
            whole, shared = (np.load(tmp_path / f"{family}_odd_{m}.npz") for m in SHARED_MESHES)
            assert whole.files == shared.files
            for key in whole.files:
                np.testing.assert_allclose(shared[key], whole[key], **TOLERANCE, err_msg=key)


def _target(exp, mesh) -> dict:
    """The train state (less the carry) as ShapeDtypeStructs placed on `mesh`."""
    abstract = jax.eval_shape(exp.init_state)
    abstract.pop("carry")
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract,
        exp.state_shardings(mesh),
    )


def _restore(path: Path, target: dict) -> dict:
    """Restore the checkpoint at `path` onto `target`, checking every array's sharding."""
    state, _ = Checkpointer(str(path)).restore(target)
    for x, t in zip(jax.tree.leaves(state), jax.tree.leaves(target), strict=True):
        assert x.sharding.is_equivalent_to(t.sharding, x.ndim), (x.sharding, t.sharding)
    return state


def _save(path: Path, state: dict) -> None:
    ckpt = Checkpointer(str(path))
    ckpt.save(3, state)
    ckpt.close()


def _checkpoint_moves(exp, family: str, workdir: Path) -> list[str]:
    """The one-device checkpoint onto fsdp2_tensor4 and data8 (values written for the test to
    compare); then 4-device fsdp -> 2-device data and back, each compared exactly here."""
    for where in ("fsdp2_tensor4", "data8"):
        mesh = sharding.make_mesh(MESHES[where])
        state = _restore(workdir / "one_device" / family, _target(exp, mesh))
        np.savez(workdir / f"{family}_restored_{where}.npz", **_leaves(state))
    devices = jax.devices()
    fsdp4 = sharding.make_mesh({"fsdp": 4}, devices[:4])
    data2 = sharding.make_mesh({"data": 2}, devices[4:6])
    start = _restore(workdir / "one_device" / family, _target(exp, fsdp4))
    moves = []
    for (a, mesh_a), (b, mesh_b) in [
        (("fsdp4", fsdp4), ("data2", data2)),
        (("data2", data2), ("fsdp4", fsdp4)),
    ]:
        state = jax.device_put(start, exp.state_shardings(mesh_a))
        _save(workdir / f"move_{a}" / family, state)
        moved = _restore(workdir / f"move_{a}" / family, _target(exp, mesh_b))
        for x, y in zip(jax.tree.leaves(moved), jax.tree.leaves(start), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        moves.append(f"{a}->{b}")
    return moves


def _spec(param: nnx.Param) -> list:
    (array,) = jax.tree.leaves(param)
    return list(array.sharding.spec)


def _assert_placed_like(abstract: dict, state: dict) -> None:
    """abstract_state (a restore target made from shapes alone) has init_state's tree, shapes,
    dtypes and placement on this mesh."""
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    for (path, a), x in zip(
        jax.tree.leaves_with_path(abstract), jax.tree.leaves(state), strict=True
    ):
        where = jax.tree_util.keystr(path)
        assert (a.shape, a.dtype) == (x.shape, x.dtype), where
        assert a.sharding.is_equivalent_to(x.sharding, x.ndim), (where, a.sharding, x.sharding)


def _save_steps(path: Path, steps: list) -> None:
    """The states and metrics of `steps` as one .npz: "<step>/<leaf path>" -> value."""
    np.savez(
        path, **{f"{i}/{k}": v for i, step in enumerate(steps) for k, v in _leaves(step).items()}
    )


def _one_mesh(family: str, name: str, workdir: Path, seed: int, report: dict):
    """Train 3 steps on mesh `name`, write <family>_<name>.npz, add to the report; the task."""
    task = _task(family, str(workdir / name / family), MESHES[name])
    steps = run_steps(task, seed)
    _save_steps(workdir / f"{family}_{name}.npz", steps)
    state = task.exp.init_state()
    _assert_placed_like(task.exp.abstract_state(), state)
    held = {k: state[k] for k in ("params", "opt_state")}
    from_shards: dict = {}  # brute force: the bytes of each device's shards
    for shard in (s for x in jax.tree.leaves(held) for s in x.addressable_shards):
        from_shards[shard.device] = from_shards.get(shard.device, 0) + shard.data.nbytes
    sizes = sharding.per_device_bytes(held)
    report["bytes"][f"{family}_{name}"] = {**sizes, "max_from_shards": max(from_shards.values())}
    if family == "translation":
        layer = state["params"]["encoder"][0]
        report["specs"][f"{family}_{name}"] = {
            "qkv": _spec(layer["attn"]["qkv_proj"]["kernel"]),
            "ffn_down": _spec(layer["ffn"]["down"]["kernel"]),
        }
    if name == "fsdp2_tensor4":  # for the one-device process to restore
        final = {k: v for k, v in steps[-1][0].items() if k != "carry"}
        _save(workdir / name / family, jax.device_put(final, task.exp.state_shardings()))
    return task


def _worker(workdir: Path, seed: int) -> None:
    """The 8-device side of the test above: writes <family>_<mesh>.npz (step/leaf -> value),
    the restored checkpoints' values, and report.json (bytes, parameter specs, moves done)."""
    assert jax.device_count() == 8, jax.devices()
    report = {"bytes": {}, "specs": {}, "moves": {}, "shared": {}}
    with jax.enable_x64(True):
        for family in FAMILIES:
            for name in MESHES:
                task = _one_mesh(family, name, workdir, seed, report)
            report["moves"][family] = _checkpoint_moves(task.exp, family, workdir)
            for name, shape in SHARED_MESHES.items():
                overrides = {**ODD_WIDTHS, **mesh_overrides(shape)}
                task = tiny_task(
                    family, str(workdir / f"odd_{name}" / family), vocab=VOCAB, **overrides
                )
                _save_steps(workdir / f"{family}_odd_{name}.npz", run_steps(task, seed))
                if name == "fsdp4_tensor2":  # the specs that name two axes for one dimension
                    report["shared"][family] = [
                        str(s.spec)
                        for s in jax.tree.leaves(task.exp.state_shardings()["params"])
                        if any(isinstance(axes, tuple) for axes in s.spec)
                    ]
    (workdir / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), int(sys.argv[2]))
