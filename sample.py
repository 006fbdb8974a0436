"""Generate text from a trained language-model workdir (Transformer-XL or the vanilla baseline).

    python sample.py --workdir=workdirs/ptb_xl --prompt="the company said" --max_new_tokens=50
    python sample.py --workdir=workdirs/ptb_xl --prompt_file=prompt.txt --num_samples=4 \\
        --temperature=0.8 --top_p=0.9 --seed=1 --output=samples.json

The context is the boundary token (a line end, as evaluation starts a text) followed by the
prompt; an empty prompt starts from the boundary alone. Word vocabularies split the prompt at
whitespace, a line break is <eos>, and unknown words become <unk> (counted in a warning).
Transformer-XL processes the context in segments through its memory, then generates token by
token over the memory and a key/value cache (--mem_len and --segment_length default to the
workdir's evaluation settings); the vanilla model caches the keys and values of every position.
Sampling: --temperature (0 = greedy), then --top_k, then --top_p (xformer/generate.py).
Prints the samples and the throughput; --output also writes them as JSON.
"""

import dataclasses
import sys
import time

from xformer.malloc_tuning import reexec_with_malloc_tuning

if __name__ == "__main__":  # first: glibc reads its tunables only when a process starts
    reexec_with_malloc_tuning()

import jax
import numpy as np
from absl import app, flags, logging

from xformer import cli
from xformer import config as config_lib
from xformer import experiment as experiment_lib
from xformer.checkpoint import CheckpointShapeError
from xformer.data.errors import DataError
from xformer.data.text import read_input_lines
from xformer.files import check_output_file, write_json
from xformer.generate import (
    Sampling,
    check_generation,
    decode_tokens,
    encode_prompt,
    make_generator,
)
from xformer.params_checkpoint import checkpoint_step, restore_params
from xformer.tasks import make_task
from xformer.tasks.language_modeling import EvalSettings

_WORKDIR = flags.DEFINE_string("workdir", None, "A train.py workdir of a language model.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_PROMPT = flags.DEFINE_string("prompt", None, "Text to continue (default: empty).")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "Read the prompt from this file.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Samples drawn in one batch.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 100, "Tokens generated per sample.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Softmax temperature (0 = greedy).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus: keep the most likely tokens up to p, (0, 1].")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed: the same seed gives the same text.")
_MEM_LEN = flags.DEFINE_integer("mem_len", None, "Transformer-XL memory (default: eval's).")
_SEGMENT = flags.DEFINE_integer(
    "segment_length", None, "Tokens per segment with a memory (default: eval's)."
)
_OUTPUT = flags.DEFINE_string("output", None, "Also write the samples here (JSON).")
_MESH = flags.DEFINE_string("mesh", None, experiment_lib.MESH_FLAG_HELP)
flags.mark_flags_as_required(["workdir"])


def read_prompt() -> str:
    if _PROMPT.value is not None and _PROMPT_FILE.value is not None:
        raise ValueError("give --prompt or --prompt_file, not both")
    if _PROMPT_FILE.value is not None:
        return "\n".join(read_input_lines(_PROMPT_FILE.value, normalize=False))  # no final break
    return _PROMPT.value or ""


def load_config(workdir: str):
    """The workdir's config, with the memory and segment flags as its evaluation settings."""
    config = experiment_lib.load_config(workdir)
    if config.model.family != "decoder_only":
        raise ValueError(
            f"{workdir} holds a translation model (model.family={config.model.family!r}); "
            "sample.py generates from language models (decoder_only): translate with eval.py"
        )
    experiment_lib.set_evaluation_mesh(config, _MESH.value, jax.device_count())
    config_lib.set_eval_flags(config, {"mem_len": _MEM_LEN.value, "segment_length": _SEGMENT.value})
    return config  # (validated by make_task)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    experiment_lib.quiet_library_logs()
    workdir = _WORKDIR.value
    try:  # every check before any compute
        sampling = Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
        if _NUM_SAMPLES.value < 1:
            raise ValueError(f"num_samples must be >= 1, got {_NUM_SAMPLES.value}")
        if _OUTPUT.value:
            check_output_file(_OUTPUT.value, "--output")
        prompt = read_prompt()
        config = load_config(workdir)
        task = make_task(config, workdir, train_if_missing=False, training=False, evaluating=False)
        step = checkpoint_step(task.exp, _STEP.value)
        settings = EvalSettings.from_config(config)
        if _SEGMENT.value is not None and not settings.mem_len:
            raise ValueError(
                "--segment_length sets the segments that pass through Transformer-XL's memory; "
                "with no memory (mem_len 0) the context is one pass: leave it out"
            )
        context, unknown = encode_prompt(task.vocab, prompt, task.boundary_id)
        model_cfg = dataclasses.replace(
            task.exp.model_cfg, clamp_len=settings.clamp_len, decoder_mask=settings.decoder_mask
        )
        check_generation(
            model_cfg,
            context_len=len(context),
            max_new_tokens=_MAX_NEW.value,
            mem_len=settings.mem_len,
            segment_length=settings.segment_length,
        )
    except (ValueError, OSError, DataError) as e:
        sys.exit(f"sample.py: {e}")
    if unknown:
        logging.warning(
            "%d prompt word(s) not in the vocabulary became <unk>: %s",
            len(unknown),
            " ".join(sorted(set(unknown))[:20]),
        )

    exp = task.exp
    try:
        params, _ = restore_params(exp, step)
    except CheckpointShapeError as e:  # the workdir's config.json was edited
        sys.exit(f"sample.py: {e}")
    generator = make_generator(
        exp.graphdef_for(model_cfg),
        sampling,
        max_new_tokens=_MAX_NEW.value,
        mem_len=settings.mem_len,
        segment_length=settings.segment_length,
    )
    args = (
        params,
        exp.rng_state,
        np.tile(context, (_NUM_SAMPLES.value, 1)),
        jax.random.key(_SEED.value),
    )
    start = time.perf_counter()
    compiled = generator.lower(*args).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens = np.asarray(jax.block_until_ready(compiled(*args).tokens))
    seconds = time.perf_counter() - start

    samples = [decode_tokens(task.vocab, row) for row in tokens]
    for i, text in enumerate(samples):
        print(f"=== sample {i} (seed {_SEED.value}) ===\n{prompt}\n--- continues ---\n{text}")
    generated = tokens.size
    memory = f"memory {settings.mem_len}, segments of {settings.segment_length}"
    print(
        f"generated {_NUM_SAMPLES.value} x {_MAX_NEW.value} tokens in {seconds:.3f} s: "
        f"{generated / seconds:.1f} tokens/s (context {len(context)} tokens, "
        f"{memory if settings.mem_len else 'no memory: key/value cache of every position'}; "
        f"compiled in {compile_s:.1f} s; step {step})"
    )
    if _OUTPUT.value:
        write_json(
            _OUTPUT.value,
            {
                "workdir": workdir,
                "step": step,
                "prompt": prompt,
                "unknown_prompt_words": len(unknown),
                "samples": samples,
                "tokens": tokens.tolist(),
                "seed": _SEED.value,
                **dataclasses.asdict(sampling),
                "max_new_tokens": _MAX_NEW.value,
                "mem_len": settings.mem_len,
                "segment_length": settings.segment_length,
                "seconds": seconds,
                "tokens_per_s": generated / seconds,
            },
        )


if __name__ == "__main__":
    cli.run(main)
