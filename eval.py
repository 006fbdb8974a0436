"""Translate a split or a text file with a trained workdir and score it with BLEU.

    python eval.py --workdir=workdirs/multi30k_ende --split=test_2016_flickr
    python eval.py --workdir=workdirs/multi30k_ende --input=my.en --reference=my.de \
        --output=my.hyp.de

Writes one hypothesis line per input line. With references it reports sacreBLEU (cased,
detokenized, with its signature) and the lowercased Moses-tokenized BLEU of Multi30k papers.
"""

import json
import os
import time

import jax
from absl import app, flags, logging

from xformer import experiment as experiment_lib
from xformer.bleu import bleu_report
from xformer.data.sources import read_parallel_files, read_text_lines
from xformer.data.translation import split_text
from xformer.translate import Translator

_WORKDIR = flags.DEFINE_string("workdir", None, "A train.py workdir.")
_SPLIT = flags.DEFINE_string("split", None, "Dataset split (default: config.data.test_split).")
_INPUT = flags.DEFINE_string("input", None, "Translate this text file instead of a split.")
_REFERENCE = flags.DEFINE_string("reference", None, "References for --input (optional).")
_OUTPUT = flags.DEFINE_string("output", None, "Hypotheses file (default: in the workdir).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_BEAM = flags.DEFINE_integer("beam_size", None, "Override config.eval.beam_size (1 = greedy).")
_ALPHA = flags.DEFINE_float("length_penalty", None, "Override config.eval.length_penalty.")
_BATCH = flags.DEFINE_integer("batch_size", None, "Override config.eval.batch_size.")
flags.mark_flag_as_required("workdir")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    experiment_lib.quiet_library_logs()
    workdir = _WORKDIR.value
    config = experiment_lib.load_config(workdir)
    for key, flag in (("beam_size", _BEAM), ("length_penalty", _ALPHA), ("batch_size", _BATCH)):
        if flag.value is not None:
            config.eval[key] = flag.value

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

    exp = experiment_lib.setup(config, workdir, train_if_missing=False)
    state, _ = exp.checkpointer.restore(exp.abstract_state(), _STEP.value)
    step = int(state["step"])
    translator = Translator(
        exp.eval_graphdef,
        exp.model_cfg,
        exp.src_tok,
        exp.tgt_tok,
        beam_size=config.eval.beam_size,
        length_penalty=config.eval.length_penalty,
        max_decode_extra=config.eval.max_decode_extra,
        batch_size=config.eval.batch_size,
        mesh=exp.mesh,
    )
    start = time.time()
    rest = jax.device_put(exp.rest, exp.replicated)
    hyps = translator.translate(state["params"], rest, sources, log_every=5)
    seconds = time.time() - start
    assert len(hyps) == len(sources)

    output = _OUTPUT.value or os.path.join(
        workdir, "translations", f"{name}.step{step}.{config.data.target_lang}"
    )
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w", encoding="utf-8") as f:
        f.writelines(h + "\n" for h in hyps)
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
    with open(os.path.join(workdir, f"eval_{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    logging.info("wrote %d translations to %s", len(hyps), output)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    app.run(main)
