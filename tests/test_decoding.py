"""Tests for xformer.decoding: greedy and beam search against numpy references."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformer.decoding import (
    NEG_INF,
    beam_search,
    expand_to_beams,
    gather_beams,
    greedy_search,
    phase_sizes,
)

PAD, EOS, BOS = 0, 1, 2
NUM_STATES = 97


class ToyLM:
    """Random autoregressive LM whose next-token distribution depends on the whole prefix.

    The prefix is summarised by two cache leaves that must both be reordered correctly:
    a running hash ``state [N]`` and the token history ``hist [N, T]``; a scalar leaf
    ``count`` (shared by all rows) supplies the position. The distribution is
    ``table[key(prefix), position]``, a pure lookup, so the numpy reference is bit-exact.
    """

    def __init__(self, seed, vocab, max_len, eos_bias=0.0, quantize=None, dtype=np.float32):
        rng = np.random.default_rng(seed)
        logits = rng.normal(size=(NUM_STATES, max_len, vocab)) * 2.0
        logits[..., PAD] -= 30.0  # the pad token is a (very unlikely) regular token
        logits[..., EOS] += eos_bias
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        if quantize is not None:  # coarse grid -> many exact ties
            logp = np.minimum(np.round(logp / quantize) * quantize, 0.0)
        self.table = logp.astype(dtype)
        self.weights = rng.integers(1, 13, size=max_len)
        self.vocab, self.max_len = vocab, max_len

    def init_cache(self, batch_size, seed):
        s0 = np.random.default_rng(seed).integers(0, NUM_STATES, size=batch_size)
        return {
            "state": jnp.asarray(s0, jnp.int32),
            "hist": jnp.zeros((batch_size, self.max_len), jnp.int32),
            "count": jnp.int32(0),
        }

    def step_fn(self, tokens, cache, index):
        table = jnp.asarray(self.table)
        weights = jnp.asarray(self.weights, jnp.int32)
        state = (cache["state"] * 31 + tokens * 7 + 3) % NUM_STATES
        hist = cache["hist"].at[:, index].set(tokens)
        key = (state + (hist * weights).sum(-1)) % NUM_STATES
        log_probs = table[key, cache["count"]]
        return log_probs, {"state": state, "hist": hist, "count": cache["count"] + 1}

    def ref_log_probs(self, s0, outputs):
        """numpy log-probs ``[V]`` of the next token after generating ``outputs``."""
        inputs = [BOS, *outputs]
        state = int(s0)
        for tok in inputs:
            state = (state * 31 + tok * 7 + 3) % NUM_STATES
        hist_hash = sum(int(w) * tok for w, tok in zip(self.weights, inputs, strict=False))
        return self.table[(state + hist_hash) % NUM_STATES, len(outputs)]


def ref_greedy(lm, s0, max_len, pad_id=PAD):
    out = []
    while len(out) < max_len and (not out or out[-1] != EOS):
        out.append(int(np.argmax(lm.ref_log_probs(s0, out))))
    return out + [pad_id] * (max_len - len(out))


def lp(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


def brute_force(lm, s0, max_len, alpha):
    """All complete hypotheses {tuple(tokens): length-penalised score}."""
    non_eos = [v for v in range(lm.vocab) if v != EOS]
    scores = {}
    for length in range(1, max_len + 1):
        for body in itertools.product(non_eos, repeat=length - 1):
            seqs = [(*body, EOS)] + ([(*body, v) for v in non_eos] if length == max_len else [])
            for seq in seqs:
                total = sum(
                    float(lm.ref_log_probs(s0, list(seq[:i]))[tok]) for i, tok in enumerate(seq)
                )
                scores[seq] = total / lp(length, alpha)
    return scores


def strip(tokens, pad_id=PAD):
    """Cut a [max_len] row after EOS, checking that only pad_id follows it."""
    tokens = [int(x) for x in tokens]
    if EOS in tokens:
        end = tokens.index(EOS) + 1
        assert all(x == pad_id for x in tokens[end:]), tokens
        return tuple(tokens[:end])
    return tuple(tokens)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_matches_numpy_loop(seed):
    batch, max_len = 6, 7
    lm = ToyLM(seed, vocab=6, max_len=max_len, eos_bias=1.0)
    cache = lm.init_cache(batch, seed + 100)
    tokens = np.asarray(greedy_search(lm.step_fn, cache, batch, max_len, BOS, EOS))
    assert tokens.shape == (batch, max_len) and tokens.dtype == np.int32
    s0 = np.asarray(cache["state"])
    for b in range(batch):
        assert tokens[b].tolist() == ref_greedy(lm, s0[b], max_len)


def test_greedy_pads_after_eos_and_exits_early():
    batch, max_len, pad_id = 8, 10, 7
    lm = ToyLM(3, vocab=5, max_len=max_len, eos_bias=2.5)
    cache = lm.init_cache(batch, 4)
    calls = []

    def counting_step(tokens, cache, index):
        jax.debug.callback(lambda i: calls.append(int(i)), index)
        return lm.step_fn(tokens, cache, index)

    tokens = np.asarray(
        greedy_search(counting_step, cache, batch, max_len, BOS, EOS, pad_id=pad_id)
    )
    jax.effects_barrier()
    ends = []
    for b in range(batch):
        row = tokens[b].tolist()
        assert row == ref_greedy(lm, np.asarray(cache["state"])[b], max_len, pad_id)
        assert EOS in row
        end = row.index(EOS) + 1
        assert all(x == pad_id for x in row[end:]) and pad_id not in row[:end]
        ends.append(end)
    assert min(ends) < max(ends) < max_len  # some rows finished early, all finished
    assert len(calls) == max(ends)  # the loop stopped once every row had emitted EOS


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("quantize", [None, 0.5])
def test_beam_size_one_equals_greedy(seed, quantize):
    batch, max_len = 5, 8
    lm = ToyLM(seed, vocab=6, max_len=max_len, eos_bias=1.0, quantize=quantize)
    cache = lm.init_cache(batch, seed + 7)
    greedy = greedy_search(lm.step_fn, cache, batch, max_len, BOS, EOS)
    tokens, scores = beam_search(lm.step_fn, cache, batch, 1, max_len, BOS, EOS, alpha=0.0)
    assert tokens.shape == (batch, 1, max_len) and scores.shape == (batch, 1)
    np.testing.assert_array_equal(np.asarray(tokens[:, 0]), np.asarray(greedy))
    # The score is the greedy sequence's summed log-probability (alpha = 0).
    s0 = np.asarray(cache["state"])
    for b in range(batch):
        seq = strip(np.asarray(greedy[b]))
        ref = sum(float(lm.ref_log_probs(s0[b], list(seq[:i]))[t]) for i, t in enumerate(seq))
        np.testing.assert_allclose(float(scores[b, 0]), ref, rtol=1e-5, atol=1e-5)


def test_beam_size_one_length_penalty_can_prefer_longer():
    """With alpha > 0 beam_size=1 is not greedy: a longer hypothesis can win after EOS."""
    # Step 0: p(EOS) = 0.55 > p(3) = 0.45; afterwards token 3 is (almost) certain.
    first = jnp.log(jnp.array([1e-9, 0.55, 1e-9, 0.45]))
    later = jnp.log(jnp.array([1e-9, 1e-9, 1e-9, 1.0]))

    def step_fn(tokens, cache, index):
        log_probs = jnp.where(index == 0, first, later)
        return jnp.broadcast_to(log_probs, (tokens.shape[0], 4)), cache

    cache = {"dummy": jnp.zeros((1, 2))}
    greedy = greedy_search(step_fn, cache, 1, 3, BOS, EOS)
    assert greedy.tolist() == [[EOS, PAD, PAD]]
    for alpha, expected in [(0.0, [EOS, PAD, PAD]), (2.0, [3, 3, 3])]:
        tokens, _ = beam_search(step_fn, cache, 1, 1, 3, BOS, EOS, alpha=alpha)
        assert tokens[0, 0].tolist() == expected


@pytest.mark.parametrize(("beam_size", "alpha"), [(40, 0.6), (64, 0.6), (40, 0.0), (40, -0.5)])
def test_exhaustive_beam_matches_brute_force(beam_size, alpha):
    batch, vocab, max_len = 3, 4, 3
    num_hyps = 1 + 3 + 9 + 27  # EOS-terminated at lengths 1..3, plus 27 of full length
    lm = ToyLM(10 + beam_size, vocab=vocab, max_len=max_len)
    cache = lm.init_cache(batch, 11)
    tokens, scores = beam_search(
        lm.step_fn, cache, batch, beam_size, max_len, BOS, EOS, alpha=alpha
    )
    tokens, scores = np.asarray(tokens), np.asarray(scores)
    assert tokens.shape == (batch, beam_size, max_len) and scores.shape == (batch, beam_size)
    assert tokens.dtype == np.int32 and scores.dtype == np.float32
    s0 = np.asarray(cache["state"])
    for b in range(batch):
        ref = brute_force(lm, s0[b], max_len, alpha)
        assert len(ref) == num_hyps
        ref_sorted = np.array(sorted(ref.values(), reverse=True))
        assert np.all(np.diff(scores[b]) <= 0)  # sorted best first
        n_valid = min(beam_size, num_hyps)
        assert np.all(scores[b, :n_valid] > NEG_INF / 2)
        assert np.all(scores[b, n_valid:] <= NEG_INF / 2)
        np.testing.assert_allclose(scores[b, :n_valid], ref_sorted[:n_valid], rtol=1e-5, atol=1e-5)
        seqs = [strip(tokens[b, k]) for k in range(n_valid)]
        assert len(set(seqs)) == n_valid
        for k, seq in enumerate(seqs):
            np.testing.assert_allclose(scores[b, k], ref[seq], rtol=1e-5, atol=1e-5)
        best = max(ref, key=ref.get)
        assert ref_sorted[0] - ref_sorted[1] > 1e-4  # unambiguous best for this seed
        assert seqs[0] == best


def test_a_float64_model_is_searched_in_float64():
    """Scores in float64, exact to 1e-12 against the brute force (no float32 step); greedy
    ranks two tokens that float32 cannot tell apart."""
    batch, vocab, max_len, alpha = 2, 4, 3, 0.6
    with jax.enable_x64(True):
        lm = ToyLM(21, vocab=vocab, max_len=max_len, dtype=np.float64)
        cache = lm.init_cache(batch, 22)
        tokens, scores = beam_search(lm.step_fn, cache, batch, 3, max_len, BOS, EOS, alpha=alpha)
        assert scores.dtype == np.float64
        s0 = np.asarray(cache["state"])
        for b in range(batch):
            ref = brute_force(lm, s0[b], max_len, alpha)
            for k in range(3):
                seq = strip(np.asarray(tokens)[b, k])
                np.testing.assert_allclose(float(scores[b, k]), ref[seq], rtol=1e-12, atol=1e-12)

        def close_call(tokens, cache, index):  # token 2 beats token 1 by 1e-12 (nat)
            log_probs = jnp.log(jnp.asarray([0.1, 0.3, 0.3 + 1e-12, 0.3 - 1e-12]))
            return jnp.broadcast_to(log_probs, (tokens.shape[0], 4)), cache

        out = greedy_search(close_call, jnp.int32(0), 1, 2, BOS, EOS)
        assert np.asarray(out).tolist() == [[2, 2]]
        beam, _ = beam_search(close_call, jnp.int32(0), 1, 1, 2, BOS, EOS)
        assert np.asarray(beam).tolist() == [[[2, 2]]]


@pytest.mark.parametrize("beam_size", [1, 3])
def test_row_limits_give_each_row_its_own_search(beam_size):
    """Rows with their own length limits get what a search of that row alone, with max_len =
    its limit, gives (then padding): the other rows' limits change nothing."""
    rng = np.random.default_rng()
    batch, vocab, max_len = 4, 5, 8
    lm = ToyLM(int(rng.integers(1000)), vocab=vocab, max_len=max_len, eos_bias=-1.0)
    cache = lm.init_cache(batch, int(rng.integers(1000)))
    limits = np.array([2, 8, 5, 1], np.int32)
    if beam_size == 1:
        got = greedy_search(lm.step_fn, cache, batch, max_len, BOS, EOS, row_limits=limits)
        got = np.asarray(got)[:, None]
    else:
        got, scores = beam_search(
            lm.step_fn, cache, batch, beam_size, max_len, BOS, EOS, row_limits=limits
        )
        got, scores = np.asarray(got), np.asarray(scores)
    for b, limit in enumerate(limits):
        row = {k: v if k == "count" else v[b : b + 1] for k, v in cache.items()}
        if beam_size == 1:
            alone = np.asarray(greedy_search(lm.step_fn, row, 1, int(limit), BOS, EOS))[:, None]
        else:
            alone, alone_scores = beam_search(lm.step_fn, row, 1, beam_size, int(limit), BOS, EOS)
            np.testing.assert_allclose(scores[b], np.asarray(alone_scores)[0], rtol=1e-6)
        np.testing.assert_array_equal(got[b, :, :limit], np.asarray(alone)[0], err_msg=str(b))
        assert (got[b, :, limit:] == PAD).all()


@pytest.mark.parametrize(("seed", "alpha"), [(21, 0.6), (21, 0.0), (21, 2.0), (2, -0.5)])
def test_early_exit_is_exact_and_consistent(seed, alpha):
    """Small beams on a longer problem: early exit changes nothing; scores match sequences."""
    batch, beam, vocab, max_len = 4, 3, 6, 9
    lm = ToyLM(seed, vocab=vocab, max_len=max_len, eos_bias=2.0)
    cache = lm.init_cache(batch, seed + 1)
    calls = []

    def counting_step(tokens, cache, index):
        jax.debug.callback(lambda i: calls.append(int(i)), index)
        return lm.step_fn(tokens, cache, index)

    args = (cache, batch, beam, max_len, BOS, EOS, alpha)
    tok_a, sc_a = beam_search(counting_step, *args, early_exit=True)
    jax.effects_barrier()
    n_early = len(calls)
    tok_b, sc_b = beam_search(lm.step_fn, *args, early_exit=False)
    np.testing.assert_array_equal(np.asarray(tok_a), np.asarray(tok_b))
    np.testing.assert_array_equal(np.asarray(sc_a), np.asarray(sc_b))
    if alpha <= 0.6:
        assert n_early < max_len  # EOS is likely, so every row stops early
    s0 = np.asarray(cache["state"])
    for b in range(batch):
        assert np.all(np.diff(np.asarray(sc_a[b])) <= 0)
        seqs = [strip(np.asarray(tok_a[b, k])) for k in range(beam)]
        assert len(set(seqs)) == beam
        for k, seq in enumerate(seqs):
            assert seq[-1] == EOS or len(seq) == max_len
            total = sum(float(lm.ref_log_probs(s0[b], list(seq[:i]))[t]) for i, t in enumerate(seq))
            np.testing.assert_allclose(sc_a[b, k], total / lp(len(seq), alpha), rtol=1e-5)


def test_beam_pads_after_eos_with_custom_pad():
    batch, beam, max_len, pad_id = 3, 4, 8, 9
    lm = ToyLM(5, vocab=5, max_len=max_len, eos_bias=1.5)
    tokens, scores = beam_search(
        lm.step_fn, lm.init_cache(batch, 6), batch, beam, max_len, BOS, EOS, pad_id=pad_id
    )
    tokens = np.asarray(tokens)
    lengths = []
    for row in tokens.reshape(-1, max_len).tolist():
        seq = strip(row, pad_id)  # asserts only pad_id follows EOS
        assert pad_id not in seq
        lengths.append(len(seq))
    assert min(lengths) < max_len
    assert np.all(np.asarray(scores) > NEG_INF / 2)


def test_jit():
    batch, beam, max_len = 3, 4, 6
    lm = ToyLM(8, vocab=7, max_len=max_len, eos_bias=1.0)
    cache = lm.init_cache(batch, 9)

    @jax.jit
    def decode(cache):
        greedy = greedy_search(lm.step_fn, cache, batch, max_len, BOS, EOS)
        beams = beam_search(lm.step_fn, cache, batch, beam, max_len, BOS, EOS, alpha=0.6)
        return greedy, beams

    greedy, (tokens, scores) = decode(cache)
    np.testing.assert_array_equal(
        np.asarray(greedy), np.asarray(greedy_search(lm.step_fn, cache, batch, max_len, BOS, EOS))
    )
    ref_tokens, ref_scores = beam_search(lm.step_fn, cache, batch, beam, max_len, BOS, EOS)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref_tokens))
    np.testing.assert_allclose(np.asarray(scores), np.asarray(ref_scores), rtol=1e-6)


def test_expand_and_gather_beams():
    tree = {"a": jnp.arange(6).reshape(2, 3), "b": jnp.arange(2.0), "s": jnp.int32(5)}
    expanded = expand_to_beams(tree, 3)
    np.testing.assert_array_equal(expanded["a"], np.repeat(np.arange(6).reshape(2, 3), 3, 0))
    np.testing.assert_array_equal(expanded["b"], [0, 0, 0, 1, 1, 1])
    assert int(expanded["s"]) == 5
    moved = {"a": expanded["a"] + jnp.arange(6)[:, None] * 100, "b": jnp.arange(6.0)}
    out = gather_beams(moved, jnp.array([[2, 2, 0], [1, 0, 0]]))
    np.testing.assert_array_equal(out["b"], [2, 2, 0, 4, 3, 3])
    np.testing.assert_array_equal(out["a"][:, 0], [200, 200, 0, 403, 303, 303])


def test_phase_sizes_double_up_to_the_length_and_bad_phases_are_refused():
    assert phase_sizes(82) == (32, 64, 82)
    assert phase_sizes(64) == (32, 64)
    assert phase_sizes(32) == (32,) and phase_sizes(5) == (5,)
    assert phase_sizes(9, first=2) == (2, 4, 8, 9)
    with pytest.raises(ValueError, match="must be >= 1"):
        phase_sizes(0)
    cache = {"h": jnp.zeros((2, 3))}
    step = lambda tokens, cache, index: (jnp.zeros((2, 4)), cache)  # noqa: E731
    grow = lambda cache, n: cache  # noqa: E731
    for phases in ((4, 8), (4, 4, 10), (0, 10)):
        with pytest.raises(ValueError, match="must increase from >= 1 up to max_len"):
            beam_search(step, cache, 2, 2, 10, BOS, EOS, cache_phases=phases, grow_cache=grow)
    with pytest.raises(ValueError, match="needs grow_cache"):
        beam_search(step, cache, 2, 2, 10, BOS, EOS, cache_phases=(5, 10))


_SHARDED_SEARCH = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from xformer import op_profile
from xformer.decoding import beam_search
from xformer.sharding import row_local_top_k

B, K, T, V, D = 8, 3, 7, 50, 16
rng = np.random.default_rng(int(sys.argv[1]))
emb = jnp.asarray(rng.normal(size=(V, D)), jnp.float32)
out = jnp.asarray(rng.normal(size=(D, V)), jnp.float32)

def step_fn(tokens, cache, t):
    state = jnp.tanh(cache["state"] + emb[tokens])  # [N, D]: the prefix, carried by the cache
    return jax.nn.log_softmax(state @ out), {"state": state}

def search(cache, top_k=jax.lax.top_k):
    return beam_search(step_fn, cache, B, K, T, bos_id=2, eos_id=1, alpha=0.6, top_k=top_k)

cache = {"state": jnp.asarray(rng.normal(size=(B, D)), jnp.float32)}
want = jax.jit(search)(cache)
mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 1), ("data", "fsdp", "tensor"))
sharded = jax.device_put(cache, NamedSharding(mesh, P(("data", "fsdp"))))
report = {}
for name, top_k in [("xla", jax.lax.top_k), ("row_local", row_local_top_k(mesh))]:
    compiled = jax.jit(lambda c: search(c, top_k)).lower(sharded).compile()
    got = compiled(sharded)
    report[name] = {
        "equal": [bool(np.array_equal(a, b)) for a, b in zip(want, got)],
        "collectives": [op.shape for op in op_profile.collective_ops(compiled.as_text())],
    }
print(json.dumps(report))
"""


def test_batch_sharded_beam_search_gathers_no_cache_and_equals_one_device():
    """On 4 devices (data 2 x fsdp 2) with the batch sharded, beam search returns exactly the
    one-device result and moves no cache rows between devices: reordering beams stays within
    each device's rows (an all-gather of every cache leaf at every step is what global row
    indices cost); with `row_local_top_k` only the early-exit flag crosses devices."""
    import json
    import os
    import subprocess
    import sys

    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    seed = str(np.random.SeedSequence().entropy % 2**31)
    result = subprocess.run(
        [sys.executable, "-c", _SHARDED_SEARCH, seed],
        env={**os.environ, "XLA_FLAGS": flags},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for name, run in report.items():
        assert run["equal"] == [True, True], name
        # Neither the beam cache f32[B * K, D] nor the token sequences s32[B, K, T] (nor any
        # other index array) cross devices.
        moved = [s for s in run["collectives"] if "f32[24,16]" in s or "s32[" in s]
        assert moved == [], (name, run["collectives"])
    # XLA replicates top_k, gathering e.g. the log-probs f32[8,3,50]; row-local top_k leaves
    # only the early-exit flag.
    assert "f32[8,3,50]" in report["xla"]["collectives"]
    assert report["row_local"]["collectives"] == ["pred[]"]
