"""Issue 12 on a GPU: does cuDNN attention return non-finite gradients when some query rows see
no key (the padding queries of packed rows), and does xformer's fused path keep them finite?

    python bench/gpu_empty_rows.py            # one H100 / H200, well under a minute
    python bench/gpu_empty_rows.py --check    # any backend: the harness, XLA in cuDNN's place

Why: on an H100 (2026-11-27, jax 0.11.2) Multi30k's bfloat16 fused training stopped at step 1
with a non-finite loss or gradient; PTB-XL and wmt14-sized steps did not. A reported cuDNN
backward bug (pytorch/pytorch#196678) fits: NaN in dQ when the key count is 64 mod 128 and a
row's log-sum-exp is below ~-88.7, as a fully masked row's is (the mask's fill). Multi30k's
rows are 64 long and ~10% padding; wmt14's are 256, and PTB-XL's have no padding.

For each row length, bfloat16 q, k, v [B, L, H, 64] over packed rows (three examples, then
padding) with xformer's segment mask, and a loss over the real query positions only (as in
training): the gradients (dq, dk, dv) of jax's cuDNN call and of xformer's fused
`dot_product_attention` (which gives cuDNN no empty row), their non-finite counts, the fused
path's relative error against a float32 XLA reference, and its cuDNN call count.
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_attention import CUDNN_CALL, flat_leaves, packed_segments, relative_error  # noqa: E402

from xformer import masks  # noqa: E402
from xformer.attention import dot_product_attention  # noqa: E402


def gradients(attention, q, k, v, g, real) -> tuple[tuple, int]:
    """(dq, dk, dv) of sum(attention(q, k, v) * g) over real query rows, and the number of
    cuDNN calls in the compiled step."""

    def loss(q, k, v):
        out = attention(q, k, v).astype(jnp.float32)
        return jnp.sum(jnp.where(real, out * g, 0.0))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    return step(q, k, v), step.as_text().count(CUDNN_CALL)


def nonfinite(grads) -> str:
    return "/".join(str(int((~jnp.isfinite(x)).sum())) for x in grads)


def case(rng, rows: int, length: int, heads: int, padded: bool, raw_impl: str) -> dict:
    segments = packed_segments(rng, rows, length)
    if not padded:
        segments = np.maximum.accumulate(segments, axis=1)  # padding joins the last example
    mask = masks.segment_mask(jnp.asarray(segments), jnp.asarray(segments))
    real = jnp.asarray(segments > 0)[:, :, None, None]
    shape = (rows, length, heads, 64)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for _ in "qkv")
    g = jnp.asarray(rng.normal(size=shape), jnp.float32)
    raw, raw_calls = gradients(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=raw_impl),
        q, k, v, g, real,
    )  # fmt: skip
    fused, fused_calls = gradients(
        lambda q, k, v: dot_product_attention(q, k, v, mask, implementation="fused"),
        q, k, v, g, real,
    )  # fmt: skip
    ref, _ = gradients(
        lambda q, k, v: dot_product_attention(q, k, v, mask, implementation="xla"),
        *(x.astype(jnp.float32) for x in (q, k, v)), g, real,
    )  # fmt: skip
    return {
        "length": length,
        "empty rows": int((~np.asarray(mask).any(-1)).sum()),
        "raw non-finite dq/dk/dv": nonfinite(raw),
        "raw cuDNN calls": raw_calls,
        "fused non-finite dq/dk/dv": nonfinite(fused),
        "fused cuDNN calls": fused_calls,
        "fused err": relative_error(flat_leaves(fused), flat_leaves(ref)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="XLA in cuDNN's place (any backend)")
    parser.add_argument("--rows", type=int, default=32, help="Multi30k's training batch")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lengths", default="64,128,192,256")
    args = parser.parse_args()
    from bench_output import command_line

    command = command_line()
    print(f"command: {command}\ndevice: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    raw_impl = "xla" if args.check else "cudnn"
    rng = np.random.default_rng()
    lengths = [int(x) for x in args.lengths.split(",")]
    results = [case(rng, args.rows, n, args.heads, True, raw_impl) for n in lengths]
    results.append(case(rng, args.rows, lengths[0], args.heads, False, raw_impl))  # control
    print("\n| " + " | ".join(results[0]) + " |\n|" + "---|" * len(results[0]))
    for row in results:
        print(
            "| "
            + " | ".join(f"{x:.1e}" if isinstance(x, float) else str(x) for x in row.values())
            + " |"
        )
    bad = [r for r in results if r["fused non-finite dq/dk/dv"] != "0/0/0" or r["fused err"] > 2e-2]
    print(
        "\nfused path: "
        + (
            "FAILED in " + str([r["length"] for r in bad])
            if bad
            else "finite and within 2e-2 of float32 everywhere"
        )
    )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
