"""Config sweeps: a grid of dotted config overrides on one base config, run point by point.

A sweep file (e.g. `configs/sweep_ptb_positional.py`) names a base config and returns its points:

    from xformer import sweep

    BASE = "configs/ptb_xl.py"  # relative to the repo root; "path:arg" passes arg to get_config

    def get_sweep():
        return sweep.product(
            sweep.grid("model.positional", ["relative", "sinusoidal"]),
            sweep.zip_({"train.seed": [0, 1], "train.learning_rate": [1e-3, 2e-3]}),
        )

A point is an ordered dict {dotted config key: value}. `grid` makes one point per value,
`product` takes every combination of its axes (the last axis varies fastest) and `zip_` pairs
its axes element by element (they must have equal lengths). An axis is a list of points; a dict
{key: values} stands for one `grid` axis per key. Every point gets a readable,
filesystem-safe name made from its overrides, e.g. `positional=sinusoidal,seed=1,lr=0.002`.

`run` launches each point in `<root>/<name>`, one after the other, as the two commands

    python train.py --config=<base> --config.<key>=<value> ... --workdir=<root>/<name>
    python eval.py --workdir=<root>/<name>

(the printed `python` is run as this interpreter, `sys.executable`). It skips points whose
training and evaluation are finished, evaluates points whose training is finished, and resumes
the others from their last checkpoint. Before anything runs, every point's config is built
exactly as train.py will build it (same ml_collections override parsing) and validated, and
compared with the config a point's workdir already holds: a point trained with another config
is not finished (it resumes where only config.RESUMABLE keys differ; else the sweep refuses).
"""

import contextlib
import dataclasses
import hashlib
import importlib.util
import itertools
import os
import re
import shlex
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np
from absl import flags
from ml_collections import config_flags

from xformer import compare as compare_lib
from xformer import experiment as experiment_lib
from xformer import launch, locks
from xformer.config import (
    config_changes,
    format_changes,
    same_value,
    unresumable_changes,
    validate,
    with_defaults,
)
from xformer.experiment import CONFIG_FILE
from xformer.files import read_json_if_present
from xformer.metric_writer import write_hparams_summary
from xformer.preemption import EXIT_STOPPED
from xformer.train_lib import DONE_FILE

REPO = Path(__file__).resolve().parents[1]  # train.py, eval.py and configs/ live here
Point = dict[str, Any]
Axis = Sequence[Point] | Mapping[str, Sequence[Any]]


# The grid ----------------------------------------------------------------------------------


def grid(key: str, values: Sequence[Any]) -> list[Point]:
    """One point {key: value} per value."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"grid({key!r}, ...) needs a list of values, got {values!r}")
    return [{key: value} for value in values]


def _axes(axes: Sequence[Axis]) -> list[list[Point]]:
    """Lists of points; a dict {key: values} stands for one grid per key."""
    out = []
    for axis in axes:
        if isinstance(axis, Mapping):
            out += [grid(key, values) for key, values in axis.items()]
        else:
            out.append([dict(point) for point in axis])
    return out


def _merge(points: Sequence[Point]) -> Point:
    merged: Point = {}
    for point in points:
        for key, value in point.items():
            if key in merged:
                raise ValueError(f"{key!r} is set by more than one axis of the sweep")
            merged[key] = value
    return merged


def product(*axes: Axis) -> list[Point]:
    """Every combination of one point from each axis (the last axis varies fastest)."""
    return [_merge(points) for points in itertools.product(*_axes(axes))]


def zip_(*axes: Axis) -> list[Point]:
    """The i-th points of all axes merged into one point; the axes must have equal lengths.
    `zip_({"a": [1, 2], "b": [3, 4]})` is `[{"a": 1, "b": 3}, {"a": 2, "b": 4}]`."""
    lists = _axes(axes)
    if len({len(points) for points in lists}) > 1:
        lengths = [len(points) for points in lists]
        raise ValueError(f"zip_ needs axes of equal length, got lengths {lengths}")
    return [_merge(points) for points in zip(*lists, strict=True)]


def seeds(axis: Axis, values: Sequence[int]) -> list[Point]:
    """Every point of `axis` repeated once per train.seed in `values` (named ...,seed=K), for
    mean and standard deviation over seeds in `eval.py --compare`."""
    return product(axis, grid("train.seed", list(values)))


# Names and command lines --------------------------------------------------------------------


def format_value(value: Any) -> str:
    """`value` as a --config.<key>= argument that ml_collections parses back to `value`."""
    if isinstance(value, tuple | list):
        return repr(tuple(value))  # ast.literal_eval'd by ml_collections' TupleParser
    return str(value)  # floats print their shortest round-tripping repr


def _name_value(value: Any) -> str:
    if isinstance(value, tuple | list):
        return "-".join(_name_value(v) for v in value) or "none"
    return format_value(value)


def _name(point: Point, full_keys: bool) -> str:
    if not point:
        return "base"
    last = [key.rsplit(".", 1)[-1] for key in point]
    parts = []
    for key, short in zip(point, last, strict=True):
        label = key if full_keys or last.count(short) > 1 else short
        parts.append(f"{label}={_name_value(point[key])}")
    name = re.sub(r"[^A-Za-z0-9._=,+-]", "_", ",".join(parts))
    if len(name) > 200:  # stay well inside file-name limits
        name = name[:183] + "," + hashlib.sha256(name.encode()).hexdigest()[:16]
    return name


def point_names(points: Sequence[Point]) -> list[str]:
    """A unique, filesystem-safe name per point, e.g. `positional=relative,seed=1`: the last
    component of each key (the full dotted key where two keys share it) and the value."""
    for full_keys in (False, True):
        names = [_name(point, full_keys) for point in points]
        if len(set(names)) == len(names):
            return names
    duplicates = sorted({n for n in names if names.count(n) > 1})
    raise ValueError(f"sweep points with the same name (repeated points?): {duplicates}")


def config_args(point: Point) -> list[str]:
    return [f"--config.{key}={format_value(value)}" for key, value in point.items()]


# Sweep files and configs -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sweep:
    base: str  # the base config as train.py's --config takes it, "path" or "path:arg"
    points: list[Point]
    names: list[str]

    def workdir(self, root: str, name: str) -> str:
        return os.path.join(root, name)


def _resolve_base(base: str) -> str:
    """The base config path relative to the current directory (BASE is relative to the repo
    root), so printed commands work from here; absolute paths stay absolute."""
    path, sep, arg = base.partition(":")
    if not os.path.isabs(path):
        path = os.path.relpath(REPO / path)
    return path + sep + arg


def load(path: str) -> Sweep:
    """Read a sweep file: its BASE and the points returned by its get_sweep()."""
    spec = importlib.util.spec_from_file_location(f"sweep_{Path(path).stem}", path)
    if spec is None or not os.path.isfile(path):
        raise FileNotFoundError(f"sweep file {path!r} not found")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not isinstance(getattr(module, "BASE", None), str) or not hasattr(module, "get_sweep"):
        raise ValueError(f"{path} must define BASE (a config path) and get_sweep()")
    points = [{k: _plain(v) for k, v in point.items()} for point in module.get_sweep()]
    if not points:
        raise ValueError(f"{path}: get_sweep() returned no points")
    return Sweep(base=_resolve_base(module.BASE), points=points, names=point_names(points))


def _plain(value: Any) -> Any:
    """A grid value with numpy scalars (np.arange, np.linspace) as Python's int, float or bool:
    the run's HParams are JSON, which has no numpy types."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value


def point_config(base: str, point: Point) -> ml_collections.ConfigDict:
    """The config train.py builds from `--config=<base>` and the point's overrides, parsed by
    the same ml_collections flag machinery and validated; raises ValueError naming the key."""
    argv = ["train.py", f"--config={base}", *config_args(point)]
    flag_values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file(
        "config", None, "Config file.", flag_values=flag_values, sys_argv=argv
    )
    try:
        flag_values(argv)
    except Exception as e:  # absl wraps unknown keys and unparsable values in several types
        raise ValueError(f"{shlex.join(argv[1:])}: {e}") from e
    config = holder.value
    for key, value in point.items():
        parsed = config[key.split(".")[0]]
        for part in key.split(".")[1:]:
            parsed = parsed[part]
        if not same_value(parsed, value):
            raise ValueError(
                f"--config.{key}={format_value(value)} parses to {parsed!r}, not {value!r}"
            )
    validate(config)
    return config


def commands(sweep: Sweep, root: str, name: str) -> tuple[list[str], list[str]]:
    """The train.py and eval.py command lines of one point, for a shell in the current dir."""
    point = sweep.points[sweep.names.index(name)]
    workdir = sweep.workdir(root, name)
    train = [
        "python",
        os.path.relpath(REPO / "train.py"),
        f"--config={sweep.base}",
        *config_args(point),
        f"--workdir={workdir}",
    ]
    evaluate = ["python", os.path.relpath(REPO / "eval.py"), f"--workdir={workdir}"]
    return train, evaluate


def remaining(workdir: str, config: ml_collections.ConfigDict) -> list[str]:
    """What a point still needs: [] (finished), ["eval"] or ["train", "eval"]. Training is
    finished when done.json says it reached config.train.num_steps or stopped at
    max_train_seconds; evaluation when eval_<test split>.json scores that final step. A point
    whose stored config differs from `config` is not finished: it trains (resumes) and
    evaluates again; raises ValueError when the difference forbids resuming (config.RESUMABLE).
    """
    stored = read_json_if_present(os.path.join(workdir, CONFIG_FILE))
    if stored is not None and experiment_lib.has_checkpoint(workdir):
        stored, _ = with_defaults(stored)  # keys newer than the workdir take their defaults
        changes = unresumable_changes(stored, config)
        if changes:
            raise ValueError(
                f"{workdir} holds a run of another config ({format_changes(changes)}): remove "
                "it, or sweep into another --workdir"
            )
        if config_changes(stored, config):
            return ["train", "eval"]
    done = read_json_if_present(os.path.join(workdir, DONE_FILE))
    if done is None or (
        done["step"] < config.train.num_steps and done["reason"] != "max_train_seconds"
    ):
        return ["train", "eval"]
    result = read_json_if_present(os.path.join(workdir, f"eval_{config.data.test_split}.json"))
    if result is None or result.get("step") != done["step"]:
        return ["eval"]
    return []


def lock_path(root: str, name: str) -> str:
    """The lock file of point `name` (xformer/locks.py), beside the points' workdirs."""
    return os.path.join(root, ".locks", f"{name}.lock")


def select(sweep: Sweep, point: int | None) -> list[str]:
    """The names of every point, or of point index `point` alone (a job-array index)."""
    if point is None:
        return list(sweep.names)
    if not 0 <= point < len(sweep.names):
        raise ValueError(
            f"--point={point}: this sweep has {len(sweep.names)} points, 0 to "
            f"{len(sweep.names) - 1} (--list prints them)"
        )
    return [sweep.names[point]]


def _configs(sweep: Sweep, names: Sequence[str]) -> dict[str, ml_collections.ConfigDict]:
    configs = {}
    for name in names:
        try:
            configs[name] = point_config(sweep.base, sweep.points[sweep.names.index(name)])
        except ValueError as e:
            raise ValueError(f"sweep point {name!r}: {e}") from e
    return configs


def status(workdir: str, config: ml_collections.ConfigDict, lock: str) -> str:
    """A point's state for --list: running (locked, by whom), config changed, done, trained
    (not evaluated), partial (its last checkpoint's step) or not started."""
    holder = locks.holder(lock)
    if holder is not None:
        return f"running ({locks.describe(holder)})"
    try:
        todo = remaining(workdir, config)
    except ValueError:
        return "config changed (stored config differs in keys that forbid resuming)"
    if not todo:
        return "done"
    if todo == ["eval"]:
        return "trained, not evaluated"
    if experiment_lib.has_checkpoint(workdir):
        stored = read_json_if_present(os.path.join(workdir, CONFIG_FILE))
        if stored is not None and config_changes(with_defaults(stored)[0], config):
            return "config changed (resumable keys: it resumes)"
        steps = [int(n) for n in os.listdir(os.path.join(workdir, "checkpoints")) if n.isdigit()]
        return f"partial (step {max(steps)} of {config.train.num_steps})"
    return "not started"


def list_points(sweep: Sweep, root: str, echo: Callable[[str], None] | None = None) -> list[str]:
    """Print (and return) one line per point: index, status and name. Runs nothing."""
    echo = echo or launch.print_now
    configs = _configs(sweep, sweep.names)
    lines = []
    for i, name in enumerate(sweep.names):
        state = status(sweep.workdir(root, name), configs[name], lock_path(root, name))
        lines.append(f"{i}\t{state}\t{name}")
        echo(lines[-1])
    return lines


def write_hparams(workdir: str, point: Point, refresh: bool = False) -> None:
    """The finished point's entry in TensorBoard's HParams dashboard (its overrides and final
    metrics) under <workdir>/tensorboard/hparams: written once, and rewritten with `refresh`
    (after the point trained or was evaluated again, e.g. with a larger train.num_steps). It is
    written beside and moved into place: an interrupted write leaves no entry, not half of one
    that later runs would keep."""
    logdir = os.path.join(workdir, "tensorboard", "hparams")
    if os.path.isdir(logdir) and not refresh:
        return
    partial = os.path.join(workdir, ".hparams.partial")  # moved into place once whole
    shutil.rmtree(partial, ignore_errors=True)
    run = compare_lib.Run.load(workdir)
    metrics = {}
    test = None if run.stale_test() else run.test  # (of an earlier step: not the point's)
    for m in run.metrics():
        if test is not None and test.get(m.eval_key) is not None:
            metrics[f"test/{m.name}"] = float(test[m.eval_key])
    final = (run.done or {}).get("metrics", {})
    if "loss" in final:
        metrics["train/final_loss"] = float(final["loss"])
    write_hparams_summary(partial, point, metrics, run.steps() or 0)
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(os.path.dirname(logdir), exist_ok=True)
    os.rename(partial, logdir)


def run(
    sweep: Sweep,
    root: str,
    dry_run: bool = False,
    echo: Callable[[str], None] | None = None,
    point: int | None = None,
) -> dict[str, list[str]]:
    """Validate the points, then run what each still needs, one point after the other.

    `point`: only that index (a job-array task). Returns {name: steps run (or, with dry_run, to
    run): [], ["eval"] or ["train", "eval"]}; a point that another job holds (its lock file) is
    skipped and left out. A dry run prints every point's exact command lines and runs nothing.
    A failing command stops its point; the other points still run, and RuntimeError names the
    failures at the end. A signal (SIGINT, SIGTERM) waits for the running command, which
    checkpoints, and stops the sweep: launch.StoppedError, after which nothing else starts; a
    signal between commands (or during the checks) stops it before its next command.
    """
    with contextlib.nullcontext() if dry_run else launch.signals_deferred():
        return _run(sweep, root, dry_run, echo or launch.print_now, point)


_ACTIONS = {0: "finished: skip", 1: "trained: eval", 2: "run"}  # by the number of steps left


def _run(
    sweep: Sweep, root: str, dry_run: bool, echo: Callable[[str], None], point: int | None
) -> dict[str, list[str]]:
    names = select(sweep, point)
    configs = _configs(sweep, names)
    count = len(sweep.points)
    echo(f"# sweep of {count} points (0 to {count - 1}) on {sweep.base} in {root}")
    todo, failed = {}, []
    for name in names:  # every point's stored run checked before anything runs
        try:
            todo[name] = remaining(sweep.workdir(root, name), configs[name])
        except ValueError as e:
            raise ValueError(f"sweep point {name!r}: {e}") from e
    for name in names:
        i = sweep.names.index(name)
        train, evaluate = commands(sweep, root, name)
        label = f"# [{i}] {name}"
        if dry_run:
            echo(f"{label}: {_ACTIONS[len(todo[name])]}")
            echo(shlex.join(train))
            echo(shlex.join(evaluate))
            continue
        with locks.exclusive(lock_path(root, name)) as taken_by:
            if taken_by is not None:
                echo(f"{label}: running in another job ({locks.describe(taken_by)}): skip")
                del todo[name]
                continue
            # Checked again under the lock: another job may have finished it meanwhile.
            todo[name] = remaining(sweep.workdir(root, name), configs[name])
            echo(f"{label}: {_ACTIONS[len(todo[name])]}")
            # A test result and HParams entry of earlier settings must not outlive an eval.py
            # that is interrupted (a restart would find nothing to do and keep them).
            result = os.path.join(
                sweep.workdir(root, name), f"eval_{configs[name].data.test_split}.json"
            )
            if todo[name]:
                if os.path.exists(result):
                    os.remove(result)
                shutil.rmtree(
                    os.path.join(sweep.workdir(root, name), "tensorboard", "hparams"),
                    ignore_errors=True,
                )
            for cmd in (train, evaluate)[2 - len(todo[name]) :]:
                try:
                    returncode = launch.run(cmd, echo=echo).returncode
                    if returncode == EXIT_STOPPED:  # signalled directly, not through the sweep
                        raise launch.StoppedError(f"{shlex.join(cmd)} exited with {returncode}")
                except launch.StoppedError as e:
                    earlier = f" ({len(failed)} failed before it: {failed})" if failed else ""
                    raise launch.StoppedError(
                        f"stopped at point {name!r}{earlier}: {e}; the same command resumes"
                    ) from None
                if returncode:
                    failed.append(f"{name} ({Path(cmd[1]).name} exited with {returncode})")
                    break
            else:
                if not remaining(sweep.workdir(root, name), configs[name]):
                    write_hparams(sweep.workdir(root, name), sweep.points[i], bool(todo[name]))
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(names)} sweep points failed: {failed}")
    return todo
