"""Evaluate a trained workdir: BLEU for translation, perplexity / bits per character for LMs.

Translation (translates every line, scores with BLEU):

    python eval.py --workdir=workdirs/multi30k_ende --split=test_2016_flickr
    python eval.py --workdir=workdirs/multi30k_ende --input=my.en --reference=my.de \\
        --output=my.hyp.de

--input gets exactly one output line per input line, in order, whatever the file holds (the
line contract of xformer/data/text.py, the batching and length limits of xformer/translate.py):
empty lines give empty outputs, inputs longer than eval.max_input_tokens are cut, translated
and counted, batches stay within eval.max_tokens_per_batch tokens.

Language modelling (scores every token of the split, or of an --input file in the corpus's
format, once; lengths independent of training):

    python eval.py --workdir=workdirs/ptb_xl --split=test --segment_length=64 --mem_len=640 \\
        --clamp_len=400 --decoder_mask=same_length
    python eval.py --workdir=workdirs/ptb_xl --input=my.txt    # words outside the vocabulary
                                                               # count as <unk> (oov_tokens)

--average_last=N evaluates the mean parameters of the last N checkpoints kept (ending at --step;
average.py writes them as a workdir of their own).

Results are printed as JSON and written to <workdir>/eval_<name>.json (<name>: the split, or
input.<file name>) when they are the run's own: its latest checkpoint, evaluated with its
settings. Others add what differs, so that none overwrites it: eval_<name>.step4.json (--step
before the latest), .avg3 (--average_last=3), .mem_len=640,clamp_len=400 (the settings whose
flags changed them; translation hypotheses are named alike, and a split's sources and
references are written beside them in their order: <name>.<source language>, <name>.ref.<target
language>; a split of the TFDS catalog, such as WMT14's, is in TFDS's stored order, not the
official file's). An --input, --reference
or --output that cannot be used (missing, invalid UTF-8, different line counts, symbols a
character model has no <unk> for) is reported in one line on stderr, naming the file, line and
column, with exit status 2, before any model is restored.

The devices need not be the training run's: its mesh is kept where it fits them, else every
device goes on the data axis; --mesh=data,fsdp,tensor sets another. With --distributed (and the
multi-process flags of train.py) every process of a jax.distributed job evaluates its share of
each batch; process 0 alone prints and writes the files.

Comparing runs (e.g. the points of a sweep): one table row per workdir with the config values
that differ, parameters, steps, training time, tokens/s, best validation and test metric, plus
the validation curves against steps and training time (xformer/compare.py):

    python eval.py --compare=workdirs/sweep/a,workdirs/sweep/b
    python eval.py --compare='workdirs/sweep/*'        # a pattern, expanded here
    python eval.py --compare workdirs/sweep/*          # expanded by the shell
    python eval.py --compare='workdirs/sweep/*' --compare_out=reports/sweep

--compare takes comma-separated workdirs or glob patterns (a pattern keeps the directories that
hold a config.json); further arguments after it are more workdirs, as a shell expands a glob.
The table is printed as markdown and written to <out>/compare.md and <out>/compare.csv, the
plot to <out>/compare.png; <out> is --compare_out, by default the workdirs' common parent.
"""

import contextlib
import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Iterator

from xformer.malloc_tuning import reexec_with_malloc_tuning

if __name__ == "__main__":  # first: glibc reads its tunables only when a process starts
    reexec_with_malloc_tuning()

import jax
from absl import app, flags, logging

from xformer import cli, distributed_flags
from xformer import compare as compare_lib
from xformer import config as config_lib
from xformer import experiment as experiment_lib
from xformer.averaging import average_params, steps_to_average
from xformer.bleu import bleu_report
from xformer.checkpoint import CheckpointShapeError
from xformer.data.errors import DataError
from xformer.data.text import read_input_lines
from xformer.data.translation import split_text
from xformer.files import check_output_file, check_writable, write_json
from xformer.params_checkpoint import checkpoint_step, restore_params
from xformer.tasks import make_task
from xformer.tasks.language_modeling import EvalSettings, encode_text_file

_WORKDIR = flags.DEFINE_string("workdir", None, "A train.py workdir.")
_SPLIT = flags.DEFINE_string("split", None, "Dataset split (default: config.data.test_split).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_AVERAGE_LAST = flags.DEFINE_integer(
    "average_last",
    None,
    "Evaluate the mean of the parameters of the last N checkpoints kept (ending at --step).",
)
_BATCH = flags.DEFINE_integer("batch_size", None, "Override config.eval.batch_size.")
_MESH = flags.DEFINE_string("mesh", None, experiment_lib.MESH_FLAG_HELP)
_INPUT = flags.DEFINE_string(
    "input", None, "Translate (language models: score) this text file instead of a split."
)
# Translation
_REFERENCE = flags.DEFINE_string("reference", None, "References for --input (optional).")
_OUTPUT = flags.DEFINE_string("output", None, "Hypotheses file (default: in the workdir).")
_BEAM = flags.DEFINE_integer("beam_size", None, "Override config.eval.beam_size (1 = greedy).")
_ALPHA = flags.DEFINE_float("length_penalty", None, "Override config.eval.length_penalty.")
# Language modelling
_SEGMENT = flags.DEFINE_integer("segment_length", None, "Tokens scored per row per step.")
_MEM_LEN = flags.DEFINE_integer("mem_len", None, "Transformer-XL memory length.")
_CLAMP_LEN = flags.DEFINE_integer("clamp_len", None, "Clamp relative distances (0 = off).")
_MASK = flags.DEFINE_string(
    "decoder_mask", None, "Masking scheme, e.g. same_length (every query sees mem_len keys)."
)
_STRIDE = flags.DEFINE_integer(
    "sliding_stride", None, "Memoryless sliding-window evaluation stride."
)
# Comparison
_COMPARE = flags.DEFINE_string("compare", None, "Compare these workdirs (comma-separated, globs).")
_COMPARE_OUT = flags.DEFINE_string("compare_out", None, "Where --compare writes its files.")

TRANSLATION_FLAGS = {"reference": _REFERENCE, "output": _OUTPUT}
INPUT_ERROR_STATUS = 2  # exit status when an input, reference or output file (or the
# evaluation settings given to the workdir's config) cannot be used
FILE_ERRORS = (ValueError, OSError)
LOG_EVERY_S = 10.0  # progress lines during evaluation
OVERRIDES = {
    "encoder_decoder": {"beam_size": _BEAM, "length_penalty": _ALPHA, "batch_size": _BATCH},
    "decoder_only": {
        "batch_size": _BATCH,
        "segment_length": _SEGMENT,
        "mem_len": _MEM_LEN,
        "clamp_len": _CLAMP_LEN,
        "decoder_mask": _MASK,
        "sliding_stride": _STRIDE,
    },
}
EVALUATION_FLAGS = {  # every flag of an evaluation (none of --compare)
    "split": _SPLIT,
    "step": _STEP,
    "average_last": _AVERAGE_LAST,
    "mesh": _MESH,
    "input": _INPUT,
    **TRANSLATION_FLAGS,
    **{name: flag for by_name in OVERRIDES.values() for name, flag in by_name.items()},
}


def main(argv):
    if _COMPARE.value is not None:
        if _WORKDIR.value is not None:
            raise app.UsageError("give --workdir (evaluate) or --compare, not both")
        given = [f"--{name}" for name, flag in EVALUATION_FLAGS.items() if flag.value is not None]
        given += distributed_flags.given()
        if given:  # --compare reads the results the runs hold: it evaluates nothing
            raise app.UsageError(
                f"--compare evaluates nothing: {', '.join(given)} would be ignored (evaluate "
                "each workdir with them first)"
            )
        return compare(argv[1:])
    if _COMPARE_OUT.value is not None:
        raise app.UsageError("--compare_out needs --compare")
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _WORKDIR.value is None:
        raise app.UsageError("--workdir (or --compare) is required")
    experiment_lib.quiet_library_logs()
    distributed_flags.initialize_if_requested(training=False)
    workdir = _WORKDIR.value
    if _INPUT.value and _SPLIT.value:
        raise app.UsageError("give --split or --input, not both")
    with input_errors(OSError, ValueError):  # not a workdir, or one this process cannot write
        config = experiment_lib.load_config(workdir)
        check_writable(workdir, "--workdir")
    try:
        experiment_lib.set_evaluation_mesh(config, _MESH.value, jax.device_count())
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    family = config.model.family
    for other, flag_map in OVERRIDES.items():
        for key, flag in flag_map.items():
            if flag.value is not None and key not in OVERRIDES[family]:
                raise app.UsageError(f"--{key} is for {other} models; {workdir} is {family}")
    if family != "encoder_decoder":
        for key, flag in TRANSLATION_FLAGS.items():
            if flag.value is not None:
                raise app.UsageError(f"--{key} is for translation; {workdir} is {family}")
    own = evaluation_settings(config)
    with input_errors(ValueError):  # the flags' settings, checked before any data is read
        config_lib.set_eval_flags(config, {k: f.value for k, f in OVERRIDES[family].items()})
        config_lib.validate(config)
        try:
            devices, processes = jax.device_count(), jax.process_count()
            config_lib.check_devices(config, devices, processes, training=False)
        except ValueError as e:
            raise ValueError(f"{e} (--batch_size or --mesh sets another)") from None
    tag = settings_tag(own, evaluation_settings(config))
    with input_errors(DataError):  # missing or bad data files, anywhere in the evaluation
        if family == "decoder_only":
            result, suffix = evaluate_language_model(config, workdir, tag)
        else:
            result, suffix = evaluate_translation(config, workdir, tag)
    if jax.process_index() == 0:
        write_json(os.path.join(workdir, f"eval_{result['name']}{suffix}.json"), result)
        print(json.dumps(result, indent=2))


def evaluation_settings(config) -> dict:
    """The evaluation settings that decide a result's values (not how it is batched, except a
    language model's rows, which split its stream)."""
    if config.model.family == "decoder_only":
        return dataclasses.asdict(EvalSettings.from_config(config))
    beam_size = config.eval.beam_size  # greedy search (beam 1) has no length penalty
    return {
        "beam_size": beam_size,
        "length_penalty": config.eval.length_penalty if beam_size > 1 else None,
    }


def settings_tag(own: dict, given: dict) -> str:
    """ ".key=value,..." of the `given` settings that differ from the workdir's `own` ("" when
    none), for the names of the files of a result; a None (not applicable) is left out."""
    changed = ",".join(f"{k}={v}" for k, v in given.items() if v is not None and own[k] != v)
    return "." + re.sub(r"[^A-Za-z0-9._=,+-]", "_", changed) if changed else ""


def result_suffix(task, step: int, averaged: dict, tag: str, name_step: bool = False) -> str:
    """What a result's file names add to its split or input name: ".step<N>" for a checkpoint
    before the latest (always with `name_step`), ".avg<K>" for an average of K checkpoints,
    and the settings `tag`. The run's own result (the latest checkpoint, its own settings) has
    none: eval_<name>.json, which --compare and sweeps read, is never overwritten by another
    evaluation."""
    older = f".step{step}" if name_step or step != checkpoint_step(task.exp) else ""
    mean = f".avg{len(averaged['averaged_steps'])}" if averaged else ""
    return older + mean + tag


def compare(extra_workdirs: list[str]) -> None:
    try:
        workdirs = compare_lib.expand([_COMPARE.value, *extra_workdirs])
        comparison = compare_lib.compare(workdirs)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"--compare: {e}")
    out = _COMPARE_OUT.value or compare_lib.default_out_dir(workdirs)
    try:
        paths = compare_lib.write(comparison, out)
    except OSError as e:  # e.g. an unwritable --compare_out
        sys.exit(f"--compare_out={out}: cannot write the comparison ({e})")
    print(compare_lib.to_markdown(comparison))
    print("wrote " + ", ".join(paths.values()))


@contextlib.contextmanager
def input_errors(*errors: type[Exception]) -> Iterator[None]:
    """Errors reading or checking the user's files (not internal errors): one line on stderr,
    exit status INPUT_ERROR_STATUS. `errors`: the types caught (default: any file error)."""
    errors = errors or FILE_ERRORS
    try:
        yield
    except errors as e:
        print(f"eval.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(INPUT_ERROR_STATUS)


def _checkpoint_steps(task) -> list[int]:
    """The checkpoints to evaluate: --step (default: the latest), or the last --average_last
    ending there. Exits with an input error when the workdir does not hold them."""
    with input_errors(FileNotFoundError, ValueError):
        if _AVERAGE_LAST.value is None:
            return [checkpoint_step(task.exp, _STEP.value)]
        return steps_to_average(task.exp, _AVERAGE_LAST.value, _STEP.value)


def _restore(task, steps: list[int]) -> tuple[object, object, int, dict]:
    """(parameters, non-parameter state, step, extra result fields) of checkpoint `steps[0]`,
    or with --average_last the average of `steps`: parameters only, not the optimizer state."""
    with input_errors(CheckpointShapeError):  # the workdir's config.json was edited
        if _AVERAGE_LAST.value is None:
            params, step = restore_params(task.exp, steps[0])
            return params, task.exp.rng_state, step, {}
        logging.info("averaging the parameters of checkpoints %s", steps)
        params = average_params(task.exp, steps)
    return params, task.exp.rng_state, steps[-1], {"averaged_steps": steps}


def input_name(path: str) -> str:
    """The name of an --input file's results: "input.<file name>", never a split's (a file
    named "test" would otherwise overwrite eval_test.json, the run's test result)."""
    return f"input.{os.path.basename(path)}"


def evaluate_language_model(config, workdir: str, tag: str) -> tuple[dict, str]:
    """(the result of scoring a split or --input, its result_suffix)."""
    split = _SPLIT.value or config.data.test_split
    task = make_task(config, workdir, train_if_missing=False, training=False)
    steps = _checkpoint_steps(task)
    # Read and encode before restoring, so bad data fails fast.
    oov = None
    if _INPUT.value:
        name = input_name(_INPUT.value)
        with input_errors():
            encoded = encode_text_file(task.vocab, _INPUT.value)
            if not len(encoded.stream):
                raise ValueError(f"{_INPUT.value}: no tokens to score (an empty file)")
        stream, oov = encoded.stream, encoded.oov_tokens
        if oov:
            logging.warning(
                "%s: %d of %d tokens are outside the vocabulary and scored as <unk>",
                _INPUT.value,
                oov,
                len(stream),
            )
    else:
        name, stream = split, task.stream(split)
    params, rng_state, step, averaged = _restore(task, steps)
    settings = EvalSettings.from_config(config)
    result = task.score_stream(params, rng_state, stream, settings, log_every_s=LOG_EVERY_S)
    logging.info("%s at step %d: %s", name, step, task.summary(result))
    extra = {} if oov is None else {"input": _INPUT.value, "oov_tokens": oov}
    result = {
        "name": name,
        "step": step,
        "dataset": config.data.dataset,
        "metric": task.corpus.metric,
        **averaged,
        **result,
        **extra,
        **{f"eval_{k}": v for k, v in vars(settings).items()},
    }
    return result, result_suffix(task, step, averaged, tag)


def read_translation_input() -> tuple[list[str], list[str] | None]:
    """--input's lines and --reference's (or None), by the line contract of data/text.py (the
    references' text as written, as sacreBLEU and a split's references are scored); raises
    ValueError when the line counts differ."""
    sources = read_input_lines(_INPUT.value)
    if not _REFERENCE.value:
        return sources, None
    references = read_input_lines(_REFERENCE.value, normalize=False)
    if len(sources) != len(references):
        raise ValueError(
            f"Parallel files have different line counts: {_INPUT.value} has {len(sources)} "
            f"lines, {_REFERENCE.value} has {len(references)} lines."
        )
    return sources, references


def write_lines(path: str, lines: list[str]) -> None:
    """One line per item, written to a temporary file and renamed (no half-written file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in lines)
    os.replace(tmp, path)


def evaluate_translation(config, workdir: str, tag: str) -> tuple[dict, str]:
    """(the result of translating a split or --input, its result_suffix)."""
    # Read every input before compiling anything, so bad files fail fast.
    if _REFERENCE.value and not _INPUT.value:
        raise app.UsageError("--reference needs --input")
    with input_errors():
        if _OUTPUT.value:
            check_output_file(_OUTPUT.value, "--output")
        else:
            check_writable(os.path.join(workdir, "translations"), "the translations directory")
        if _INPUT.value:
            sources, references = read_translation_input()
    if _INPUT.value:
        name = input_name(_INPUT.value)
    else:
        name = _SPLIT.value or config.data.test_split
        sources, references = split_text(config, name)

    task = make_task(config, workdir, train_if_missing=False, training=False)
    params, rng_state, step, averaged = _restore(task, _checkpoint_steps(task))
    start = time.time()
    translations = task.translator().translate(params, rng_state, sources, LOG_EVERY_S)
    seconds = time.time() - start
    hyps = translations.lines
    if len(hyps) != len(sources):
        raise AssertionError(f"{len(hyps)} translations of {len(sources)} lines")
    if translations.hit_length_cap:
        logging.warning(
            "%d of %d translations stopped at the length cap (their own source length + "
            "eval.max_decode_extra=%d tokens) instead of at end-of-sentence",
            translations.hit_length_cap,
            len(sources) - translations.empty,
            config.eval.max_decode_extra,
        )

    hypotheses = name + result_suffix(task, step, averaged, tag, name_step=True)
    output = _OUTPUT.value or os.path.join(
        workdir, "translations", f"{hypotheses}.{config.data.target_lang}"
    )
    aligned = {}  # {path: lines}: a split's sources and references, in its hypotheses' order
    if not _INPUT.value and not _OUTPUT.value:
        stem, d = os.path.join(workdir, "translations", name), config.data
        aligned = {f"{stem}.{d.source_lang}": sources, f"{stem}.ref.{d.target_lang}": references}
    if jax.process_index() == 0:
        write_lines(output, hyps)
        logging.info("wrote %d translations to %s", len(hyps), output)
        for path, lines in aligned.items():
            write_lines(path, [" ".join(line.splitlines()) for line in lines])  # one line each
    result = {
        "name": name,
        "step": step,
        **averaged,
        "sentences": len(hyps),
        "empty_inputs": translations.empty,
        "truncated_inputs": translations.truncated,
        "longest_input_tokens": translations.longest_input,
        "max_input_tokens": config.eval.max_input_tokens,
        "input_token_limit": translations.input_limit,  # (at most model.max_len when learned)
        "stopped_at_length_cap": translations.hit_length_cap,
        "max_decode_extra": config.eval.max_decode_extra,
        "seconds": round(seconds, 2),
        **evaluation_settings(config),  # beam_size, length_penalty (None for greedy search)
        "output": output,
        **dict(zip(("sources", "references"), aligned, strict=False)),
    }
    if references is not None and hyps:
        result.update(bleu_report(hyps, references, config.data.target_lang).as_dict())
    return result, result_suffix(task, step, averaged, tag)


if __name__ == "__main__":
    cli.run(main)
