"""Batches of a language-modelling token stream, in the order a recurrent memory needs.

Training cuts the stream into `batch_size` contiguous rows and serves segment k of every row
at step k, so row b of one batch continues row b of the previous batch. Evaluation scores every
token of a split exactly once: the first token is predicted from a boundary token (`<eos>`, as
if the split followed a line end), and the tail that does not fill whole rows is padded with
zero weights instead of being dropped.

Every batch is {"inputs", "targets": [B, L] int32, "weights": [B, L] float32 (0 on padding),
"reset": [B] bool (the row's stream restarts here: empty its memory)}.
"""

from collections.abc import Iterator

import numpy as np
from absl import logging

from xformer.data.errors import DataValueError


def _segment(rows_in, rows_out, start, length, reset) -> dict[str, np.ndarray]:
    b, row_len = rows_in.shape
    stop = min(start + length, row_len)
    inputs, targets = np.zeros((2, b, length), np.int32)
    weights = np.zeros((b, length), np.float32)
    inputs[:, : stop - start] = rows_in[:, start:stop]
    targets[:, : stop - start] = rows_out[:, start:stop]
    weights[:, : stop - start] = 1.0
    return {"inputs": inputs, "targets": targets, "weights": weights, "reset": np.full(b, reset)}


class TrainStream:
    """Endless training batches; `get_state`/`set_state` checkpoint the stream position.

    The stream (n tokens) gives batch_size rows of (n - 1) // batch_size inputs each; inputs
    and targets are the same rows shifted by one token. An epoch ends after the last segment
    (zero-padded if the row length is not a multiple of segment_length); the next epoch
    starts with reset=True. `rows` selects this process's share of the global rows.
    """

    def __init__(
        self,
        stream: np.ndarray,
        batch_size: int,
        segment_length: int,
        rows: slice = slice(None),
    ):
        row_len = (len(stream) - 1) // batch_size
        if row_len < 1:
            raise DataValueError(
                f"a stream of {len(stream)} tokens is too short for batch_size={batch_size}"
            )
        cut = np.asarray(stream[: batch_size * row_len + 1], np.int32)
        self.inputs = cut[:-1].reshape(batch_size, row_len)[rows]
        self.targets = cut[1:].reshape(batch_size, row_len)[rows]
        self.segment_length = segment_length
        self.segments_per_epoch = -(-row_len // segment_length)
        self.epoch, self.segment = 0, 0

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        start = self.segment * self.segment_length
        batch = _segment(self.inputs, self.targets, start, self.segment_length, self.segment == 0)
        self.segment += 1
        if self.segment >= self.segments_per_epoch:
            self.epoch, self.segment = self.epoch + 1, 0
        return batch

    def get_state(self) -> dict:
        return {"epoch": self.epoch, "segment": self.segment}

    def set_state(self, state: dict) -> None:
        """Resume at `state`; a position past this stream's epoch (a checkpoint of another
        data.segment_length, train.batch_size or corpus) starts the next epoch."""
        self.epoch, self.segment = int(state["epoch"]), int(state["segment"])
        if self.segment >= self.segments_per_epoch:
            logging.warning(
                "the checkpoint's data position (segment %d of epoch %d) is past this stream's "
                "%d segments per epoch: epoch %d starts",
                self.segment,
                self.epoch,
                self.segments_per_epoch,
                self.epoch + 1,
            )
            self.epoch, self.segment = self.epoch + 1, 0


def eval_segments(
    stream: np.ndarray, batch_size: int, segment_length: int, boundary_id: int
) -> list[dict[str, np.ndarray]]:
    """Every token of `stream` as a target exactly once, in rows of ceil(n / batch_size)."""
    n = len(stream)
    row_len = -(-n // batch_size)
    targets = np.zeros(batch_size * row_len, np.int32)
    targets[:n] = stream
    inputs = np.concatenate([[boundary_id], targets[:-1]]).astype(np.int32)
    valid = np.arange(batch_size * row_len) < n
    shape = (batch_size, row_len)
    inputs, targets, valid = inputs.reshape(shape), targets.reshape(shape), valid.reshape(shape)
    batches = []
    for start in range(0, row_len, segment_length):
        batch = _segment(inputs, targets, start, segment_length, start == 0)
        stop = min(start + segment_length, row_len)
        batch["weights"][:, : stop - start] = valid[:, start:stop]
        batches.append(batch)
    return batches


def sliding_windows(
    stream: np.ndarray, batch_size: int, window: int, stride: int, boundary_id: int
) -> Iterator[dict[str, np.ndarray]]:
    """Al-Rfou et al. evaluation of a memoryless model: each window of `window` inputs scores
    only its last `stride` targets (stride 1: every token sees exactly `window` tokens of
    context, one forward pass per token). Windows at the start of the stream are left-padded;
    "positions" restart at 0 on the first real token and "key_valid" hides the padding.
    """
    if not 1 <= stride <= window:
        raise ValueError(f"need 1 <= stride <= window, got stride={stride}, window={window}")
    n = len(stream)
    inputs = np.concatenate([[boundary_id], stream[:-1]]).astype(np.int32)
    pad = window - stride
    padded_in = np.concatenate([np.zeros(pad, np.int32), inputs])
    padded_out = np.concatenate([np.zeros(pad, np.int32), np.asarray(stream, np.int32)])
    starts = np.arange(0, n, stride)  # the window with first target t covers [t - pad, t + stride)
    offsets = np.arange(window)
    for first in range(0, len(starts), batch_size):
        t0 = np.zeros(batch_size, np.int64)
        rows = starts[first : first + batch_size]
        t0[: len(rows)] = rows
        idx = t0[:, None] + offsets[None, :]  # indices into the padded arrays
        stream_pos = idx - pad  # -1 and below: left padding
        in_stream = (stream_pos >= 0) & (stream_pos < n)
        real_row = (np.arange(batch_size) < len(rows))[:, None]
        yield {
            "inputs": padded_in[np.minimum(idx, len(padded_in) - 1)] * in_stream,
            "targets": padded_out[np.minimum(idx, len(padded_out) - 1)] * in_stream,
            "weights": (in_stream & real_row & (offsets >= pad)[None, :]).astype(np.float32),
            "positions": np.maximum(offsets[None, :] - np.maximum(pad - t0, 0)[:, None], 0).astype(
                np.int32
            ),
            "key_valid": stream_pos >= 0,
        }
