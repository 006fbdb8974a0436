"""Per-device bytes of parameters + Adam state under several meshes, from the real shardings.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/sharded_memory.py
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/sharded_memory.py \
        --config=configs/wmt14_ende.py --vocab=32000

The train state is built abstractly (`jax.eval_shape`: nothing is allocated), each array is
given the sharding `Experiment.state_shardings` assigns on the mesh (sharding.RULES), and the
bytes every device would hold are summed from those shardings (`sharding.per_device_bytes`).
Activations, gradients and the XL memory are not counted. Default: configs/wt103_xl_base.py
(WikiText-103's 267,735 types) under (data=8), (fsdp=8), (fsdp=4, tensor=2) and
(data=4, fsdp=2).
"""

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xformer import config as config_lib  # noqa: E402
from xformer import experiment as experiment_lib  # noqa: E402
from xformer import model_config, sharding  # noqa: E402
from xformer.language_model import LanguageModel  # noqa: E402
from xformer.models import EncoderDecoder  # noqa: E402

MESHES = ({"data": 8}, {"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"data": 4, "fsdp": 2})


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("config_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def state_bytes(config, vocab: int, shape: dict) -> dict:
    """per_device_bytes of {"params", "opt_state"} on a mesh of `shape` over all devices."""
    config = config.copy_and_resolve_references()
    for axis in sharding.MESH_AXES:
        config.mesh[axis] = shape.get(axis, 1)
    config_lib.validate(config)
    if config.model.family == "decoder_only":
        cls, cfg = LanguageModel, model_config.from_config(config.model, vocab_size=vocab)
    else:
        cfg = model_config.from_config(config.model, src_vocab_size=vocab, tgt_vocab_size=vocab)
        cls = EncoderDecoder
    exp = experiment_lib.setup(config, tempfile.mkdtemp(), cls, cfg)
    abstract = jax.eval_shape(exp._init)
    shardings = exp.state_shardings()
    held = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        {k: abstract[k] for k in ("params", "opt_state")},
        {k: shardings[k] for k in ("params", "opt_state")},
    )
    num_params = sum(x.size for x in jax.tree.leaves(abstract["params"]))
    return {**sharding.per_device_bytes(held), "num_params": num_params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/wt103_xl_base.py")
    parser.add_argument("--vocab", type=int, default=267_735, help="vocabulary size")
    args = parser.parse_args()
    config = load_config(args.config)
    # the batch only has to divide over the mesh's row shards for this count to be built
    config.train.batch_size = config.eval.batch_size = 8 * config.train.grad_accum_steps
    from bench_output import command_line

    print(
        f"command: XLA_FLAGS=--xla_force_host_platform_device_count={jax.device_count()} "
        f"{command_line()}"
    )
    print(f"{args.config}, vocabulary {args.vocab:,}, {jax.device_count()} devices\n")
    print("| mesh | params | params + Adam, total | per device | share |")
    print("|---|---:|---:|---:|---:|")
    for shape in MESHES:
        sizes = state_bytes(config, args.vocab, shape)
        name = ", ".join(f"{k}={v}" for k, v in shape.items())
        print(
            f"| ({name}) | {sizes['num_params'] / 1e6:.1f}M | {sizes['total'] / 2**20:,.0f} MiB | "
            f"{sizes['max'] / 2**20:,.0f} MiB | {sizes['max'] / sizes['total']:.3f} |"
        )


if __name__ == "__main__":
    main()
