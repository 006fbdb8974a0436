"""Issue 12 on a GPU: does cuDNN flash attention serve each positional scheme and mask, and does
it compute what the XLA path computes?

    python bench/gpu_attention.py                 # one H100 / H200, ~9 min (mostly compiling)
    python bench/gpu_attention.py --quick         # tiny shapes, any backend (CPU: no cuDNN)
    python bench/gpu_attention.py --sizes multi30k --only "enc-dec sinusoidal"  # Multi30k's

For every case, three models share one set of float32 parameters (same seed): the bfloat16
model with `model.attention_impl="xla"`, the same with "fused", and a float32 "xla" model as
the reference. Each computes a loss and its gradients with respect to every parameter, jitted.
Reported per case:

- cuDNN: how many `__cudnn$fmha` custom calls the compiled fused step holds (forward and
  backward kernels; 0 means the fused path fell back to XLA, and the log says why);
- err fused / err xla: relative error against the float32 reference, of the loss, and of all
  gradients together (||g - g_ref|| / ||g_ref|| over the concatenated leaves). The fused path
  passes when its error is within 2x the bfloat16 XLA path's own + 1e-4 (both round to
  bfloat16, whose unit roundoff is 3.9e-3);
- fwd+bwd ms, xla and fused: medians of 20 timed steps after 3 warm-ups.

Cases (dropout 0: attention dropout has no fused form): the encoder-decoder under each
positional scheme on packed rows (three examples and padding per row, so the masks are
block-diagonal); Transformer-XL language models over a half-filled memory under each relative
scheme and each LM masking scheme; and one cached decoding step of the encoder-decoder (log-
probabilities, forward only).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xformer.language_model import LanguageModel  # noqa: E402
from xformer.losses import cross_entropy  # noqa: E402
from xformer.model_config import LMConfig, TransformerConfig  # noqa: E402
from xformer.models import EncoderDecoder  # noqa: E402

CUDNN_CALL = "__cudnn$fmha"


SIZES = {
    "default": dict(batch=16, length=256, d_model=512, heads=8, layers=2, vocab=8000),
    # configs/multi30k_ende.py's model and training batch (3+3 layers, packed rows of 64)
    "multi30k": dict(batch=32, length=64, d_model=256, heads=4, layers=3, vocab=8000),
    "quick": dict(batch=2, length=16, d_model=32, heads=2, layers=1, vocab=50),
}


def packed_segments(rng, batch: int, length: int, examples: int = 3) -> np.ndarray:
    """[B, L] ids 1..examples of that many examples per row, in order, then padding (0) over
    the last ~10%."""
    segments = np.zeros((batch, length), np.int32)
    for row in segments:
        used = int(length * rng.uniform(0.85, 0.95))
        cuts = np.sort(rng.choice(np.arange(2, used - 1), examples - 1, replace=False))
        row[:used] = 1 + np.searchsorted(cuts, np.arange(used), side="right")
    return segments


def _translation_case(positional: str, sizes: dict, rng) -> tuple:
    b, length, vocab = sizes["batch"], sizes["length"], sizes["vocab"]
    src_seg, tgt_seg = (packed_segments(rng, b, length) for _ in range(2))
    src = rng.integers(1, vocab, size=(b, length)) * (src_seg > 0)
    tgt_in = rng.integers(1, vocab, size=(b, length)) * (tgt_seg > 0)
    tgt_out = rng.integers(1, vocab, size=(b, length))
    batch = tuple(jnp.asarray(a) for a in (src, tgt_in, src_seg, tgt_seg, tgt_out))

    def build(dtype, impl, seed):
        cfg = TransformerConfig(
            src_vocab_size=vocab,
            tgt_vocab_size=vocab,
            d_model=sizes["d_model"],
            num_heads=sizes["heads"],
            num_encoder_layers=sizes["layers"],
            num_decoder_layers=sizes["layers"],
            d_ff=2 * sizes["d_model"],
            dropout=0.0,
            positional=positional,
            max_len=length,
            dtype=dtype,
            attention_impl=impl,
        )
        return EncoderDecoder(cfg, rngs=nnx.Rngs(seed))

    def loss(model, src, tgt_in, src_seg, tgt_seg, tgt_out):
        logits = model(src, tgt_in, src_seg, tgt_seg)
        weights = (tgt_seg > 0).astype(jnp.float32)
        return cross_entropy(logits, tgt_out, weights, 0.1)[0] / weights.sum()

    return build, loss, batch


def _lm_case(positional: str, mask: str, sizes: dict, rng) -> tuple:
    b, length, vocab = sizes["batch"], sizes["length"], sizes["vocab"]
    tokens = jnp.asarray(rng.integers(0, vocab, size=(b, 2 * length + 1)))
    mem_len = 0 if mask == "prefix_lm" else length // 2

    def build(dtype, impl, seed):
        cfg = LMConfig(
            vocab_size=vocab,
            d_model=sizes["d_model"],
            num_heads=sizes["heads"],
            num_decoder_layers=sizes["layers"],
            d_ff=2 * sizes["d_model"],
            dropout=0.0,
            mem_len=mem_len,
            positional=positional,
            decoder_mask=mask,
            attention_window=length // 4 if mask == "sliding_window" else 0,
            prefix_length=length // 8 if mask == "prefix_lm" else 0,
            dtype=dtype,
            attention_impl=impl,
        )
        return LanguageModel(cfg, rngs=nnx.Rngs(seed))

    def loss(model, tokens):
        """Second segment's mean NLL over a memory the first one (length L) half fills."""
        memory = model.init_memory(tokens.shape[0], mem_len)
        _, memory = model(tokens[:, :length], tokens[:, 1 : length + 1], memory)
        nll, _ = model(tokens[:, length:-1], tokens[:, length + 1 :], memory)
        return nll.mean()

    return build, loss, (tokens,)


def _timed(fn, args, repeats: int = 20) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def flat_leaves(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def relative_error(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def check_training_case(name: str, build, loss, batch: tuple, seed: int) -> dict:
    """Loss and gradients of bf16 xla, bf16 fused and the f32 reference; see the module doc."""
    results, row = {}, {"case": name}
    for label, dtype, impl in (
        ("ref", "float32", "xla"),
        ("xla", "bfloat16", "xla"),
        ("fused", "bfloat16", "fused"),
    ):
        graphdef, params, rest = nnx.split(build(dtype, impl, seed), nnx.Param, ...)

        def value_and_grad(params, *batch, graphdef=graphdef, rest=rest):
            return jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p, rest), *batch))(params)

        step = jax.jit(value_and_grad)
        compiled = step.lower(params, *batch).compile()
        if impl == "fused":
            row["cudnn"] = compiled.as_text().count(CUDNN_CALL)
        value, grads = compiled(params, *batch)
        results[label] = (float(value), flat_leaves(grads))
        if label != "ref":
            row[f"{label}_ms"] = _timed(compiled, (params, *batch))
    ref_loss, ref_grads = results["ref"]
    for label in ("xla", "fused"):
        value, grads = results[label]
        row[f"{label}_loss_err"] = abs(value - ref_loss) / abs(ref_loss)
        row[f"{label}_grad_err"] = relative_error(grads, ref_grads)
    row["ok"] = bool(
        np.isfinite(results["fused"][1]).all()
        and row["fused_grad_err"] <= 2 * row["xla_grad_err"] + 1e-4
        and row["fused_loss_err"] <= 2 * row["xla_loss_err"] + 1e-4
    )
    return row


def check_decode_step(sizes: dict, rng, seed: int) -> dict:
    """Log-probs of one cached decoding step at position L/2 over a padded source."""
    build, _, (src, *_rest) = _translation_case("rope", sizes, rng)
    src = src * (jnp.arange(src.shape[1]) < (3 * src.shape[1]) // 4)  # right padding
    max_len, index = sizes["length"], sizes["length"] // 2
    tokens = jnp.asarray(rng.integers(1, sizes["vocab"], size=(src.shape[0], max_len)))
    outputs, row = {}, {"case": "decode step (rope, cache)"}
    for label, dtype, impl in (
        ("ref", "float32", "xla"),
        ("xla", "bfloat16", "xla"),
        ("fused", "bfloat16", "fused"),
    ):
        model = build(dtype, impl, seed)
        model.eval()
        graphdef, state = nnx.split(model)

        def step(state, src, tokens, graphdef=graphdef):
            model = nnx.merge(graphdef, state)
            cache = model.init_decode_cache(src, max_len)
            for i in range(index):  # fill the cache with the first tokens
                _, cache = model.decode_step(tokens[:, i], cache, jnp.asarray(i))
            return model.decode_step(tokens[:, index], cache, jnp.asarray(index))[0]

        compiled = jax.jit(step).lower(state, src, tokens).compile()
        if impl == "fused":
            row["cudnn"] = compiled.as_text().count(CUDNN_CALL)
        outputs[label] = np.asarray(compiled(state, src, tokens), np.float64)
    for label in ("xla", "fused"):
        row[f"{label}_loss_err"] = relative_error(outputs[label], outputs["ref"])
        row[f"{label}_grad_err"] = float("nan")
    row["ok"] = bool(row["fused_loss_err"] <= 2 * row["xla_loss_err"] + 1e-4)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (any backend)")
    parser.add_argument("--sizes", choices=sorted(SIZES), default="default", help="model, batch")
    parser.add_argument(
        "--only", default="", help="run the cases whose name holds one of these (a,b,...)"
    )
    args = parser.parse_args()
    sizes = SIZES["quick" if args.quick else args.sizes]
    rng, seed = np.random.default_rng(), int(time.time()) % 10_000
    from bench_output import command_line

    command = command_line()
    device = jax.devices()[0]
    print(
        f"command: {command}\ndevice: {device.device_kind} ({jax.default_backend()}), "
        f"jax {jax.__version__}; sizes {sizes}; seed {seed}",
        flush=True,
    )
    cases = [
        (f"enc-dec {p}", *_translation_case(p, sizes, rng))
        for p in ("sinusoidal", "learned", "none", "rope", "alibi", "t5_bias", "relative")
    ]
    cases += [
        (f"XL {p}, causal", *_lm_case(p, "causal", sizes, rng))
        for p in ("relative", "rope", "alibi", "t5_bias")
    ]
    cases += [
        (f"XL relative, {m}", *_lm_case("relative", m, sizes, rng))
        for m in ("sliding_window", "same_length")
    ]
    cases.append(("LM rope, prefix_lm (no memory)", *_lm_case("rope", "prefix_lm", sizes, rng)))

    def wanted(name: str) -> bool:
        return not args.only or any(part in name for part in args.only.split(","))

    rows = []
    for name, build, loss, batch in cases:
        if wanted(name):
            rows.append(check_training_case(name, build, loss, batch, seed))
            print(rows[-1], flush=True)
    if wanted("decode step (rope, cache)"):
        rows.append(check_decode_step(sizes, rng, seed))
        print(rows[-1], flush=True)
    print(f"\ncommand: {command}\n")
    print(
        "| case | cuDNN calls | loss err xla / fused | grad err xla / fused | "
        "fwd+bwd ms xla / fused | ok |"
    )
    print("|---|---:|---|---|---|---|")
    for r in rows:
        times = f"{r['xla_ms']:.2f} / {r['fused_ms']:.2f}" if "xla_ms" in r else "n/a"
        print(
            f"| {r['case']} | {r['cudnn']} | {r['xla_loss_err']:.1e} / {r['fused_loss_err']:.1e}"
            f" | {r['xla_grad_err']:.1e} / {r['fused_grad_err']:.1e} | {times} | {r['ok']} |"
        )
    if not all(r["ok"] for r in rows):
        sys.exit("some fused case is further from the float32 reference than the xla path")


if __name__ == "__main__":
    main()
