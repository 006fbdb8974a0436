"""Resumable orbax checkpoints of the train state plus the input pipeline's position."""

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.path import step as ocp_step

from xformer import distributed, faults

TRASH = "deleted"  # under <workdir>/checkpoints: checkpoints dropped, being deleted


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (its temporary directory is never committed)."""


class CheckpointMismatchError(ValueError):
    """A checkpoint that the run restoring it cannot resume from."""


class CheckpointShapeError(CheckpointMismatchError):
    """A checkpoint holds arrays of other shapes than the model restoring it."""


class _CheckpointManager(ocp.CheckpointManager):
    """Orbax's manager, leaving JAX's preemption service to the train loop. The loop asks it
    after every step with its count of steps (distributed.preemption_sync_point); orbax would
    also ask it when saving, with the checkpoint's step and from its finalize thread, moving
    the count that the service's protocol reads (one process could then pass the agreed stop
    step, and the others wait for it in a collective). The loop saves at the stop itself."""

    def reached_preemption(self, step: int) -> bool:
        return False


class Checkpointer:
    """Keeps the last `keep` checkpoints under <workdir>/checkpoints.

    Each holds "state" (any pytree of arrays: params, optimizer state, step, RNG), "data" (the
    JSON state of the training data iterator, so a resumed run sees the same batches: every
    process's own, as {"per_process": [state of process 0, ...]}) and "progress" (JSON, e.g.
    the training seconds so far; absent from older checkpoints).
    """

    def __init__(self, workdir: str, keep: int = 2):
        # Orbax writes a checkpoint asynchronously into a temporary directory and renames it
        # when complete, and renames the oldest one into TRASH before it is deleted (orbax's
        # own deletion removes files one by one under the step's name), so a process killed at
        # any moment leaves no partial checkpoint under a step's name. A later run ignores the
        # leftovers (train.py removes them).
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            temporary_path_class=faults.checkpoint_path_class(),
            todelete_subdir=TRASH,
        )
        self.manager = _CheckpointManager(
            os.path.join(os.path.abspath(workdir), "checkpoints"),
            options=options,
            item_names=("state", "data", "progress"),
        )
        self._writing: int | None = None  # the step of a save that may still be in flight

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The committed steps as process 0 lists them, on every process: the processes of an
        evaluation agree on the checkpoint to read while a training run commits more."""
        mine = sorted(self.manager.all_steps()) if jax.process_index() == 0 else None
        return distributed.allgather_json(mine)[0]

    def remove_unfinished_writes(self) -> None:
        """Delete the temporary directories of writes a killed start left (a signal's checkpoint
        at an irregular step is never written again to replace its own) and the checkpoints it
        was deleting. For train.py's start on process 0 only: eval.py and sample.py open the
        checkpoints of runs that may be writing one now."""
        for name in ocp_step.tmp_checkpoints(self.manager.directory):
            logging.info("removing %s: a checkpoint write that a killed run left unfinished", name)
            shutil.rmtree(self.manager.directory / name)
        self._empty_trash()

    def _empty_trash(self) -> None:
        """Delete the checkpoints orbax dropped (renamed into TRASH: they are no steps)."""
        trash = self.manager.directory / TRASH
        if jax.process_index() == 0 and trash.exists():
            shutil.rmtree(trash)

    def save(
        self, step: int, state, data_state: dict | None = None, progress: dict | None = None
    ) -> None:
        data = {"per_process": distributed.allgather_json(data_state)}
        self.wait()
        self._writing = step
        with self._write_errors():
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave(data),
                    progress=ocp.args.JsonSave(progress or {}),
                ),
            )

    def wait(self) -> None:
        """Wait until the last save is written and committed; raises CheckpointWriteError if
        its write failed."""
        if self._writing is not None:
            with self._write_errors():
                self.manager.wait_until_finished()
            self._writing = None
            self._empty_trash()  # a committed save drops the oldest checkpoint

    @contextlib.contextmanager
    def _write_errors(self) -> Iterator[None]:
        """A failed write of a save (disk full, file too large, no permission), raised now or by
        its background thread, as one CheckpointWriteError naming the step and directory."""
        try:
            yield
        except (OSError, ValueError) as e:  # tensorstore reports file errors as ValueError
            if isinstance(e, ValueError) and "os_error" not in str(e):
                raise
            step, self._writing = self._writing, None
            raise CheckpointWriteError(
                f"checkpoint {step} could not be written to {self.manager.directory}: {e}. Is "
                "the disk full or not writable? The last complete checkpoint is kept; a rerun "
                "resumes from it"
            ) from e

    def _step(self, step: int | None) -> int:
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.manager.directory}")
        return step

    def restore(self, target, step: int | None = None) -> tuple[object, dict]:
        """Restore onto `target` (a pytree of arrays or ShapeDtypeStructs with shardings)."""
        step = self._step(step)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        # Both checks before any array is read:
        data = self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
        data = data["data"]
        states = data.get("per_process", [data])  # (one process's, before per-process states)
        if len(states) != jax.process_count():
            raise CheckpointMismatchError(
                f"checkpoint {step} in {self.manager.directory} holds the data positions of "
                f"{len(states)} processes, but this run has {jax.process_count()}: resume it with "
                f"{len(states)} processes"
            )
        check_shapes(self.manager.directory, step, abstract)
        with explained_shape_errors(self.manager.directory):
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
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
        self.wait()
        self.manager.close()


def _leaf_shapes(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{path: shape} of the arrays of `tree`, each path as strings without nnx's "value"
    attribute (a checkpoint's metadata spells it as a dict key)."""

    def name(key) -> str:
        return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))

    return {
        tuple(n for n in map(name, path) if n != "value"): tuple(x.shape)
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def state_dir(checkpoints: object, step: int) -> str:
    """The directory of checkpoint `step`'s "state" item under the checkpoints directory."""
    return os.path.join(os.fspath(checkpoints), str(step), "state")


def stored_tree(path: str):
    """The pytree of array metadata (shape, dtype) of the "state" item at `path`."""
    absl_logger = logging.getLogger("absl")  # (orbax warns of a metadata file it never writes)
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        metadata = ocp.PyTreeCheckpointer().metadata(path).item_metadata
    finally:
        absl_logger.setLevel(level)
    if metadata is None:
        raise FileNotFoundError(
            f"{path} holds no array metadata: this checkpoint is incomplete (a copy or deletion "
            f"of it was interrupted?); remove {os.path.dirname(os.path.normpath(path))}"
        )
    return metadata.tree


def check_shapes(checkpoints: object, step: int, target) -> None:
    """Raise CheckpointShapeError when checkpoint `step` stores an array of `target` with another
    shape, lacks one, or holds one more under the same top-level keys (another number of layers:
    orbax's partial restore would take the layers both have). Found from the metadata: a failed
    restore leaves orbax's threads running."""
    tree = stored_tree(state_dir(checkpoints, step))
    stored, wanted = _leaf_shapes(tree), _leaf_shapes(target)
    roots = {p[:1] for p in wanted}
    missing = [p for p in wanted if p not in stored]
    extra = [p for p in stored if p[:1] in roots and p not in wanted]
    if missing or extra:
        examples = [f"the model's {'/'.join(p)} is not stored" for p in missing[:1]]
        examples += [f"{'/'.join(p)} is not in the model" for p in extra[:1]]
        raise CheckpointShapeError(
            f"The checkpoints in {checkpoints} hold other arrays than this model's ({len(missing)} "
            f"of the model's missing, {len(extra)} more; e.g. {', '.join(examples)}): "
            f"{SHAPE_CAUSES}"
        )
    differ = [(p, stored[p], s) for p, s in wanted.items() if stored[p] != s]
    if differ:
        path, have, want = differ[0]
        raise CheckpointShapeError(
            f"The checkpoints in {checkpoints} hold {len(differ)} arrays of other shapes than this "
            f"model's (e.g. {'/'.join(path)}: {have}, the model's {want}): {SHAPE_CAUSES}"
        )


SHAPE_CAUSES = (
    "another model config, or an earlier xformer (until 2026-11-27 attention's q/k/v kernels "
    "were [d, 3d] and its k/v kernels [d, 2d], now [d, 3, d], [d, 2, d]; and adaptive embedding "
    "tables had as many rows as their tokens, now rounded up to a multiple of 8)"
)


@contextlib.contextmanager
def explained_shape_errors(directory: object) -> Iterator[None]:
    """Orbax's error for a stored array of another shape, with its likely causes, as a
    CheckpointShapeError."""
    try:
        yield
    except ValueError as error:
        if "not compatible with the stored shape" not in str(error):
            raise
        raise CheckpointShapeError(
            f"{error} The checkpoints in {directory} hold parameters of other shapes than this "
            f"model's: {SHAPE_CAUSES}"
        ) from error


def read_state(workdir: str, step: int) -> dict:
    """The "state" item of checkpoint `step` as numpy arrays on the host, whatever mesh wrote
    it (for comparing runs and inspecting checkpoints; training restores with Checkpointer)."""
    path = state_dir(os.path.join(os.path.abspath(workdir), "checkpoints"), step)
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), stored_tree(path))
    return ocp.PyTreeCheckpointer().restore(
        path, args=ocp.args.PyTreeRestore(restore_args=as_numpy)
    )
