"""Batched, jit-compatible greedy and beam search over a functional decoder step.

Both searches run inside ``jax.lax.while_loop`` with fixed shapes, so a caller can wrap them
in ``jax.jit`` (the step function, sizes and token ids are static / closed over): one loop, or
for beam search one per phase of a cache that grows (``cache_phases``, :func:`phase_sizes`).
The model is abstracted as a pure step function::

    log_probs, new_cache = step_fn(tokens, cache, index)

* ``tokens``: ``[N] int32``, the previous token of every row (``bos_id`` at index 0).
* ``cache``: any pytree (e.g. key/value caches) whose array leaves have leading dim ``N``;
  scalar (0-d) leaves are allowed and are passed through untouched by beam reordering, and
  so are the leaves that ``step_fn`` returns unchanged (the same array, e.g. an encoder's
  keys and values): they hold the same values in every beam of a row.
  ``new_cache`` must have the same structure, shapes and dtypes.
* ``index``: scalar ``int32``, the position being decoded (0 for the first output token).
* ``log_probs``: ``[N, V]``, normalised log-probabilities (all ``<= 0``) of the token at
  ``index``. Beam search's early exit relies on log-probabilities being ``<= 0``.

Beam search semantics (per batch row, ``k = beam_size``):

* ``k`` *alive* hypotheses (no EOS yet) and ``k`` *finished* hypotheses are kept. Alive
  hypotheses are ranked by their summed log-probability; finished ones by the GNMT score
  ``sum_log_prob / lp(L)`` with ``lp(L) = ((5 + L) / 6) ** alpha`` and ``L`` the length
  including EOS.
* Each step ranks the ``2k`` best one-token extensions of the alive hypotheses. An EOS
  extension is finished if it ranks among the ``k`` best of them (as in a plain top-``k``
  beam search); the ``k`` best non-EOS extensions (there are always at least ``k`` of the
  ``2k``) become the new alive set, and the cache is gathered by their parent beams
  (except the leaves the step returns unchanged, which are the same in every beam).
* Alive hypotheses still alive at the row's length limit (``max_len``, or its entry of
  ``row_limits``) are finished with ``L`` = that limit, so every row returns ``k`` real
  hypotheses unless there are fewer than ``k`` possible sequences.
* A row stops once no alive hypothesis can beat its worst finished one. Extending a
  hypothesis can only lower its summed log-probability ``s <= s_alive``, and for a monotone
  ``lp`` the best possible final score is ``max(s / lp(t + 1), s / lp(limit))`` over the
  remaining lengths, so the test is exact: stopping early never changes the result.
* ``row_limits`` ([B] int32, each in [1, max_len]) gives each row its own length limit, so a
  row's output does not depend on the other rows of its batch (e.g. their source lengths).
* With ``beam_size=1`` and ``alpha=0`` the result is exactly the greedy result. With
  ``alpha > 0`` it can legitimately differ: after the greedy hypothesis ends, the alive
  beam may later finish a longer hypothesis with a better length-penalised score.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from xformer.precision import at_least_float32

Cache = Any
StepFn = Callable[[jax.Array, Cache, jax.Array], tuple[jax.Array, Cache]]

# Large negative *finite* score for invalid/absent hypotheses (avoids inf - inf = NaN).
NEG_INF = -1.0e9
# Scores at or below this are invalid (NEG_INF plus any accumulated log-probabilities).
_INVALID = 0.5 * NEG_INF


def length_penalty(length: jax.Array | int, alpha: float, dtype=jnp.float32) -> jax.Array:
    """GNMT length penalty ``((5 + L) / 6) ** alpha`` in ``dtype`` (``L`` includes EOS)."""
    length = jnp.asarray(length, dtype)
    return ((5.0 + length) / 6.0) ** jnp.asarray(alpha, dtype)


def phase_sizes(max_len: int, first: int = 32) -> tuple[int, ...]:
    """Cache sizes of a search in phases: first, 2 first, 4 first, ... below max_len, then max_len.

    Every step of beam search attends over and reorders every slot of the self-attention cache,
    while step t needs only slots 0..t. Run in phases, the search decodes steps
    phases[i - 1] .. phases[i] - 1 over a cache of phases[i] slots, so early steps read a
    small cache; `grow_cache` appends empty slots between phases. A masked slot adds exactly 0
    to a step's softmax, so the results are those of one loop, up to the order in which the
    softmax sums its terms.
    """
    if max_len < 1 or first < 1:
        raise ValueError(f"max_len={max_len} and first={first} must be >= 1")
    sizes = []
    while first < max_len:
        sizes.append(first)
        first *= 2
    return (*sizes, max_len)


def _check_phases(phases: tuple[int, ...], max_len: int, grow_cache) -> tuple[int, ...]:
    """The phases to run: (max_len,) for none, else checked."""
    if not phases:
        return (max_len,)
    if grow_cache is None:
        raise ValueError("cache_phases needs grow_cache, which enlarges the cache between them")
    if phases[-1] != max_len or any(a >= b for a, b in zip((0, *phases), phases, strict=False)):
        raise ValueError(f"cache_phases={phases} must increase from >= 1 up to max_len={max_len}")
    return phases


def _while_in_phases(cond, body, state: tuple, phases: tuple[int, ...], grow_cache) -> tuple:
    """jax.lax.while_loop(cond, body, state) for a state (t, ..., cache): phase i runs while
    t < phases[i], after grow_cache(cache, phases[i]) has enlarged the cache (from phase 1 on).
    Each phase is a loop of its own, compiled for its cache size."""
    for i, end in enumerate(phases):
        if i:
            state = (*state[:-1], grow_cache(state[-1], end))
        state = jax.lax.while_loop(lambda s, end=end: cond(s) & (s[0] < end), body, state)
    return state


def expand_to_beams(tree: Cache, beam_size: int) -> Cache:
    """Repeat every row ``beam_size`` times: leaves ``[B, ...] -> [B * beam, ...]``.

    Row ``b * beam_size + j`` of the result is a copy of row ``b``. Scalar leaves are kept.
    """

    def expand(x: Any) -> Any:
        x = jnp.asarray(x)
        return x if x.ndim == 0 else jnp.repeat(x, beam_size, axis=0)

    return jax.tree.map(expand, tree)


def gather_beams(tree: Cache, parent: jax.Array, *, unchanged_since: Cache = None) -> Cache:
    """Reorder a flattened beam cache by parent beam.

    Args:
      tree: pytree with leaves ``[B * beam, ...]`` (row ``b * beam + j``); scalars are kept.
      parent: ``[B, n] int32``, beam index (in ``[0, beam)``) each new row is copied from.
      unchanged_since: the cache the step function was given, or None. A leaf of ``tree``
        that is the very same array as its counterpart here was passed through by the step
        (e.g. the encoder's keys and values for cross-attention). It is kept as it is: it
        started as ``beam`` copies of each row (:func:`expand_to_beams`) and no step changes
        it, so reordering a row's beams cannot change it either. Requires ``n == beam``.

    Returns:
      The pytree with leaves ``[B * n, ...]``; new row ``b * n + i`` is old row
      ``b * beam + parent[b, i]``.
    """
    batch_size, n = parent.shape

    def gather(x: Any, before: Any = None) -> Any:
        if x is before:
            return x
        x = jnp.asarray(x)
        if x.ndim == 0:
            return x
        rows = _take(x.reshape(batch_size, -1, *x.shape[1:]), parent)
        return rows.reshape(batch_size * n, *x.shape[1:])

    if unchanged_since is None:
        return jax.tree.map(gather, tree)
    return jax.tree.map(gather, tree, unchanged_since)


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """Per-row gather along axis 1: ``x [B, m, ...]``, ``idx [B, n]`` -> ``[B, n, ...]``.

    The batch is a batching dimension of the gather (vmap), so a batch-sharded search
    gathers within each device's rows; indexing with global row numbers made the SPMD
    partitioner all-gather every operand, the caches of all layers included, at every step.
    """
    return jax.vmap(lambda row, i: row[i])(x, idx)


def greedy_search(
    step_fn: StepFn,
    cache: Cache,
    batch_size: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
    pad_id: int = 0,
    *,
    early_exit: bool = True,
    row_limits: jax.Array | None = None,
) -> jax.Array:
    """Greedy (argmax) decoding.

    Args:
      step_fn: see module docstring; called with ``N = batch_size`` rows.
      cache: initial cache pytree, leaves ``[batch_size, ...]``.
      batch_size: ``B``.
      max_len: number of tokens to generate (not counting BOS).
      bos_id, eos_id, pad_id: special token ids.
      early_exit: stop the loop once every row has emitted EOS (never changes the result).
      row_limits: ``[B]`` int32, the tokens each row may generate (<= max_len; None: max_len).

    Returns:
      ``[B, max_len] int32`` generated tokens (BOS excluded); EOS is included when produced
      and every position after it (or after the row's limit) holds ``pad_id``.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    B = batch_size
    limits = _row_limits(row_limits, B, max_len)

    def cond(state):
        t, _, _, finished, _ = state
        keep_going = t < max_len
        if early_exit:
            keep_going &= ~jnp.all(finished)
        return keep_going

    def body(state):
        t, tokens, last, finished, cache = state
        log_probs, cache = step_fn(last, cache, t)
        nxt = jnp.argmax(log_probs, axis=-1).astype(jnp.int32)  # (a widening cast ranks alike)
        nxt = jnp.where(finished, jnp.int32(pad_id), nxt)
        tokens = tokens.at[:, t].set(nxt)
        finished = finished | (nxt == eos_id) | (t + 1 >= limits)
        return t + 1, tokens, nxt, finished, cache

    init = (
        jnp.int32(0),
        jnp.full((B, max_len), pad_id, jnp.int32),
        jnp.full((B,), bos_id, jnp.int32),
        limits < 1,
        cache,
    )
    _, tokens, _, _, _ = jax.lax.while_loop(cond, body, init)
    return tokens


def beam_search(
    step_fn: StepFn,
    cache: Cache,
    batch_size: int,
    beam_size: int,
    max_len: int,
    bos_id: int,
    eos_id: int,
    alpha: float = 0.6,
    pad_id: int = 0,
    *,
    early_exit: bool = True,
    top_k: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]] = jax.lax.top_k,
    cache_phases: tuple[int, ...] = (),
    grow_cache: Callable[[Cache, int], Cache] | None = None,
    row_limits: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Beam search with GNMT length penalty (semantics in the module docstring).

    Args:
      step_fn: see module docstring; called with ``N = batch_size * beam_size`` rows, row
        ``b * beam_size + j`` being beam ``j`` of batch row ``b``.
      cache: initial cache pytree with leaves ``[batch_size, ...]`` (NOT expanded; it is
        expanded here with :func:`expand_to_beams`).
      batch_size, beam_size: ``B`` and ``K``.
      max_len: maximum number of generated tokens (not counting BOS, counting EOS).
      bos_id, eos_id, pad_id: special token ids.
      alpha: length-penalty exponent (0 disables the penalty).
      early_exit: stop the loop once no row can improve (exact: never changes the result).
      top_k: ``jax.lax.top_k`` or an equivalent over the last axis of ``[B, ...]`` arrays
        (``sharding.row_local_top_k`` for a batch split over devices).
      cache_phases, grow_cache: run in phases (:func:`phase_sizes`): `cache` holds
        cache_phases[0] slots, and grow_cache(cache, n) returns the beam-expanded cache (leaves
        ``[B * K, ...]``) with n; () for one loop.
      row_limits: ``[B]`` int32, each row's own maximum length (<= max_len; None: max_len).

    Returns:
      ``(tokens [B, K, max_len] int32, scores [B, K] float32)`` sorted best first. Tokens
      exclude BOS, include EOS when produced and are ``pad_id`` after it; scores are summed
      log-probabilities divided by ``lp(L)``. If fewer than ``K`` sequences exist (tiny
      vocabulary), the missing slots have scores ``<= NEG_INF / 2`` and meaningless tokens.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    phases = _check_phases(cache_phases, max_len, grow_cache)
    B, K, T = batch_size, beam_size, max_len
    limits = _row_limits(row_limits, B, max_len)
    beams = expand_to_beams(cache, K)
    step_out = jax.eval_shape(step_fn, jnp.zeros(B * K, jnp.int32), beams, jnp.int32(0))[0]
    dtype = at_least_float32(step_out.dtype)  # scores: float32, or float64 for such a model
    lp_max = length_penalty(limits, alpha, dtype)[:, None]  # [B, 1]: of each row's longest output

    def cond(state):
        t, *_, done, _ = state
        keep_going = t < T
        if early_exit:
            keep_going &= ~jnp.all(done)
        return keep_going

    def body(state):
        t, last, alive_seqs, alive_scores, fin_seqs, fin_scores, done, cache = state
        log_probs, stepped = step_fn(last.reshape(B * K), cache, t)
        V = log_probs.shape[-1]
        log_probs = jnp.maximum(log_probs.astype(dtype), NEG_INF).reshape(B, K, V)

        # Best 2K extensions: the top-2K overall contain at most 2K tokens per beam, so
        # take a per-beam top-c first (exact token order, ties -> lower id, like argmax).
        c = min(2 * K, V)
        beam_lp, beam_tok = top_k(log_probs, c)  # [B, K, c]
        flat_scores = (alive_scores[:, :, None] + beam_lp).reshape(B, K * c)
        n = min(2 * K, K * c)
        cand_scores, cand_idx = top_k(flat_scores, n)  # [B, n], best first
        cand_tok = _take(beam_tok.reshape(B, K * c), cand_idx)
        cand_parent = cand_idx // c
        cand_eos = cand_tok == eos_id

        # EOS extensions ranked among the K best become finished hypotheses.
        m = min(K, n)
        eos_ok = cand_eos[:, :m] & (cand_scores[:, :m] > _INVALID) & ~done[:, None]
        eos_scores = jnp.where(
            eos_ok, cand_scores[:, :m] / length_penalty(t + 1, alpha, dtype), NEG_INF
        )
        eos_seqs = _take(alive_seqs, cand_parent[:, :m]).at[:, :, t].set(eos_id)

        # The K best non-EOS extensions stay alive (at least K of the 2K are non-EOS).
        alive_cand = jnp.where(cand_eos, NEG_INF, cand_scores)
        alive_scores, alive_idx = top_k(alive_cand, K)  # [B, K]
        last = _take(cand_tok, alive_idx)
        parent = _take(cand_parent, alive_idx)
        alive_seqs = _take(alive_seqs, parent).at[:, :, t].set(last)
        cache = gather_beams(stepped, parent, unchanged_since=cache)

        # At a row's last position, hypotheses that are still alive count as finished.
        last_position = (t == limits - 1)[:, None]
        final_ok = last_position & (alive_scores > _INVALID) & ~done[:, None]
        final_scores = jnp.where(final_ok, alive_scores / lp_max, NEG_INF)

        # Merge; existing hypotheses come first so that ties keep them (top_k is stable).
        all_scores = jnp.concatenate([fin_scores, eos_scores, final_scores], axis=1)
        all_seqs = jnp.concatenate([fin_seqs, eos_seqs, alive_seqs], axis=1)
        fin_scores, keep = top_k(all_scores, K)
        fin_seqs = _take(all_seqs, keep)

        if early_exit:
            # Descendants have summed log-prob <= the best alive one and length in
            # [t + 2, limit]; lp is monotone, so the best reachable score is at an endpoint.
            best = alive_scores[:, 0]
            bound = jnp.maximum(best / length_penalty(t + 2, alpha, dtype), best / lp_max[:, 0])
            done = done | (bound <= fin_scores[:, -1])
        done = done | (t + 1 >= limits)  # a row past its limit changes no more
        return t + 1, last, alive_seqs, alive_scores, fin_seqs, fin_scores, done, cache

    init = (
        jnp.int32(0),
        jnp.full((B, K), bos_id, jnp.int32),
        jnp.full((B, K, T), pad_id, jnp.int32),
        jnp.tile(jnp.array([0.0] + [NEG_INF] * (K - 1), dtype), (B, 1)),
        jnp.full((B, K, T), pad_id, jnp.int32),
        jnp.full((B, K), NEG_INF, dtype),
        jnp.zeros((B,), bool),
        beams,
    )
    state = _while_in_phases(cond, body, init, phases, grow_cache)
    return state[4], state[5]


def _row_limits(row_limits: jax.Array | None, batch_size: int, max_len: int) -> jax.Array:
    """[B] int32 length limits: row_limits capped at max_len, or max_len for every row."""
    if row_limits is None:
        return jnp.full((batch_size,), max_len, jnp.int32)
    return jnp.minimum(jnp.asarray(row_limits, jnp.int32), max_len)


def ban_tokens(step_fn: StepFn, token_ids: tuple[int, ...]) -> StepFn:
    """Wrap step_fn so that `token_ids` (e.g. padding, BOS) are never generated."""
    ids = jnp.asarray(token_ids, jnp.int32)

    def step(tokens, cache, index):
        log_probs, cache = step_fn(tokens, cache, index)
        return log_probs.at[:, ids].set(NEG_INF), cache

    return step
