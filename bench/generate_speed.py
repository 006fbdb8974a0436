"""Benchmark: generation speed of Transformer-XL with its memory against the vanilla model.

    python bench/generate_speed.py

Each model continues a prompt of --prompt_tokens tokens (the boundary token + random ids: the
cost does not depend on them) by --new_tokens tokens, in batches of --batch_sizes rows, with
xformer/generate.py exactly as sample.py runs it (one jit-compiled program: prefill, then a
lax.scan of one-token steps; temperature 1, no top-k / top-p).

- vanilla: configs/ptb_xl.py:vanilla's model (absolute sinusoidal positions, no memory). Its
  key/value cache holds every position, so step t attends over all prompt + t keys.
- Transformer-XL (`--xl`, mem_len:segment_length pairs): configs/ptb_xl.py's model with relative
  positions. The prompt goes through the memory segment by segment; each step attends to the
  memory (M states per layer) and the cached keys/values of its segment (at most S), and every
  S steps the segment moves into the memory.

Both have the PTB size of configs/ptb_xl.py (unless overridden) and the PTB vocabulary size
(10,000) with random, untrained parameters. Every (model, batch size) pair is compiled ahead of
time twice: for --new_tokens and for 1 new token (the prefill alone). Then, per repeat, every
pair runs both (interleaved, so background load hits all alike) up to `block_until_ready`.
Reported, medians over the repeats: end-to-end generated tokens/s (prefill included), the
prefill time, and decoding tokens/s and ms per step with the prefill subtracted. The f32 matmul
ceiling (bench/matmul_ceiling.py) is measured before and after. Prints a table, JSON with every
figure, the device and the exact command; the JSON also goes to --output.
"""

import argparse
import dataclasses
import importlib.util
import os
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_output import finish  # noqa: E402
from matmul_ceiling import matmul_gflops  # noqa: E402

from xformer.generate import Sampling, make_generator  # noqa: E402
from xformer.language_model import LanguageModel  # noqa: E402
from xformer.model_config import from_config  # noqa: E402

PTB_VOCAB = 10_000


def load_config(spec: str):
    """A config file with an optional ":variant"."""
    path, _, variant = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("bench_config", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()  # (some take none)


def model_state(spec: str, args, **changes) -> tuple:
    """(graphdef, params, rest) of a random-init model of the config `spec`."""
    m = load_config(spec).model
    sizes = {"d_model": args.d_model, "num_heads": args.num_heads, "d_ff": args.d_ff}
    sizes["num_decoder_layers"] = args.num_layers
    for key, value in sizes.items():
        if value is not None:
            m[key] = value
    cfg = dataclasses.replace(from_config(m, vocab_size=PTB_VOCAB), **changes)
    model = LanguageModel(cfg, rngs=nnx.Rngs(args.seed))
    model.eval()
    return nnx.split(model, nnx.Param, ...), cfg


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt_tokens", type=int, default=512)
    parser.add_argument("--new_tokens", type=int, default=1024)
    parser.add_argument("--batch_sizes", default="1,8", help="rows generated at once")
    parser.add_argument("--xl", default="70:70,512:128", help="XL mem_len:segment_length pairs")
    parser.add_argument("--d_model", type=int, default=None)
    parser.add_argument("--num_heads", type=int, default=None)
    parser.add_argument("--num_layers", type=int, default=None)
    parser.add_argument("--d_ff", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="workdirs/generate_speed.json")
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    ceiling_before = matmul_gflops()

    (v_graphdef, v_params, v_rest), cfg = model_state("configs/ptb_xl.py:vanilla", args)
    settings = {"vanilla": (v_graphdef, v_params, v_rest, 0, 0)}
    for pair in args.xl.split(","):
        mem_len, segment_length = (int(x) for x in pair.split(":"))
        (graphdef, params, rest), _ = model_state(
            "configs/ptb_xl.py", args, positional="relative", mem_len=mem_len
        )
        settings[f"xl_m{mem_len}_s{segment_length}"] = (
            graphdef,
            params,
            rest,
            mem_len,
            segment_length,
        )

    rng = np.random.default_rng(args.seed)
    prompt = np.concatenate([[0], rng.integers(1, PTB_VOCAB, args.prompt_tokens - 1)])
    runs, compile_s = {}, {}
    for name, (graphdef, params, rest, mem_len, segment_length) in settings.items():
        for b in batch_sizes:
            call = (params, rest, np.tile(prompt, (b, 1)).astype(np.int32), jax.random.key(0))
            for n in (args.new_tokens, 1):
                start = time.perf_counter()
                generator = make_generator(
                    graphdef,
                    Sampling(),
                    max_new_tokens=n,
                    mem_len=mem_len,
                    segment_length=segment_length,
                )
                compiled = generator.lower(*call).compile()
                compile_s[(name, b, n)] = time.perf_counter() - start
                tokens = compiled(*call).tokens  # warm-up run, checked
                assert tokens.shape == (b, n) and 0 <= int(tokens.min())
                assert int(tokens.max()) < PTB_VOCAB
                runs[(name, b, n)] = (compiled, call)
            print(f"compiled {name} batch {b}", flush=True)

    times = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, (compiled, call) in runs.items():
            times[key].append(timed(lambda c=compiled, a=call: c(*a).tokens))
    ceiling_after = matmul_gflops()

    rows = []
    for name, (_, _, _, mem_len, segment_length) in settings.items():
        for b in batch_sizes:
            total = statistics.median(times[(name, b, args.new_tokens)])
            prefill = statistics.median(times[(name, b, 1)])
            decode_s = total - prefill
            rows.append(
                {
                    "model": name,
                    "mem_len": mem_len,
                    "segment_length": segment_length or args.prompt_tokens + args.new_tokens - 1,
                    "batch_size": b,
                    "seconds": round(total, 4),
                    "end_to_end_tokens_per_s": round(b * args.new_tokens / total, 1),
                    "prefill_seconds": round(prefill, 4),
                    "decode_tokens_per_s": round(b * (args.new_tokens - 1) / decode_s, 1),
                    "ms_per_step": round(1000 * decode_s / (args.new_tokens - 1), 3),
                    "seconds_per_repeat": [round(t, 4) for t in times[(name, b, args.new_tokens)]],
                    "prefill_seconds_per_repeat": [round(t, 4) for t in times[(name, b, 1)]],
                    "compile_seconds": round(compile_s[(name, b, args.new_tokens)], 2),
                }
            )

    header = ("model", "batch", "tok/s end to end", "prefill s", "decode tok/s", "ms/step")
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        cells = (
            r["model"],
            r["batch_size"],
            r["end_to_end_tokens_per_s"],
            r["prefill_seconds"],
            r["decode_tokens_per_s"],
            r["ms_per_step"],
        )
        print("| " + " | ".join(str(c) for c in cells) + " |")
    summary = {
        "results": rows,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "model": {
            "d_model": cfg.d_model,
            "num_heads": cfg.num_heads,
            "num_layers": cfg.num_layers,
            "d_ff": cfg.d_ff,
            "vocab_size": PTB_VOCAB,
            "parameters": "random (untrained)",
        },
        "repeats": args.repeats,
        "matmul_ceiling_gflops_before_after": [round(ceiling_before, 1), round(ceiling_after, 1)],
    }
    finish(summary, args.output)


if __name__ == "__main__":
    main()
