"""Translation input pipelines: tokenized pairs -> packed training batches and eval batches.

Training rows are fixed-shape [batch, max_train_length] packs of several sentence pairs (first-fit
packing, `packing.py`), described by segment ids (0 = padding) and per-segment positions. The
decoder input of each pair is BOS + target and its label is target + EOS, so they pack with
identical layouts and the shift never crosses an example boundary.
"""

import dataclasses
from collections.abc import Sequence

import grain
import numpy as np
from absl import logging
from grain import experimental as grain_exp

from xformer.data.errors import DataValueError
from xformer.data.packing import PackedPairs, join_rows
from xformer.data.tokenizer import PAD_ID, Tokenizer


@dataclasses.dataclass(frozen=True)
class RaggedIds:
    """Token id sequences stored flat: sequence i is ids[offsets[i] : offsets[i + 1]].

    ids: [total tokens] (any integer dtype, e.g. a memory-mapped uint16 array); offsets:
    [num sequences + 1] int64, starting at 0. Indexing returns an int32 copy of one sequence.
    """

    ids: np.ndarray
    offsets: np.ndarray

    def __post_init__(self):
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or self.offsets[0] != 0:
            raise ValueError("offsets must be a 1-D array starting at 0")
        if self.offsets[-1] != len(self.ids):
            raise ValueError(f"offsets end at {self.offsets[-1]}, ids hold {len(self.ids)}")

    @classmethod
    def from_sequences(cls, seqs: Sequence[np.ndarray], dtype=np.int32) -> "RaggedIds":
        lengths = np.fromiter(map(len, seqs), np.int64, count=len(seqs))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.concatenate(seqs).astype(dtype) if len(seqs) else np.zeros(0, dtype)
        return cls(ids, offsets)

    @classmethod
    def concatenate(cls, parts: Sequence["RaggedIds"], dtype=np.int32) -> "RaggedIds":
        if not parts:
            return cls(np.zeros(0, dtype), np.zeros(1, np.int64))
        starts = np.cumsum([0] + [len(p.ids) for p in parts[:-1]])
        offsets = [np.zeros(1, np.int64)]
        offsets += [p.offsets[1:] + start for p, start in zip(parts, starts, strict=True)]
        return cls(np.concatenate([p.ids for p in parts]), np.concatenate(offsets))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.ids[self.offsets[i] : self.offsets[i + 1]], np.int32)

    @property
    def lengths(self) -> np.ndarray:
        """[num sequences] int64."""
        return np.diff(self.offsets)


@dataclasses.dataclass(frozen=True)
class EncodedPairs:
    """Token ids of aligned sentence pairs (each ends with EOS)."""

    src: RaggedIds
    tgt: RaggedIds

    def __post_init__(self):
        if len(self.src) != len(self.tgt):
            raise ValueError(f"{len(self.src)} source vs {len(self.tgt)} target sentences")

    @classmethod
    def from_sequences(cls, src: Sequence[np.ndarray], tgt: Sequence[np.ndarray]) -> "EncodedPairs":
        return cls(RaggedIds.from_sequences(src), RaggedIds.from_sequences(tgt))

    @classmethod
    def from_text(
        cls, src: list[str], tgt: list[str], src_tok: Tokenizer, tgt_tok: Tokenizer
    ) -> "EncodedPairs":
        return cls.from_sequences(src_tok.encode(src), tgt_tok.encode(tgt))

    def __len__(self) -> int:
        return len(self.src)


def packed_train_dataset(
    pairs: EncodedPairs,
    *,
    batch_size: int,
    max_length: int,
    seed: int,
    num_packing_bins: int = 0,
    max_pairs_per_row: int = 0,
    num_shards: int = 1,
    shards: Sequence[int] = (0,),
) -> grain.IterDataset:
    """Shuffled (reshuffled every epoch), first-fit packed training batches (`packing.py`).

    A global batch of batch_size rows joins num_shards independent packed streams, shard s
    packing the pairs s, s + num_shards, ... into batch_size / num_shards rows; this dataset
    yields the rows of `shards` (one process's consecutive shards), so the global batches do not
    depend on how many processes read them. Pairs with a side longer than max_length are
    dropped (training only); a row holds at most max_pairs_per_row pairs (0: no limit). Each
    element maps names to int32 arrays
    [len(shards) * batch_size / num_shards, max_length].
    """
    keep = np.flatnonzero((pairs.src.lengths <= max_length) & (pairs.tgt.lengths <= max_length))
    if len(keep) < len(pairs):
        logging.warning(
            "%d of %d training pairs have a side longer than data.max_train_length=%d: not "
            "trained on",
            len(pairs) - len(keep),
            len(pairs),
            max_length,
        )
    if len(keep) < num_shards:
        raise DataValueError(
            f"{len(keep)} training pairs fit data.max_train_length={max_length}: too few for "
            f"{num_shards} input shards"
        )
    rows = batch_size // num_shards

    def shard(s: int) -> PackedPairs:
        return PackedPairs(
            pairs,
            keep[s::num_shards],
            length=max_length,
            num_bins=num_packing_bins or 4 * rows,
            rows_per_batch=rows,
            seed=seed,
            max_pairs=max_pairs_per_row,
            shard=s,
        )

    if len(shards) == 1:
        return shard(shards[0])
    return grain_exp.ZipIterDataset([shard(s) for s in shards]).map(join_rows)


class ShardBatches:
    """Iterates `dataset`, the batches of input shards `shards` of `num_shards`, and saves its
    position with the shards it read, so a checkpoint resumes only onto them: under a mesh of
    other row blocks, the processes of one block would resume different positions and feed
    different rows to devices that must hold the same ones."""

    def __init__(self, dataset: grain.IterDataset, num_shards: int, shards: Sequence[int]):
        self._iterator = iter(dataset)
        self._shards = {"num_shards": num_shards, "shards": list(shards)}

    def __iter__(self) -> "ShardBatches":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def get_state(self) -> dict:
        return {**self._shards, "position": self._iterator.get_state()}

    def set_state(self, state: dict) -> None:
        if "position" not in state:  # written before the shards were saved with it
            self._iterator.set_state(state)
            return
        read = {"num_shards": state["num_shards"], "shards": list(state["shards"])}
        if read != self._shards:
            raise ValueError(
                f"the checkpoint's process read input shards {read['shards']} of "
                f"{read['num_shards']}, this one reads {self._shards['shards']} of "
                f"{self._shards['num_shards']}: resume on the mesh (row blocks per process) "
                "that wrote it"
            )
        self._iterator.set_state(state["position"])


def bucket_length(n: int, multiple: int = 16) -> int:
    """Round a length up to a multiple, so a handful of shapes cover all batches."""
    return max(multiple, -(-n // multiple) * multiple)


def sorted_batches(lengths: Sequence[int] | np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Index batches of similar length (sorted, longest first); together they cover every index."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def source_bucket_length(n: int) -> int:
    """A decoding batch's padded source length: multiples of 16 up to 128, then of 64, so
    inputs up to 512 tokens need at most 14 shapes."""
    return bucket_length(n, 16) if n <= 128 else bucket_length(n, 64)


@dataclasses.dataclass(frozen=True)
class BudgetBatch:
    """Input `indices` padded into an array [rows, length] (rows >= len(indices))."""

    indices: np.ndarray
    rows: int
    length: int


def rows_within_budget(length: int, max_rows: int, max_tokens: int, row_multiple: int) -> int:
    """Rows of a batch padded to `length`: as many as rows x length <= max_tokens allows, at
    most max_rows, a multiple of row_multiple and at least row_multiple (one row per shard)."""
    rows = min(max_rows, max_tokens // length) // row_multiple * row_multiple
    return max(row_multiple, rows)


def budget_batches(
    lengths: Sequence[int],
    max_rows: int,
    max_tokens: int,
    row_multiple: int = 1,
    max_length: int | None = None,
) -> list[BudgetBatch]:
    """Every index of `lengths` exactly once, longest first, in batches padded to
    `source_bucket_length` of their longest member (at most max_length, e.g. a learned
    position table; no length may exceed it), with `rows_within_budget` rows: the rows of a
    batch depend only on its padded length, so there is one shape per length bucket, and long
    inputs come in small batches (down to row_multiple rows). max_rows must be a multiple of
    row_multiple."""
    if max_rows % row_multiple:
        raise ValueError(f"max_rows={max_rows} must be a multiple of row_multiple={row_multiple}")
    if max_length is not None and max(lengths, default=0) > max_length:
        raise ValueError(f"a length of {max(lengths)} exceeds max_length={max_length}")
    order = np.argsort(-np.asarray(lengths, np.int64), kind="stable")
    batches, start = [], 0
    while start < len(order):
        length = source_bucket_length(int(lengths[order[start]]))
        length = min(length, max_length or length)
        rows = rows_within_budget(length, max_rows, max_tokens, row_multiple)
        batches.append(BudgetBatch(order[start : start + rows], rows, length))
        start += rows
    return batches


def pad_rows(rows: list[np.ndarray], length: int, num_rows: int) -> np.ndarray:
    """Right-pad int sequences into an array [num_rows, length] filled with PAD_ID."""
    out = np.full((num_rows, length), PAD_ID, np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out
