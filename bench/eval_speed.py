"""Benchmark: evaluation speed of Transformer-XL vs the vanilla model (Dai et al., 2019, Table 9).

    python bench/eval_speed.py

Table 9 of the paper reports how much faster Transformer-XL scores a token than the vanilla
model of Al-Rfou et al. evaluated with a sliding window, at the same attention length A
(the paper: 363x at A=800, up to 1,874x at A=3,800). Here, at attention length A, every
prediction sees exactly A tokens of context (the token it is conditioned on and the A - 1 before):

- vanilla: the memoryless model with absolute (sinusoidal) positions scores each token with its
  own forward pass over a window of A inputs (`sliding_windows` with stride 1) and keeps only
  the last position. By default the softmax is computed for that position alone, the cheapest
  vanilla evaluation (`--vanilla_softmax=all` scores the whole window and weights all but the
  last position by 0; eval.py's `--sliding_stride` also scores only the positions it needs);
- Transformer-XL: relative positions with a memory of mem_len = A states per layer and
  the same_length mask (every query attends to exactly A keys), scoring segments of S tokens
  (`--segment_length`; S = A when A < S) one after another with the memory carried
  (`eval_segments`, eval.py's jitted `eval_step` with the memory as an argument).

Both models have the same size (d_model, heads, layers, d_ff of configs/ptb_xl.py unless
overridden) and the PTB vocabulary (10,000 types), with random untrained parameters: the cost
does not depend on their values. The tokens are the start of the PTB valid split
(`--random_tokens`: random ids instead). Both use the same number of rows per batch
(`--batch_size`). Batches are on the device before timing. One warm-up batch compiles each
step; then, per repeat, a fixed number of vanilla batches and of XL segments are timed (the two
interleaved, so background load hits both alike) up to `block_until_ready`, and the median of
the repeats gives tokens scored per second. XL's memory is already carried from the warm-up
segment; its cost does not depend on how full the memory is (fixed shapes, masked slots). Every
step returns the sum of its weights, and the bench asserts that each model scored exactly the
intended number of tokens.

Prints a table (attention length | vanilla tok/s | XL tok/s | speed-up | paper speed-up) and
JSON with all figures, the device and the command; the JSON also goes to --output.
"""

import argparse
import dataclasses
import functools
import importlib.util
import json
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

from xformer.data.lm_stream import eval_segments, sliding_windows  # noqa: E402
from xformer.language_model import LanguageModel  # noqa: E402
from xformer.model_config import from_config  # noqa: E402
from xformer.tasks.language_modeling import eval_step  # noqa: E402

PAPER_SPEEDUP = {3800: 1874, 2800: 1409, 1800: 773, 800: 363}  # Dai et al. (2019), Table 9
PTB_VOCAB = 10_000


def load_config(path: str):
    spec = importlib.util.spec_from_file_location("bench_config", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def token_stream(args) -> tuple[np.ndarray, int, int, str]:
    """(stream, boundary id, vocabulary size, description)."""
    if args.random_tokens:
        rng = np.random.default_rng(args.seed)
        return rng.integers(0, PTB_VOCAB, 100_000).astype(np.int32), 0, PTB_VOCAB, "random ids"
    from xformer.data.readers import read_corpus
    from xformer.data.registry import LM_CORPORA
    from xformer.data.vocab import build_vocab

    try:
        vocab = build_vocab(LM_CORPORA["ptb"], read_corpus("ptb", "train"))
        stream = vocab.encode_lines(read_corpus("ptb", "valid"))
    except Exception as e:  # noqa: BLE001 (any failure to find or prepare the corpus)
        raise SystemExit(f"could not read PTB ({e}); run with --random_tokens") from e
    return stream, vocab.eos_id, len(vocab), "ptb valid"


def tokens_for(stream: np.ndarray, n: int) -> np.ndarray:
    """The first n tokens of the stream (repeated if it is shorter)."""
    return np.resize(stream, n).astype(np.int32)


def make_model(cfg) -> LanguageModel:
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    model.eval()  # no dropout
    return model


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def check_scored(name: str, outputs: list, expected: int) -> None:
    nll_sum, tokens = np.sum(np.asarray(jax.device_get(outputs), np.float64), axis=0)
    if tokens != expected:
        raise AssertionError(f"{name} scored {tokens} tokens, expected {expected}")
    if not np.isfinite(nll_sum):
        raise AssertionError(f"{name}: non-finite NLL sum {nll_sum}")


def measure(length: int, args, xl_base, vanilla_model, stream, boundary_id) -> dict:
    b, repeats = args.batch_size, args.repeats
    seg = min(args.segment_length, length)

    # Vanilla: B windows (one scored token each) per batch; batch 0 warms up.
    v_graphdef, v_params, v_rng_state = vanilla_model
    v_batches_per_repeat = -(-args.vanilla_tokens // b)
    v_tokens = b * (1 + repeats * v_batches_per_repeat)
    v_batches = list(sliding_windows(tokens_for(stream, v_tokens), b, length, 1, boundary_id))
    for batch in v_batches:
        if batch["weights"][:, :-1].any():
            raise AssertionError("stride 1 windows must score only their last position")
    v_batches = [jax.device_put(batch) for batch in v_batches]
    last = 1 if args.vanilla_softmax == "last" else None
    v_step = jax.jit(
        lambda p, r, batch: eval_step(v_graphdef, p, r, None, batch, score_last=last)[:2]
    )

    # Transformer-XL: B rows of `seg` tokens per segment, memory of `length` states.
    xl_cfg = dataclasses.replace(xl_base, decoder_mask="same_length")
    xl_model = make_model(xl_cfg)
    memory = xl_model.init_memory(b, length)
    x_graphdef, x_params, x_rng_state = nnx.split(xl_model, nnx.Param, ...)
    x_batches_per_repeat = -(-args.xl_tokens // (b * seg))
    x_tokens = b * seg * (1 + repeats * x_batches_per_repeat)
    x_batches = eval_segments(tokens_for(stream, x_tokens), b, seg, boundary_id)
    assert len(x_batches) == 1 + repeats * x_batches_per_repeat
    x_batches = [jax.device_put(batch) for batch in x_batches]
    x_step = jax.jit(functools.partial(eval_step, x_graphdef))
    outputs = {"vanilla": [], "xl": []}

    def run_vanilla(batches):
        out = [v_step(v_params, v_rng_state, batch) for batch in batches]
        outputs["vanilla"].extend(out)
        return out

    def run_xl(batches):
        nonlocal memory
        out = []
        for batch in batches:
            *sums, memory = x_step(x_params, x_rng_state, memory, batch)
            out.append(sums)
        outputs["xl"].extend(out)
        return out, memory

    compile_s = {
        "vanilla": timed(run_vanilla, v_batches[:1]),
        "xl": timed(run_xl, x_batches[:1]),
    }
    times = {"vanilla": [], "xl": []}
    for r in range(repeats):
        v_chunk = v_batches[1 + r * v_batches_per_repeat : 1 + (r + 1) * v_batches_per_repeat]
        x_chunk = x_batches[1 + r * x_batches_per_repeat : 1 + (r + 1) * x_batches_per_repeat]
        times["vanilla"].append(timed(run_vanilla, v_chunk))
        times["xl"].append(timed(run_xl, x_chunk))
    check_scored(f"vanilla A={length}", outputs["vanilla"], v_tokens)
    check_scored(f"XL A={length}", outputs["xl"], x_tokens)

    per_repeat = {"vanilla": b * v_batches_per_repeat, "xl": b * seg * x_batches_per_repeat}
    tok_s = {k: per_repeat[k] / statistics.median(times[k]) for k in times}
    return {
        "attention_length": length,
        "xl_segment_length": seg,
        "xl_mem_len": length,
        "vanilla_tokens_per_s": round(tok_s["vanilla"], 2),
        "xl_tokens_per_s": round(tok_s["xl"], 1),
        "speedup": round(tok_s["xl"] / tok_s["vanilla"], 1),
        "paper_speedup": PAPER_SPEEDUP.get(length),
        "tokens_timed_per_repeat": per_repeat,
        "seconds_per_repeat": {k: [round(t, 4) for t in v] for k, v in times.items()},
        "compile_and_warmup_seconds": {k: round(v, 2) for k, v in compile_s.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="128,512,800", help="attention lengths A")
    parser.add_argument("--segment_length", type=int, default=128, help="XL segment (min A)")
    parser.add_argument("--batch_size", type=int, default=10, help="rows per batch, both models")
    parser.add_argument("--config", default="configs/ptb_xl.py", help="model size from here")
    parser.add_argument("--d_model", type=int, default=None)
    parser.add_argument("--num_heads", type=int, default=None)
    parser.add_argument("--num_layers", type=int, default=None)
    parser.add_argument("--d_ff", type=int, default=None)
    parser.add_argument("--random_tokens", action="store_true", help="random ids, not PTB valid")
    parser.add_argument("--xl_tokens", type=int, default=5000, help="per repeat (whole segments)")
    parser.add_argument("--vanilla_tokens", type=int, default=100, help="per repeat (batches)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vanilla_softmax", choices=("last", "all"), default="last")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="workdirs/eval_speed.json")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    stream, boundary_id, vocab_size, source = token_stream(args)
    config = load_config(args.config)
    m = config.model
    overrides = {"d_model": "d_model", "num_heads": "num_heads", "d_ff": "d_ff"}
    overrides["num_layers"] = "num_decoder_layers"
    for flag, key in overrides.items():
        if getattr(args, flag) is not None:
            m[key] = getattr(args, flag)
    base = from_config(config.model, vocab_size=vocab_size)
    xl_base = dataclasses.replace(base, positional="relative")
    vanilla = make_model(dataclasses.replace(base, positional="sinusoidal"))
    vanilla_model = nnx.split(vanilla, nnx.Param, ...)

    rows = []
    for length in lengths:
        row = measure(length, args, xl_base, vanilla_model, stream, boundary_id)
        rows.append(row)
        print(json.dumps(row), flush=True)

    header = ("attention length", "vanilla tok/s", "XL tok/s", "speed-up", "paper speed-up")
    print("\n" + " | ".join(header))
    print(" | ".join("-" * len(h) for h in header))
    for r in rows:
        paper = f"{r['paper_speedup']}x" if r["paper_speedup"] else "-"
        cells = (
            str(r["attention_length"]),
            f"{r['vanilla_tokens_per_s']:.2f}",
            f"{r['xl_tokens_per_s']:.1f}",
            f"{r['speedup']:.1f}x",
            paper,
        )
        print(" | ".join(c.rjust(len(h)) for c, h in zip(cells, header, strict=True)))

    summary = {
        "results": rows,
        "model": {
            "d_model": base.d_model,
            "num_heads": base.num_heads,
            "num_layers": base.num_layers,
            "d_ff": base.d_ff,
            "vocab_size": vocab_size,
            "vanilla_positional": "sinusoidal",
            "vanilla_softmax": args.vanilla_softmax,
            "xl_same_length": True,
            "xl_clamp_len": base.clamp_len,
        },
        "tokens": source,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
    }
    finish(summary, args.output)


if __name__ == "__main__":
    main()
