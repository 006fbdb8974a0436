"""First-fit packing (xformer/data/packing.py) against a plain-Python packer written from its
specification, resumption from any position, and its errors."""

import logging

import numpy as np
import pytest

from xformer.data.packing import PackedPairs
from xformer.data.pipeline import EncodedPairs, packed_train_dataset
from xformer.data.tokenizer import BOS_ID, EOS_ID

LENGTH, BINS, ROWS, SEED = 12, 6, 4, 7  # 6 bins a round, 4 rows a batch: batches span rounds


def random_pairs(rng: np.random.Generator, n: int) -> EncodedPairs:
    """Pairs of 1-12 tokens a side (EOS-terminated, ids 4-99), a few too long to pack."""
    lengths = rng.integers(1, LENGTH + 1, size=(2, n))
    lengths[:, :3] = LENGTH + 1, LENGTH + 5, 1  # the first two are dropped by packed_train_dataset
    src, tgt = (
        [np.append(rng.integers(4, 100, k - 1), EOS_ID).astype(np.int32) for k in side]
        for side in lengths
    )
    return EncodedPairs.from_sequences(src, tgt)


def reference_batches(
    pairs: EncodedPairs, members: np.ndarray, num_batches: int, max_pairs: int = 0
) -> list:
    """The specification, one pair and one bin at a time: pairs in the order of
    default_rng([SEED, epoch]).permutation, each into the first bin with room for both sides
    (and fewer than max_pairs pairs, if given);
    the first pair that fits no bin closes the round (and opens the next); a round's rows are
    served in the order default_rng([SEED, round start]).permutation(BINS)."""
    rows, position = [], 0
    while len(rows) < num_batches * ROWS:
        start, bins = position, [[] for _ in range(BINS)]
        while True:
            epoch, i = divmod(position, len(members))
            pair = int(members[np.random.default_rng([SEED, epoch]).permutation(len(members))[i]])
            src, tgt = pairs.src[pair].tolist(), pairs.tgt[pair].tolist()
            room = [
                sum(len(s) for s, _ in b) + len(src) <= LENGTH
                and sum(len(t) for _, t in b) + len(tgt) <= LENGTH
                and (not max_pairs or len(b) < max_pairs)
                for b in bins
            ]
            if not any(room):
                break
            bins[room.index(True)].append((src, tgt))
            position += 1
        for b in np.random.default_rng([SEED, start]).permutation(BINS):
            row = {k: [] for k in ("src", "src_segments", "src_positions")}
            row.update({k: [] for k in ("tgt_in", "tgt_out", "tgt_segments", "tgt_positions")})
            for segment, (src, tgt) in enumerate(bins[b], start=1):
                row["src"] += src
                row["src_segments"] += [segment] * len(src)
                row["src_positions"] += list(range(len(src)))
                row["tgt_in"] += [BOS_ID] + tgt[:-1]
                row["tgt_out"] += tgt
                row["tgt_segments"] += [segment] * len(tgt)
                row["tgt_positions"] += list(range(len(tgt)))
            rows.append({k: v + [0] * (LENGTH - len(v)) for k, v in row.items()})
    return [
        {k: np.asarray([r[k] for r in rows[i : i + ROWS]]) for k in rows[0]}
        for i in range(0, num_batches * ROWS, ROWS)
    ]


SETTINGS = {"batch_size": ROWS, "max_length": LENGTH, "seed": SEED, "num_packing_bins": BINS}


def test_packing_equals_the_plain_python_packer_over_several_epochs():
    rng = np.random.default_rng()
    pairs = random_pairs(rng, 40)  # 38 fit; ~8 pairs a round: 30 batches span ~5 epochs
    members = np.arange(2, 40)
    want = reference_batches(pairs, members, 30)
    have = iter(packed_train_dataset(pairs, **SETTINGS))
    for batch, expected in zip((next(have) for _ in want), want, strict=True):
        assert batch.keys() == expected.keys()
        for key in batch:
            assert batch[key].dtype == np.int32 and batch[key].shape == (ROWS, LENGTH)
            np.testing.assert_array_equal(batch[key], expected[key], err_msg=key)


def test_a_row_holds_at_most_max_pairs_per_row():
    """data.max_pairs_per_row = 2: the same first-fit specification with that cap (pairs of
    1-4 tokens would put ~5 in a row without it)."""
    rng = np.random.default_rng()
    pairs = random_pairs(rng, 40)
    short = EncodedPairs.from_sequences(
        *(
            [side[i][-int(rng.integers(1, 5)) :] for i in range(40)]
            for side in (pairs.src, pairs.tgt)
        )
    )
    want = reference_batches(short, np.arange(40), 10, max_pairs=2)
    have = iter(packed_train_dataset(short, **SETTINGS, max_pairs_per_row=2))
    for batch, expected in zip((next(have) for _ in want), want, strict=True):
        for key in batch:
            np.testing.assert_array_equal(batch[key], expected[key], err_msg=key)
    assert max(b["src_segments"].max() for b in want) == 2
    uncapped = next(iter(packed_train_dataset(short, **SETTINGS)))
    assert uncapped["src_segments"].max() > 2


def test_every_position_resumes_exactly():
    """From the state after k batches (mid-round and at round ends), a fresh iterator serves
    the same next batches."""
    pairs = random_pairs(np.random.default_rng(), 50)
    original = iter(packed_train_dataset(pairs, **SETTINGS))
    states, batches = [], []
    for _ in range(12):
        states.append(original.get_state())
        batches.append(next(original))
    for k in (0, 1, 2, 3, 7, 11):
        resumed = iter(packed_train_dataset(pairs, **SETTINGS))
        resumed.set_state(states[k])
        for expected in batches[k : k + 2]:
            for key, value in next(resumed).items():
                np.testing.assert_array_equal(value, expected[key])


def test_a_state_of_another_pipeline_is_refused_with_its_reason():
    pairs = random_pairs(np.random.default_rng(), 20)
    it = iter(packed_train_dataset(pairs, **SETTINGS))
    with pytest.raises(ValueError, match="written before xformer's own packer"):
        it.set_state({"parent": {"next_index": 5}, "next_row": 0, "counter": 12})


def test_pairs_longer_than_the_rows_are_refused():
    pairs = random_pairs(np.random.default_rng(), 10)
    with pytest.raises(ValueError, match="2 pairs have a side longer than 12"):
        PackedPairs(pairs, np.arange(10), length=LENGTH, num_bins=2, rows_per_batch=2, seed=0)


def test_pairs_too_long_to_train_on_are_counted_in_a_warning(caplog):
    rng = np.random.default_rng()
    lengths = rng.integers(3, 20, size=(2, 200))
    src, tgt = ([rng.integers(4, 50, n).astype(np.int32) for n in side] for side in lengths)
    too_long = int(((lengths[0] > 12) | (lengths[1] > 12)).sum())
    with caplog.at_level(logging.WARNING):
        packed_train_dataset(
            EncodedPairs.from_sequences(src, tgt), batch_size=4, max_length=12, seed=0
        )
    message = f"{too_long} of 200 training pairs have a side longer than data.max_train_length=12"
    assert message in caplog.text
