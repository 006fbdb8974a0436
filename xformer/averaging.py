"""Checkpoint averaging: the element-wise mean of the parameters of a run's last checkpoints
(the Transformer paper evaluates its WMT models on the average of the last 5 or 20)."""

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from xformer.experiment import Experiment
from xformer.params_checkpoint import restore_params


def steps_to_average(exp: Experiment, last: int, until: int | None = None) -> list[int]:
    """The `last` newest checkpoint steps of exp.workdir, ending at `until` (default: the
    latest). Raises ValueError naming the steps kept and the config key that keeps more."""
    if last < 1:
        raise ValueError(f"average the last N >= 1 checkpoints, not {last}")
    kept = exp.checkpointer.steps()
    if until is not None:
        if until not in kept:
            raise ValueError(f"no checkpoint {until} in {exp.workdir} (it holds {kept or 'none'})")
        kept = [step for step in kept if step <= until]
    if len(kept) < last:
        raise ValueError(
            f"averaging the last {last} checkpoints needs {last}, but {exp.workdir} holds "
            f"{len(kept)} up to that step ({kept or 'none'}); train with a larger "
            f"train.keep_checkpoints (this run kept {exp.config.train.keep_checkpoints})"
        )
    steps, every = kept[-last:], exp.config.train.checkpoint_every
    if any(b - a != every for a, b in zip(steps, steps[1:], strict=False)):
        logging.warning(  # e.g. a checkpoint a signal saved, or the last one, at another step
            "the checkpoints averaged, %s, are not train.checkpoint_every=%d steps apart",
            steps,
            every,
        )
    return steps


def average_params(exp: Experiment, steps: list[int]) -> nnx.State:
    """The mean of the parameters of checkpoints `steps`, summed in float32 or wider and cast
    back to each parameter's dtype, in the experiment's parameter shardings."""
    total = None
    for step in steps:
        params, _ = restore_params(exp, step)
        wide = jax.tree.map(lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32)), params)
        total = wide if total is None else jax.tree.map(jnp.add, total, wide)
        dtypes = jax.tree.map(lambda x: x.dtype, params)
    return jax.tree.map(lambda t, dtype: (t / len(steps)).astype(dtype), total, dtypes)
