"""Multi-head scaled dot-product attention: self-attention (optionally over a Transformer-XL
memory), cross-attention, and one-token steps over a key/value cache. Positional schemes act
through rotations of q and k and a bias on the logits (see positional/base.py)."""

import contextlib
import math
import sys
import threading
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from xformer import cudnn_packed, masks, precision
from xformer.dropout import Dropout
from xformer.layout import Layout
from xformer.linear import Linear, Projections
from xformer.positional.base import BoundScheme

IMPLEMENTATIONS = ("xla", "fused", "fused_packed")  # model.attention_impl
_LOGGED: set[str] = set()


def forget_logged_fallbacks() -> None:
    """Log each fallback reason again (a benchmark that runs several settings in one process
    notes each setting's own)."""
    _LOGGED.clear()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logging.warning("model.attention_impl (fused attention): %s", message)


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: masks.Mask | None,
    dropout: Dropout | None = None,
    bias: jax.Array | None = None,
    implementation: str = "xla",
) -> jax.Array:
    """softmax(q k^T / sqrt(D) + bias, masked) v.

    q [B, Lq, H, D], k and v [B, Lk, H, D], mask [B or 1, 1 or H, Lq, Lk] bool (or a
    masks.StructuredMask around one), bias broadcastable to [B, H, Lq, Lk] -> [B, Lq, H, D].
    Logits and softmax are at least float32. implementation "xla": the einsum reference;
    "fused": flash attention where it can serve (cuDNN on GPU, Pallas' splash kernel on TPU
    for structured masks), jax.nn.dot_product_attention's XLA implementation elsewhere;
    "fused_packed": the same, but on GPU packed rows go to cuDNN as segment lengths and
    offsets (cudnn_packed.py) rather than as their mask. Dropout on the weights has no fused
    form, so active attention dropout takes the reference path.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {implementation!r} not in {IMPLEMENTATIONS}")
    dropping = dropout is not None and dropout.rate > 0 and not dropout.deterministic
    fused = implementation != "xla"
    if fused and dropping:
        _log_once(
            "jax.nn.dot_product_attention has no dropout on the attention weights; with "
            f"model.attention_dropout={dropout.rate} training attention runs the xla path"
        )
    elif fused and q.dtype == jnp.float64:  # (jax's XLA form computes its softmax in float32)
        _log_once("fused attention has no float64 form: a float64 model runs the xla path")
    elif fused:
        return _fused_attention(q, k, v, mask, bias, packed=implementation == "fused_packed")
    mask = masks.dense(mask)
    logits = precision.wide_einsum("bqhd,bkhd->bhqk", q, k)
    logits_dtype = logits.dtype
    logits = logits / math.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + bias.astype(logits_dtype)
    if mask is not None:
        logits = jnp.where(mask, logits, precision.mask_value(logits_dtype))
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    if dropping:
        weights = dropout(weights)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


CUDNN_HEAD_MULTIPLE = 8  # cuDNN flash attention takes head sizes that are multiples of 8


def _fused_attention(q, k, v, mask, bias, packed: bool = False) -> jax.Array:
    """On TPU, the splash kernel where it serves (splash_attention.py); on GPU, cuDNN unless it
    refuses the call (dtype, head size, shapes); else, as on every other backend,
    jax.nn.dot_product_attention's XLA implementation. Every reason is logged once."""
    backend = jax.default_backend()
    if backend == "tpu":
        try:
            from xformer import splash_attention  # Pallas: imported only where it runs

            reason = splash_attention.unsupported(q, k, mask, bias)
        except ImportError as error:  # a jax whose Pallas keeps the kernel elsewhere
            reason = f"no splash kernel in this jax: {error}"
        if reason is None:
            return splash_attention.attention(q, k, v, mask)
        _log_once(f"TPU splash attention cannot serve this call ({reason}); using XLA")
    elif backend == "gpu":
        try:
            return _cudnn_attention(q, k, v, mask, bias, packed)
        except (NotImplementedError, ValueError, RuntimeError, TypeError) as error:
            _log_once(f"cuDNN flash attention cannot serve this call ({error}); using XLA")
    else:
        _log_once(f"no cuDNN on {backend}: jax.nn.dot_product_attention uses its XLA path")
    scale = 1.0 / math.sqrt(q.shape[-1])
    return jax.nn.dot_product_attention(
        q, k, v, bias, masks.dense(mask), scale=scale, implementation="xla"
    )


def _cudnn_attention(q, k, v, mask, bias, packed: bool = False) -> jax.Array:
    """jax.nn.dot_product_attention's cuDNN implementation (it raises where cuDNN refuses).

    Over whole rows (a StructuredMask without segment ids or window) cuDNN gets its own causal
    mask, or none, instead of a mask it would read as a [B, 1, Lq, Lk] bias; with `packed`,
    packed rows go to cuDNN's packed-sequence mode where it serves them (cudnn_packed.py). A
    head size that is not a multiple of 8 (WikiText-103's Transformer-XL: 410 / 10 = 41) is
    zero-padded, with the scale of the true size: the padded features add 0 to every q.k and
    their outputs, all 0, are sliced off, so the result and its gradients are exact."""
    size = q.shape[-1]
    scale = 1.0 / math.sqrt(size)

    def padded(*xs):
        if not size % CUDNN_HEAD_MULTIPLE:
            return xs
        pad = [(0, 0)] * (q.ndim - 1) + [(0, -size % CUDNN_HEAD_MULTIPLE)]
        return tuple(jnp.pad(x, pad) for x in xs)

    if packed:
        reason = cudnn_packed.unsupported(mask, bias)
        if reason is None:
            if not mask.max_segments:
                _log_once(
                    "packed mode without data.max_pairs_per_row: one segment slot per position "
                    f"({q.shape[1]}), so cuDNN keeps softmax statistics [B * {q.shape[1]}, H, "
                    f"{q.shape[1]}] in float32; set data.max_pairs_per_row"
                )
            try:
                return cudnn_packed.attention(*padded(q, k, v), mask, scale)[..., :size]
            except NotImplementedError as error:  # e.g. before Hopper: no packed layout
                reason = str(error)
        if isinstance(mask, masks.StructuredMask) and mask.q_segments is not None:
            _log_once(f"cuDNN's packed mode cannot serve this call ({reason}); it reads the mask")
    structured = mask if isinstance(mask, masks.StructuredMask) else None
    whole_rows = structured is not None and structured.q_segments is None and not structured.window
    if whole_rows:
        causal, mask = structured.causal, None
    else:
        causal = False
        q, mask, bias = _without_empty_rows(q, masks.dense(mask), bias)
    bias = None if bias is None else bias.astype(q.dtype)
    with _no_bias_gradient_for_a_mask(bias is None):
        out = jax.nn.dot_product_attention(
            *padded(q, k, v),
            bias,
            mask,
            scale=scale,
            is_causal=causal,
            implementation="cudnn",
        )
    return out[..., :size]


_CUDNN_TRACING = threading.RLock()


@contextlib.contextmanager
def _no_bias_gradient_for_a_mask(mask_only: bool) -> Iterator[None]:
    """While tracing a cuDNN call whose only bias is the boolean mask, stop jax before 0.11
    from asking cuDNN's backward pass for that bias's gradient: its `should_export_dbias` is
    always True, so every backward call also reduced dS over the heads into a [B, 1, Lq, Lk]
    gradient that nothing reads. jax 0.11 skips it by itself (no such function there).
    The flag is read when the call is traced, not in the backward pass (it travels in the
    call's static arguments), so it is set only around the call; every cuDNN call traced here
    takes one lock, so that another thread's call with a real bias never sees it."""
    module = sys.modules.get("jax._src.cudnn.fused_attention_stablehlo")
    if getattr(module, "should_export_dbias", None) is None:
        yield
        return
    with _CUDNN_TRACING:
        export = module.should_export_dbias  # read under the lock: never another's patch
        if mask_only:
            module.should_export_dbias = lambda *shapes: False
        try:
            yield
        finally:
            module.should_export_dbias = export


def _without_empty_rows(q, mask, bias):
    """(q, mask, bias) with every query row that sees no key given all keys, a zero query and
    a zero bias: logits 0, the uniform average of the values, which is what the reference
    computes for such a row (every logit the same fill value), with zero gradients into q, k
    and the bias, as there. Padding queries of packed rows are such rows.

    Why: cuDNN's flash-attention backward is reported (pytorch/pytorch#196678; H100 and H200)
    to score the padded half of its last 128-key tile as 0 and return NaN in dQ for a row whose
    log-sum-exp is below ln(FLT_MAX) ~ -88.7 when the key count is 64 mod 128. A fully masked
    row's log-sum-exp is the mask fill (about -2e12 in bfloat16), and one NaN row makes every
    weight gradient NaN: the suspected cause of Multi30k's non-finite first step on an H100
    (bench/gpu_empty_rows.py tests it). q [B, Lq, H, D], mask [B or 1, 1 or H, Lq, Lk]."""
    if mask is None:
        return q, mask, bias
    sees = jnp.any(mask, axis=-1, keepdims=True)  # [B or 1, 1 or H, Lq, 1]
    q = jnp.where(jnp.swapaxes(sees, 1, 2), q, 0)
    bias = None if bias is None else jnp.where(sees, bias, 0)
    return q, mask | ~sees, bias


class MultiHeadAttention(nnx.Module):
    """kind "self": one fused q/k/v projection; "memory": self-attention whose keys may also
    cover a memory of earlier states (separate q and k/v projections); "cross": queries from
    the decoder, keys and values from the encoder output. `split_heads`: the device mesh splits
    the heads (see linear.Projections)."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        kind: str,
        dropout: float,
        use_bias: bool = True,
        implementation: str = "xla",
        split_heads: bool = False,
        kernel_init: Callable = nnx.nn.linear.default_kernel_init,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim, self.kind = num_heads, d_model // num_heads, kind
        self.implementation = implementation
        linear = dict(
            use_bias=use_bias,
            kernel_init=kernel_init,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        heads = dict(axes=("embed", "heads"), **linear)
        if kind == "self":
            self.qkv_proj = Projections(d_model, 3, d_model, split_heads=split_heads, **heads)
        else:
            self.q_proj = Linear(d_model, d_model, **heads)
            self.kv_proj = Projections(d_model, 2, d_model, split_heads=split_heads, **heads)
        self.out_proj = Linear(d_model, d_model, axes=("heads", "embed"), **linear)
        self.dropout = Dropout(dropout, rngs=rngs)

    def _heads(self, x: jax.Array) -> list[jax.Array]:
        """[B, L, n, H*D] (Projections) or [B, L, H*D] (n = 1) -> n arrays [B, L, H, D]."""
        x = x.reshape(*x.shape[:2], -1, self.num_heads, self.head_dim)
        return [x[:, :, i] for i in range(x.shape[2])]

    def project_kv(self, states: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, L, H, D] of states [B, L, d]."""
        return tuple(self._heads(self.kv_proj(states)))

    def init_cross_cache(self, encoded: jax.Array) -> dict:
        """Cross-attention's keys and values of encoded [B, Ls, d] for decoding, computed once
        per input: {"k", "v"} [B, H, Ls, D], head-major like `init_cache` (for the same reason:
        in [B, Ls, H, D], XLA on CPU transposed them at every step)."""
        k, v = self.project_kv(encoded)
        # The barrier keeps XLA from cancelling this transpose against `cached_kv`'s.
        return jax.lax.optimization_barrier({"k": k.swapaxes(1, 2), "v": v.swapaxes(1, 2)})

    @staticmethod
    def cached_kv(cache: dict) -> tuple[jax.Array, jax.Array]:
        """Keys and values [B, slots, H, D] of a head-major cache, read in place."""
        return cache["k"].swapaxes(1, 2), cache["v"].swapaxes(1, 2)

    def _qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        if self.kind == "self":
            return tuple(self._heads(self.qkv_proj(x)))
        return self._heads(self.q_proj(x))[0], *self.project_kv(x)

    def __call__(
        self,
        x: jax.Array,
        mask: masks.Mask | None,
        *,
        positional: BoundScheme | None = None,
        layer: int = 0,
        memory: jax.Array | None = None,
        encoded: jax.Array | None = None,
        kv: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        """x [B, Lq, d] -> [B, Lq, d]; mask [B or 1, 1, Lq, Lk].

        Self-attention: keys are x, or [memory ; x] with memory [B, Lm, d] (kind "memory").
        Cross-attention: keys from encoded [B, Lk, d] or their precomputed kv ([B, Lk, H, D]).
        """
        if self.kind == "cross":
            q = self._heads(self.q_proj(x))[0]
            k, v = kv if kv is not None else self.project_kv(encoded)
        elif memory is not None:  # projected apart: the memory needs no input gradient
            q = self._heads(self.q_proj(x))[0]
            k, v = (
                jnp.concatenate(pair, axis=1)
                for pair in zip(self.project_kv(memory), self.project_kv(x), strict=True)
            )
        else:
            q, k, v = self._qkv(x)
        if positional is not None:
            q = positional.scheme.rotate(q, positional.layout.q_start)
            k = positional.scheme.rotate(k, positional.layout.k_start)
        return self._attend(q, k, v, mask, positional, layer)

    def _attend(self, q, k, v, mask, positional, layer) -> jax.Array:
        bias = None if positional is None else positional.bias(q, k, layer)
        out = dot_product_attention(q, k, v, mask, self.dropout, bias, self.implementation)
        return self.out_proj(out.reshape(*out.shape[:-2], -1))

    def init_cache(self, batch_size: int, max_len: int, dtype: jnp.dtype) -> dict:
        """An empty key/value cache of max_len slots for `decode_step`: {"k", "v"} [B, H,
        max_len, D]. Head-major, so that each step's dot reads it in place: with [B, max_len, H,
        D], XLA on CPU copied the whole cache into the dot's layout at every step."""
        zeros = jnp.zeros((batch_size, self.num_heads, max_len, self.head_dim), dtype)
        return {"k": zeros, "v": zeros}

    @staticmethod
    def cache_slots(cache: dict) -> int:
        return cache["k"].shape[2]

    @staticmethod
    def grow_cache(cache: dict, max_len: int) -> dict:
        """`init_cache`'s cache with empty slots appended up to max_len."""
        pad = ((0, 0), (0, 0), (0, max_len - cache["k"].shape[2]), (0, 0))
        return {name: jnp.pad(x, pad) for name, x in cache.items()}

    @staticmethod
    def write_cache(cache: dict, k: jax.Array, v: jax.Array, index: int | jax.Array) -> dict:
        """The cache with keys and values k, v [B, n, H, D] in slots index..index+n-1."""
        return {
            name: jax.lax.dynamic_update_slice_in_dim(
                cache[name], new.swapaxes(1, 2).astype(cache[name].dtype), index, axis=2
            )
            for name, new in (("k", k), ("v", v))
        }

    def decode_step(
        self,
        x: jax.Array,
        cache: dict,
        index: jax.Array,
        mask: jax.Array,
        positional: BoundScheme,
        layer: int,
    ) -> tuple[jax.Array, dict]:
        """One incremental self-attention step.

        x [B, n, d] at positions index..index+n-1 (index scalar; n = 1 when decoding token by
        token); cache (`init_cache`): keys (rotated, for rotary schemes) and values of earlier
        positions, to which this step's are written; mask [B, 1, n, max_len] hides later slots;
        positional is bound to Layout(n, max_len, q_start=index).
        """
        q, k, v = self._qkv(x)
        q, k = (positional.scheme.rotate(t, index) for t in (q, k))
        cache = self.write_cache(cache, k, v, index)
        keys, values = self.cached_kv(cache)
        return self._attend(q, keys, values, mask, positional, layer), cache


def decode_layout(index: jax.Array, max_len: int) -> Layout:
    """Where one decoding step sits: the query at `index`, keys at cache slots 0..max_len-1."""
    return Layout(1, max_len, q_start=index)
