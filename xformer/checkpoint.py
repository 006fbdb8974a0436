"""Resumable orbax checkpoints of the train state plus the input pipeline's position."""

import os

import jax
import orbax.checkpoint as ocp

from xformer import distributed


class Checkpointer:
    """Keeps the last `keep` checkpoints under <workdir>/checkpoints.

    Each holds "state" (any pytree of arrays: params, optimizer state, step, RNG), "data" (the
    JSON state of the training data iterator, so a resumed run sees the same batches: every
    process's own, as {"per_process": [state of process 0, ...]}) and "progress" (JSON, e.g.
    the training seconds so far; absent from older checkpoints).
    """

    def __init__(self, workdir: str, keep: int = 2):
        self.manager = ocp.CheckpointManager(
            os.path.join(os.path.abspath(workdir), "checkpoints"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "data", "progress"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(
        self, step: int, state, data_state: dict | None = None, progress: dict | None = None
    ) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave({"per_process": distributed.allgather_json(data_state)}),
                progress=ocp.args.JsonSave(progress or {}),
            ),
        )

    def _step(self, step: int | None) -> int:
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        return step

    def restore(self, target, step: int | None = None) -> tuple[object, dict]:
        """Restore onto `target` (a pytree of arrays or ShapeDtypeStructs with shardings)."""
        step = self._step(step)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()
            ),
        )
        data = restored["data"]
        if "per_process" not in data:  # written before per-process states (one process)
            return restored["state"], data
        states = data["per_process"]
        if len(states) != jax.process_count():
            raise ValueError(
                f"checkpoint {step} in {self.manager.directory} holds the data positions of "
                f"{len(states)} processes, but this run has {jax.process_count()}: resume it with "
                f"{len(states)} processes"
            )
        return restored["state"], states[jax.process_index()] or {}

    def progress(self, step: int | None = None) -> dict:
        """The checkpoint's "progress" item; {} for checkpoints written before it existed."""
        step = self._step(step)
        if not (self.manager.directory / str(step) / "progress").exists():
            return {}
        restored = self.manager.restore(
            step, args=ocp.args.Composite(progress=ocp.args.JsonRestore())
        )
        return restored["progress"]

    def close(self) -> None:
        """Wait for the last save to finish, then release the manager."""
        self.manager.close()
