"""Benchmark: translation decoding speed (beam and greedy search) of an encoder-decoder config.

    python bench/translate_speed.py
    python bench/translate_speed.py --one_loop   # and beam search without cache phases
    python bench/translate_speed.py --config=configs/wmt14_ende.py --batch_size=32 --src_len=48

Decodes the same batch as eval.py does (`translate.search`: the model's cached decoding steps,
PAD and BOS banned, beam search with the config's eval.beam_size and eval.length_penalty, and
greedy search) with the config's model, random untrained parameters and a vocabulary of
--vocab_size. The source is --batch_size rows of --src_len random token ids; the search runs
for src_len + eval.max_decode_extra steps, as eval.py caps it. An untrained model seldom
emits EOS, so nearly every row runs to that cap: the work per batch is fixed (the bench
prints how many rows stopped early). Each search is compiled first; then, per repeat, every
search decodes the batch once (interleaved, so background load hits all alike) up to
`block_until_ready`. Reported, medians over the repeats: seconds a batch, ms per decoding
step, sentences/s and generated tokens/s (rows x steps / seconds). The f32 matmul ceiling
(bench/matmul_ceiling.py) is measured before and after. Prints a table, JSON with every figure,
the device and the exact command; the JSON also goes to --output. The searches run as eval.py's
do, beam search over a self-attention cache grown in phases (`decoding.phase_sizes`);
--one_loop adds beam search in one loop over the whole cache, in the same interleaved repeats,
and counts the rows whose tokens the two forms agree on.
"""

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_output import finish  # noqa: E402
from generate_speed import load_config  # noqa: E402
from matmul_ceiling import matmul_gflops  # noqa: E402

from xformer.data.tokenizer import EOS_ID  # noqa: E402
from xformer.decoding import phase_sizes  # noqa: E402
from xformer.model_config import from_config  # noqa: E402
from xformer.models import EncoderDecoder  # noqa: E402
from xformer.translate import decode_length, position_limit, search  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/multi30k_ende.py")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--src_len", type=int, default=32)
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="workdirs/translate_speed.json")
    parser.add_argument(
        "--one_loop",
        action="store_true",
        help="also time beam search in one loop over the whole cache (no cache phases)",
    )
    args = parser.parse_args()

    config = load_config(args.config)
    vocab = {"src_vocab_size": args.vocab_size, "tgt_vocab_size": args.vocab_size}
    cfg = from_config(config.model, **vocab)
    max_len = decode_length(args.src_len, config.eval.max_decode_extra, position_limit(cfg))
    model = EncoderDecoder(cfg, rngs=nnx.Rngs(args.seed))
    model.eval()
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(args.seed)
    src = jnp.asarray(rng.integers(4, args.vocab_size, (args.batch_size, args.src_len)), jnp.int32)

    beams = {"beam": config.eval.beam_size, "greedy": 1}
    if args.one_loop:
        beams["beam, one loop"] = config.eval.beam_size
    searches, compile_s, stopped_early, outputs = {}, {}, {}, {}
    ceiling_before = matmul_gflops()
    for name, beam_size in beams.items():
        phases = (max_len,) if name.endswith("one loop") else None  # None: eval.py's
        fn = jax.jit(
            lambda state, src, k=beam_size, phases=phases: search(
                nnx.merge(graphdef, state),
                src,
                max_len,
                k,
                config.eval.length_penalty,
                phases=phases,
            )
        )
        start = time.perf_counter()
        searches[name] = fn.lower(state, src).compile()
        compile_s[name] = time.perf_counter() - start
        outputs[name] = tokens = np.asarray(searches[name](state, src))
        stopped_early[name] = int((tokens == EOS_ID).any(axis=1).sum())
    same = {}  # the phased search's tokens against one loop's, row by row
    if args.one_loop:
        same["beam"] = int((outputs["beam"] == outputs["beam, one loop"]).all(axis=1).sum())
    times = {name: [] for name in searches}
    for _ in range(args.repeats):
        for name, fn in searches.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(state, src))
            times[name].append(time.perf_counter() - start)
    ceiling_after = matmul_gflops()

    rows = []
    for name, beam_size in beams.items():
        seconds = float(np.median(times[name]))
        rows.append(
            {
                "search": name,
                "beam_size": beam_size,
                "seconds": round(seconds, 4),
                "ms_per_step": round(1000 * seconds / max_len, 3),
                "sentences_per_s": round(args.batch_size / seconds, 2),
                "tokens_per_s": round(args.batch_size * max_len / seconds, 1),
                "rows_stopped_before_the_cap": stopped_early[name],
                "seconds_per_repeat": [round(t, 4) for t in times[name]],
                "compile_seconds": round(compile_s[name], 2),
            }
        )
    header = ("search", "beam", "s a batch", "ms/step", "sentences/s", "tokens/s")
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        cells = (r["search"], r["beam_size"], r["seconds"], r["ms_per_step"])
        cells += (r["sentences_per_s"], r["tokens_per_s"])
        print("| " + " | ".join(str(c) for c in cells) + " |")
    summary = {
        "results": rows,
        "batch_size": args.batch_size,
        "src_len": args.src_len,
        "steps": max_len,
        "model": {**dataclasses.asdict(cfg), "parameters": "random (untrained)"},
        "repeats": args.repeats,
        "cache_phases": list(phase_sizes(max_len)),
        "rows_equal_to_one_loop": same,
        "matmul_ceiling_gflops_before_after": [round(ceiling_before, 1), round(ceiling_after, 1)],
    }
    finish(summary, args.output)


if __name__ == "__main__":
    main()
