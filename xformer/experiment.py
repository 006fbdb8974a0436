"""What train.py and eval.py share: mesh, tokenizers, model graph, abstract state, checkpoints."""

import dataclasses
import json
import logging
import os

import jax
import ml_collections
import optax
from absl import logging as absl_logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from xformer import config as config_lib
from xformer.checkpoint import Checkpointer
from xformer.data.tokenizer import Tokenizer
from xformer.data.translation import load_tokenizers
from xformer.models import EncoderDecoder, TransformerConfig
from xformer.optim import make_optimizer

CONFIG_FILE = "config.json"


def model_config(
    config: ml_collections.ConfigDict, src_vocab: int, tgt_vocab: int
) -> TransformerConfig:
    m = config.model
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kwargs = {k: v for k, v in m.items() if k in fields}
    return TransformerConfig(
        src_vocab_size=src_vocab,
        tgt_vocab_size=tgt_vocab,
        pre_norm=m.layer_norm == "pre",
        **kwargs,
    )


@dataclasses.dataclass
class Experiment:
    config: ml_collections.ConfigDict
    workdir: str
    mesh: Mesh
    src_tok: Tokenizer
    tgt_tok: Tokenizer
    model_cfg: TransformerConfig
    train_graphdef: nnx.GraphDef  # dropout active
    eval_graphdef: nnx.GraphDef  # deterministic
    rest: nnx.State  # non-parameter model state (dropout RNG streams), reseeded every step
    tx: optax.GradientTransformation
    checkpointer: Checkpointer

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P("data"))

    def init_state(self) -> dict:
        """A fresh train state {"step", "params", "opt_state"}, replicated over the mesh."""

        def init():
            model = EncoderDecoder(self.model_cfg, rngs=nnx.Rngs(self.config.train.seed))
            params = nnx.state(model, nnx.Param)
            return {
                "step": jax.numpy.zeros((), jax.numpy.int32),
                "params": params,
                "opt_state": self.tx.init(params),
            }

        return jax.jit(init, out_shardings=self.replicated)()

    def abstract_state(self) -> dict:
        return jax.eval_shape(self.init_state)


def quiet_library_logs() -> None:
    """Drop orbax's per-save INFO chatter from absl logs; warnings and errors still show."""

    class _Filter(logging.Filter):
        def filter(self, record):
            return record.levelno >= logging.WARNING or "orbax" not in record.pathname

    absl_logging.get_absl_handler().addFilter(_Filter())


def make_mesh() -> Mesh:
    """A 1-D data-parallel mesh over every device of every process."""
    return jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def setup(
    config: ml_collections.ConfigDict, workdir: str, *, train_if_missing: bool = True
) -> Experiment:
    """Validate the config, then build tokenizers (training them if needed) and the model graph."""
    config_lib.validate(config)
    mesh = make_mesh()
    for key in ("train.batch_size", "eval.batch_size"):
        section, name = key.split(".")
        if config[section][name] % jax.device_count():
            raise ValueError(
                f"{key}={config[section][name]} must be divisible by the {jax.device_count()} "
                "devices"
            )
    os.makedirs(workdir, exist_ok=True)
    src_tok, tgt_tok = load_tokenizers(config, workdir, train_if_missing=train_if_missing)
    model_cfg = model_config(config, src_tok.vocab_size, tgt_tok.vocab_size)
    model = nnx.eval_shape(lambda: EncoderDecoder(model_cfg, rngs=nnx.Rngs(config.train.seed)))
    train_graphdef, _, _ = nnx.split(model, nnx.Param, ...)
    model.eval()
    eval_graphdef, _, _ = nnx.split(model, nnx.Param, ...)
    # Only the RNG-stream state is kept; under jit XLA drops the unused parameter init.
    rest = jax.jit(
        lambda: nnx.state(EncoderDecoder(model_cfg, rngs=nnx.Rngs(0)), nnx.Not(nnx.Param))
    )()
    return Experiment(
        config=config,
        workdir=workdir,
        mesh=mesh,
        src_tok=src_tok,
        tgt_tok=tgt_tok,
        model_cfg=model_cfg,
        train_graphdef=train_graphdef,
        eval_graphdef=eval_graphdef,
        rest=rest,
        tx=make_optimizer(config.train),
        checkpointer=Checkpointer(workdir, config.train.keep_checkpoints),
    )


def save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
    if jax.process_index() == 0:
        with open(os.path.join(workdir, CONFIG_FILE), "w") as f:
            f.write(config.to_json(indent=2))


def load_config(workdir: str) -> ml_collections.ConfigDict:
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {workdir!r} a train.py workdir?")
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))
