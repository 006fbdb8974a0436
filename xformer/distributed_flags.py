"""The multi-process flags of train.py and eval.py (one jax.distributed job per command)."""

from absl import app, flags

from xformer import distributed

DISTRIBUTED = flags.DEFINE_bool(
    "distributed",
    False,
    "Multi-process: call jax.distributed.initialize(), with the three flags below where given, "
    "else with what JAX detects (SLURM, Open MPI, Cloud TPU, GKE).",
)
COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "With --distributed: host:port of process 0's coordinator."
)
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "With --distributed: processes.")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "With --distributed: this one's index.")


def given() -> list[str]:
    """The multi-process flags given, as "--name" (for commands that run no job of their own)."""
    chosen = [DISTRIBUTED] if DISTRIBUTED.value else []
    chosen += [f for f in (COORDINATOR, NUM_PROCESSES, PROCESS_ID) if f.present]
    return [f"--{f.name}" for f in chosen]


def initialize_if_requested(training: bool) -> None:
    """Join the job when --distributed is given (`training`: see distributed.initialize); a
    usage error for its flags without it."""
    if DISTRIBUTED.value:
        try:
            distributed.initialize(
                COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value, training=training
            )
        except ValueError as e:  # JAX's check of the flags, e.g. a process id out of range
            raise app.UsageError(f"--distributed: {e}") from None
    elif given():
        raise app.UsageError(
            "--coordinator_address, --num_processes, --process_id need --distributed"
        )
