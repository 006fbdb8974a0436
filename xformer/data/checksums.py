"""SHA-256 of the upstream raw files, one table for every dataset of the registry.

``SHA256[dataset][file]`` is the digest of the file's *uncompressed content*
(gzip is undone first, recognised by its magic bytes), so a local plain copy, a
local ``.gz`` copy, a file extracted from the official archive and a downloaded
``.gz`` file are all checked the same way::

    from xformer.data.checksums import verify

    verify("ptb", raw, {"ptb.train.txt": path, ...}, downloaded=False)

Local copies that differ only log a warning (edited copies are allowed); a
downloaded file that differs is an error.  Files without a recorded digest are
not checked.  The digests below were computed from the files in
``<repo>/../shared/data`` and match the ``sha256 (uncompressed content)`` column
of their ``SOURCE.md``:

* ``multi30k``: byte-for-byte copies of upstream ``multi30k/dataset``
  ``data/task1/raw/`` (the ``.gz`` files themselves also match the digests this
  repository recorded before).
* ``ptb``: Mikolov's ``simple-examples`` files (their MD5 also equal the widely
  used reference values).
* ``ptb_char``: ``valid`` and ``test`` only.  The shared ``ptb.char.train.txt``
  is derived locally from ``ptb.train.txt``, not an upstream copy, so its
  digest is not recorded.
* ``wikitext2``: the WikiText-2 v1 ``wiki.*.tokens`` files.

WikiText-103, enwik8 and text8 have no verified digest here and are not checked;
lm1b's download is checked by the TFDS catalog's own checksum file.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path

from xformer.data.errors import DataValueError
from xformer.data.raw_files import RawFiles
from xformer.data.text import GZIP_MAGIC

logger = logging.getLogger(__name__)

# dataset, upstream file name, SHA-256 of its uncompressed content.  (ptb_char has no
# train row: the shared copy is derived, not upstream; see above.)
_TABLE = """
multi30k   train.en.gz             460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6
multi30k   train.de.gz             2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72
multi30k   val.en.gz               1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227
multi30k   val.de.gz               660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660
multi30k   test_2016_flickr.en.gz  399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182
multi30k   test_2016_flickr.de.gz  4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16
multi30k   test_2017_flickr.en.gz  ce1450ddc5ab0834502579d77a170849952e15a2938b34cc503bdc25ebb4fb98
multi30k   test_2017_flickr.de.gz  c3078bc3b36808bf9d20eb2347ed6137016179ef59ec0d2b9b8ecc3fb2880081
multi30k   test_2017_mscoco.en.gz  43051fdfa86fd5395182e718a94ca67b1b227b9f7c79596ff0f6b813216981d2
multi30k   test_2017_mscoco.de.gz  58277df3c75f92f7145a11b910b553d1cf82c439249d4dc237c899609eafac22
ptb        ptb.train.txt           fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf
ptb        ptb.valid.txt           c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2
ptb        ptb.test.txt            dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0
ptb_char   ptb.char.valid.txt      21661f63ec355085879458b6524644d4add5573541b4be14fb52ab2e2e995eb8
ptb_char   ptb.char.test.txt       1ef5607ac3c463b16e38bfe7900dd3bfc91de5a96e0f21e7eab5188b465b8ebe
wikitext2  wiki.train.tokens       9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f
wikitext2  wiki.valid.tokens       f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8
wikitext2  wiki.test.tokens        d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0
"""


def _parse(table: str) -> dict[str, dict[str, str]]:
    digests: dict[str, dict[str, str]] = {}
    for line in table.strip().splitlines():
        dataset, name, digest = line.split()
        digests.setdefault(dataset, {})[name] = digest
    return digests


SHA256: dict[str, dict[str, str]] = _parse(_TABLE)  # {dataset: {file name: digest}}


def content_sha256(path: str | Path) -> str:
    """SHA-256 of a file's content, after gunzip if it is gzip (detected by magic bytes)."""
    with open(path, "rb") as f:
        is_gzip = f.read(2) == GZIP_MAGIC
    digest = hashlib.sha256()
    with gzip.open(path, "rb") if is_gzip else open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(
    dataset: str,
    raw: RawFiles,
    paths: Mapping[str, Path],
    *,
    downloaded: bool,
    origin: str | Path | None = None,
) -> None:
    """Checks ``{file name: path}`` of ``dataset`` against ``SHA256``.

    A local copy (``downloaded=False``) that differs logs a warning; a downloaded
    file that differs raises ``ValueError``.  ``origin`` names the archive the
    files were extracted from, for the messages.
    """
    expected = SHA256.get(dataset, {})
    bad = {}
    for name, path in paths.items():
        if name in expected and (got := content_sha256(path)) != expected[name]:
            bad[name] = got
    if not bad:
        return
    where = {name: f"{name} in {origin}" if origin else str(paths[name]) for name in bad}
    if not downloaded:
        logger.warning(
            "Using local %s files that differ from upstream (SHA-256 of the content): %s",
            dataset,
            ", ".join(where.values()),
        )
        return
    name, got = next(iter(bad.items()))
    raise DataValueError(
        f"{where[name]} (downloaded from {raw.download_url(name)}) has SHA-256 {got} (of its "
        f"uncompressed content), expected {expected[name]}. Delete the download and retry, or "
        "use a local copy."
    )
