"""Train a model from an ml_collections config, or run a sweep of configs.

    python train.py --config=configs/multi30k_ende.py --workdir=workdirs/multi30k
    python train.py --config=configs/multi30k_ende.py --config.model.num_heads=8 --workdir=...

Re-running with the same --workdir resumes from its last checkpoint; a config that changes the
model, data or optimizer is refused there unless --accept_config_changes. SIGTERM / SIGINT:
the run finishes its step, checkpoints and exits with status 75 (a second signal exits at
once); a non-finite loss with train.nonfinite="stop" exits with status 3.

A sweep (see xformer/sweep.py and configs/sweeps/) trains and evaluates each of its points
in <workdir>/<point name>, one after the other, skipping finished points and resuming the rest;
--dry_run prints each point's train.py / eval.py command lines and runs nothing:

    python train.py --sweep=configs/sweeps/ptb_positional.py --workdir=workdirs/ptb_pos --dry_run
    python train.py --sweep=configs/sweeps/ptb_positional.py --workdir=workdirs/ptb_pos

Several jobs may share a sweep (a job array; README "Sweeps on a cluster"): --point=K runs
point K alone, and a per-point lock makes a job skip a point another job is running; --list
prints every point's index and status (done, partial, not started, config changed, running):

    python train.py --sweep=configs/sweeps/ptb_positional.py --workdir=workdirs/ptb_pos --list
    python train.py --sweep=configs/sweeps/ptb_positional.py --workdir=workdirs/ptb_pos --point=3

Multi-process (one command per process, every one with the same flags; README "Multi-host"):

    python train.py --config=... --workdir=<shared storage> --distributed   # SLURM, TPU, GKE
    python train.py --config=... --workdir=... --distributed \
        --coordinator_address=10.0.0.1:8476 --num_processes=2 --process_id=0
"""

import ast
import re
import sys

from xformer.malloc_tuning import reexec_with_malloc_tuning

if __name__ == "__main__":  # first: glibc reads its tunables only when a process starts
    reexec_with_malloc_tuning()

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from xformer import cli, distributed_flags, launch, preemption, train_lib
from xformer import experiment as experiment_lib
from xformer import sweep as sweep_lib
from xformer.checkpoint import CheckpointWriteError
from xformer.config import ConfigError
from xformer.data.errors import DataError

EXIT_DIVERGED = 3  # train.nonfinite="stop" met a non-finite loss or gradient

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and vocabularies go here.")
_ACCEPT_CHANGES = flags.DEFINE_bool(
    "accept_config_changes",
    False,
    "Resume a workdir's checkpoints even though the config changes the model, data or optimizer "
    "(by default such a resume is refused, listing the keys).",
)
_SWEEP = flags.DEFINE_string(
    "sweep", None, "A sweep file (instead of --config): run each point in <workdir>/<name>."
)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "With --sweep: print the commands, run nothing.")
_POINT = flags.DEFINE_integer(
    "point", None, "With --sweep: run only the point of this index (e.g. $SLURM_ARRAY_TASK_ID)."
)
_LIST = flags.DEFINE_bool(
    "list", False, "With --sweep: print each point's index, status and name; run nothing."
)
flags.mark_flags_as_required(["workdir"])


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing; a --config that cannot be loaded or overridden (missing file,
    unknown variant, unknown key, bad value) exits with one line instead of a traceback."""
    try:
        remaining = flags.FLAGS(argv)
        if _CONFIG.value is not None:
            _CONFIG.value.keys()  # ml_collections defers a file's load error to its first use
        return remaining
    except flags.Error as e:  # its message may hold the config file's traceback
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        reason = lines[0].replace(" Error whilst parsing config file:", "")
        if len(lines) > 1:
            reason += " " + re.sub(r"^\w+: ", "", lines[-1])  # the exception, less its type
        sys.exit(f"train.py: {reason} (--helpshort lists the flags)")
    except (AttributeError, KeyError) as e:  # an override names a key the config lacks
        text = str(e)
        while len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
            text = ast.literal_eval(text)
        key, *hint = text.splitlines()
        given = [a.split("=")[0] for a in argv if a.startswith("--config.") and key[1:-1] in a]
        where = f"{given[0]}: " if given else ""
        hint = f" ({' '.join(hint)})" if hint else ""
        sys.exit(f"train.py: {where}the config has no key {key}{hint}")
    except OSError as e:  # the config file could not be read; the reason is the last line
        reason = re.sub(r"^.*failure to load: ", "", str(e).splitlines()[-1].strip())
        sys.exit(f"train.py: --config: {reason}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    if (config is None) == (_SWEEP.value is None):
        raise app.UsageError("give exactly one of --config and --sweep")
    if _SWEEP.value is not None:
        ignored = distributed_flags.given()
        ignored += ["--accept_config_changes"] if _ACCEPT_CHANGES.value else []
        if ignored:  # a sweep's points are single-process train.py runs it starts itself
            raise app.UsageError(f"{', '.join(ignored)}: for --config runs, not --sweep")
        if _LIST.value and (_POINT.value is not None or _DRY_RUN.value):
            raise app.UsageError("--list runs nothing: give it without --point and --dry_run")
        try:
            sweep = sweep_lib.load(_SWEEP.value)
            if _LIST.value:
                sweep_lib.list_points(sweep, _WORKDIR.value)
                return
            sweep_lib.run(sweep, _WORKDIR.value, dry_run=_DRY_RUN.value, point=_POINT.value)
        except launch.StoppedError as e:  # by a signal, after the running point checkpointed
            print(f"sweep {_SWEEP.value}: {e}", file=sys.stderr)
            sys.exit(preemption.EXIT_STOPPED)
        except (ValueError, RuntimeError, OSError) as e:  # a bad point or a failed run
            sys.exit(f"sweep {_SWEEP.value}: {e}")
        return
    for name, given in (("dry_run", _DRY_RUN.value), ("list", _LIST.value)):
        if given:
            raise app.UsageError(f"--{name} needs --sweep")
    if _POINT.value is not None:
        raise app.UsageError("--point needs --sweep")
    experiment_lib.quiet_library_logs()
    distributed_flags.initialize_if_requested(training=True)
    logging.info("devices: %s", jax.devices())
    try:
        result = train_lib.train_and_evaluate(
            config, _WORKDIR.value, accept_config_changes=_ACCEPT_CHANGES.value
        )
    except (ConfigError, DataError) as e:  # the message says what to change
        sys.exit(f"train.py: {e}")
    except train_lib.DivergedError as e:
        logging.error("%s", e)
        sys.exit(EXIT_DIVERGED)
    except CheckpointWriteError as e:
        logging.error("%s", e)
        sys.exit(1)
    logging.info("finished: %s", result)
    if result["stopped"] == "signal":
        sys.exit(preemption.EXIT_STOPPED)


if __name__ == "__main__":
    cli.run(main, flags_parser=parse_flags)
