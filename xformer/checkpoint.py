"""Resumable orbax checkpoints of the train state plus the input pipeline's position."""

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Keeps the last `keep` checkpoints under <workdir>/checkpoints.

    Each holds "state" (any pytree of arrays: params, optimizer state, step, RNG) and "data"
    (the JSON state of the training data iterator, so a resumed run sees the same batches).
    """

    def __init__(self, workdir: str, keep: int = 2):
        self.manager = ocp.CheckpointManager(
            os.path.join(os.path.abspath(workdir), "checkpoints"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "data"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict | None = None) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state or {})
            ),
        )

    def restore(self, target, step: int | None = None) -> tuple[object, dict]:
        """Restore onto `target` (a pytree of arrays or ShapeDtypeStructs with shardings)."""
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], restored["data"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
