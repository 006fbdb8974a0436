"""Issue 12 on a GPU: cuDNN attention over packed rows, the segment mask as a bias (what xformer
does today) against cuDNN's packed-sequence mode (per-segment lengths and offsets: no bias read),
with the same call unmasked beside them (what the mask's bias costs).

    python bench/gpu_packed_attention.py          # one H100 / H200, about a minute
    python bench/gpu_packed_attention.py --check  # the conversion below only (any backend)

Why: on an H100 (2026-11-27) the 36 cuDNN calls of the wmt14 bf16 step took 7.2 ms, ~4x their
byte floor; the main kernels ran at 71 (forward) and 85 TFLOP/s (backward) counting every
masked tile. Each call reads the [B, 1, L, L] mask as a bias, once per head (jax 0.11 asks for
no gradient of it; 0.10 did, and xformer's fused path stops it). jax's public call takes
sequence lengths (padding) but not packing; its private `jax._src.cudnn.fused_attention_stablehlo`
`dot_product_attention` also takes per-segment lengths [B, M] and offsets [B, M + 1]. This
script measures both on wmt14's attention shapes ([96, 256] rows of ~8 pairs, 8 heads of 64)
for the encoder (segments), the decoder (segments, causal) and cross attention (target
segments over source segments), and checks both against a float32 XLA reference: outputs at
real (non-padding) query positions and the gradients of a loss over them. `unmasked` is the
same call without the mask (a wrong result, timed only): if it costs what `bias` does, the
bias is free and a packed mode can gain only by skipping tiles across segments. `xformer` is
xformer's own packed path (`attention_impl="fused_packed"`, xformer/cudnn_packed.py: its
segment conversion and selects around the same call, M = 16 slots a row), checked the same
way: the first run of it on real cuDNN.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_output import command_line  # noqa: E402
from gpu_attention import flat_leaves, packed_segments, relative_error  # noqa: E402

from xformer import masks  # noqa: E402
from xformer.attention import dot_product_attention  # noqa: E402

LABELS = ("bias", "packed", "packed_all", "xformer")
XFORMER_SLOTS = 16  # data.max_pairs_per_row of the `packed` step of bench/gpu_session.sh


def lengths_and_offsets(
    segments: np.ndarray, slots: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous segment ids [B, L] (1..m in order, 0 = padding) -> cuDNN's per-segment
    lengths [B, M] and starts [B, M + 1] within the row, -1 where a row has fewer segments.
    M = `slots`, else the batch's most segments in a row (a model, not knowing its batches'
    counts, would need a static bound: L at worst)."""
    count = slots or int(segments.max())
    lengths = np.full((segments.shape[0], count), -1, np.int32)
    offsets = np.full((segments.shape[0], count + 1), -1, np.int32)
    for b, row in enumerate(segments):
        ids, starts, sizes = np.unique(row, return_index=True, return_counts=True)
        real = ids > 0
        lengths[b, : real.sum()] = sizes[real]
        offsets[b, : real.sum()] = starts[real]
    return lengths, offsets


def segment_mask(q_segments, k_segments, causal: bool) -> np.ndarray:
    """[B, 1, Lq, Lk] bool: xformer's packed-row mask (and not a later position, if causal)."""
    mask = np.asarray(masks.segment_mask(q_segments, k_segments))
    if causal:
        mask &= np.tril(np.ones((q_segments.shape[1], k_segments.shape[1]), bool))
    return mask


def mask_from_lengths(lengths, offsets, q_len, k_lengths, k_offsets, k_len, causal):
    """The mask cuDNN's packed mode means: query i of segment j sees key positions of the
    key side's segment j (up to its own position within the segment, if causal)."""
    mask = np.zeros((lengths.shape[0], 1, q_len, k_len), bool)
    for b in range(lengths.shape[0]):
        for j in range(lengths.shape[1]):
            if lengths[b, j] < 0:
                continue
            for i in range(lengths[b, j]):
                keys = k_lengths[b, j] if not causal else min(i + 1, k_lengths[b, j])
                start = k_offsets[b, j]
                mask[b, 0, offsets[b, j] + i, start : start + keys] = True
    return mask


def check(rng) -> None:
    src, tgt = (packed_segments(rng, 4, 64, examples=5) for _ in range(2))
    for slots in (None, 64):
        for q, k, causal in ((src, src, False), (tgt, tgt, True), (tgt, src, False)):
            qa, ka = lengths_and_offsets(q, slots), lengths_and_offsets(k, slots)
            built = mask_from_lengths(*qa, q.shape[1], *ka, k.shape[1], causal)
            assert np.array_equal(built, segment_mask(q, k, causal)), (causal, q is k, slots)
    print("check: lengths and offsets describe the segment masks exactly (3 kinds, 4 rows, 2 M)")


def timed_loss_and_grads(attention, q, k, v, g, real, repeats: int):
    """(loss, (dq, dk, dv)) of sum(attention(q, k, v) * g) over real query positions, and the
    median ms of a jitted forward + backward (a call cuDNN refuses raises)."""

    def loss(q, k, v):
        out = attention(q, k, v).astype(jnp.float32)
        return jnp.sum(jnp.where(real, out * g.astype(jnp.float32), 0.0))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    out = jax.block_until_ready(step(q, k, v))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - start)
    return out, 1e3 * statistics.median(times)


def run_case(rng, shape, q_segments, k_segments, causal: bool, repeats: int) -> dict:
    """Reference (float32 XLA), bias (today's cuDNN call) and packed (cuDNN's segment mode)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_call

    scale = shape[-1] ** -0.5
    q, k, v, g = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for _ in range(4))
    mask = jnp.asarray(segment_mask(q_segments, k_segments, causal))
    real = jnp.asarray(q_segments > 0)[:, :, None, None]
    mask_type = MaskType.PADDING_CAUSAL if causal else MaskType.PADDING

    def packed(slots):
        (q_len, q_off), (k_len, k_off) = (
            tuple(map(jnp.asarray, lengths_and_offsets(s, slots))) for s in (q_segments, k_segments)
        )
        return lambda q, k, v: cudnn_call(
            q, k, v, None, None, q_len, k_len, q_off, k_off, scale=scale, mask_type=mask_type
        )

    attentions = {
        "ref": lambda q, k, v: jax.nn.dot_product_attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), mask=mask, scale=scale
        ),
        "bias": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scale, implementation="cudnn"
        ),
        "packed": packed(None),
        "packed_all": packed(q_segments.shape[1]),  # M = L: a bound that holds for any batch
        "xformer": lambda q, k, v: dot_product_attention(
            q,
            k,
            v,
            masks.StructuredMask(
                mask,
                jnp.asarray(q_segments),
                jnp.asarray(k_segments),
                causal=causal,
                max_segments=XFORMER_SLOTS,
            ),
            implementation="fused_packed",
        ),
        "unmasked": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, implementation="cudnn"
        ),
    }
    results = {}
    for label, attention in attentions.items():
        try:
            results[label] = timed_loss_and_grads(attention, q, k, v, g, real, repeats)
        except Exception as error:  # the private call's API or cuDNN's support may differ
            print(f"  {label}: {type(error).__name__}: {str(error)[:300]}", flush=True)
    row = {"unmasked_ms": results["unmasked"][1] if "unmasked" in results else None}
    for label in LABELS:
        ok = label in results and "ref" in results
        row[f"{label}_err"] = (
            relative_error(flat_leaves(results[label][0][1]), flat_leaves(results["ref"][0][1]))
            if ok
            else None
        )
        row[f"{label}_ms"] = results[label][1] if label in results else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only the conversion (any backend)")
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=8, help="segments a row")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    command = command_line()
    rng = np.random.default_rng()
    check(rng)
    if args.check:
        print(f"command: {command}")
        return
    device = jax.devices()[0]
    print(f"command: {command}\ndevice: {device.device_kind}, jax {jax.__version__}", flush=True)
    shape = (args.rows, args.length, args.heads, args.head_size)
    src, tgt = (packed_segments(rng, args.rows, args.length, args.pairs) for _ in range(2))
    rows = []
    for name, q_segments, k_segments, causal in (
        ("encoder self", src, src, False),
        ("decoder self, causal", tgt, tgt, True),
        ("cross", tgt, src, False),
    ):
        rows.append((name, run_case(rng, shape, q_segments, k_segments, causal, args.repeats)))
        print(rows[-1], flush=True)

    def fmt(x, spec):
        return "n/a" if x is None else format(x, spec)

    print(f"\ncommand: {command}\n[B, L, heads, head size] {list(shape)}, {args.pairs} a row\n")
    labels = LABELS
    print(
        "packed: M = the batch's most segments in a row; packed_all: M = L; "
        f"xformer: attention_impl=fused_packed with M = {XFORMER_SLOTS}\n"
    )
    print("unmasked: the bias call without its mask (wrong results; its time only)\n")
    print(
        "| call | grad err bias / packed / packed_all / xformer "
        "| fwd+bwd ms bias / packed / packed_all / xformer / unmasked |"
    )
    print("|---|---|---|")
    for name, r in rows:
        errors = " / ".join(fmt(r[f"{x}_err"], ".1e") for x in labels)
        times = " / ".join(fmt(r[f"{x}_ms"], ".3f") for x in (*labels, "unmasked"))
        print(f"| {name} | {errors} | {times} |")


if __name__ == "__main__":
    main()
