"""How fast the translation input pipeline packs training batches: xformer's first-fit packer
(`xformer/data/packing.py`, what train.py runs) against grain's FirstFitPackIterDataset as this
project used it before (shuffled MapDataset -> to_iter_dataset -> first-fit pack -> batch).

    python bench/packing_speed.py
    python bench/packing_speed.py --shapes 96x256 --batches 20 --repeats 5

Pairs: random pairs of WMT-like lengths (bench/gpu_throughput.py's: median source 24 tokens,
clipped to the row length), packed into the Multi30k config's [32, 64] rows and the WMT14
config's [96, 256] (train.batch_size x data.max_train_length), 4 x rows bins a round (the
default data.num_packing_bins).
Each repeat times `--batches` batches of each packer after one untimed batch, alternating
packers; the medians are reported with tokens a batch (the fill) and tokens/s. A packer slower
than the accelerator's step starves it: train.py packs the next batch while the device runs
the current step, on one host thread.
"""

import argparse
import functools
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def grain_first_fit(pairs, *, batch_size: int, max_length: int, seed: int):
    """The pipeline this project ran before packing.py (its code as of 038f2cc)."""
    import grain
    from grain import experimental as grain_exp

    from xformer.data.tokenizer import BOS_ID

    keep = np.flatnonzero((pairs.src.lengths <= max_length) & (pairs.tgt.lengths <= max_length))
    ds = grain.MapDataset.source(keep).shuffle(seed=seed).repeat()
    ds = ds.map(
        lambda i: {
            "src": pairs.src[i],
            "tgt_in": np.concatenate([[BOS_ID], pairs.tgt[i][:-1]]).astype(np.int32),
            "tgt_out": pairs.tgt[i],
        }
    )
    packed = grain_exp.FirstFitPackIterDataset(
        ds.to_iter_dataset(),
        length_struct={"src": max_length, "tgt_in": max_length, "tgt_out": max_length},
        num_packing_bins=4 * batch_size,
        seed=seed,
        shuffle_bins=True,
    )
    return packed.batch(batch_size, drop_remainder=True)


def time_packer(make, batches: int) -> tuple[float, float]:
    """(seconds a batch, target + source tokens a batch) over `batches` batches."""
    it = iter(make())
    next(it)
    tokens, start = 0, time.perf_counter()
    for _ in range(batches):
        batch = next(it)
        tokens += int((batch["src"] > 0).sum() + (batch["tgt_out"] > 0).sum())  # 0 = padding
    return (time.perf_counter() - start) / batches, tokens / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32x64,96x256", help="rows x length, comma-separated")
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import gpu_throughput as gt
    from bench_output import command_line

    from xformer.data.pipeline import packed_train_dataset

    print(f"command: {command_line()}")
    for shape in args.shapes.split(","):
        rows, length = map(int, shape.split("x"))
        pairs = gt.wmt_like_pairs(
            max(20_000, 40 * rows * length // 50), 8000, length, np.random.default_rng(0)
        )
        settings = {"batch_size": rows, "max_length": length, "seed": 0}
        packers = {
            "xformer packing.py": functools.partial(packed_train_dataset, pairs, **settings),
            "grain first-fit (before)": functools.partial(grain_first_fit, pairs, **settings),
        }
        times = {name: [] for name in packers}
        fill = {}
        for _ in range(args.repeats):
            for name, make in packers.items():
                seconds, fill[name] = time_packer(make, args.batches)
                times[name].append(seconds)
        print(f"\n[{rows}, {length}] batches of WMT-like pairs, {args.repeats} x {args.batches}")
        print("| packer | ms a batch (median) | tokens a batch | fill | tokens/s |")
        print("|---|---:|---:|---:|---:|")
        for name in packers:
            ms = statistics.median(times[name]) * 1e3
            print(
                f"| {name} | {ms:.1f} | {fill[name]:,.0f} | {fill[name] / (2 * rows * length):.1%}"
                f" | {fill[name] / ms * 1e3:,.0f} |"
            )


if __name__ == "__main__":
    main()
