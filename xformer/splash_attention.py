"""TPU flash attention: Pallas' splash-attention kernel for `attention_impl="fused"` on TPU.

The kernel never materialises the [B, H, Lq, Lk] logits: it builds the mask blockwise from a
static pattern (causal or all keys, optionally within a sliding window) and per-token segment
ids, skipping blocks the pattern hides. So it serves the calls whose mask is a
`masks.StructuredMask` and that have no bias (sinusoidal, learned, rotary or no positions);
`unsupported` gives the reason for any other call, which then takes
jax.nn.dot_product_attention's XLA path.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as patterns
from jax.sharding import PartitionSpec as P

from xformer import masks, sharding

INTERPRET = False  # True: Pallas' interpreter runs the kernel on any backend (the CPU tests)
LANES = 128  # the kernel's blocks are multiples of 128 positions
BLOCKS = (512, 256, 128)  # the largest that divides a sequence length is used
DTYPES = (jnp.float32, jnp.bfloat16)


def unsupported(q: jax.Array, k: jax.Array, mask, bias: jax.Array | None) -> str | None:
    """Why the kernel cannot serve this call (None if it can). q [B, Lq, H, D], k [B, Lk, H,
    D]; mask as `dot_product_attention` takes it."""
    if bias is not None:
        return "the positional scheme adds a bias to the logits"
    if not isinstance(mask, masks.StructuredMask):
        return (
            "its mask is not a StructuredMask (causal or all keys, optionally in a window, "
            "AND same example, on aligned positions)"
        )
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (it takes {', '.join(jnp.dtype(d).name for d in DTYPES)})"
    lengths = (q.shape[1], k.shape[1])
    if any(length % LANES for length in lengths):
        return f"sequence lengths {lengths} are not multiples of {LANES}"
    mesh = _split_mesh()
    if mesh is not None:
        rows, heads = sharding.batch_rows(mesh), mesh.shape["tensor"]
        if q.shape[0] % rows or q.shape[2] % heads:
            return f"{q.shape[0]} rows and {q.shape[2]} heads over {rows} x {heads} devices"
    return None


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: masks.StructuredMask) -> jax.Array:
    """softmax(q k^T / sqrt(D), masked) v by the splash kernel: q [B, Lq, H, D], k and v [B, Lk,
    H, D] -> [B, Lq, H, D]. Under a mesh that splits the work, each device runs the kernel on
    its own rows (data x fsdp) and heads (tensor): XLA cannot partition a Pallas call."""
    segments = () if mask.q_segments is None else (mask.q_segments, mask.k_segments)

    def local(q, k, v, *segments):
        kernel = _kernel(q.shape[2], q.shape[1], k.shape[1], mask.causal, mask.window, INTERPRET)
        heads_first = [x.swapaxes(1, 2) for x in (q / math.sqrt(q.shape[-1]), k, v)]
        if segments:
            call = lambda q, k, v, qs, ks: kernel(q, k, v, splash.SegmentIds(qs, ks))  # noqa: E731
        else:
            call = kernel
        return jax.vmap(call)(*heads_first, *segments).swapaxes(1, 2)

    mesh = _split_mesh()
    if mesh is None:
        return local(q, k, v, *segments)
    heads = P(sharding.BATCH_AXES, None, "tensor", None)
    rows = P(sharding.BATCH_AXES, None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(heads, heads, heads, *[rows] * len(segments)),
        out_specs=heads,
        check_vma=False,  # the Pallas call carries no varying-axes types
    )(q, k, v, *segments)


def _split_mesh():
    """The trace's abstract mesh (`sharding.traced_on`) if it has more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


@functools.cache
def _kernel(heads: int, q_len: int, k_len: int, causal: bool, window: int, interpret: bool):
    """The kernel for one [heads, q_len, D] x [heads, k_len, D] call (its mask's block map is
    computed here, once per shape): keys up to window - 1 positions before (and, unless
    causal, after) each query; window 0: no limit. Blocks the pattern hides are skipped."""
    shape = (q_len, k_len)
    if window:
        sides = (window - 1, 0 if causal else window - 1)
        pattern = patterns.LocalMask(shape, sides, offset=0)
    else:  # (a LocalMask unlimited on both sides captures a constant in the kernel)
        pattern = (patterns.CausalMask if causal else patterns.FullMask)(shape)
    block_q, block_k = (next(b for b in BLOCKS if not n % b) for n in (q_len, k_len))
    blocks = splash.BlockSizes(
        block_q=block_q,
        block_kv=block_k,
        block_kv_compute=block_k,
        block_q_dkv=block_q,
        block_kv_dkv=block_k,
        block_kv_dkv_compute=block_k,
        block_q_dq=block_q,
        block_kv_dq=block_k,
    )
    with jax.ensure_compile_time_eval():  # concrete block maps, not the first caller's tracers
        return splash.make_splash_mha(
            patterns.MultiHeadMask([pattern] * heads),
            block_sizes=blocks,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )
