"""LM stream batching against brute-force bookkeeping: order, coverage, resets, resume."""

import numpy as np
import pytest

from xformer.data.errors import DataValueError
from xformer.data.lm_stream import TrainStream, eval_segments, sliding_windows


def _stream(n, seed=0):
    return np.random.default_rng(seed).integers(1, 1000, n).astype(np.int32)


def test_train_rows_are_contiguous_and_continue_across_batches():
    stream = _stream(1003)
    it = TrainStream(stream, batch_size=4, segment_length=30)
    row_len = 1002 // 4
    assert it.segments_per_epoch == -(-row_len // 30)
    epoch = [next(it) for _ in range(it.segments_per_epoch)]
    assert [bool(b["reset"].all()) for b in epoch] == [True] + [False] * (len(epoch) - 1)
    for row in range(4):
        w = np.concatenate([b["weights"][row] for b in epoch]).astype(bool)
        inputs = np.concatenate([b["inputs"][row] for b in epoch])[w]
        targets = np.concatenate([b["targets"][row] for b in epoch])[w]
        np.testing.assert_array_equal(inputs, stream[row * row_len : (row + 1) * row_len])
        np.testing.assert_array_equal(targets, stream[row * row_len + 1 : (row + 1) * row_len + 1])
    again = next(it)  # the next epoch starts over with a reset
    assert again["reset"].all() and it.epoch == 1
    np.testing.assert_array_equal(again["inputs"], epoch[0]["inputs"])


def test_train_stream_resumes_and_splits_rows_between_processes():
    stream = _stream(500, seed=1)
    a = TrainStream(stream, 4, 16)
    for _ in range(9):
        next(a)
    b = TrainStream(stream, 4, 16)
    b.set_state(a.get_state())
    for _ in range(30):
        x, y = next(a), next(b)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])
    # A position past this stream's epoch (a checkpoint of a longer data.segment_length or
    # smaller batch): the next epoch starts, where it served batches of no tokens forever.
    shorter = TrainStream(stream, 4, 64)
    shorter.set_state({"epoch": 2, "segment": 5})
    first = next(shorter)
    assert shorter.get_state() == {"epoch": 3, "segment": 1} and first["reset"].all()
    np.testing.assert_array_equal(first["inputs"], next(TrainStream(stream, 4, 64))["inputs"])
    with pytest.raises(DataValueError, match="a stream of 3 tokens is too short for batch_size=4"):
        TrainStream(stream[:3], 4, 16)
    full = next(TrainStream(stream, 4, 16))
    half = next(TrainStream(stream, 4, 16, rows=slice(2, 4)))
    np.testing.assert_array_equal(half["inputs"], full["inputs"][2:])


@pytest.mark.parametrize("n,batch,length", [(101, 4, 7), (64, 2, 8), (5, 3, 4), (997, 10, 70)])
def test_eval_scores_every_token_exactly_once(n, batch, length):
    stream = _stream(n, seed=n)
    batches = eval_segments(stream, batch, length, boundary_id=0)
    weights = np.stack([b["weights"] for b in batches], 1).reshape(batch, -1)
    targets = np.stack([b["targets"] for b in batches], 1).reshape(batch, -1)
    inputs = np.stack([b["inputs"] for b in batches], 1).reshape(batch, -1)
    assert weights.sum() == n
    np.testing.assert_array_equal(targets[weights > 0], stream)  # row-major = stream order
    np.testing.assert_array_equal(inputs[weights > 0], np.concatenate([[0], stream[:-1]]))
    assert all(b["reset"].all() == (i == 0) for i, b in enumerate(batches))


@pytest.mark.parametrize("n,window,stride", [(50, 8, 1), (50, 8, 3), (23, 5, 5), (7, 10, 2)])
def test_sliding_windows_give_each_token_its_full_context(n, window, stride):
    stream = _stream(n, seed=window)
    inputs_stream = np.concatenate([[0], stream[:-1]])
    scored = []
    for b in sliding_windows(stream, batch_size=4, window=window, stride=stride, boundary_id=0):
        for row in range(4):
            for col in np.flatnonzero(b["weights"][row]):
                valid = b["key_valid"][row, : col + 1]
                context = b["inputs"][row, : col + 1][valid]
                t = len(scored)
                assert b["targets"][row, col] == stream[t]
                start = max(0, t - window + 1) if stride == 1 else None
                if start is not None:  # stride 1: exactly `window` tokens (fewer at the start)
                    np.testing.assert_array_equal(context, inputs_stream[start : t + 1])
                else:
                    np.testing.assert_array_equal(
                        context, inputs_stream[t + 1 - len(context) : t + 1]
                    )
                    assert len(context) >= min(t + 1, window - stride + 1)
                positions = b["positions"][row, : col + 1][valid]
                np.testing.assert_array_equal(positions, np.arange(len(context)))
                scored.append(t)
    assert scored == list(range(n))
