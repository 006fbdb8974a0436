"""Start-up cost of a translation run's training split: encoding the text at every start
against loading the encoded split from its cache (`xformer/data/encoded_cache.py`).

    python bench/translation_startup.py --pairs 1000000

Builds a Multi30k-format manual dir whose training split is Multi30k's 29,000 training pairs
repeated up to `--pairs` pairs (a stand-in for a large corpus such as WMT14's 4.5M pairs),
prepares it with the Multi30k TFDS builder and trains a joint 8k SentencePiece model on it.
Then, each in a fresh process, alternating `--repeats` times:
  text    reading, parsing and encoding every pair into an EncodedPairs (what every start did
          before the cache; each sentence then its own array)
  cached  `cached_pairs` from a warm cache: memory-maps the ids, then reads every id once
          (as training eventually does)
and once `cold`: `cached_pairs` with an empty cache (read, encode, save: the first start).
Prints the median seconds and the peak resident memory above the process's baseline after
imports.
"""

import argparse
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "multi30k", "raw")
LANGS = ("en", "de")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(mode: str, workdir: str) -> dict:
    """One measurement in this (fresh) process."""
    import tensorflow_datasets  # noqa: F401  (imported by translation_source: not counted)

    from xformer.data.encoded_cache import cached_pairs
    from xformer.data.pipeline import EncodedPairs
    from xformer.data.readers import read_all, translation_source
    from xformer.data.tokenizer import Tokenizer

    tok = Tokenizer(os.path.join(workdir, "spm.model"))
    manual, tfds = os.path.join(workdir, "manual"), os.path.join(workdir, "tfds")
    baseline = _rss_mib()
    start = time.perf_counter()
    source = translation_source("multi30k", "train", data_dir=tfds, manual_dir=manual)
    if mode == "text":
        records = read_all(source)
        src, tgt = ([r[lang] for r in records] for lang in LANGS)
        del records
        pairs = EncodedPairs.from_text(src, tgt, tok, tok)
        del src, tgt
        tokens = sum(len(s) for s in pairs.src) + sum(len(t) for t in pairs.tgt)
    else:
        cache = os.path.join(workdir, "cache" if mode == "cached" else "cold_cache")
        if mode == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        pairs = cached_pairs(source, LANGS, (tok, tok), cache)
        pairs.src.ids.sum(), pairs.tgt.ids.sum()  # reads every id once
        tokens = len(pairs.src.ids) + len(pairs.tgt.ids)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "mode": mode,
        "pairs": len(pairs),
        "tokens": tokens,
        "seconds": seconds,
        "peak_mib_above_baseline": peak - baseline,
    }


def build(workdir: str, pairs: int) -> None:
    """The scaled manual dir, its prepared TFDS copy and the tokenizer (kept between runs)."""
    manual = os.path.join(workdir, "manual")
    if os.path.exists(os.path.join(workdir, "spm.model")):
        return
    os.makedirs(manual, exist_ok=True)
    for name in os.listdir(SHARED):
        if not name.startswith("train."):
            shutil.copy(os.path.join(SHARED, name), manual)
    for lang in LANGS:
        with gzip.open(os.path.join(SHARED, f"train.{lang}.gz"), "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
        with gzip.open(os.path.join(manual, f"train.{lang}.gz"), "wt", 1, "utf-8") as f:
            for i in range(pairs):
                f.write(lines[i % len(lines)] + "\n")
    from xformer.data.readers import read_all, translation_source
    from xformer.data.tokenizer import train_tokenizer

    start = time.perf_counter()
    tfds = os.path.join(workdir, "tfds")
    source = translation_source("multi30k", "train", data_dir=tfds, manual_dir=manual)
    print(f"prepared {len(source)} pairs in {time.perf_counter() - start:.0f} s", flush=True)
    texts = [r[lang] for r in read_all(source)[:29000] for lang in LANGS]
    train_tokenizer(texts, os.path.join(workdir, "spm.model"), 8000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/xformer_translation_startup")
    parser.add_argument("--measure", choices=("text", "cached", "cold"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = os.path.join(args.workdir, str(args.pairs))
    if args.measure:
        print(json.dumps(measure(args.measure, workdir)))
        return
    build(workdir, args.pairs)

    def child(mode: str) -> dict:
        cmd = [sys.executable, __file__, f"--pairs={args.pairs}", f"--workdir={args.workdir}"]
        out = subprocess.run([*cmd, f"--measure={mode}"], capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    results = {"cold": [child("cold")], "text": [], "cached": []}
    child("cached")  # writes the warm cache
    for _ in range(args.repeats):
        for mode in ("text", "cached"):
            results[mode].append(child(mode))
    medians = {m: statistics.median(r["seconds"] for r in rows) for m, rows in results.items()}
    tokens = results["cold"][0]["tokens"]
    print(f"\n{args.pairs:,} pairs ({tokens:,} tokens with EOS)")
    print(f"median of {args.repeats} fresh processes each (cold: 1)")
    print(f"{'':8} {'seconds':>9} {'peak MiB above baseline':>24}")
    for mode, rows in results.items():
        mib = statistics.median(r["peak_mib_above_baseline"] for r in rows)
        runs = [round(r["seconds"], 2) for r in rows]
        print(f"{mode:8} {medians[mode]:9.2f} {mib:24.0f}   (each: {runs})")
    print(f"text / cached: {medians['text'] / medians['cached']:.1f}x")
    command = "python bench/translation_startup.py"
    print(f"command: {command} --pairs {args.pairs} --repeats {args.repeats}")


if __name__ == "__main__":
    main()
