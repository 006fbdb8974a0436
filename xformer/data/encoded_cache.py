"""Encoded splits cached on disk: a split is read and encoded once, then every later start of
every process memory-maps its token ids (the processes of one host share the pages).

Without it each start of each process read, parsed and encoded the whole training split before
its first step: 38 s for 1M translation pairs, 46 s for 104M word tokens (bench/data_startup.py).
Translation pairs are stored flat (`RaggedIds`: uint16 ids where the vocabulary allows, int64
offsets), a language-modelling split as its int32 token stream.

    <cache_dir>/<name>-<key>/<array>.npy, info.json

`key` hashes everything the arrays depend on: the split's record files (path, first record,
records, size, modification time, as TFDS resolves the split) and the bytes of the tokenizer or
vocabulary (for translation also the language direction). A rebuilt dataset or a new vocabulary
makes a new entry, never a stale one; delete old entries to reclaim the space.
"""

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from absl import logging
from etils import epath

from xformer import locks


def cached_arrays(
    cache_dir: str, name: str, fingerprint: dict, encode: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """The arrays that encode() returns, memory-mapped from `<cache_dir>/<name>-<key>/`, where
    key hashes `fingerprint` (JSON: everything they depend on); encode() runs only when that
    entry is missing. Jobs that share cache_dir and start together encode it once: the others
    wait, then load. Where cache_dir is read-only, encode() runs every time, with a warning."""
    key = hashlib.sha1(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir, re.sub(r"[^\w.-]+", "_", name) + f"-{key}")
    if not os.path.isdir(path):
        if not _writable(cache_dir):
            logging.warning("%s is not writable: encoding %s in memory", cache_dir, name)
            return encode()

        def on_wait(holder: dict) -> None:
            logging.info("waiting for %s, which is encoding %s", locks.describe(holder), path)

        with locks.waiting(path + ".lock", on_wait):
            if not os.path.isdir(path):
                start = time.perf_counter()
                arrays = encode()
                _save(arrays, fingerprint, path)
                logging.info("encoded %s in %.1f s", name, time.perf_counter() - start)
    return {  # read-only views of the mapped files (plain ndarrays, which jax takes as input)
        file.removesuffix(".npy"): np.asarray(np.load(os.path.join(path, file), mmap_mode="r"))
        for file in os.listdir(path)
        if file.endswith(".npy")
    }


def record_files(data_source: Any) -> list:
    """What a TFDS data source reads: [path, first record, records, bytes, mtime] per file."""
    files = []
    for part in data_source.dataset_info.splits[data_source.split].file_instructions:
        stat = epath.Path(part.filename).stat()
        files.append([os.fspath(part.filename), part.skip, part.take, stat.length, stat.mtime])
    return files


def file_digest(path: str) -> str:
    return hashlib.sha1(epath.Path(path).read_bytes()).hexdigest()


def _writable(folder: str) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def _save(arrays: dict[str, np.ndarray], fingerprint: dict, path: str) -> None:
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".partial-")
    try:
        for name, array in arrays.items():
            np.save(os.path.join(tmp, f"{name}.npy"), array)
        with open(os.path.join(tmp, "info.json"), "w") as f:
            json.dump({**fingerprint, "shapes": {k: a.shape for k, a in arrays.items()}}, f)
        os.rename(tmp, path)  # atomic: a reader never sees a partial entry
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
