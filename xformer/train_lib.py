"""The training loop: jit-compiled data-parallel steps, metrics, evaluation, checkpoints."""

import contextlib
import functools
import glob
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx
from jax.experimental import multihost_utils
from jax.experimental.layout import Format, Layout

from xformer import config as config_lib
from xformer import distributed, faults, locks, op_profile, provenance, sharding
from xformer import experiment as experiment_lib
from xformer import flops as flops_lib
from xformer.checkpoint import CheckpointMismatchError
from xformer.dispatch import DispatchWindow
from xformer.files import read_json_if_present, read_jsonl, write_json
from xformer.optim import learning_rate_schedule
from xformer.precision import at_least_float32
from xformer.preemption import StopOnSignal
from xformer.tasks import make_task
from xformer.timing import TrainClock, format_duration

RUN_INFO_FILE = "run_info.json"  # written at the start of every train.py run
DONE_FILE = "done.json"  # written when training reached num_steps or max_train_seconds
PROFILE_DIR = "profile"  # train.profile_steps: jax.profiler traces under <workdir>/profile

# Platforms whose train step skips a non-finite update with a cond around it; the others keep
# the old values with a select after it. Each is the form whose compiled wmt14 step copies
# least (bench/gpu_compile.py for XLA:GPU). XLA:CPU updates the donated parameters and moments
# in place only under the cond (with the select: 939 copies, 0.62 GB, against 552 and
# 0.13 GB); XLA:GPU copies the cond's outputs into the donated buffers (582 copy kernels,
# 0.73 GB) and fuses the select into the update (no copies). As in layer_norm, platforms
# other than the CPU get the GPU's form.
SKIP_BY_COND = frozenset({"cpu"})

# XLA options of the train step's compilation, by platform, where XLA_FLAGS does not set them.
# XLA:GPU's Triton GEMM fusions cost more than they save here: a Triton fusion takes the
# elementwise producers of its GEMM's operands (casts, bias, dropout) away from the fusions that
# read those tensors anyway. wmt14 bf16 fused on an H100 ran 42.8 ms a step without them against
# 45.3 ms with them (2026-11-27), and compiled for an H100 without a GPU, every setting tried
# moved more bytes with them (wmt14: 62.2 against 55.7 GB, floor +2.0 ms; wt103_xl: +0.8 ms).
STEP_COMPILER_OPTIONS = {"gpu": {"xla_gpu_enable_triton_gemm": False}}

# Platforms whose compiler lays out the train state (Layout.AUTO), the others keep each array's
# default layout. A TPU's default depends on the shape alone: WikiText-103's [267,736, 410]
# embedding table and its Adam moments arrive column-major (410 columns would pad to 512 lanes),
# and the step relaid them out and back every step (compiled for a v5e chip, wt103_xl bf16:
# layout copies 12.34 -> 6.44 GB a step with the compiler's layouts).
AUTO_LAYOUT_PLATFORMS = frozenset({"tpu"})


def compile_step(lowered: jax.stages.Lowered, platform: str) -> jax.stages.Compiled:
    """`lowered.compile()` with the STEP_COMPILER_OPTIONS of `platform` (a device's platform,
    e.g. "gpu"), less those that XLA_FLAGS names (the user's choice wins) and those that the
    installed XLA does not know (logged, then compiled with XLA's defaults)."""
    named = {flag.split("=", 1)[0].lstrip("-") for flag in os.environ.get("XLA_FLAGS", "").split()}
    options = STEP_COMPILER_OPTIONS.get(platform, {})
    options = {name: value for name, value in options.items() if name not in named}
    if options:
        try:
            compiled = lowered.compile(compiler_options=options)
            logging.info("train step compiled with XLA options %s (XLA_FLAGS overrides)", options)
            return compiled
        except jax.errors.JaxRuntimeError as error:
            if "No such compile option" not in str(error):
                raise
            logging.warning("compiling the train step with XLA's defaults: %s", error)
    return lowered.compile()


def lower_train_step(
    task, state: dict, rng_state: nnx.State, batch: dict, platform: str
) -> jax.stages.Lowered:
    """`train_step` lowered for these arguments (arrays, or ShapeDtypeStructs with shardings)
    on `platform`: the state is donated, and the new state stays where the old one was
    (sharding.py). On AUTO_LAYOUT_PLATFORMS the compiler picks the state's layouts, the same
    for the old and the new state (donation aliases them): call the compiled step with the state
    `in_step_layouts`."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    if platform in AUTO_LAYOUT_PLATFORMS:  # lowered from shapes: an array's layout is fixed
        shardings = jax.tree.map(lambda where: Format(Layout.AUTO, where), shardings)
        state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
    jit_step = jax.jit(
        functools.partial(train_step, task),
        in_shardings=(shardings, None, None),  # None: as the argument is
        out_shardings=(shardings, task.exp.replicated),
        donate_argnums=0,
    )
    return jit_step.lower(state, rng_state, batch)


def in_step_layouts(state: dict, compiled: jax.stages.Compiled) -> dict:
    """`state` in the layouts the compiled step takes it in: arrays already in theirs as they
    are, the others relaid out (after init or restore on AUTO_LAYOUT_PLATFORMS), donated."""
    formats = compiled.input_formats[0][0]
    return jax.tree.map(
        lambda x, where: x if x.format == where else jax.device_put(x, where, donate=True),
        state,
        formats,
    )


def train_step(task, state: dict, rng_state: nnx.State, batch: dict) -> tuple[dict, dict]:
    """One optimizer step on the global batch (every entry [B, ...], rows first).

    The loss is the summed loss over the batch divided by its scored token count. With
    train.grad_accum_steps = k > 1 the rows are split into k micro-batches of B / k rows
    (`split_rows`) that run one after another in a lax.scan; their summed-loss gradients and
    metric sums are added up, then divided by the token count of the whole batch before the one
    optimizer update: the same step as k = 1 with less activation memory.

    Dropout keys derive from (seed, step), and with k > 1 also from the micro-batch index, so
    the accumulated step's dropout masks differ from the k = 1 step's. The task's carry (e.g. the
    Transformer-XL memory, split by `task.carry_batch_axes`) flows from the previous step to the
    next through the state; each micro-batch uses and updates the carry of its own rows.
    """
    exp = task.exp
    k = exp.config.train.grad_accum_steps
    key = jax.random.fold_in(jax.random.key(exp.config.train.seed), state["step"])

    def grads_and_sums(rows: dict, carry: dict, key: jax.Array, per_token: bool) -> tuple:
        """Gradients of the summed loss of `rows` (divided by their token count if per_token),
        (its sums, their new carry)."""

        def loss_fn(params):
            # copy: new RNG variables at this trace level (reseed updates them; under grad or
            # scan, the caller's would belong to an outer trace)
            model = nnx.merge(exp.train_graphdef, params, rng_state, copy=True)
            nnx.reseed(model, dropout=key)
            loss_terms = sharding.traced_on(exp.mesh, task.loss_terms)
            loss_sum, sums, carry_out = loss_terms(model, rows, carry)
            return loss_sum, ({"loss_sum": loss_sum, **sums}, carry_out)

        loss_sum, backward, (sums, carry_out) = jax.vjp(loss_fn, state["params"], has_aux=True)
        # 1/tokens as the cotangent: the division rides on the loss's backward instead of a
        # pass over every gradient
        if per_token:  # the count is float32: divide in the loss's dtype (float64 stays exact)
            cotangent = 1.0 / jnp.maximum(sums["tokens"].astype(loss_sum.dtype), 1.0)
        else:
            cotangent = jnp.ones_like(loss_sum)
        (grads,) = backward(cotangent)
        return grads, (sums, carry_out)

    if k == 1:
        grads, (sums, carry) = grads_and_sums(batch, state["carry"], key, per_token=True)
    else:
        axes = task.carry_batch_axes
        micro = (
            jnp.arange(k),
            jax.tree.map(lambda x: split_rows(x, 0, k), batch),
            {name: split_rows(x, axes[name], k) for name, x in state["carry"].items()},
        )

        def accumulate(total, xs):
            i, rows, carry = xs
            micro_key = jax.random.fold_in(key, i)
            grads, (sums, carry) = grads_and_sums(rows, carry, micro_key, per_token=False)
            return jax.tree.map(jnp.add, total, (grads, sums)), carry

        _, rows, carry = jax.tree.map(lambda x: x[0], micro)
        grad_shapes, (sum_shapes, _) = jax.eval_shape(
            functools.partial(grads_and_sums, per_token=False), rows, carry, key
        )
        zeros = jax.tree.map(  # bfloat16 gradients add up in float32
            lambda s: jnp.zeros(s.shape, at_least_float32(s.dtype)), (grad_shapes, sum_shapes)
        )
        (grads, sums), carry = jax.lax.scan(accumulate, zeros, micro)
        carry = {name: join_rows(x, axes[name]) for name, x in carry.items()}
        tokens = jnp.maximum(sums["tokens"], 1.0)
        grads = jax.tree.map(lambda g: g / tokens, grads)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
    grad_norm = optax.tree_utils.tree_norm(grads)
    # A non-finite loss or gradient never reaches the parameters or Adam's state: the step is
    # skipped (the counter and the data move on; a carry row holding a non-finite value
    # restarts, as a new stream would).
    finite = jnp.isfinite(sums["loss_sum"]) & jnp.isfinite(grad_norm)

    def update(params_and_opt_state: tuple) -> tuple:
        params, opt_state = params_and_opt_state
        updates, opt_state = exp.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    old = (state["params"], state["opt_state"])
    if exp.mesh.devices.flat[0].platform in SKIP_BY_COND:
        params, opt_state = jax.lax.cond(finite, update, lambda unchanged: unchanged, old)
    else:
        keep = functools.partial(jnp.where, finite)
        params, opt_state = jax.tree.map(keep, update(old), old)
    new_state = {
        "step": state["step"] + 1,
        "params": params,
        "opt_state": opt_state,
        "carry": restart_nonfinite_rows(carry, task.carry_batch_axes),
    }
    return new_state, {**sums, "grad_norm": grad_norm, "nonfinite": 1.0 - finite}


def restart_nonfinite_rows(carry: dict, axes: dict) -> dict:
    """The carry with every row that holds a non-finite value in any entry set to 0 in every
    entry (rows on axis axes[name]): for the XL memory, an empty memory (filled 0)."""
    if not carry:
        return carry
    bad = None
    for name, x in carry.items():
        others = tuple(i for i in range(x.ndim) if i != axes[name])
        row_bad = ~jnp.isfinite(x).all(axis=others)
        bad = row_bad if bad is None else bad | row_bad

    def restart(x: jax.Array, axis: int) -> jax.Array:
        rows = jnp.expand_dims(bad, tuple(i for i in range(x.ndim) if i != axis))
        return jnp.where(rows, jnp.zeros((), x.dtype), x)

    return {name: restart(x, axes[name]) for name, x in carry.items()}


def split_rows(x: jax.Array, axis: int, k: int) -> jax.Array:
    """[..., B, ...] (rows on `axis`) -> [k, ..., B / k, ...]: micro-batch i holds rows i, i + k,
    i + 2k, ... A device's contiguous shard of the rows (B / devices of them, a multiple of k)
    thereby splits into its own part of every micro-batch: no rows move between devices."""
    x = x.reshape(*x.shape[:axis], x.shape[axis] // k, k, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis + 1, 0)


def join_rows(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of `split_rows`: [k, ..., B / k, ...] -> [..., B, ...]."""
    x = jnp.moveaxis(x, 0, axis + 1)
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


class StepProfiler:
    """A jax.profiler trace of the train steps whose step counter is in [start, stop)
    (train.profile_steps "start:stop"), written to <workdir>/profile/plugins/profile/<time>/:
    <host>.xplane.pb for TensorBoard's profile plugin (`tensorboard --logdir <workdir>`) and
    perfetto_trace.json.gz for ui.perfetto.dev (with several processes, each under
    profile/process_<i>/: on a shared disk they would share one folder, which JAX's perfetto
    export refuses). Every traced step is a finished step: the trace
    starts once the earlier steps are done and stops once the last traced step's outputs are.

    A run resumed at step k with start < k < stop traces the rest of the range, [k, stop); one
    resumed at k >= stop traces nothing (a log line says so). Starting and stopping the trace
    (which writes the files) is left out of the training clock.
    """

    def __init__(
        self,
        profile_steps: str,
        workdir: str,
        first_step: int,
        clock: TrainClock,
        program_text: Callable[[], str] | None = None,
    ):
        self.log_dir = os.path.join(workdir, PROFILE_DIR)
        if jax.process_count() > 1:  # JAX names a trace's folder by the second: one each
            self.log_dir = os.path.join(self.log_dir, f"process_{jax.process_index()}")
        self.clock, self.tracing, self.program_text = clock, False, program_text
        self.start = self.stop = self.done = -1  # done: the counter after the last traced step
        steps = config_lib.profile_range(profile_steps)
        if steps is None:
            return
        if first_step >= steps[1]:
            logging.info(
                "train.profile_steps=%s: no trace, this run starts at step %d (resumed)",
                profile_steps,
                first_step,
            )
            return
        if first_step > steps[0]:
            logging.info(
                "train.profile_steps=%s: resumed at step %d, tracing steps %d:%d",
                profile_steps,
                first_step,
                first_step,
                steps[1],
            )
        self.start, self.stop = max(steps[0], first_step), steps[1]

    def before_step(self, step: int, state) -> None:
        """Called with the step counter before the step runs and the state it runs on."""
        if step == self.start:
            jax.block_until_ready(state)  # the earlier steps finish outside the trace
            with self.clock.paused():
                jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
            self.tracing = True

    def after_step(self, step: int, outputs) -> None:
        """Called with the step counter after the step and the step's outputs."""
        if self.tracing:
            self.done = step
            if step >= self.stop:
                jax.block_until_ready(outputs)  # the last traced step is complete in the trace
                self.close()

    def close(self) -> None:
        """Stop a running trace (at the end of the range, or when training stops inside it)."""
        if not self.tracing:
            return
        self.tracing = False
        with self.clock.paused():
            jax.profiler.stop_trace()
        run = max(glob.glob(os.path.join(self.log_dir, "plugins", "profile", "*")), default="")
        if run and self.program_text is not None:
            with open(os.path.join(run, op_profile.HLO_FILE), "w") as f:
                f.write(self.program_text())
        logging.info(
            "profile of steps %d:%d written to %s (view: tensorboard --logdir %s, profile tab; "
            "or open its perfetto_trace.json.gz in ui.perfetto.dev; ops by time: "
            "python -m xformer.op_profile %s)",
            self.start,
            self.done,
            run or self.log_dir,
            os.path.dirname(self.log_dir),
            run or self.log_dir,
        )


def stop_reason(
    budget_seconds: float, budget: float, signalled: bool, step: int, log_every: int
) -> str | None:
    """Why training stops after this step: "signal" (SIGTERM / SIGINT), "max_train_seconds"
    (the run's time budget is spent) or None. With several processes `signalled` is already
    common to all (distributed.preemption_sync_point), and the budget is decided once per
    logging interval (at a step the host waits for the device anyway) by process 0's clock. A
    process that stopped alone would leave the others waiting in a collective."""
    time_up = bool(budget) and budget_seconds >= budget
    if jax.process_count() > 1:  # process 0's clock, at logging steps
        time_up = not step % log_every and bool(
            multihost_utils.broadcast_one_to_all(np.uint8(time_up))
        )
    return "signal" if signalled else "max_train_seconds" if time_up else None


class DivergedError(RuntimeError):
    """A non-finite loss or gradient with train.nonfinite="stop"."""


class NonfiniteSteps:
    """Counts the steps whose loss or gradient was not finite (train_step skipped their update)
    and, for train.nonfinite="stop", raises DivergedError at the first one, before a checkpoint
    could follow it."""

    def __init__(self, mode: str, total: int = 0, checked_through: int = 0):
        self.mode, self.total, self.checked_through = mode, total, checked_through

    def check(self, pending: list[dict], step: int, last_checkpoint: int | None) -> None:
        """`pending`: the metrics of steps step - len(pending) + 1 .. step; steps checked by an
        earlier call are not counted again."""
        steps = range(step - len(pending) + 1, step + 1)
        bad = [
            s
            for s, m in zip(steps, pending, strict=True)
            if s > self.checked_through and m["nonfinite"]
        ]
        self.checked_through = step
        if not bad:
            return
        first = pending[bad[0] - steps.start]
        loss, norm = float(first["loss_sum"]), float(first["grad_norm"])
        values = f"loss sum {loss:.4g}, gradient norm {norm:.4g}"
        if self.mode == "stop":
            kept = "none" if last_checkpoint is None else f"step {last_checkpoint}"
            kernel = (
                " A finite loss with a non-finite gradient points at a backward pass kernel: "
                "on a GPU with model.attention_impl='fused', rerun with 'xla' to compare."
                if np.isfinite(loss) and not np.isfinite(norm)
                else ""
            )
            raise DivergedError(
                f"non-finite loss or gradient at step {bad[0]} ({values}); its update was not "
                f"applied and no checkpoint was saved after it (the last one kept: {kept}). "
                "Lower train.learning_rate, set train.grad_clip_norm, or "
                f"train.nonfinite='skip' to go on.{kernel}"
            )
        self.total += len(bad)
        logging.warning(
            "skipped the update of %d non-finite step(s) up to step %d (first: %d, %s; %d so far)",
            len(bad),
            step,
            bad[0],
            values,
            self.total,
        )


def eta_seconds(
    t: ml_collections.ConfigDict,
    step: int,
    steps_run: int,
    seconds: float,
    eval_seconds: float,
    validations: int,
) -> float:
    """Seconds until step t.num_steps at the pace of this start, which ran `steps_run` steps
    (checkpoints included) and `validations` validation passes in `seconds` (`eval_seconds` of
    them validating): its time a step, and its mean pass for each validation still due, that
    of `step` included (it follows the step's log line)."""
    per_step = (seconds - eval_seconds) / steps_run
    evals_left = -(-t.num_steps // t.eval_every) - (step - 1) // t.eval_every
    return (t.num_steps - step) * per_step + evals_left * eval_seconds / max(validations, 1)


def interval_losses(pending: list[dict]) -> dict[str, float]:
    """loss, nll, perplexity and grad_norm of a logging interval from its steps' train_step
    metrics: token-weighted over the steps whose update was applied (the NaNs of a skipped
    non-finite step would hide the others); NaN when none was."""
    applied = [m for m in pending if not float(m["nonfinite"])]
    if not applied:
        return dict.fromkeys(("loss", "nll", "perplexity", "grad_norm"), float("nan"))
    loss, nll, tokens, grad_norm = (
        sum(float(m[k]) for m in applied) for k in ("loss_sum", "nll_sum", "tokens", "grad_norm")
    )
    return {
        "loss": loss / tokens,
        "nll": nll / tokens,
        "perplexity": float(np.exp(nll / tokens)),
        "grad_norm": grad_norm / len(applied),
    }


def logged_validation(workdir: str, step: int, split: str) -> dict[str, float] | None:
    """{name: value} of the validation of `step` on `split` that metrics.jsonl holds (its last
    such row), or None."""
    found, prefix = None, f"{split}/"
    for row in read_jsonl(os.path.join(workdir, "metrics.jsonl")):
        if row.get("step") == step and "train/loss" not in row:  # (not a training row)
            values = {k[len(prefix) :]: v for k, v in row.items() if k.startswith(prefix)}
            found = values or found
    return found


def count_params(params) -> int:
    """Number of parameters: the summed sizes of the leaves of `params`."""
    return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str, accept_config_changes: bool = False
) -> dict:
    """Train (resuming from the workdir's last checkpoint) and return final validation metrics
    (with "stopped": "signal", "max_train_seconds" or None). A workdir with checkpoints resumes
    only the same run (experiment.check_workdir) unless `accept_config_changes`; a config that
    cannot run raises config.ConfigError first."""
    try:
        config_lib.validate(config)
        experiment_lib.check_workdir(config, workdir, accept_config_changes)
        config_lib.check_devices(config, jax.device_count(), jax.process_count())
        distributed.check_preemption_service()
    except ValueError as e:
        raise config_lib.ConfigError(str(e)) from e
    with _sole_trainer(workdir):
        return _train(config, workdir)


TRAIN_LOCK = ".train.lock"  # in the workdir: held by process 0 of the run training it


@contextlib.contextmanager
def _sole_trainer(workdir: str):
    """Process 0 holds the workdir's lock (xformer/locks.py) for the run: a second train.py on
    the same workdir (by hand, or beside a sweep's) is refused in one line, before it would
    delete the first one's checkpoint writes in progress and rewrite its metrics."""
    path = os.path.join(workdir, TRAIN_LOCK)
    lock = locks.exclusive(path) if jax.process_index() == 0 else contextlib.nullcontext()
    with lock as taken_by:
        taken_by = distributed.allgather_json(taken_by)[0]  # every process stops, not only 0
        if taken_by is not None:
            raise config_lib.ConfigError(
                f"{workdir} is being trained by another train.py ({locks.describe(taken_by)}): "
                "wait for it to stop, or train into another --workdir"
            )
        yield


def _train(config: ml_collections.ConfigDict, workdir: str) -> dict:
    # Imported here: tensorboardX serves the loop only, not the users of train_step
    # (bench/gpu_throughput.py runs where it is missing).
    from xformer.metric_writer import MetricWriter

    # A resumed run needs the vocabulary it was trained with: never a new one.
    task = make_task(config, workdir, train_if_missing=not experiment_lib.has_checkpoint(workdir))
    exp = task.exp
    if jax.process_index() == 0:
        exp.checkpointer.remove_unfinished_writes()
    t = config.train
    data_iter = task.train_batches()
    task.prepare_evaluation()  # a validation split that cannot be read fails before training

    carry, progress, resumed = task.init_carry(), {}, exp.checkpointer.latest_step() is not None
    if not resumed:
        state = exp.init_state(carry)
    else:  # onto shapes: a resumed run neither initialises nor holds a second train state
        try:
            state, data_state = exp.checkpointer.restore(exp.abstract_state(carry))
        except CheckpointMismatchError as e:  # (other shapes, another process count)
            exp.checkpointer.close()  # (its threads would outlive the exit, each with a stack)
            raise config_lib.ConfigError(str(e)) from e
        progress = exp.checkpointer.progress()
        try:
            data_iter.set_state(data_state)
        except (KeyError, TypeError, ValueError) as e:  # another input pipeline wrote it
            exp.checkpointer.close()
            raise config_lib.ConfigError(
                f"the checkpoint's data position does not fit this run's input pipeline "
                f"(was data.input_shards or the data changed?): {e!r}"
            ) from e
        logging.info("resumed from step %d", int(state["step"]))
    step = int(state["step"])
    # Only now: a resume that fails leaves config.json describing the checkpoints.
    experiment_lib.save_config(config, workdir)
    last_metrics = progress.get("metrics", {})  # (the metrics of the last logged interval)
    # The checkpoint was saved before the validation due at its step, which a signal skipped
    # or a kill may have interrupted: run it now unless metrics.jsonl holds its row (process
    # 0's finding, for every process: validating is collective).
    pending_eval = bool(progress.get("pending_eval", False))
    if pending_eval:
        mine = logged_validation(workdir, step, config.data.eval_split)
        logged = distributed.allgather_json(mine if jax.process_index() == 0 else None)[0]
        if logged is not None:
            logging.info("the validation of step %d is logged: not run again", step)
            last_metrics = {**last_metrics, **{f"val_{k}": v for k, v in logged.items()}}
            pending_eval = False
    # A start killed while running that validation may have logged it: the step's rows are
    # dropped and its training row rewritten, as TensorBoard purges the whole step.
    writer = MetricWriter(
        workdir,
        enabled=jax.process_index() == 0,
        resume_step=(step - 1 if pending_eval else step) if resumed else -1,
    )
    if pending_eval:
        writer.write(step, last_metrics, prefix="train/")
    rng_state = exp.rng_state
    evaluating, validations = 0.0, 0  # seconds and number of this start's validation passes

    def validate(step: int) -> dict:
        """Score data.eval_split, log it, and return {"val_<name>": value}."""
        nonlocal evaluating, validations
        eval_start = time.monotonic()
        val, summary = task.evaluate(state["params"], rng_state)
        samples = val.pop("samples", None)
        val_row = {f"{config.data.eval_split}/{k}": v for k, v in val.items()}
        writer.write(step, {**val_row, "train/train_seconds": clock.seconds()})
        if samples:
            writer.write_text(step, "samples", samples)
        evaluating += time.monotonic() - eval_start
        validations += 1
        logging.info(
            "eval %s at step %d: %s (%.0fs)",
            config.data.eval_split,
            step,
            summary,
            time.monotonic() - eval_start,
        )
        return {f"val_{k}": v for k, v in val.items()}

    # Training seconds, cumulative across resumes: compilation, start-up, metric writing,
    # checkpoints and evaluation excluded.
    interval_start = float(progress.get("train_seconds", 0.0))
    clock = TrainClock(interval_start)  # (a finished run's; the loop's starts after compiling)
    done_path = os.path.join(workdir, DONE_FILE)
    # train.max_train_seconds is a budget for the whole run: the wall time of the loops of every
    # start so far (up to its last checkpoint) counts, validation passes excluded (a slower
    # machine's evaluations must not take steps away from its training).
    budget_before = float(progress.get("budget_seconds", progress.get("train_seconds", 0.0)))
    if step >= t.num_steps:
        reason = "num_steps"
        logging.info(
            "already finished at step %d (train.num_steps=%d): nothing to train (%s)",
            step,
            t.num_steps,
            "train.num_steps sets the cosine decay: train longer in a new workdir"
            if t.schedule == "cosine"
            else "raise train.num_steps to train on",
        )
    elif t.max_train_seconds and budget_before >= t.max_train_seconds:
        reason = "max_train_seconds"
        logging.info(
            "the time budget is spent (%.0f s of train.max_train_seconds=%g) at step %d: "
            "nothing to train (raise it to train on)",
            budget_before,
            t.max_train_seconds,
            step,
        )
    else:
        reason = None
    if reason:  # before compiling anything; the finished run's metrics are its marker's
        marker = read_json_if_present(done_path)
        metrics = (marker or {}).get("metrics", last_metrics)
        if pending_eval:
            with clock.paused():
                metrics = {**metrics, **validate(step)}
        exp.checkpointer.close()
        writer.close()
        if jax.process_index() == 0 and (marker is None or reason == "max_train_seconds"):
            write_json(done_path, {"step": step, "reason": reason, "metrics": metrics})
        return {"step": step, "stopped": None if reason == "num_steps" else reason, **metrics}
    if jax.process_index() == 0:
        info_path = os.path.join(workdir, RUN_INFO_FILE)
        info = provenance.with_start(
            read_json_if_present(info_path),
            provenance.start_record(step),
            count_params(state["params"]),
        )
        write_json(info_path, info)
        if len(info["commits"]) > 1:
            logging.warning("this run was trained by several commits: %s", info["commits"])
        if step < t.num_steps and os.path.exists(done_path):
            os.remove(done_path)  # training further: the old marker is stale

    def global_batch(batch):  # this process's block of rows (sharding.row_blocks)
        return jax.make_array_from_process_local_data(exp.batch_sharding, batch)

    first = global_batch(next(data_iter))
    platform = exp.mesh.devices.flat[0].platform
    compiled = compile_step(lower_train_step(task, state, rng_state, first, platform), platform)
    state = in_step_layouts(state, compiled)
    flops = flops_lib.executed_flops(compiled, exp.mesh.size, t.grad_accum_steps)
    model_flops = flops_lib.train_step_flops(
        exp.model_cfg, t.batch_size, flops_lib.row_length(config)
    ).total
    device_kind = exp.mesh.devices.flat[0].device_kind
    peak = flops_lib.peak_tflops(device_kind, t.peak_tflops)
    logging.info(
        "train step: %.2f GFLOP executed (XLA cost analysis, summed over %d device(s)), "
        "%.2f GFLOP model FLOPs (flops.py); MFU against %s",
        flops / 1e9,
        exp.mesh.size,
        model_flops / 1e9,
        f"{peak:g} TFLOP/s per device"
        if peak
        else f"no peak: {device_kind!r} is not in flops.PEAK_TFLOPS (set train.peak_tflops)",
    )
    lr_fn = jax.jit(learning_rate_schedule(t))  # one program, not an eager op per term

    eval_seconds = float(progress.get("eval_seconds", 0.0))  # validation passes, all starts
    nonfinite = NonfiniteSteps(t.nonfinite, int(progress.get("nonfinite_steps", 0)), step)
    clock = TrainClock(interval_start)  # from here: start-up and compilation are not training
    start_time, start_step, pending, window = time.monotonic(), step, [], DispatchWindow()

    def budget_spent() -> float:
        """train.max_train_seconds spent: every start's loop so far, validations excluded."""
        return budget_before + time.monotonic() - start_time - evaluating

    batch, stopped = first, None
    profiler = StepProfiler(t.profile_steps, workdir, step, clock, compiled.as_text)
    several = jax.process_count() > 1  # then a signal stops all at a step they agree on
    signals = StopOnSignal(several_processes=several)
    noticed = distributed.preemption_decided if several else signals.requested
    try:
        signals.install()  # SIGTERM / SIGINT: stop after a step, checkpointed
        if pending_eval:
            with clock.paused():
                last_metrics = {**last_metrics, **validate(step)}
        while step < t.num_steps:
            profiler.before_step(step, state)
            with jax.profiler.StepTraceAnnotation("train", step_num=step):
                state, metrics = compiled(state, rng_state, batch)
            pending.append(metrics)
            window.push(metrics)
            step += 1
            profiler.after_step(step, (state, metrics))
            sync_point = distributed.preemption_sync_point(step - start_step)  # (one: False)
            faults.stall_after_step(step, noticed, exp.checkpointer.wait)
            budget_seconds = budget_spent()
            signalled = sync_point if several else signals.requested()
            stopped = stop_reason(budget_seconds, t.max_train_seconds, signalled, step, t.log_every)
            done = step >= t.num_steps or stopped is not None
            checkpoint_due = step % t.checkpoint_every == 0 or done
            if checkpoint_due:  # the position after the batches consumed by steps 1..step
                data_state = data_iter.get_state()
            if not done:
                batch = global_batch(next(data_iter))  # host work overlaps the async device step

            # A row at every checkpoint too: a resumed run's first row then starts after it,
            # and no step between the last row and the checkpoint goes unlogged.
            if step % t.log_every == 0 or checkpoint_due:
                nonfinite.check(pending, step, exp.checkpointer.latest_step())  # (device sync)
                sums = jax.tree.map(lambda *xs: float(np.sum(xs)), *pending)
                train_seconds = clock.seconds()
                dt = train_seconds - interval_start
                remaining = eta_seconds(  # (timed after the sync: dispatch runs ahead)
                    t,
                    step,
                    step - start_step,
                    time.monotonic() - start_time,
                    evaluating,
                    validations,
                )
                if t.max_train_seconds:
                    remaining = min(remaining, t.max_train_seconds - budget_seconds)
                steps_per_s = len(pending) / dt
                with clock.paused():  # (the schedule's first call compiles it)
                    learning_rate = float(lr_fn(step - nonfinite.total))
                last_metrics = {
                    **interval_losses(pending),
                    # of the last applied update: the schedule follows Adam's count of them
                    "learning_rate": learning_rate,
                    "steps_per_s": steps_per_s,
                    "tokens_per_s": sums["input_tokens"] / dt,
                    "target_tokens_per_s": sums["tokens"] / dt,
                    "gflop_per_s": flops * steps_per_s / 1e9,
                    **(
                        {"mfu": model_flops * steps_per_s / (exp.mesh.size * peak * 1e12)}
                        if peak
                        else {}
                    ),
                    "train_seconds": train_seconds,
                    "nonfinite_steps": sums["nonfinite"],
                    "nonfinite_steps_total": nonfinite.total,
                }
                with clock.paused():
                    writer.write(step, last_metrics, prefix="train/")
                    mfu = f" | MFU {last_metrics['mfu']:.1%}" if peak else ""
                    logging.info(
                        "step %d/%d | loss %.3f | ppl %.1f | lr %.2e | %.2f steps/s | %.0f tok/s | "
                        "%.1f GFLOP/s%s | ETA %s",
                        step,
                        t.num_steps,
                        last_metrics["loss"],
                        last_metrics["perplexity"],
                        last_metrics["learning_rate"],
                        steps_per_s,
                        last_metrics["tokens_per_s"],
                        last_metrics["gflop_per_s"],
                        mfu,
                        format_duration(remaining),
                    )
                interval_start, pending = train_seconds, []

            # A signal leaves little time (a grace period): checkpoint, no evaluation.
            eval_due = (step % t.eval_every == 0 or done) and stopped != "signal"
            if checkpoint_due or eval_due:
                jax.block_until_ready(state)  # the steps so far count as training time
            if checkpoint_due:
                with clock.paused():
                    spent = budget_spent()
                    # The checkpoint notes the validation due after it, or skipped by a signal
                    # (at an eval step, the last step or the step that spent the budget): a
                    # start killed before that validation logged its row runs it on resuming.
                    last = step >= t.num_steps or 0 < t.max_train_seconds <= spent
                    skipped_eval = stopped == "signal" and (step % t.eval_every == 0 or last)
                    progress = {
                        "train_seconds": clock.seconds(),
                        "budget_seconds": spent,
                        "eval_seconds": eval_seconds + evaluating,
                        "nonfinite_steps": nonfinite.total,
                        "pending_eval": eval_due or skipped_eval,
                        "metrics": last_metrics,
                    }
                    exp.checkpointer.save(step, state, data_state, progress)
            if eval_due:
                with clock.paused():
                    last_metrics = {**last_metrics, **validate(step)}
            if done:
                break
    finally:
        try:
            profiler.close()  # a run that stopped inside the range (time limit, error) keeps it
            # Waits for the last save, its signal handler still installed: a SIGTERM now (the
            # end of a job, a signal delivered twice) does not kill the commit.
            exp.checkpointer.close()  # (a diverged run saved nothing new)
        finally:
            writer.close()
            signals.uninstall()
    finished = (step >= t.num_steps and stopped != "signal") or stopped == "max_train_seconds"
    if jax.process_index() == 0 and finished:
        reason = "num_steps" if step >= t.num_steps else "max_train_seconds"
        write_json(done_path, {"step": step, "reason": reason, "metrics": last_metrics})
    if stopped == "signal":
        logging.warning(
            "stopped by %s at step %d with a checkpoint: re-run the same command to resume",
            signals.signal_name or "a signal to one of the processes",
            step,
        )
    return {"step": step, "stopped": stopped, **last_metrics}
