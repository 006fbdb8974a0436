"""Train a model from an ml_collections config.

    python train.py --config=configs/multi30k_ende.py --workdir=workdirs/multi30k
    python train.py --config=configs/multi30k_ende.py --config.model.num_heads=8 --workdir=...

Re-running with the same --workdir resumes from its last checkpoint.
"""

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from xformer import experiment as experiment_lib
from xformer import train_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and vocabularies go here.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() (multi-host; env-configured)."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    experiment_lib.quiet_library_logs()
    if _DISTRIBUTED.value:
        jax.distributed.initialize()
    logging.info("devices: %s", jax.devices())
    result = train_lib.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    logging.info("finished: %s", result)


if __name__ == "__main__":
    app.run(main)
