"""A translation split's token ids, encoded once and memory-mapped by every later start.

Without it each start of each process reads, parses and encodes the whole training split before
its first step, and holds every sentence as its own array (for WMT14's 4.5M pairs: minutes per
start and gigabytes per process). The cache holds both sides flat (`RaggedIds`): uint16 ids when
the vocabulary allows, int64 offsets. Processes on one host share its pages.

    <cache_dir>/<dataset>-<split>-<key>/{src,tgt}_{ids,offsets}.npy, info.json

`key` hashes everything the ids depend on: the split's record files (path, size, modification
time and the records taken from each, as TFDS resolves the split), the two languages and the
bytes of the two SentencePiece models. A rebuilt dataset or a new tokenizer makes a new entry;
delete the folder to reclaim the space.
"""

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence

import numpy as np
from absl import logging
from etils import epath

from xformer import locks
from xformer.data.pipeline import EncodedPairs, RaggedIds
from xformer.data.readers import TranslationSource
from xformer.data.tokenizer import Tokenizer

_CHUNK = 16384  # pairs read and encoded at a time: bounds the text held in memory
_SIDES = ("src", "tgt")


def cached_pairs(
    source: TranslationSource,
    languages: tuple[str, str],
    tokenizers: tuple[Tokenizer, Tokenizer],
    cache_dir: str,
) -> EncodedPairs:
    """Every pair of `source` as (source language, target language) ids, each side ending with
    EOS, in dataset order: loaded from `cache_dir`, else encoded and saved there first (only
    encoded, with a warning, where cache_dir is read-only). Jobs that share cache_dir and start
    together encode it once: the others wait, then load."""
    fingerprint = _fingerprint(source, languages, tokenizers)
    key = hashlib.sha1(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]
    name = re.sub(r"[^\w.-]+", "_", f"{source.dataset}-{source.split}")
    path = os.path.join(cache_dir, f"{name}-{key}")
    if not os.path.isdir(path):
        if not _writable(cache_dir):
            logging.warning("%s is not writable: encoding %s in memory", cache_dir, name)
            return _encode(source, languages, tokenizers)

        def on_wait(holder: dict) -> None:
            logging.info("waiting for %s, which is encoding %s", locks.describe(holder), path)

        with locks.waiting(path + ".lock", on_wait):
            if not os.path.isdir(path):
                _save(_encode(source, languages, tokenizers), fingerprint, path)
    pairs = _load(path)
    if len(pairs) != len(source):
        raise ValueError(
            f"{path} holds {len(pairs)} pairs, the split has {len(source)}: delete the folder "
            "to encode it again"
        )
    return pairs


def _writable(folder: str) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def _fingerprint(source: TranslationSource, languages, tokenizers) -> dict:
    files = []
    for part in source.source.dataset_info.splits[source.split].file_instructions:
        stat = epath.Path(part.filename).stat()
        files.append([os.fspath(part.filename), part.skip, part.take, stat.length, stat.mtime])
    models = [hashlib.sha1(epath.Path(t.path).read_bytes()).hexdigest() for t in tokenizers]
    return {"files": files, "languages": list(languages), "tokenizers": models}


def _encode(
    source: TranslationSource, languages: Sequence[str], tokenizers: Sequence[Tokenizer]
) -> EncodedPairs:
    start_time = time.perf_counter()
    dtype = np.uint16 if max(t.vocab_size for t in tokenizers) <= 2**16 else np.int32
    parts: tuple[list, list] = ([], [])
    for start in range(0, len(source), _CHUNK):
        records = source.__getitems__(range(start, min(start + _CHUNK, len(source))))
        for side, lang, tok in zip(parts, languages, tokenizers, strict=True):
            side.append(RaggedIds.from_sequences(tok.encode([r[lang] for r in records]), dtype))
    pairs = EncodedPairs(*(RaggedIds.concatenate(side, dtype) for side in parts))
    logging.info(
        "encoded the %d pairs of %s %s in %.1f s",
        len(pairs),
        source.dataset,
        source.split,
        time.perf_counter() - start_time,
    )
    return pairs


def _save(pairs: EncodedPairs, fingerprint: dict, path: str) -> None:
    tmp = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".partial-")
    try:
        for side, ragged in zip(_SIDES, (pairs.src, pairs.tgt), strict=True):
            np.save(os.path.join(tmp, f"{side}_ids.npy"), ragged.ids)
            np.save(os.path.join(tmp, f"{side}_offsets.npy"), ragged.offsets)
        with open(os.path.join(tmp, "info.json"), "w") as f:
            json.dump({**fingerprint, "pairs": len(pairs)}, f, indent=1)
        os.rename(tmp, path)  # atomic: a reader never sees a partial entry
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _load(path: str) -> EncodedPairs:
    def side(name: str) -> RaggedIds:
        ids = np.load(os.path.join(path, f"{name}_ids.npy"), mmap_mode="r")
        return RaggedIds(ids, np.load(os.path.join(path, f"{name}_offsets.npy")))

    return EncodedPairs(*(side(name) for name in _SIDES))
