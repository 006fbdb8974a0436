"""Restore only the parameters (and step) of a train-state checkpoint, for evaluation.

A checkpoint's "state" item (checkpoint.Checkpointer) holds the step, the parameters, Adam's
two moments and any carry; evaluation needs the parameters alone, a third of the bytes. This
reads the "params" subtree with orbax's partial restore, placed by the experiment's parameter
shardings (sharding.RULES on the current mesh, whatever mesh wrote the checkpoint).
"""

import jax
import orbax.checkpoint as ocp
from flax import nnx

from xformer.checkpoint import check_shapes, explained_shape_errors, state_dir
from xformer.experiment import Experiment


def checkpoint_step(exp: Experiment, step: int | None = None) -> int:
    """`step` (default: the latest) if exp.workdir holds that checkpoint. Raises
    FileNotFoundError naming the checkpoints there when there is none or not that step."""
    directory = exp.checkpointer.manager.directory
    steps = exp.checkpointer.steps()
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {directory}: train.py writes them")
    if step is not None and step not in steps:
        raise FileNotFoundError(f"no checkpoint {step} in {directory} (it holds {steps})")
    return steps[-1] if step is None else step


def restore_params(exp: Experiment, step: int | None = None) -> tuple[nnx.State, int]:
    """(parameters, step) of checkpoint `step` (default: the latest) in exp.workdir. Raises
    FileNotFoundError as checkpoint_step does, and CheckpointShapeError (a ValueError) when
    the checkpoint holds parameters of other shapes than the experiment's model."""
    manager = exp.checkpointer.manager
    step = checkpoint_step(exp, step)
    abstract = exp.abstract_state()
    target = {"step": abstract["step"], "params": abstract["params"]}
    restore_args = jax.tree.map(
        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype),
        target,
    )
    check_shapes(manager.directory, step, target)  # before any array is read
    with explained_shape_errors(manager.directory):
        restored = ocp.PyTreeCheckpointer().restore(
            state_dir(manager.directory, step),
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=True
            ),
        )
    return restored["params"], int(restored["step"])
