"""The device mesh and where arrays live on it.

The mesh has three named axes: "data" (batch rows), "fsdp" (batch rows, and parameters with
their optimizer state sharded over it) and "tensor" (attention heads, the FFN's inner width and
vocabularies split over it). Parameters carry logical axis names as Flax NNX sharding metadata
(`logical`, at their creation); RULES maps each logical name to a mesh axis. A dimension that
does not divide over its mesh axis is replicated instead (e.g. a 267,735-type vocabulary).
Steps are traced under their mesh (`traced_on`): activations keep their batch rows split
(`constrain_rows`), and row-wise work that the partitioner would not split by rows runs on
each device's own rows (`per_row_shard`).
"""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # batch rows are split over both
# every axis the SPMD partitioner's to use (jax 0.11's AbstractMesh defaults to Explicit axes,
# on which `constrain_rows`'s P.UNCONSTRAINED dimensions are an error)
AXIS_TYPES = (AxisType.Auto,) * len(MESH_AXES)

RULES: dict[str, str | None] = {  # logical axis -> mesh axis (None: replicated)
    "embed": "fsdp",  # the model width d_model of weight matrices and embedding tables
    "heads": "tensor",  # the H * D outputs of q/k/v projections (inputs of the output one)
    "mlp": "tensor",  # the FFN's inner width d_ff
    "vocab": "tensor",  # token types of embedding tables and output layers
    "cluster": None,  # adaptive softmax: the cluster logits
    "relative": None,  # T5 relative-position buckets
    "head_dim": None,  # per-head vectors (Transformer-XL u, v)
}


def logical(init: Callable, *names: str | None) -> Callable:
    """An initializer whose parameter carries the logical axis `names`, one per dimension."""
    unknown = [n for n in names if n is not None and n not in RULES]
    if unknown:
        raise ValueError(f"logical axes {unknown} have no rule in sharding.RULES")
    # eager_sharding=False: the parameter is created whole, and placed by the jitted init.
    return nnx.with_partitioning(init, names, eager_sharding=False)


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of axes MESH_AXES sized by `shape` ({"data": -1, "fsdp": 1, "tensor": 1}; one
    size may be -1: the devices left), over `devices` (default: every device of every process).
    Raises ValueError naming the `mesh.*` keys when the sizes do not fit the device count."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(shape, len(devices))
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=AXIS_TYPES)


def abstract_mesh(sizes: tuple[int, int, int]) -> AbstractMesh:
    """A mesh of (data, fsdp, tensor) `sizes` without devices, its axes typed as make_mesh's."""
    return AbstractMesh(sizes, MESH_AXES, axis_types=AXIS_TYPES)


def parse_mesh(text: str) -> dict[str, int]:
    """A command-line mesh, data,fsdp,tensor (e.g. "2,4,1"; one size may be -1) -> the sizes
    by MESH_AXES. Raises ValueError unless it is three integers."""
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != len(MESH_AXES):
        raise ValueError("give three integer sizes, data,fsdp,tensor")
    return dict(zip(MESH_AXES, sizes, strict=True))


def mesh_shape(shape: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
    """(data, fsdp, tensor) sizes with the -1 filled in; see make_mesh."""
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh keys {sorted(unknown)} are not mesh axes {MESH_AXES}")
    sizes = [int(shape.get(axis, 1)) for axis in MESH_AXES]
    keys = ", ".join(f"mesh.{a}={s}" for a, s in zip(MESH_AXES, sizes, strict=True))
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"{keys}: sizes must be >= 1, with at most one -1 (the rest)")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"{keys}: {num_devices} devices do not divide by {known}")
        sizes[sizes.index(-1)] = num_devices // known
    if int(np.prod(sizes)) != num_devices:
        raise ValueError(
            f"{keys}: the mesh has {int(np.prod(sizes))} devices, but there are {num_devices}"
        )
    return tuple(sizes)


def row_blocks(owners: np.ndarray) -> tuple[list[int], int]:
    """Which block of the batch rows each process reads, and how many blocks there are.

    owners [data, fsdp, tensor]: the process index of each device of the mesh. The batch rows
    split into data x fsdp shards, each held by its tensor axis's devices; a process reads the
    rows of every shard its devices hold. Processes whose devices hold the same shards
    (mesh.tensor spanning them) read the same block; the blocks are equal runs of shards.
    Raises ValueError when the processes' shards overlap otherwise."""
    shards = owners.reshape(-1, owners.shape[-1])  # [row shards, tensor]
    processes = int(owners.max()) + 1
    held = [tuple(np.flatnonzero((shards == p).any(axis=1))) for p in range(processes)]
    blocks = sorted(set(held))
    size = len(blocks[0])
    if any(b != tuple(range(i * size, (i + 1) * size)) for i, b in enumerate(blocks)):
        raise ValueError(
            f"mesh.tensor={owners.shape[-1]} splits the row shards of the mesh unevenly over "
            f"{processes} processes of {owners.size // processes} devices each: it must divide, "
            "or be a multiple of, each process's device count"
        )
    return [blocks.index(h) for h in held], len(blocks)


def process_row_block(mesh: Mesh) -> tuple[int, int]:
    """(this process's block of the batch rows, the number of blocks): see row_blocks."""
    owners = np.vectorize(lambda d: d.process_index)(mesh.devices)
    blocks, count = row_blocks(owners)
    return blocks[jax.process_index()], count


def batch_spec(mesh: Mesh, axis: int = 0) -> P:
    """Rows (dimension `axis`) over data x fsdp; the tensor axis holds copies."""
    return P(*[None] * axis, BATCH_AXES)


def batch_rows(mesh: Mesh) -> int:
    """How many ways batch rows are split: data x fsdp."""
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def _row_mesh() -> Any:
    """The abstract mesh of the trace's context (`traced_on`) if it splits batch rows, else
    None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or all(mesh.shape.get(axis, 1) == 1 for axis in BATCH_AXES):
        return None
    return mesh


def constrain_rows(x: jax.Array) -> jax.Array:
    """x [B, ...] with its rows split over data x fsdp (its other dimensions left to the
    partitioner) when traced under a mesh (`traced_on`) that splits rows; else x unchanged.

    The model calls it on every layer's input and output. Without it, XLA's SPMD partitioner
    is free to split a [B * L, d] x [d, d_ff] matmul by the fsdp-sharded d of the weight
    rather than by the rows of the activation, and under FSDP it did: it gathered and reduced
    whole-batch activations (Transformer base, fsdp=4: 23 GB per device per step) instead of
    gathering the weights (0.5 GB)."""
    if _row_mesh() is None:
        return x
    return jax.lax.with_sharding_constraint(x, P(BATCH_AXES, *[P.UNCONSTRAINED] * (x.ndim - 1)))


def per_row_shard(fn: Callable, rows: tuple, shared: tuple) -> Any:
    """fn(*rows, *shared) computed by each device on its own rows, when traced under a mesh
    (`traced_on`) that splits them: every array of `rows` [N, ...] and fn's results [N, ...]
    are split over data x fsdp by dimension 0, `shared` is whole on every row shard (its
    gradient summed over them); the tensor axis stays the partitioner's. Else fn on the whole.

    For work that XLA's SPMD partitioner cannot split by rows itself, e.g. adaptive.py's
    capacity gather, which picks rows by a cumulative count over all N: left to the
    partitioner, every device gathers and scores the whole batch's rows."""
    mesh = _row_mesh()
    if mesh is None:
        return fn(*rows, *shared)
    row_spec = P(BATCH_AXES)
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(*[row_spec] * len(rows), *[P()] * len(shared)),
        out_specs=row_spec,
        axis_names=set(BATCH_AXES),
        # fn may build values that do not vary over the shards inside per-shard control flow
        # (adaptive.py's unused zero residuals); unchecked, shard_map still sums `shared`'s
        # gradient over the shards (tests/test_adaptive.py checks it against one device)
        check_vma=False,
    )(*rows, *shared)


def traced_on(mesh: Mesh, fn: Callable) -> Callable:
    """fn, run with `mesh` as the context of `constrain_rows` and `per_row_shard`: the function
    a step jits, or one it calls while traced."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def row_local_top_k(mesh: Mesh) -> Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]:
    """`jax.lax.top_k` on each device's rows (dimension 0 over data x fsdp; `per_row_shard`).
    XLA's SPMD partitioner replicates top_k, all-gathering its whole operand (a beam search's
    [rows, beam, vocabulary] log-probabilities at every step); rows are independent, so each
    device can take its own rows' top k."""
    if batch_rows(mesh) == 1:
        return jax.lax.top_k

    def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        return per_row_shard(lambda rows: tuple(jax.lax.top_k(rows, k)), (x,), ())

    return traced_on(mesh, top_k)


def mesh_spec(logical_spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """Logical axis names -> mesh axes by RULES, each mesh axis used at most once; a dimension
    that does not divide over its axis (or an axis of size 1) is replicated. FSDP shards every
    parameter it can: when the rules gave no dimension "fsdp" (the width does not divide, or
    there is none), the largest free dimension that divides takes it, or failing one, in a
    matrix or table, the largest dimension another axis splits that divides over both (e.g.
    WikiText-103's [267736, 410] table at fsdp=4, tensor=2: its rows over ("tensor", "fsdp");
    vectors are left as they are: little memory, and a gather more in every step)."""
    names = tuple(logical_spec) + (None,) * (len(shape) - len(logical_spec))
    out: list[str | tuple[str, str] | None] = []
    for name, size in zip(names, shape, strict=True):
        axis = RULES.get(name) if isinstance(name, str) else None
        if axis is None or axis in out or mesh.shape[axis] == 1 or size % mesh.shape[axis]:
            axis = None
        out.append(axis)
    fsdp = mesh.shape["fsdp"]
    if "fsdp" not in out and fsdp > 1:
        free = [i for i, size in enumerate(shape) if out[i] is None and size % fsdp == 0]
        split = [
            i for i, size in enumerate(shape) if out[i] and size % (mesh.shape[out[i]] * fsdp) == 0
        ]
        if free:
            out[max(free, key=lambda i: shape[i])] = "fsdp"
        elif split and len(shape) > 1:
            i = max(split, key=lambda i: shape[i])
            out[i] = (out[i], "fsdp")
    return P(*out)


def param_shardings(abstract_params: nnx.State, mesh: Mesh) -> Any:
    """NamedSharding of each parameter (a tree like `abstract_params`, of arrays or
    ShapeDtypeStructs still wrapped in their nnx Variables) from its logical axes."""
    specs = nnx.get_partition_spec(abstract_params)

    def sharding(spec, x):
        return NamedSharding(mesh, mesh_spec(spec, x.shape, mesh))

    return jax.tree.map(sharding, specs, abstract_params, is_leaf=lambda x: isinstance(x, P))


def per_device_bytes(tree: Any) -> dict[str, int]:
    """Bytes of `tree`'s arrays (or ShapeDtypeStructs with shardings) held by each device:
    {"max": largest over devices, "total": summed over the tree's global shapes}."""
    per_device: dict[Any, int] = {}
    total = 0
    for x in jax.tree.leaves(tree):
        itemsize = np.dtype(x.dtype).itemsize
        total += int(np.prod(x.shape)) * itemsize
        for device, index in x.sharding.devices_indices_map(x.shape).items():
            shard = [len(range(*s.indices(n))) for s, n in zip(index, x.shape, strict=True)]
            per_device[device] = per_device.get(device, 0) + int(np.prod(shard)) * itemsize
    return {"max": max(per_device.values(), default=0), "total": total}
