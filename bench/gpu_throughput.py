"""Benchmark 2 of issue 12: train-step throughput, MFU and peak memory on one GPU.

    python bench/gpu_throughput.py --out gpu_throughput.json    # one H100 / H200, <= ~9 min
    python bench/gpu_throughput.py --quick --out /tmp/gpu_throughput_quick.json  # tiny, CPU

First run on one H100 on 2026-11-24 (jax 0.11.2, flax 0.12.10): the figures are in the README.

What is timed is the train step train.py runs: `train_lib.train_step` on the task's own loss
(`TranslationTask.loss_terms`, `LanguageModelingTask.loss_terms` with the XL memory carried in
the state), built from the config files and compiled ahead of time with the state donated, as
`train_lib.train_and_evaluate` does. Only the data is synthetic (no corpus is read):

- wmt14: configs/wmt14_ende.py, the base Transformer (6+6 layers, d_model 512, shared 32k
  vocabulary), on the config's 96 packed rows of 256 source and 256 target positions, packed by
  the real packer (`data.pipeline.packed_train_dataset`, first-fit) from random sentence pairs
  of WMT-like lengths: source ~ lognormal with median 24 tokens, target ~1.1x the source, EOS
  included; about 8 pairs (segments) per row.
- ptb_xl: configs/ptb_xl.py, Transformer-XL (4 layers, d_model 256, 32 rows x 70 tokens, memory
  70) over PTB's 10,000 word types.
- wt103_xl: configs/wt103_xl_base.py (16 layers, d_model 410, 60 rows x 150 tokens, memory 150,
  adaptive softmax over WikiText-103's 267,735 types, cutoffs 20k/40k/200k).
  Language-model streams draw ids from a Zipf law (p ~ 1 / rank; vocabularies are sorted by
  frequency, so the adaptive-softmax clusters get a realistic share of the targets) and are
  served by the real batcher (`data.lm_stream.TrainStream`).

Each model runs in {float32, bfloat16} x {xla, fused} (`model.dtype`, `model.attention_impl`).
Per setting: the step is compiled once (compile time reported), run `--warmup` steps, then
`--repeats` timed windows of `--steps` steps, each ended by `block_until_ready`; the medians of
the windows are reported. `--batches` distinct batches, already on the device, are cycled.

- tokens/s: the tokens the train loop counts as input tokens (translation: real source + target
  tokens, padding excluded; language models: rows x segment length).
- FLOPs per step, two sources side by side: XLA's cost analysis of the compiled step (every op,
  elementwise and optimizer included; on GPU, library calls such as cuDNN attention may be
  counted partly or not at all; a lax.cond counts as its costlier branch, e.g. the dense
  fallback of `model.adaptive_capacity`), and the model FLOPs that train.py's MFU counts
  (xformer/flops.py): 6 x the multiply-adds of the weight matrices over the positions of the
  step (padding included: the step computes them; memory positions included for XL's
  key/value projections; 4 x for XL's projection of the relative encodings), plus the
  attention term 6 * 2 * Lq * Lk * d per row and layer (6 * Lq * W * d more with relative
  positions, W distances; masked and causal halves included, as a dense kernel computes them).
  Embedding lookups, LayerNorm, softmax and the optimizer are left out.
- MFU = model FLOPs per step / median step time / the device's dense bf16 peak (PEAK_TFLOPS
  of xformer/flops.py by `device_kind`, e.g. 989 TFLOP/s for H100 SXM and H200;
  `--peak-tflops` overrides; n/a on CPU without it). MFU (XLA) uses XLA's count instead.
- memory: `memory_stats()["peak_bytes_in_use"]` of the device (GPU; n/a on CPU), and XLA's
  memory analysis of the compiled step (arguments + outputs - donated aliases + temporaries).
- fused: how many cuDNN attention calls the compiled step holds (`__cudnn$fmha` custom calls)
  and the attention module's log lines on why it used the XLA path, if it did.

Every setting runs in a fresh process (`--isolate`, the default except with `--quick`): a clean
peak-memory counter, and a setting that fails or runs out of memory records its error while
the others go on. The full run is sized for about 8 minutes on one H100: few steps per setting
(3 warm-up, 5 windows of 5), so compiling (expected tens of seconds per setting, with XLA's
GPU autotuning) is most of it. `--budget-s` (default 480) makes that a bound whatever the
compile times turn out to be: no setting starts after 480 s (the rest are recorded as
skipped) and a worker still running at 540 s is killed, inside the device machine's 10-minute
limit per command. The encoder-decoder runs first; `--configs ptb_xl,wt103_xl` in a second
command completes a table cut short. Results go to stdout (progress lines, the exact command,
a table) and to `--out` as JSON, rewritten after every setting.

On the device machine (its python3 has jax 0.11.2, flax, optax and orbax, not the rest), run
`bash bench/gpu_wheels.sh` here first, carry `.whl` (ignored by git) and run:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && \
    PYTHONUNBUFFERED=1 python3 bench/gpu_throughput.py --out $OUT/gpu_throughput.json \
        2>&1 | tee $OUT/gpu_throughput.log

`--profile STEPS` traces that many more steps of every setting after its timing, into
`--profile-dir` (default: profiles/ beside --out), saves the step's HLO beside each trace and
adds each setting's op profile (xformer/op_profile.py) to the JSON and the printout. It sets
XLA_FLAGS=--xla_gpu_enable_command_buffer= for the run (kernels inside a CUDA graph would all be
charged to the graph's op), so its throughput figures are not those of a default run.

The step compiles as train.py's (`train_lib.compile_step`: on a GPU without XLA's Triton GEMM
fusions, unless XLA_FLAGS sets `--xla_gpu_enable_triton_gemm`).

`--quick` (`--tiny`) shrinks every model, batch and vocabulary (d_model 64, one layer (1+1),
8 rows of 64 or 4 rows of 32 tokens, 1,000-3,000 types; 1 warm-up step, 3 windows of 2, all
settings in one process): a check that the benchmark works end to end, not a measurement. It
is compiling the 12 steps that takes the time: ~3.5 min of CPU time (5-8 min wall on a 2-core
machine shared with other jobs); `XLA_FLAGS=--xla_backend_optimization_level=0` compiles ~35%
faster (and runs slower) where that matters.
"""

import argparse
import ast
import contextlib
import importlib.util
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {  # name -> (config file, vocabulary size of its corpus)
    "wmt14": ("configs/wmt14_ende.py", 32_000),
    "ptb_xl": ("configs/ptb_xl.py", 10_000),
    "wt103_xl": ("configs/wt103_xl_base.py", 267_735),
}
TINY = {  # --quick: name -> (config overrides, vocabulary size)
    "wmt14": (
        {
            "model.d_model": 64,
            "model.num_heads": 2,
            "model.num_encoder_layers": 1,
            "model.num_decoder_layers": 1,
            "model.d_ff": 128,
            "model.max_len": 64,
            "data.max_train_length": 64,
            "train.batch_size": 8,
        },
        1000,
    ),
    "ptb_xl": (
        {
            "model.d_model": 64,
            "model.num_heads": 2,
            "model.num_decoder_layers": 1,
            "model.d_ff": 128,
            "model.mem_len": 32,
            "data.segment_length": 32,
            "train.batch_size": 4,
        },
        1000,
    ),
    "wt103_xl": (
        {
            "model.d_model": 64,
            "model.num_heads": 2,
            "model.num_decoder_layers": 1,
            "model.d_ff": 128,
            "model.mem_len": 32,
            "model.adaptive_cutoffs": (200, 400, 2000),
            "data.segment_length": 32,
            "train.batch_size": 4,
        },
        3000,
    ),
}
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="  # --profile: one op per kernel
DTYPES = ("bfloat16", "float32")
IMPLS = ("fused", "xla")  # the default run
KNOWN_IMPLS = (*IMPLS, "fused_packed")  # model.attention_impl's choices (no jax import here)

# Synthetic data ----------------------------------------------------------------------------


def wmt_like_pairs(num_pairs: int, vocab: int, max_length: int, rng: np.random.Generator):
    """Random sentence pairs of WMT-like lengths (EOS-terminated int32 ids in [4, vocab)):
    source ~ lognormal(median 24, sigma 0.65), target ~ source x lognormal(median 1.1, 0.15),
    both clipped to [2, max_length]. -> data.pipeline.EncodedPairs"""
    from xformer.data.pipeline import EncodedPairs
    from xformer.data.tokenizer import EOS_ID

    src_len = np.clip(np.rint(rng.lognormal(math.log(24), 0.65, num_pairs)), 2, max_length)
    tgt_len = np.clip(
        np.rint(src_len * rng.lognormal(math.log(1.1), 0.15, num_pairs)), 2, max_length
    )

    def sentence(n):
        return np.concatenate([rng.integers(4, vocab, int(n) - 1), [EOS_ID]]).astype(np.int32)

    return EncodedPairs.from_sequences(
        [sentence(n) for n in src_len], [sentence(n) for n in tgt_len]
    )


def translation_batches(config, vocab: int, num_batches: int, seed: int = 0) -> list[dict]:
    """`num_batches` packed batches {"src", "tgt_in", "tgt_out", "*_segments", "*_positions":
    [batch_size, max_train_length] int32} from the real packer over synthetic pairs."""
    from xformer.data.pipeline import packed_train_dataset

    rows, length = config.train.batch_size, config.data.max_train_length
    pairs = wmt_like_pairs(4 * rows * length // 50, vocab, length, np.random.default_rng(seed))
    dataset = iter(
        packed_train_dataset(
            pairs,
            batch_size=rows,
            max_length=length,
            seed=seed,
            max_pairs_per_row=config.data.max_pairs_per_row,
        )
    )
    return [next(dataset) for _ in range(num_batches)]


def lm_batches(config, vocab: int, num_batches: int, seed: int = 0) -> list[dict]:
    """`num_batches` consecutive TrainStream batches {"inputs", "targets": [B, L] int32,
    "weights": [B, L] float32, "reset": [B] bool} of a Zipf-distributed token stream."""
    from xformer.data.lm_stream import TrainStream

    rows, length = config.train.batch_size, config.data.segment_length
    p = 1.0 / np.arange(1, vocab + 1)
    rng = np.random.default_rng(seed)
    stream = rng.choice(vocab, size=rows * length * num_batches + 1, p=p / p.sum())
    batches = TrainStream(stream.astype(np.int32), rows, length)
    return [next(batches) for _ in range(num_batches)]


# FLOPs -------------------------------------------------------------------------------------


def synthetic_batches(config, vocab: int, num_batches: int) -> list[dict]:
    """The family's synthetic batches (translation_batches or lm_batches)."""
    if config.model.family == "encoder_decoder":
        return translation_batches(config, vocab, num_batches)
    return lm_batches(config, vocab, num_batches)


def compiled_step_bytes(compiled) -> int | None:
    """XLA's memory analysis of a compiled step: arguments + outputs - donated (aliased) +
    temporaries, the step's peak; None where the backend gives no analysis."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def model_flops(config, vocab: int):
    """flops.StepFlops of a validated config's train step with this vocabulary (both sides)."""
    from xformer import flops, model_config

    sizes = {"vocab_size": vocab}
    if config.model.family == "encoder_decoder":
        sizes = {"src_vocab_size": vocab, "tgt_vocab_size": vocab}
    cfg = model_config.from_config(config.model, **sizes)
    return flops.train_step_flops(cfg, config.train.batch_size, flops.row_length(config))


# One setting -------------------------------------------------------------------------------


def load_config(name: str, quick: bool, dtype: str, impl: str, overrides: dict):
    from xformer import config as config_lib

    path, vocab = MODELS[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    values = dict(TINY[name][0]) if quick else {}
    values.update(overrides)
    values.update({"model.dtype": dtype, "model.attention_impl": impl})
    config_lib.override(config, values)
    config_lib.validate(config)
    return config, TINY[name][1] if quick else vocab


def make_task(config, vocab: int, workdir: str):
    """The family's task class with its own loss and carry, built without reading a corpus."""
    from xformer import experiment as experiment_lib
    from xformer import model_config

    if config.model.family == "encoder_decoder":
        from xformer.models import EncoderDecoder
        from xformer.tasks.translation import TranslationTask, model_cfg_for

        class SyntheticTranslation(TranslationTask):
            def __init__(self):
                self.config = config
                cfg = model_cfg_for(config, vocab, vocab)
                self.exp = experiment_lib.setup(config, workdir, EncoderDecoder, cfg)

        return SyntheticTranslation()

    from xformer.language_model import LanguageModel
    from xformer.tasks.language_modeling import LanguageModelingTask

    class SyntheticLM(LanguageModelingTask):
        def __init__(self):
            self.config, self.mem_len = config, config.model.mem_len
            cfg = model_config.from_config(config.model, vocab_size=vocab)
            self.exp = experiment_lib.setup(config, workdir, LanguageModel, cfg)

    return SyntheticLM()


class _Collect(logging.Handler):
    """Keeps the log lines that mention attention_impl (why fused attention took XLA)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "attention_impl" in message and message not in self.lines:
            self.lines.append(message)


def peak_tflops(device_kind: str, override: float) -> tuple[float | None, str]:
    """(dense bf16 TFLOP/s of one device, where the figure comes from)."""
    from xformer import flops

    if override:
        return override, "--peak-tflops"
    peak = flops.peak_tflops(device_kind)
    if peak is None:
        return None, f"unknown for {device_kind!r}: pass --peak-tflops"
    return peak, f"dense bf16 peak of {device_kind} (datasheet, xformer/flops.py)"


def run_setting(spec: dict) -> dict:
    """Build, compile, warm up and time one (model, dtype, attention_impl) setting."""
    import jax

    from xformer import attention, train_lib

    result = {k: spec[k] for k in ("model", "dtype", "attention_impl")}
    device = jax.devices()[0]
    result.update(
        device_kind=device.device_kind,
        platform=device.platform,
        devices=jax.device_count(),
        jax=jax.__version__,
    )
    handler = _Collect()
    logging.getLogger().addHandler(handler)
    attention.forget_logged_fallbacks()  # each setting's own (--quick: one process)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            result.update(_measure(spec, workdir, jax, train_lib))
        result["status"] = "ok"
    except Exception as error:  # noqa: BLE001 (recorded; the other settings go on)
        result["status"] = "error"
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        logging.getLogger().removeHandler(handler)
    result["attention_log"] = handler.lines
    stats = device.memory_stats() or {}
    result["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    result["bytes_limit"] = stats.get("bytes_limit")
    peak, source = peak_tflops(device.device_kind, spec["peak_tflops"])
    result["peak_tflops"], result["peak_source"] = peak, source
    if result["status"] == "ok" and peak:
        per_s = 1.0 / result["step_s"] / (peak * 1e12)
        # The model FLOPs are of the global batch, over every device's peak; XLA's cost analysis
        # counts one device's program.
        result["mfu"] = result["flops_analytic"] * per_s / result["devices"]
        result["mfu_xla"] = result["flops_xla"] * per_s if result["flops_xla"] else None
    return result


def _measure(spec: dict, workdir: str, jax, train_lib) -> dict:
    began = time.perf_counter()
    config, vocab = load_config(
        spec["model"], spec["quick"], spec["dtype"], spec["attention_impl"], spec["overrides"]
    )
    task = make_task(config, vocab, workdir)
    exp = task.exp
    host_batches = synthetic_batches(config, vocab, spec["batches"])
    if config.model.family == "encoder_decoder":  # real source + target tokens, as train.py
        tokens = [
            int((b["src_segments"] > 0).sum() + (b["tgt_segments"] > 0).sum()) for b in host_batches
        ]
    else:
        tokens = [int(b["weights"].sum()) for b in host_batches]
    batches = [jax.make_array_from_process_local_data(exp.batch_sharding, b) for b in host_batches]
    state = exp.init_state(task.init_carry())
    rng_state = jax.device_put(exp.rng_state, exp.replicated)
    params = train_lib.count_params(state["params"])

    start = time.perf_counter()
    setup_s = start - began  # model graphs, synthetic batches, initial state
    platform = exp.mesh.devices.flat[0].platform
    lowered = train_lib.lower_train_step(task, state, rng_state, batches[0], platform)
    compiled = train_lib.compile_step(lowered, platform)
    state = train_lib.in_step_layouts(state, compiled)
    compile_s = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list | tuple) else cost) or {}
    step_bytes = compiled_step_bytes(compiled)
    hlo = compiled.as_text() or ""

    count, metrics = 0, None
    for _ in range(spec["warmup"]):
        state, metrics = compiled(state, rng_state, batches[count % len(batches)])
        count += 1
    jax.block_until_ready((state, metrics))
    step_times, rates, skipped = [], [], 0
    for _ in range(spec["repeats"]):
        window = [count + i for i in range(spec["steps"])]
        start = time.perf_counter()
        for i in window:
            state, metrics = compiled(state, rng_state, batches[i % len(batches)])
        jax.block_until_ready((state, metrics))
        seconds = time.perf_counter() - start
        count += len(window)
        step_times.append(seconds / len(window))
        rates.append(sum(tokens[i % len(batches)] for i in window) / seconds)
        skipped += float(metrics["nonfinite"])  # the window's last step skipped its update
    loss = float(metrics["loss_sum"] / metrics["tokens"])
    profile = None
    if spec.get("profile"):
        profile = profile_steps(spec, compiled, hlo, (state, rng_state), batches, count, jax)

    flops = model_flops(config, vocab)
    first = host_batches[0]["src" if "src" in host_batches[0] else "inputs"]
    return {
        "config_file": MODELS[spec["model"]][0],
        "vocab": vocab,
        "params": params,
        "rows": int(first.shape[0]),
        "length": int(first.shape[1]),
        "mem_len": int(config.model.mem_len),
        "tokens_per_step": statistics.mean(tokens),
        "fill": statistics.mean(tokens) / (first.size * (2 if "src" in host_batches[0] else 1)),
        "setup_s": setup_s,
        "compile_s": compile_s,
        "step_s": statistics.median(step_times),
        "step_s_all": step_times,
        "tokens_per_s": statistics.median(rates),
        "flops_xla": float(cost.get("flops", 0.0)) or None,
        "flops_analytic": flops.total,
        "flops_analytic_matmul": flops.matmul,
        "flops_analytic_attention": flops.attention,
        "step_bytes_xla": step_bytes,
        "cudnn_attention_calls": hlo.count("__cudnn$fmha"),
        "loss": loss,
        "grad_norm": float(metrics["grad_norm"]),
        "nonfinite_windows": int(skipped),  # windows whose last step had a non-finite gradient
        "steps_run": count,
        "profile": profile,
    }


def profile_steps(spec: dict, compiled, hlo: str, carry: tuple, batches: list, count: int, jax):
    """Trace `spec["profile"]` more steps into <profile_dir>/<model>_<dtype>_<impl>/, save the
    step's HLO beside the trace and summarise its ops (xformer/op_profile.py)."""
    from xformer import op_profile

    state, rng_state = carry
    label = "_".join(spec[k] for k in ("model", "dtype", "attention_impl"))
    folder = os.path.join(spec["profile_dir"], label)
    with jax.profiler.trace(folder):
        for i in range(count, count + spec["profile"]):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                state, metrics = compiled(state, rng_state, batches[i % len(batches)])
        jax.block_until_ready((state, metrics))
    trace = op_profile.newest_trace(folder)
    with open(os.path.join(os.path.dirname(trace), op_profile.HLO_FILE), "w") as f:
        f.write(hlo)
    return op_profile.summarise(trace, hlo, steps=spec["profile"], top=15)


# The run -----------------------------------------------------------------------------------


def worker_command(spec: dict) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]


def run_isolated(spec: dict, timeout: float | None) -> dict:
    """run_setting in a fresh Python process; its result is the last "RESULT " line."""
    base = {k: spec[k] for k in ("model", "dtype", "attention_impl")}
    try:
        proc = subprocess.run(
            worker_command(spec), cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {**base, "status": "error", "error": f"killed after {timeout:.0f} s (budget)"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {**base, "status": "error", "error": f"worker exit {proc.returncode}", "log": tail}
    return json.loads(lines[-1][len("RESULT ") :])


def brief(error: str, width: int = 240) -> str:
    """An error's exception type and its last line (where the specifics usually are)."""
    lines = [line for line in error.splitlines() if line.strip()] or [""]
    kind = error.split(":", 1)[0] if len(lines) > 1 else ""
    text = f"{kind}: ... {lines[-1]}" if kind and kind.isidentifier() else lines[-1]
    return text if len(text) <= width else text[: width - 3] + "..."


def fmt(value, spec: str = ".0f", scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, spec)


def table(results: list[dict]) -> str:
    head = (
        "| model | dtype | attention | tokens/s | step ms | MFU | MFU (XLA FLOPs) | "
        "GFLOP/step 6NT + attn = analytic | GFLOP/step XLA | peak GiB | step GiB (XLA) | "
        "compile s | cuDNN calls |"
    )
    rows = [head, "|" + "---|" * 3 + "---:|" * 10]
    for r in results:
        name = f"| {r['model']} | {r['dtype']} | {r['attention_impl']} |"
        if r["status"] != "ok":
            rows.append(f"{name} {r['status']}: {brief(r.get('error', ''))} |" + " |" * 9)
            continue
        gib = 2.0**-30

        def gflop(flops):
            return fmt(flops, ".1f" if flops and flops >= 1e10 else ".3f", 1e-9)

        analytic = (
            f"{gflop(r['flops_analytic_matmul'])} + {gflop(r['flops_analytic_attention'])} = "
            f"{gflop(r['flops_analytic'])}"
        )
        rows.append(
            f"{name} {fmt(r['tokens_per_s'])} | {fmt(r['step_s'], '.1f', 1e3)} | "
            f"{fmt(r.get('mfu'), '.1%')} | {fmt(r.get('mfu_xla'), '.1%')} | {analytic} | "
            f"{gflop(r['flops_xla'])} | {fmt(r['peak_bytes_in_use'], '.2f', gib)} | "
            f"{fmt(r['step_bytes_xla'], '.2f', gib)} | {fmt(r['compile_s'], '.1f')} | "
            f"{r['cudnn_attention_calls']} |"
        )
    return "\n".join(rows)


def parse_overrides(items: list[str]) -> dict[str, dict]:
    """["wt103_xl:model.adaptive_capacity=0.25", "train.batch_size=48"] -> per model
    {key: value}; a value is read as JSON or else as a Python literal where either parses
    (`false` and `False` alike; lists become tuples), else a string; without a "model:" prefix
    it applies to every model."""
    out: dict[str, dict] = {name: {} for name in MODELS}
    for item in items:
        target, _, value = item.partition("=")
        name, _, key = target.rpartition(":")
        if name and name not in MODELS:
            raise SystemExit(f"--set {item!r}: unknown model {name!r}; known: {list(MODELS)}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                parsed = value
        parsed = tuple(parsed) if isinstance(parsed, list) else parsed
        for model in [name] if name else MODELS:
            out[model][key] = parsed
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--quick", "--tiny", action="store_true", help="tiny models (CPU check)")
    parser.add_argument("--configs", default=",".join(MODELS), help="comma-separated models")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--impls", default=",".join(IMPLS), help="attention implementations")
    parser.add_argument("--steps", type=int, help="steps per timed window (5; --quick 2)")
    parser.add_argument("--repeats", type=int, help="timed windows, median (5; --quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed steps after compiling (3; --quick 1)")
    parser.add_argument("--batches", type=int, help="distinct batches cycled (4; --quick 2)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="peak for MFU")
    parser.add_argument(
        "--budget-s",
        type=float,
        help="start no setting after this many seconds (480; --quick: none)",
    )
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one process per setting (default: yes, except with --quick)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="[MODEL:]KEY=VALUE",
        help="config override, e.g. wt103_xl:model.adaptive_capacity=0.25 (repeatable)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after timing, trace this many steps per setting and rank their ops "
        "(turns XLA's GPU command buffers off for the whole run)",
    )
    parser.add_argument(
        "--profile-dir", help="traces go here (default: profiles/ beside --out, else a temp dir)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:  # one setting, in this process
        print("RESULT " + json.dumps(run_setting(json.loads(args.worker))), flush=True)
        return

    names = [n for n in args.configs.split(",") if n]
    for kind, chosen, known in (
        ("model", names, MODELS),
        ("dtype", args.dtypes.split(","), DTYPES),
        ("attention_impl", args.impls.split(","), KNOWN_IMPLS),
    ):
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            raise SystemExit(f"unknown {kind} {unknown}; known: {list(known)}")
    overrides = parse_overrides(args.set)
    for key, full, quick in (
        ("steps", 5, 2),
        ("repeats", 5, 3),
        ("warmup", 3, 1),
        ("batches", 4, 2),
        ("budget_s", 480.0, math.inf),
    ):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    isolate = not args.quick if args.isolate is None else args.isolate
    if args.profile:  # kernels in a CUDA graph would all be charged to its command-buffer op
        if "jax" in sys.modules:
            raise SystemExit("--profile must set XLA_FLAGS before jax is imported")
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} {NO_COMMAND_BUFFERS}".strip()
        args.profile_dir = args.profile_dir or (
            os.path.join(os.path.dirname(args.out) or ".", "profiles")
            if args.out
            else tempfile.mkdtemp(prefix="gpu_profiles_")
        )
    from bench_output import command_line

    command = command_line()
    print(f"command: {command}", flush=True)
    settings = [
        {
            "model": name,
            "dtype": dtype,
            "attention_impl": impl,
            "quick": args.quick,
            "overrides": overrides[name],
            "steps": args.steps,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "batches": args.batches,
            "peak_tflops": args.peak_tflops,
            "profile": args.profile,
            "profile_dir": args.profile_dir,
        }
        for name in names
        for dtype in args.dtypes.split(",")
        for impl in args.impls.split(",")
    ]
    report = {
        "command": command,
        "host": platform.node(),
        "quick": args.quick,
        "isolated": isolate,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "notes": (
            "tokens/s: median over timed windows; MFU: analytic FLOPs (6NT + attention, "
            "positions incl. padding) per step / median step time / dense bf16 peak; "
            "flops_xla: XLA cost analysis of the compiled step"
        ),
        "results": [],
    }
    start = time.time()
    for spec in settings:
        elapsed = time.time() - start
        label = f"{spec['model']} {spec['dtype']} {spec['attention_impl']}"
        if elapsed > args.budget_s:
            result = {**{k: spec[k] for k in ("model", "dtype", "attention_impl")}}
            result.update(status="skipped", error=f"--budget-s {args.budget_s:.0f} s spent")
        elif isolate:
            timeout = max(30.0, args.budget_s - elapsed + 60.0)
            result = run_isolated(spec, None if math.isinf(timeout) else timeout)
        else:
            result = run_setting(spec)
        result["wall_s"] = time.time() - start - elapsed
        report["results"].append(result)
        line = f"[{time.time() - start:5.0f}s] {label}: {result['status']}"
        if result["status"] == "ok":
            line += (
                f", {result['tokens_per_s']:.0f} tok/s, {result['step_s'] * 1e3:.1f} ms/step, "
                f"MFU {fmt(result.get('mfu'), '.1%')}, compile {result['compile_s']:.1f} s"
            )
        else:
            line += f" ({brief(result.get('error', ''))})"
        print(line, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    ok = [r for r in report["results"] if r["status"] == "ok"]
    if ok:
        r = ok[0]
        report.update(device_kind=r["device_kind"], platform=r["platform"], jax=r["jax"])
        print(
            f"\ndevice: {r['device_kind']} ({r['platform']}, {r['devices']} device(s)), "
            f"jax {r['jax']}; MFU peak: {fmt(r['peak_tflops'], '.4g')} TFLOP/s "
            f"({r['peak_source']})"
        )
    print(f"command: {command}\n")
    print(table(report["results"]))
    for r in report["results"]:
        lines = list(r.get("attention_log", []))
        if r.get("nonfinite_windows"):
            lines.append(
                f"{r['nonfinite_windows']} of the timed windows ended in a step whose loss or "
                f"gradient was not finite (grad norm {r['grad_norm']}): its update was skipped"
            )
        for line in lines:
            print(f"note ({r['model']} {r['dtype']} {r['attention_impl']}): {line}")
    for r in report["results"]:
        if r.get("profile"):
            from xformer import op_profile

            print(f"\nprofile: {r['model']} {r['dtype']} {r['attention_impl']}")
            print(op_profile.format_summary(r["profile"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nresults: {args.out}")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
