"""Write the average of a run's last checkpoints as a new workdir.

    python average.py --workdir=workdirs/multi30k_ende --last=2 --output=workdirs/multi30k_avg2
    python eval.py --workdir=workdirs/multi30k_avg2 --split=test_2016_flickr

A run keeps its last train.keep_checkpoints checkpoints (2 by default): to average 5, train with
--config.train.keep_checkpoints=5 (and a train.checkpoint_every that spaces them as wanted).

The output workdir holds the source's config.json, vocabulary and run_info.json (its commits
and parameter count, for eval.py --compare) and one checkpoint, at the newest averaged step,
with the mean parameters (xformer/averaging.py) and no optimizer state: eval.py and sample.py
use it like any workdir; train.py refuses to train in it (continue training in the source
workdir). `eval.py --workdir=<source> --average_last=2` evaluates the same parameters without
writing them.
"""

import copy
import os
import shutil
import sys

import jax
import jax.numpy as jnp
from absl import app, flags, logging

from xformer import cli
from xformer import experiment as experiment_lib
from xformer.averaging import average_params, steps_to_average
from xformer.checkpoint import Checkpointer, CheckpointShapeError
from xformer.data.errors import DataError
from xformer.files import check_writable, write_json
from xformer.tasks import make_task
from xformer.train_lib import RUN_INFO_FILE

_WORKDIR = flags.DEFINE_string("workdir", None, "A train.py workdir with checkpoints.")
_LAST = flags.DEFINE_integer("last", None, "Average the last N checkpoints kept.")
_STEP = flags.DEFINE_integer("step", None, "The newest checkpoint to average (default: latest).")
_OUTPUT = flags.DEFINE_string("output", None, "The new workdir (must not exist or be empty).")
_MESH = flags.DEFINE_string("mesh", None, experiment_lib.MESH_FLAG_HELP)
flags.mark_flags_as_required(["workdir", "last", "output"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    experiment_lib.quiet_library_logs()
    source, output = _WORKDIR.value, _OUTPUT.value
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        sys.exit(f"average.py: --output={output} exists and is not an empty directory")
    try:
        config = experiment_lib.load_config(source)  # written to the output as it is
        run_config = copy.deepcopy(config)
        experiment_lib.set_evaluation_mesh(run_config, _MESH.value, jax.device_count())
        task = make_task(
            run_config, source, train_if_missing=False, training=False, evaluating=False
        )
        steps = steps_to_average(task.exp, _LAST.value, _STEP.value)
        check_writable(output, "--output")
    except (ValueError, OSError, DataError) as e:
        sys.exit(f"average.py: {e}")
    try:
        params = average_params(task.exp, steps)
    except CheckpointShapeError as e:  # the workdir's config.json was edited
        sys.exit(f"average.py: {e}")

    experiment_lib.save_config(config, output)
    if not config.data.vocab_dir and os.path.isdir(os.path.join(source, "vocab")):
        shutil.copytree(os.path.join(source, "vocab"), os.path.join(output, "vocab"))
    if os.path.exists(os.path.join(source, RUN_INFO_FILE)):  # the commits and size of the run
        shutil.copy2(os.path.join(source, RUN_INFO_FILE), output)
    step_dtype = task.exp.abstract_state()["step"].dtype
    state = {"step": jnp.asarray(steps[-1], step_dtype), "params": params}
    info = {"source": os.path.abspath(source), "averaged_steps": steps}
    # The marker first: killed before the checkpoint is written, the output is no workdir that
    # train.py would take for a run to resume (it refuses averaged workdirs).
    write_json(os.path.join(output, experiment_lib.AVERAGED_FILE), info)
    checkpointer = Checkpointer(output, keep=1)
    checkpointer.save(steps[-1], state, progress=info)
    checkpointer.close()
    logging.info("wrote the average of checkpoints %s of %s to %s", steps, source, output)
    print(f"averaged checkpoints {steps} of {source} into {output}")


if __name__ == "__main__":
    cli.run(main)
