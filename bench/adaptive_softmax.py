"""Benchmark: training loss of a full softmax vs the adaptive softmax, dense and capacity-limited.

    python bench/adaptive_softmax.py            # WikiText-103 sizes (~15 min, 2 cores)
    python bench/adaptive_softmax.py --quick    # tiny smoke run

At WikiText-103's vocabulary (V = 267,735 types, cutoffs 20000/40000/200000) and for each
setting (d_model, d_embed, div_val) it times one forward + backward pass of the mean NLL over
`--positions` hidden states (gradients w.r.t. the hidden states and every parameter), for

- full: a plain softmax, logits = h @ W^T + b with W [V, d_model] (no clusters);
- adaptive: xformer.adaptive.AdaptiveLogSoftmax with capacity 0 (every tail cluster scored for
  every position);
- capacity c: the same module with capacity c (each tail cluster scores C = ceil(c * N)
  gathered rows, in a block rounded up to a multiple of 8; a cluster with more than C targets
  is scored densely, one such block of rows at a time; the table names such clusters).

Each step is jitted and compiled ahead; one warm-up call each, then `--repeats` rounds in which
every variant of a setting runs once in turn (background load hits them alike), timed up to
block_until_ready; the table gives the median and the minimum. Memory is XLA's static estimate
for the compiled step (`compile().memory_analysis()`, which works on CPU): argument bytes
(parameters, hidden states, targets) and temp bytes (every intermediate; the outputs, loss and
gradients, are counted apart and are the same for the adaptive variants).
Parameters and hidden states are random (N(0, 0.02) parameters, N(0, 1) hidden states): the
cost does not depend on their values. The targets are drawn from a Zipf distribution over
frequency ranks, p(rank r) ~ r^-s (`--zipf`, default 1.1: about 11% of tokens fall outside
the top 20k, as in WikiText-103-like text); the table reports the fraction of targets in each
tail cluster, expected and drawn. All methods see the same targets; the adaptive variants
share parameters, and the bench checks that the capacity losses equal the dense adaptive loss.

Prints one table and JSON with all figures, the device and the command (also to --output).
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench_output import command_line  # noqa: E402

from xformer.adaptive import AdaptiveLogSoftmax, ClusterLayout  # noqa: E402

WT103_VOCAB = 267_735
WT103_CUTOFFS = (20_000, 40_000, 200_000)
SETTINGS = ((410, 410, 1), (410, 410, 4), (1024, 1024, 4))  # d_model, d_embed, div_val


def zipf_targets(vocab: int, n: int, s: float, rng: np.random.Generator):
    """n ranks drawn with p(r) ~ (r + 1)^-s, r in [0, vocab); and the probabilities [vocab]."""
    p = np.arange(1, vocab + 1, dtype=np.float64) ** -s
    p /= p.sum()
    return rng.choice(vocab, size=n, p=p).astype(np.int32), p


def full_softmax_loss(params: dict, hidden: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean NLL of a plain softmax: hidden [N, d], params W [V, d], b [V], targets [N]."""
    logp = jax.nn.log_softmax(hidden @ params["w"].T + params["b"])
    return -jnp.take_along_axis(logp, targets[:, None], axis=-1).mean()


def compile_step(step, args) -> tuple:
    """(compiled step, memory figures in bytes) of a jitted step for these arguments."""
    compiled = step.lower(*args).compile()
    mem = compiled.memory_analysis()
    return compiled, {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
    }


def time_interleaved(variants: list, repeats: int) -> None:
    """Warm up every (row, compiled, args) variant, then time them in turn, `repeats` rounds
    (so that background load hits them alike); fills row["loss"], ["seconds"] (median),
    ["seconds_min"] and ["seconds_all"]."""
    for row, compiled, args in variants:
        row["loss"] = float(jax.block_until_ready(compiled(*args))[0])
        row["seconds_all"] = []
    for _ in range(repeats):
        for row, compiled, args in variants:
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            row["seconds_all"].append(time.perf_counter() - start)
    for row, _, _ in variants:
        row["seconds"] = statistics.median(row["seconds_all"])
        row["seconds_min"] = min(row["seconds_all"])


def run(args) -> dict:
    vocab, cutoffs = args.vocab, args.cutoffs
    n = args.positions
    rng = np.random.default_rng(args.seed)
    targets_np, p = zipf_targets(vocab, n, args.zipf, rng)
    targets = jnp.asarray(targets_np)
    edges = (0, *cutoffs, vocab)
    fractions = [
        {
            "cluster": i,
            "tokens": f"[{s}, {e})",
            "expected": float(p[s:e].sum()),
            "drawn": float(((targets_np >= s) & (targets_np < e)).mean()),
        }
        for i, (s, e) in enumerate(zip(edges[:-1], edges[1:], strict=True))
    ]
    rows = []
    full_done = set()
    for d_model, d_embed, div_val in args.settings:
        variants = []
        hidden = jnp.asarray(rng.standard_normal((n, d_model)), jnp.float32)
        if d_model not in full_done and not args.no_full:
            params = {
                "w": jnp.asarray(rng.normal(0, 0.02, (vocab, d_model)), jnp.float32),
                "b": jnp.zeros(vocab, jnp.float32),
            }
            step = jax.jit(jax.value_and_grad(full_softmax_loss, argnums=(0, 1)))
            compiled, mem = compile_step(step, (params, hidden, targets))
            row = dict(d_model=d_model, d_embed=d_model, div_val="-", method="full",
                       capacity=None, **mem)  # fmt: skip
            variants.append((row, compiled, (params, hidden, targets)))
            full_done.add(d_model)
        layout = ClusterLayout.make(vocab, d_embed, d_model, cutoffs, div_val)
        state = None
        for cap in (0.0, *args.capacities):
            module = AdaptiveLogSoftmax(layout, rngs=nnx.Rngs(args.seed), capacity=cap)
            graphdef, new_state = nnx.split(module, nnx.Param)
            state = new_state if state is None else state  # every variant, the same parameters

            def loss_fn(state, hidden, targets, graphdef=graphdef):
                return nnx.merge(graphdef, state).nll(hidden, targets).mean()

            step = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))
            compiled, mem = compile_step(step, (state, hidden, targets))
            rows_per_tail = min(n, max(1, math.ceil(round(cap * n, 6)))) if cap else n
            overflow = [f["drawn"] * n > rows_per_tail for f in fractions[1:]]
            row = dict(d_model=d_model, d_embed=d_embed, div_val=div_val,
                       method="capacity" if cap else "adaptive", capacity=cap or None,
                       rows_per_tail=rows_per_tail, dense_fallback=overflow, **mem)  # fmt: skip
            variants.append((row, compiled, (state, hidden, targets)))
        time_interleaved(variants, args.repeats)
        dense_loss = next(r["loss"] for r, _, _ in variants if r["method"] == "adaptive")
        for row, _, _ in variants:
            if row["capacity"] and not math.isclose(row["loss"], dense_loss, rel_tol=1e-5):
                raise AssertionError(f"capacity {row['capacity']}: loss {row['loss']} != dense")
            rows.append(row)
            print(_row(row), flush=True)
        del variants, state
    return {"fractions": fractions, "rows": rows}


def _mib(b: int) -> str:
    return f"{b / 2**20:.0f}"


HEADER = (
    "| d_model | d_embed | div_val | method | rows per tail cluster | fwd+bwd ms (median) | "
    "(min) | argument MiB | temp MiB | loss |"
)


def _row(r: dict) -> str:
    method = r["method"]
    if r["capacity"]:
        method = f"capacity {r['capacity']:g}"
        fallback = [i + 1 for i, o in enumerate(r["dense_fallback"]) if o]
        if fallback:
            method += " (dense: cluster " + ", ".join(map(str, fallback)) + ")"
    per_tail = "-" if r["method"] == "full" else str(r["rows_per_tail"])
    ms = f"{1e3 * r['seconds']:.0f} | {1e3 * r['seconds_min']:.0f}"
    return (
        f"| {r['d_model']} | {r['d_embed']} | {r['div_val']} | {method} | {per_tail} | {ms} | "
        f"{_mib(r['argument_bytes'])} | {_mib(r['temp_bytes'])} | {r['loss']:.4f} |"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--positions", type=int, default=2048, help="N = batch * length")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--capacities", type=float, nargs="*", default=[0.05, 0.1, 0.25])
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the targets")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_full", action="store_true", help="skip the full softmax")
    parser.add_argument(
        "--settings", nargs="*", default=[], help="d_model,d_embed,div_val triples (default: "
        + " ".join(",".join(map(str, s)) for s in SETTINGS) + ")",
    )  # fmt: skip
    parser.add_argument("--output", default="", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.vocab, args.cutoffs = 2000, (200, 400, 1500)
        args.settings = ((32, 32, 1), (32, 64, 4))
        args.positions, args.repeats = min(args.positions, 256), min(args.repeats, 2)
    else:
        args.vocab, args.cutoffs = WT103_VOCAB, WT103_CUTOFFS
        args.settings = [tuple(map(int, s.split(","))) for s in args.settings] or SETTINGS
    command = command_line()
    print(f"# {command}")
    print(
        f"# device: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{os.cpu_count()} CPUs, jax {jax.__version__}; V={args.vocab}, cutoffs={args.cutoffs}, "
        f"N={args.positions} positions, Zipf s={args.zipf}, median of {args.repeats}"
    )
    print(HEADER)
    print("|" + "---|" * 10)
    result = run(args)
    print("\nFraction of targets per cluster (Zipf; expected | drawn):")
    for f in result["fractions"]:
        print(f"  cluster {f['cluster']} {f['tokens']}: {f['expected']:.4f} | {f['drawn']:.4f}")
    result.update(
        command=command,
        device=str(jax.devices()[0]),
        backend=jax.default_backend(),
        cpus=os.cpu_count(),
        machine=platform.machine(),
        jax=jax.__version__,
        vocab=args.vocab,
        cutoffs=list(args.cutoffs),
        positions=args.positions,
        zipf=args.zipf,
        repeats=args.repeats,
    )
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
