"""What every model family shares: mesh, model graphs, train state, optimizer, checkpoints."""

import dataclasses
import json
import logging
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from absl import logging as absl_logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xformer import config as config_lib
from xformer import sharding
from xformer.checkpoint import Checkpointer
from xformer.files import write_json
from xformer.optim import make_optimizer

CONFIG_FILE = "config.json"
AVERAGED_FILE = "averaged.json"  # average.py's output: averaged parameters, no optimizer state


@dataclasses.dataclass
class Experiment:
    """Everything a model family needs to train and evaluate, independent of the family."""

    config: ml_collections.ConfigDict
    workdir: str
    mesh: Mesh
    model_cls: type[nnx.Module]
    model_cfg: Any  # the family's frozen model dataclass
    train_graphdef: nnx.GraphDef  # dropout active
    eval_graphdef: nnx.GraphDef  # deterministic
    abstract_params: nnx.State  # the parameters' shapes, dtypes and logical axes; no values
    rng_state: nnx.State  # dropout RNG streams (all non-parameter state, replicated), re-keyed
    # each step
    tx: optax.GradientTransformation
    checkpointer: Checkpointer

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def batch_sharding(self) -> NamedSharding:
        """Batch rows over the data x fsdp mesh axes."""
        return NamedSharding(self.mesh, sharding.batch_spec(self.mesh))

    def make_model(self, rngs: nnx.Rngs) -> nnx.Module:
        return self.model_cls(self.model_cfg, rngs=rngs)

    def _init(self) -> dict:
        params = nnx.state(self.make_model(model_rngs(self.config.train.seed)), nnx.Param)
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": self.tx.init(params),
        }

    def state_shardings(self, mesh: Mesh | None = None) -> dict:
        """Where each array of the train state (less the carry) lives on `mesh` (default: the
        experiment's): parameters by their logical axes (sharding.RULES), Adam's moments like
        their parameters, the rest copied."""
        mesh = mesh or self.mesh
        replicated = NamedSharding(mesh, P())
        abstract = self._abstract_train_state()
        params = sharding.param_shardings(abstract["params"], mesh)
        opt_state = optax.tree_map_params(
            self.tx,
            lambda _, param_sharding: param_sharding,
            abstract["opt_state"],
            params,
            transform_non_params=lambda _: replicated,
        )
        return {"step": replicated, "params": params, "opt_state": opt_state}

    def init_state(self, carry: Any = None) -> dict:
        """A fresh train state {"step", "params", "opt_state", "carry"} placed by
        `state_shardings`; `carry` is state that flows from step to step (e.g. an XL memory),
        already sharded."""
        state = jax.jit(self._init, out_shardings=self.state_shardings())()
        return {**state, "carry": carry or {}}

    def abstract_state(self, carry: Any = None) -> dict:
        """`init_state`'s ShapeDtypeStructs, placed by `state_shardings` (and `carry`'s as they
        are), from shapes alone: a restore target that initialises nothing."""
        placed = jax.tree.map(
            lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
            self._abstract_train_state(),
            self.state_shardings(),
        )
        carry = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), carry or {}
        )
        return {**placed, "carry": carry}

    def _abstract_train_state(self) -> dict:
        """The shapes and dtypes of `_init`'s state, without tracing the model again."""
        return {
            "step": jax.ShapeDtypeStruct((), jnp.int32),
            "params": self.abstract_params,
            "opt_state": jax.eval_shape(self.tx.init, self.abstract_params),
        }

    def on_mesh(self, mesh: Mesh) -> "Experiment":
        """This experiment for another mesh of the same axes, e.g. compile-only devices
        (bench/gpu_compile.py); rng_state stays where it is."""
        model_cfg, _, train, params, evaluation = _model_graphs(
            self.model_cls, self.model_cfg, mesh
        )
        return dataclasses.replace(
            self,
            mesh=mesh,
            model_cfg=model_cfg,
            train_graphdef=train,
            abstract_params=params,
            eval_graphdef=evaluation,
        )

    def graphdef_for(self, model_cfg: Any) -> nnx.GraphDef:
        """An evaluation graph for a variant of the model config with the same parameters
        (e.g. Transformer-XL evaluated with another clamp_len)."""
        model = nnx.eval_shape(lambda: self.model_cls(model_cfg, rngs=model_rngs(0)))
        model.eval()
        return nnx.split(model, nnx.Param, ...)[0]


def model_rngs(seed: int) -> nnx.Rngs:
    """Parameter and dropout streams. The dropout stream must carry the "dropout" tag: the train
    step re-keys it every step with `nnx.reseed(model, dropout=...)`, which ignores streams that
    fell back to "default" (those would repeat the same dropout masks at every step)."""
    return nnx.Rngs(params=seed, dropout=seed)


def _model_graphs(model_cls: type[nnx.Module], model_cfg: Any, mesh: Mesh) -> tuple:
    """(model config for this mesh, abstract model, train graph, abstract parameters, evaluation
    graph). A model config with split_heads (model_config.StackConfig) is told whether the mesh
    splits attention heads."""
    if hasattr(model_cfg, "split_heads"):
        model_cfg = dataclasses.replace(model_cfg, split_heads=mesh.shape["tensor"] > 1)
    model = nnx.eval_shape(lambda: model_cls(model_cfg, rngs=model_rngs(0)))
    train_graphdef, abstract_params, _ = nnx.split(model, nnx.Param, ...)
    model.eval()
    eval_graphdef, _, _ = nnx.split(model, nnx.Param, ...)
    return model_cfg, model, train_graphdef, abstract_params, eval_graphdef


def _dropout_stream_state(model: nnx.Module, mesh: Mesh) -> nnx.State:
    """The state of an abstract model's RNG streams (all its non-parameter state), replicated
    on every device of the mesh. Its values reach no computation: the train step re-keys every
    dropout stream (nnx.reseed) and evaluation draws nothing. So they are made from the shapes
    alone, without tracing or compiling the model."""
    state = nnx.state(model, nnx.Not(nnx.Param))
    others = jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Any(nnx.Param, nnx.RngState))))
    streams = [s for _, s in nnx.graph.iter_graph(model) if isinstance(s, nnx.RngStream)]
    tags = sorted({stream.key.tag for stream in streams} - {"dropout"})
    if others or tags:
        raise ValueError(
            f"the model keeps {len(others)} non-parameter, non-RNG arrays and RNG streams {tags}: "
            "the train step sets neither (it re-keys the dropout streams only)"
        )

    def placeholder(leaf: jax.ShapeDtypeStruct) -> jax.Array:
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return jnp.broadcast_to(jax.random.key(0), leaf.shape)
        return jnp.zeros(leaf.shape, leaf.dtype)

    # jit, not device_put: device_put cannot place an array on other processes' devices
    make = jax.jit(lambda: jax.tree.map(placeholder, state), out_shardings=NamedSharding(mesh, P()))
    return make()


def quiet_library_logs() -> None:
    """Drop orbax's per-save INFO chatter from absl logs; warnings and errors still show."""

    class _Filter(logging.Filter):
        def filter(self, record):
            return record.levelno >= logging.WARNING or "orbax" not in record.pathname

    absl_logging.get_absl_handler().addFilter(_Filter())


def setup(
    config: ml_collections.ConfigDict,
    workdir: str,
    model_cls: type[nnx.Module],
    model_cfg: Any,
) -> Experiment:
    """Mesh, model graphs, optimizer and checkpointer for a validated config (`make_task`
    checks it against the devices)."""
    mesh = sharding.make_mesh(config.mesh)
    os.makedirs(workdir, exist_ok=True)
    model_cfg, model, train_graphdef, abstract_params, eval_graphdef = _model_graphs(
        model_cls, model_cfg, mesh
    )
    rng_state = _dropout_stream_state(model, mesh)
    return Experiment(
        config=config,
        workdir=workdir,
        mesh=mesh,
        model_cls=model_cls,
        model_cfg=model_cfg,
        train_graphdef=train_graphdef,
        eval_graphdef=eval_graphdef,
        abstract_params=abstract_params,
        rng_state=rng_state,
        tx=make_optimizer(config.train),
        checkpointer=Checkpointer(workdir, config.train.keep_checkpoints),
    )


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    if jax.process_index() == 0:
        write_json(os.path.join(workdir, CONFIG_FILE), json.loads(config.to_json()))


def has_checkpoint(workdir: str) -> bool:
    """Whether the workdir holds a committed checkpoint (an unfinished write does not count)."""
    root = os.path.join(workdir, "checkpoints")
    return os.path.isdir(root) and any(name.isdigit() for name in os.listdir(root))


def check_workdir(config: ml_collections.ConfigDict, workdir: str, accept_changes: bool) -> None:
    """Before any compute: the workdir must be writable, and a workdir with checkpoints resumes
    only the run its config.json describes. Raises ValueError listing the keys that would change
    the model, data or optimisation (config.RESUMABLE lists what may change), unless
    `accept_changes`."""
    try:
        os.makedirs(workdir, exist_ok=True)
        # A unique name: the processes of a multi-host run (in containers, often of one pid)
        # probe a shared workdir at once.
        with tempfile.NamedTemporaryFile(dir=workdir, prefix=".writable."):
            pass
    except OSError as e:
        raise ValueError(f"workdir {workdir!r} is not writable: {e}") from None
    averaged = os.path.join(workdir, AVERAGED_FILE)
    if os.path.exists(averaged):
        with open(averaged) as f:
            source = json.load(f).get("source")
        raise ValueError(
            f"{workdir} holds averaged parameters written by average.py, without optimizer "
            f"state: evaluate it, or continue training in its source workdir {source}"
        )
    path = os.path.join(workdir, CONFIG_FILE)
    if accept_changes or not has_checkpoint(workdir) or not os.path.exists(path):
        return
    changes = config_lib.unresumable_changes(load_config(workdir), config)
    if changes:
        raise ValueError(
            f"{workdir} holds checkpoints of a run with another config: "
            f"{config_lib.format_changes(changes)}. Use a new --workdir, or pass "
            "--accept_config_changes to resume it with these changes"
        )


MESH_FLAG_HELP = (
    "data,fsdp,tensor: the device mesh of this run, one size -1 for the rest (default: the "
    "training run's mesh where it fits these devices, else every device on data)"
)


def set_evaluation_mesh(
    config: ml_collections.ConfigDict, mesh_flag: str | None, num_devices: int
) -> None:
    """Set config.mesh (a trained run's config) for evaluating on `num_devices`: `mesh_flag`
    ("data,fsdp,tensor") where given; else the training mesh if it fits these devices, else
    every device on the data axis, logged. A checkpoint restores onto any mesh."""
    if mesh_flag is not None:
        try:
            shape = sharding.parse_mesh(mesh_flag)
            sharding.mesh_shape(shape, num_devices)
        except ValueError as e:
            raise ValueError(f"--mesh={mesh_flag}: {e}") from None
        config.mesh.update(shape)
        return
    try:
        sharding.mesh_shape(config.mesh, num_devices)
    except ValueError as e:
        absl_logging.info(
            "the training mesh does not fit this run (%s): every device on data instead "
            "(--mesh sets another)",
            e,
        )
        config.mesh.update(config_lib.base_config().mesh.to_dict())


def load_config(workdir: str) -> ml_collections.ConfigDict:
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {workdir!r} a train.py workdir?")
    with open(path) as f:
        config, added = config_lib.with_defaults(json.load(f))
    if added:
        absl_logging.info("%s has no %s: using their defaults", path, ", ".join(added))
    return config
