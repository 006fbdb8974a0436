"""Evaluate a trained workdir: BLEU for translation, perplexity / bits per character for LMs.

Translation (translates every line, scores with BLEU):

    python eval.py --workdir=workdirs/multi30k_ende --split=test_2016_flickr
    python eval.py --workdir=workdirs/multi30k_ende --input=my.en --reference=my.de \\
        --output=my.hyp.de

Language modelling (scores every token of the split once; lengths independent of training):

    python eval.py --workdir=workdirs/ptb_xl --split=test --segment_length=64 --mem_len=640 \\
        --clamp_len=400 --decoder_mask=same_length

Results are printed as JSON and written to <workdir>/eval_<name>.json.

With --distributed (and the multi-process flags of train.py) every process of a jax.distributed
job evaluates its share of each batch; process 0 alone prints and writes the files.

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

import json
import os
import sys
import time

import jax
from absl import app, flags, logging

from xformer import compare as compare_lib
from xformer import distributed_flags
from xformer import experiment as experiment_lib
from xformer.bleu import bleu_report
from xformer.data.text import read_parallel_files, read_text_lines
from xformer.data.translation import split_text
from xformer.files import write_json
from xformer.tasks import make_task
from xformer.tasks.language_modeling import EvalSettings

_WORKDIR = flags.DEFINE_string("workdir", None, "A train.py workdir.")
_SPLIT = flags.DEFINE_string("split", None, "Dataset split (default: config.data.test_split).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_BATCH = flags.DEFINE_integer("batch_size", None, "Override config.eval.batch_size.")
# Translation
_INPUT = flags.DEFINE_string("input", None, "Translate this text file instead of a split.")
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

TRANSLATION_FLAGS = {"input": _INPUT, "reference": _REFERENCE, "output": _OUTPUT}
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


def main(argv):
    if _COMPARE.value is not None:
        if _WORKDIR.value is not None:
            raise app.UsageError("give --workdir (evaluate) or --compare, not both")
        return compare(argv[1:])
    if _COMPARE_OUT.value is not None:
        raise app.UsageError("--compare_out needs --compare")
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _WORKDIR.value is None:
        raise app.UsageError("--workdir (or --compare) is required")
    experiment_lib.quiet_library_logs()
    distributed_flags.initialize_if_requested()
    workdir = _WORKDIR.value
    config = experiment_lib.load_config(workdir)
    family = config.model.family
    for other, flag_map in OVERRIDES.items():
        for key, flag in flag_map.items():
            if flag.value is not None and key not in OVERRIDES[family]:
                raise app.UsageError(f"--{key} is for {other} models; {workdir} is {family}")
    if family != "encoder_decoder":
        for key, flag in TRANSLATION_FLAGS.items():
            if flag.value is not None:
                raise app.UsageError(f"--{key} is for translation; {workdir} is {family}")
    with config.unlocked():
        for key, flag in OVERRIDES[family].items():
            if flag.value is not None:
                config.eval[key] = flag.value
    if family == "decoder_only":
        result = evaluate_language_model(config, workdir)
    else:
        result = evaluate_translation(config, workdir)
    if jax.process_index() == 0:
        write_json(os.path.join(workdir, f"eval_{result['name']}.json"), result)
        print(json.dumps(result, indent=2))


def compare(extra_workdirs: list[str]) -> None:
    try:
        workdirs = compare_lib.expand([_COMPARE.value, *extra_workdirs])
        comparison = compare_lib.compare(workdirs)
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"--compare: {e}")
    out = _COMPARE_OUT.value or compare_lib.default_out_dir(workdirs)
    paths = compare_lib.write(comparison, out)
    print(compare_lib.to_markdown(comparison))
    print("wrote " + ", ".join(paths.values()))


def _restore(task) -> tuple[dict, object]:
    exp = task.exp
    state, _ = exp.checkpointer.restore(exp.abstract_state(task.init_carry()), _STEP.value)
    return state, exp.rng_state


def evaluate_language_model(config, workdir: str) -> dict:
    split = _SPLIT.value or config.data.test_split
    task = make_task(config, workdir, train_if_missing=False)
    task.stream(split)  # read and encode before restoring, so bad data fails fast
    state, rng_state = _restore(task)
    settings = EvalSettings.from_config(config)
    result = task.score(state["params"], rng_state, split, settings, log_every_s=30)
    logging.info("%s at step %d: %s", split, int(state["step"]), task.summary(result))
    return {
        "name": split,
        "step": int(state["step"]),
        "dataset": config.data.dataset,
        "metric": task.corpus.metric,
        **result,
        **{f"eval_{k}": v for k, v in vars(settings).items()},
    }


def evaluate_translation(config, workdir: str) -> dict:
    # Read every input before compiling anything, so bad files fail fast.
    if _INPUT.value:
        if _REFERENCE.value:
            sources, references = read_parallel_files(_INPUT.value, _REFERENCE.value)
        else:
            sources, references = read_text_lines(_INPUT.value), None
        name = os.path.basename(_INPUT.value)
    else:
        if _REFERENCE.value:
            raise app.UsageError("--reference needs --input")
        name = _SPLIT.value or config.data.test_split
        sources, references = split_text(config, name)

    task = make_task(config, workdir, train_if_missing=False)
    state, rng_state = _restore(task)
    step = int(state["step"])
    start = time.time()
    hyps = task.translator().translate(state["params"], rng_state, sources, log_every=5)
    seconds = time.time() - start
    assert len(hyps) == len(sources)

    output = _OUTPUT.value or os.path.join(
        workdir, "translations", f"{name}.step{step}.{config.data.target_lang}"
    )
    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w", encoding="utf-8") as f:
            f.writelines(h + "\n" for h in hyps)
        logging.info("wrote %d translations to %s", len(hyps), output)
    result = {
        "name": name,
        "step": step,
        "sentences": len(hyps),
        "seconds": round(seconds, 2),
        "beam_size": config.eval.beam_size,
        "length_penalty": config.eval.length_penalty,
        "output": output,
    }
    if references is not None:
        result.update(bleu_report(hyps, references, config.data.target_lang).as_dict())
    return result


if __name__ == "__main__":
    app.run(main)
