"""Start-up cost of a run's training data: reading and encoding the split at every start against
loading it from the encoded-split cache (`xformer/data/encoded_cache.py`).

    python bench/data_startup.py --family translation --scale 1000000 --repeats 3
    python bench/data_startup.py --family lm --scale 50 --repeats 3

translation: a Multi30k-format manual dir whose training split is Multi30k's 29,000 training
pairs repeated up to `--scale` pairs (a stand-in for WMT14's 4.5M pairs), prepared with the
Multi30k TFDS builder, and a joint 8k SentencePiece model.
lm: a WikiText-2-format manual dir whose training split is WikiText-2's repeated `--scale` times
(50: 104M tokens, WikiText-103's size), prepared with its TFDS builder, and its word vocabulary.

Then, each in a fresh process, alternating `--repeats` times:
  text    what every start did before the cache: read and parse every record, encode it (each
          translation sentence then its own array; the LM split one int32 stream)
  cached  loading from a warm cache: memory-maps the ids, then reads every id once (as
          training eventually does)
and once `cold`: an empty cache (read, encode and save: the first start).
Prints the median seconds and the peak resident memory above the process's baseline after
imports (TFDS included).
"""

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
LANGS = ("en", "de")
# family: (dataset, its folder in ../shared/data, the training split's files)
DATA = {
    "translation": ("multi30k", "multi30k/raw", [f"train.{lang}.gz" for lang in LANGS]),
    "lm": ("wikitext2", "wikitext-2", ["wiki.train.tokens.gz"]),
}


def _memory_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process. (Not ru_maxrss: Linux carries it over from
    the parent's memory at fork, through exec.)"""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _read_lines(path: str) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def build(family: str, scale: int, workdir: str) -> None:
    """The scaled manual dir, its prepared TFDS copy and the vocabulary (kept between runs)."""
    dataset, folder, train_files = DATA[family]
    manual, tfds = os.path.join(workdir, "manual"), os.path.join(workdir, "tfds")
    if os.path.exists(os.path.join(workdir, "ready")):
        return
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(manual)
    for name in os.listdir(os.path.join(SHARED, folder)):
        if name.endswith(".gz") and name not in train_files:
            shutil.copy(os.path.join(SHARED, folder, name), manual)
    for name in train_files:
        lines = _read_lines(os.path.join(SHARED, folder, name))
        count = scale if family == "translation" else scale * len(lines)
        with gzip.open(os.path.join(manual, name), "wt", 1, "utf-8") as f:
            for i in range(count):
                f.write(lines[i % len(lines)] + "\n")
    start = time.perf_counter()
    if family == "translation":
        from xformer.data.readers import read_all, translation_source
        from xformer.data.tokenizer import train_tokenizer

        source = translation_source(dataset, "train", data_dir=tfds, manual_dir=manual)
        texts = [r[lang] for r in read_all(source)[:29000] for lang in LANGS]
        train_tokenizer(texts, os.path.join(workdir, "spm.model"), 8000)
    else:
        from xformer.data.readers import read_corpus
        from xformer.data.registry import corpus_info
        from xformer.data.vocab import build_vocab

        lines = read_corpus(dataset, "train", data_dir=tfds, manual_dir=manual)
        build_vocab(corpus_info(dataset), lines).save(os.path.join(workdir, "corpus.vocab"))
    print(f"prepared in {time.perf_counter() - start:.0f} s", flush=True)
    open(os.path.join(workdir, "ready"), "w").close()


def measure(family: str, mode: str, workdir: str) -> dict:
    """One measurement in this (fresh) process."""
    import numpy as np
    import tensorflow_datasets  # noqa: F401  (imported by the readers: not counted)

    from xformer.data import encoded_cache, readers, translation
    from xformer.data.pipeline import EncodedPairs
    from xformer.data.tokenizer import Tokenizer
    from xformer.data.vocab import WordVocab

    dataset = DATA[family][0]
    dirs = {
        "data_dir": os.path.join(workdir, "tfds"),
        "manual_dir": os.path.join(workdir, "manual"),
    }
    cache = os.path.join(workdir, "cold_cache" if mode == "cold" else "cache")
    if mode == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    baseline = _memory_mib("VmRSS")
    start = time.perf_counter()
    if family == "translation":
        tok = Tokenizer(os.path.join(workdir, "spm.model"))
        source = readers.translation_source(dataset, "train", **dirs)
        if mode == "text":
            records = readers.read_all(source)
            src, tgt = ([r[lang] for r in records] for lang in LANGS)
            del records
            pairs = EncodedPairs.from_text(src, tgt, tok, tok)
            del src, tgt
        else:
            pairs = translation.cached_pairs(source, LANGS, (tok, tok), cache)
            pairs.src.ids.sum(), pairs.tgt.ids.sum()  # reads every id once
        units, tokens = len(pairs), int(pairs.src.lengths.sum() + pairs.tgt.lengths.sum())
    else:
        vocab_path = os.path.join(workdir, "corpus.vocab")
        vocab = WordVocab.load(vocab_path)
        source = readers.corpus_source(dataset, "train", **dirs)

        def encode():
            return {"ids": vocab.encode_lines(readers.corpus_text(dataset, source))}

        if mode == "text":
            ids = encode()["ids"]
        else:
            fingerprint = {"files": encoded_cache.record_files(source), "vocab": vocab_path}
            ids = encoded_cache.cached_arrays(cache, dataset, fingerprint, encode)["ids"]
            np.asarray(ids).sum()  # reads every id once
        units, tokens = len(source), len(ids)
    seconds = time.perf_counter() - start
    peak = _memory_mib("VmHWM") - baseline
    return {"units": units, "tokens": tokens, "seconds": seconds, "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(DATA), default="translation")
    parser.add_argument("--scale", type=int, default=0, help="pairs, or copies of the LM split")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/xformer_data_startup")
    parser.add_argument("--measure", choices=("text", "cached", "cold"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    scale = args.scale or (1_000_000 if args.family == "translation" else 50)
    workdir = os.path.join(args.workdir, f"{args.family}-{scale}")
    if args.measure:
        print(json.dumps(measure(args.family, args.measure, workdir)))
        return
    build(args.family, scale, workdir)

    def child(mode: str) -> dict:
        cmd = [sys.executable, __file__, f"--family={args.family}", f"--scale={scale}"]
        cmd += [f"--workdir={args.workdir}", f"--measure={mode}"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    results = {"cold": [child("cold")], "text": [], "cached": []}
    child("cached")  # fills the warm cache
    for _ in range(args.repeats):
        for mode in ("text", "cached"):
            results[mode].append(child(mode))
    first = results["cold"][0]
    unit = "pairs" if args.family == "translation" else "lines"
    print(f"\n{DATA[args.family][0]}: {first['units']:,} {unit}, {first['tokens']:,} tokens")
    print(f"median of {args.repeats} fresh processes each (cold: 1)")
    print(f"{'':8} {'seconds':>9} {'peak MiB above baseline':>24}")
    medians = {m: statistics.median(r["seconds"] for r in rows) for m, rows in results.items()}
    for mode, rows in results.items():
        mib = statistics.median(r["peak_mib"] for r in rows)
        runs = [round(r["seconds"], 2) for r in rows]
        print(f"{mode:8} {medians[mode]:9.2f} {mib:24.0f}   (each: {runs})")
    print(f"text / cached: {medians['text'] / medians['cached']:.0f}x")
    from bench_output import command_line  # here: the timed children need not import it

    print(f"command: {command_line()}")


if __name__ == "__main__":
    main()
