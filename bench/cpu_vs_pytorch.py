"""Benchmark 1 of issue 12: xformer's train step against PyTorch nn.Transformer on CPU.

    pip install -e ".[bench]"
    python bench/cpu_vs_pytorch.py                 # 5 interleaved rounds, the table, JSON
    python bench/cpu_vs_pytorch.py --profile       # also: xformer's top ops by time
    python bench/cpu_vs_pytorch.py --torch_fused_adam   # also PyTorch with Adam(fused=True)
    python bench/cpu_vs_pytorch.py --torch_compile      # also torch.compile + fused Adam

Both sides train the same model on the same batch: post-LN encoder-decoder, d_model 256, 4
heads, 3 + 3 layers, d_ff 1024, vocabulary 8,000 with separate source and target embeddings
and an untied output projection without bias, sinusoidal positions added to the embeddings
scaled by sqrt(d_model), dropout 0.1 on embeddings, residual branches, attention weights and
after the FFN's ReLU, label smoothing 0.1, Adam (b2 0.98, eps 1e-9), 64 rows of 32 source + 32
target tokens (no padding; the decoder is causal).

- xformer: the train step train.py runs (`train_lib.train_step`, jitted with the train state
  donated), built from a validated config like training (`experiment.setup`, the translation
  task's `loss_terms`), fed the batch layout of packed training rows (one pair per row).
- PyTorch: `nn.Transformer(batch_first=True)` without its final encoder/decoder LayerNorms
  (post-LN stacks need none; xformer has none), `nn.Embedding` x2, `nn.Linear(bias=False)`,
  `CrossEntropyLoss(label_smoothing=0.1)`, `torch.optim.Adam` (its default implementation;
  `--torch_fused_adam` adds Adam(fused=True) as a fourth side), eager mode (`--torch_compile`
  adds a side with `torch.compile` (inductor's C++ kernels; a C++ compiler is needed) over the
  model and its loss, with Adam(fused=True)),
  `torch.set_num_threads(--threads)` (default: the cores this process may use) and OpenMP's
  wait policy as the environment sets it (OpenMP's default, as a PyTorch user gets it, unless
  OMP_WAIT_POLICY is set). On a machine shared with other processes, set
  OMP_WAIT_POLICY=PASSIVE: OpenMP's default spin-waiting workers lose whole time slices there
  (measured: 11.8 s against 4.3 s per PyTorch step at load average 3.7 on 2 cores). Until
  2026-11-29 the benchmark set PASSIVE itself, which slows PyTorch's step on a quiet machine
  (README); ACTIVE makes torch's idle workers spin through xformer's rounds.

After one warm-up (compilation) and `--warmup` steps of each, the heap is grown by
`--heap_reserve_gib` GiB of touched memory, freed again, and `--warmup_rounds` untimed rounds
run. Then every round times `--steps` steps of xformer, then `--steps` of PyTorch, each after
one untimed step (the first step after the other side's, whose memory use differs, was up to 2x
slower: training runs steps back to back). The reserve is there because the three programs
share one heap: XLA:CPU mallocs the xformer step's 410 MB of temporaries as one block, which
after the other programs' allocations sometimes fits no free hole, so the heap grows and the
new pages fault in during a timed step (huge pages: 190-280 faults took 0.6-0.9 s of system
time, a 580 ms step 1.0-1.2 s, likely the kernel compacting memory for them; in two 9-round
runs without the reserve, 2 timed rounds of each had 34-271 faults). A training run likely
meets this a few times near its start (not measured apart). The minor page faults taken during
each timed run are in the JSON;
tokens/s counts source + target tokens (4,096 a step), the median over rounds is reported with
the ratio of the medians and the median of per-round ratios.
GFLOP/s uses two FLOP counts: XLA's cost analysis of the compiled xformer step, and one analytic
count for both (`analytic_train_flops`: 2 FLOPs per multiply-add of every matmul of the forward
pass - projections, FFN, attention scores and weighted values, output layer - times 3 for
forward + backward; embeddings, softmax, LayerNorm, dropout, loss and Adam are not counted).
The ceiling is `bench/matmul_ceiling.py`'s f32 2048^3 matmul (median of 3), measured at the end
of every round; the table divides by the median over rounds. Each round also times "matmuls
only": the step's 156 matmuls (`step_matmuls`) alone in one program, a bound on what removing
all other work could give. Like train.py, the benchmark re-executes itself with glibc's malloc
on huge pages and keeping freed memory (xformer/malloc_tuning.py; both sides share the
process); XFORMER_MALLOC_TUNING=0 measures without.

`--profile` traces `--profile_steps` xformer steps with `jax.profiler` and ranks the XLA ops
(thunks: fusions, YNNPACK matmul fusions, Eigen dots, copies) of the trace by their time, summed
by category, through xformer/op_profile.py (which also summarises a train.profile_steps trace);
each op's kind (matmul, transpose, reduce, elementwise) and innermost xformer source line come
from the optimized HLO's metadata. Shares are of the summed op time.
Caveat: Eigen `dot.N` thunks finish asynchronously, so the trace under-counts them and their
time shows up in the ops that run beside them (usually the next matmul); matmul totals are
roughly right (ops sum to about the wall time), single matmul ops are not. `--rounds 0
--no_torch --profile` profiles only.
"""

import argparse
import json
import math
import os
import platform
import re
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from xformer.malloc_tuning import reexec_with_malloc_tuning  # noqa: E402

if __name__ == "__main__":  # before jax starts, as train.py does (xformer/malloc_tuning.py)
    reexec_with_malloc_tuning()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from matmul_ceiling import matmul_gflops  # noqa: E402

from xformer import config as config_lib  # noqa: E402
from xformer import experiment as experiment_lib  # noqa: E402
from xformer import model_config, op_profile, train_lib  # noqa: E402
from xformer.models import EncoderDecoder  # noqa: E402
from xformer.tasks.translation import TranslationTask  # noqa: E402

SHAPE = dict(
    d_model=256, num_heads=4, layers=3, d_ff=1024, vocab=8000, rows=64, src_len=32, tgt_len=32
)
DROPOUT, LABEL_SMOOTHING, LR = 0.1, 0.1, 1e-4
VOCAB_DIM = re.compile(rf"[\[,]{SHAPE['vocab']}[\],]")  # a vocabulary-sized HLO dimension


def analytic_train_flops(
    d_model, num_heads, layers, d_ff, vocab, rows, src_len, tgt_len, **_
) -> float:
    """Matmul FLOPs of one train step: 2 per multiply-add of the forward pass, times 3."""
    ns, nt, d = rows * src_len, rows * tgt_len, d_model
    proj = 4 * d * d  # q, k, v, out
    ffn = 2 * d * d_ff
    enc = ns * (proj + ffn) + 2 * rows * src_len * src_len * d  # scores + weighted values
    dec_self = nt * proj + 2 * rows * tgt_len * tgt_len * d
    dec_cross = nt * 2 * d * d + ns * 2 * d * d + 2 * rows * tgt_len * src_len * d
    dec = dec_self + dec_cross + nt * ffn
    macs = layers * (enc + dec) + nt * d * vocab
    return 3 * 2 * float(macs)


def step_matmuls(
    d_model, num_heads, layers, d_ff, vocab, rows, src_len, tgt_len, **_
) -> list[tuple[str, tuple, tuple]]:
    """The matmuls of one train step as (dot_general contraction, lhs shape, rhs shape): each
    forward dense x[M, K] W[K, N] with its backward g W^T and x^T g, and each attention product
    over [rows * heads] batches with its two backward products; the analytic FLOP count's."""
    ns, nt, d = rows * src_len, rows * tgt_len, d_model
    bh, hd = rows * num_heads, d_model // num_heads
    dense = [(ns, d, 3 * d), (ns, d, d), (ns, d, d_ff), (ns, d_ff, d)] * layers  # encoder
    dense += [(nt, d, 3 * d), (nt, d, d), (nt, d, d), (ns, d, 2 * d), (nt, d, d)] * layers
    dense += [(nt, d, d_ff), (nt, d_ff, d)] * layers + [(nt, d, vocab)]
    attention = [(src_len, src_len)] * layers + [(tgt_len, tgt_len), (tgt_len, src_len)] * layers
    out = []
    for m, k, n in dense:  # x W; dx = g W^T; dW = x^T g
        out += [("nn", (m, k), (k, n)), ("nt", (m, n), (k, n)), ("tn", (m, k), (m, n))]
    for lq, lk in attention:  # scores q k^T, values p v, and their gradients
        q, kv, p = (bh, lq, hd), (bh, lk, hd), (bh, lq, lk)
        out += [("bnt", q, kv), ("bnn", p, kv), ("btn", p, q)]  # s = q k^T; dq = ds k; dk = ds^T q
        out += [("bnn", p, kv), ("bnt", q, kv), ("btn", p, q)]  # o = p v; dp = do v^T; dv = p^T do
    return out


class MatmulsOnly:
    """The step's matmuls alone (`step_matmuls`, f32, random inputs of their own) in one jitted
    program: how fast the step could be if everything but its matmuls were free."""

    DIMS = {  # contraction -> dot_general dimension numbers
        "nn": (((1,), (0,)), ((), ())),
        "nt": (((1,), (1,)), ((), ())),
        "tn": (((0,), (0,)), ((), ())),
        "bnn": (((2,), (1,)), ((0,), (0,))),
        "bnt": (((2,), (2,)), ((0,), (0,))),
        "btn": (((1,), (1,)), ((0,), (0,))),
    }

    def __init__(self):
        matmuls = step_matmuls(**SHAPE)
        keys = jax.random.split(jax.random.key(0), 2 * len(matmuls))
        self.operands, self.dims = [], []
        for i, (kind, lhs, rhs) in enumerate(matmuls):
            self.operands.append(
                (jax.random.normal(keys[2 * i], lhs), jax.random.normal(keys[2 * i + 1], rhs))
            )
            self.dims.append(self.DIMS[kind])
        dims = self.dims
        self.program = jax.jit(
            lambda ops: [jax.lax.dot_general(a, b, d) for (a, b), d in zip(ops, dims, strict=True)]
        )
        flops = self.program.lower(self.operands).compile().cost_analysis()["flops"]
        if not math.isclose(flops, analytic_train_flops(**SHAPE), rel_tol=1e-6):
            raise AssertionError(f"step_matmuls: {flops} FLOPs, not the analytic count's")
        self.outputs = None

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            self.outputs = self.program(self.operands)
        jax.block_until_ready(self.outputs)
        return time.perf_counter() - start


def make_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Random ids in [4, vocab), one pair per row, no padding: the packed-row layout."""
    s = SHAPE
    rng = np.random.default_rng(seed)
    b, ls, lt = s["rows"], s["src_len"], s["tgt_len"]
    tgt = rng.integers(4, s["vocab"], (b, lt + 1)).astype(np.int32)
    return {
        "src": rng.integers(4, s["vocab"], (b, ls)).astype(np.int32),
        "tgt_in": tgt[:, :-1],
        "tgt_out": tgt[:, 1:],
        "src_segments": np.ones((b, ls), np.int32),
        "tgt_segments": np.ones((b, lt), np.int32),
        "src_positions": np.broadcast_to(np.arange(ls, dtype=np.int32), (b, ls)).copy(),
        "tgt_positions": np.broadcast_to(np.arange(lt, dtype=np.int32), (b, lt)).copy(),
    }


def xformer_config():
    """The benchmark model as a train.py config (validated as training validates it)."""
    s = SHAPE
    c = config_lib.base_config()
    m = c.model
    m.d_model, m.num_heads, m.d_ff = s["d_model"], s["num_heads"], s["d_ff"]
    m.num_encoder_layers = m.num_decoder_layers = s["layers"]
    m.dropout = m.attention_dropout = m.relu_dropout = DROPOUT
    m.positional, m.layer_norm = "sinusoidal", "post"
    m.tie_output, m.share_embeddings = False, False
    c.data.vocab, c.data.vocab_size = "separate", s["vocab"]
    c.data.max_train_length = max(s["src_len"], s["tgt_len"])
    c.train.batch_size, c.train.label_smoothing = s["rows"], LABEL_SMOOTHING
    c.train.learning_rate, c.train.schedule, c.train.warmup_steps = LR, "constant", 1
    config_lib.validate(c)
    return c


class XformerStep:
    """train.py's compiled step on a fixed batch, built as TranslationTask builds it."""

    def __init__(self, workdir: str):
        config = xformer_config()
        model_cfg = model_config.from_config(
            config.model, src_vocab_size=SHAPE["vocab"], tgt_vocab_size=SHAPE["vocab"]
        )
        task = object.__new__(TranslationTask)  # the task without its tokenizers and data
        task.config = config
        task.exp = experiment_lib.setup(config, workdir, EncoderDecoder, model_cfg)
        exp = task.exp
        self.state = exp.init_state(task.init_carry())
        self.rng_state = jax.device_put(exp.rng_state, exp.replicated)
        self.batch = jax.device_put(make_batch(), exp.batch_sharding)
        lowered = train_lib.lower_train_step(task, self.state, self.rng_state, self.batch, "cpu")
        self.compiled = train_lib.compile_step(lowered, "cpu")  # as train.py compiles it
        self.flops = float((self.compiled.cost_analysis() or {}).get("flops", 0.0))
        self.metrics = None

    def run(self, steps: int) -> float:
        """Seconds for `steps` steps, up to the last step's results on the host."""
        start = time.perf_counter()
        for _ in range(steps):
            self.state, self.metrics = self.compiled(self.state, self.rng_state, self.batch)
        loss = float(self.metrics["loss_sum"] / self.metrics["tokens"])
        elapsed = time.perf_counter() - start
        if not math.isfinite(loss):
            raise FloatingPointError(f"xformer loss is {loss}")
        return elapsed


class TorchStep:
    """The same model and step in PyTorch (imported only here: it is an optional extra)."""

    def __init__(self, threads: int, fused_adam: bool = False, compiled: bool = False):
        import torch
        from torch import nn

        torch.set_num_threads(threads)
        torch.manual_seed(0)
        s = SHAPE
        d, v = s["d_model"], s["vocab"]

        class Seq2Seq(nn.Module):
            def __init__(self):
                super().__init__()
                self.src_embed, self.tgt_embed = nn.Embedding(v, d), nn.Embedding(v, d)
                length = max(s["src_len"], s["tgt_len"])
                angles = torch.arange(length)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
                pe = torch.stack([angles.sin(), angles.cos()], -1).reshape(length, d)
                self.register_buffer("pe", pe)  # even dims sin, odd cos: as xformer
                self.dropout = nn.Dropout(DROPOUT)
                self.transformer = nn.Transformer(
                    d,
                    s["num_heads"],
                    s["layers"],
                    s["layers"],
                    s["d_ff"],
                    DROPOUT,
                    batch_first=True,
                )
                self.transformer.encoder.norm = self.transformer.decoder.norm = None
                self.output = nn.Linear(d, v, bias=False)

            def embed(self, table, tokens):
                return self.dropout(table(tokens) * math.sqrt(d) + self.pe[: tokens.shape[1]])

            def forward(self, src, tgt_in):
                causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
                x = self.transformer(
                    self.embed(self.src_embed, src),
                    self.embed(self.tgt_embed, tgt_in),
                    tgt_mask=causal,
                    tgt_is_causal=True,
                )
                return self.output(x)

        self.torch = torch
        self.model = Seq2Seq().train()
        self.opt = torch.optim.Adam(  # default: one parameter after another on CPU
            self.model.parameters(), LR, betas=(0.9, 0.98), eps=1e-9, fused=fused_adam or None
        )
        self.criterion = nn.CrossEntropyLoss(label_smoothing=LABEL_SMOOTHING)
        self.loss = torch.compile(self._loss) if compiled else self._loss  # inductor: C++ kernels
        batch = make_batch()
        self.src, self.tgt_in, self.tgt_out = (
            torch.from_numpy(batch[k]).long() for k in ("src", "tgt_in", "tgt_out")
        )
        self.version = torch.__version__

    def _loss(self, src, tgt_in, tgt_out):
        logits = self.model(src, tgt_in)
        return self.criterion(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))

    def step(self):
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(self.src, self.tgt_in, self.tgt_out)
        loss.backward()
        self.opt.step()
        return loss

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            loss = self.step()
        value = loss.item()
        elapsed = time.perf_counter() - start
        if not math.isfinite(value):
            raise FloatingPointError(f"PyTorch loss is {value}")
        return elapsed


COMPILED = "pytorch compiled, fused Adam"  # the --torch_compile side
OTHER_TORCH_SIDES = {  # side -> (its ratio's JSON key, its label in the printed ratio)
    "pytorch fused Adam": ("ratio_of_medians_fused_adam", "with fused Adam"),
    COMPILED: ("ratio_of_medians_compiled", "compiled with fused Adam"),
}

CATEGORIES = (  # first match wins; the names of the README's profile table
    ("matmul: output layer [*, V]", lambda op: op.kind == "matmul" and VOCAB_DIM.search(op.shapes)),
    (
        "matmul: attention (scores, values)",
        lambda op: op.kind == "matmul" and "dot_product" in op.source,
    ),
    ("matmul: projections, FFN", lambda op: op.kind == "matmul"),
    ("layout transposes / copies", lambda op: op.kind == "transpose"),
    ("loss: log-softmax over V", lambda op: op.source.startswith("losses.py")),
    ("dropout masks", lambda op: op.source.startswith("dropout.py")),
    ("attention softmax, masks", lambda op: op.source.startswith(("attention.py", "masks.py"))),
    ("LayerNorm, residual", lambda op: "Residual" in op.source or "layer_norm" in op.source),
    ("optimizer (Adam)", lambda op: op.source.startswith("train_lib.py")),
    ("other", lambda op: True),
)


def profile_step(step: XformerStep, steps: int, top: int) -> dict:
    """Trace `steps` steps with jax.profiler and rank their XLA ops (xformer/op_profile.py)."""
    step.run(1)
    logdir = tempfile.mkdtemp(prefix="xformer_profile_")
    with jax.profiler.trace(logdir):
        start = time.perf_counter()
        step.run(steps)
        wall = (time.perf_counter() - start) / steps
    trace = op_profile.newest_trace(logdir)
    summary = op_profile.summarise(
        trace, step.compiled.as_text(), steps=steps, categories=CATEGORIES, top=top
    )
    return {"logdir": logdir, "wall_ms_per_step": 1e3 * wall, **summary}


def reserve_heap(gib: float) -> None:
    """Grow the heap by `gib` GiB of touched memory and free it. With the malloc settings of
    xformer/malloc_tuning.py freed memory stays mapped, so later blocks that fit no free hole
    take these pages instead of growing the heap and faulting new ones in mid-round."""
    if gib > 0:
        block = np.ones(int(gib * 2**30), np.uint8)  # np.ones touches every page
        del block


def interleaved_round(sides: dict, steps: int) -> dict[str, tuple[float, int]]:
    """Each side's seconds for `steps` steps, one side after the other, with the minor page
    faults the process took during them. An untimed step first: the first step after another
    program's is slower (its memory use differs; training runs steps back to back)."""
    result = {}
    for name, side in sides.items():
        side.run(1)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        seconds = side.run(steps)
        result[name] = (seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return result


def print_profile(profile: dict) -> None:
    print(f"\nxformer profile: {profile['wall_ms_per_step']:.0f} ms/step wall")
    print(op_profile.format_summary(profile))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps of each per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each")
    parser.add_argument(
        "--warmup_rounds", type=int, default=2, help="untimed interleaved rounds first"
    )
    parser.add_argument(
        "--heap_reserve_gib", type=float, default=2.0, help="heap grown before timing; 0: none"
    )
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--no_torch", action="store_true", help="xformer only")
    parser.add_argument(
        "--torch_fused_adam",
        action="store_true",
        help="also time PyTorch with Adam(fused=True) (its fused CPU kernel), as a fourth side",
    )
    parser.add_argument(
        "--torch_compile",
        action="store_true",
        help="also time PyTorch with torch.compile (inductor) over the model and loss, and "
        "Adam(fused=True), as another side (compiling takes minutes)",
    )
    parser.add_argument("--profile", action="store_true", help="rank xformer's XLA ops by time")
    parser.add_argument("--profile_steps", type=int, default=5)
    parser.add_argument("--profile_top", type=int, default=12)
    parser.add_argument("--output", default="", help="also write the JSON here")
    args = parser.parse_args()
    command = "python " + " ".join(sys.argv)
    tokens = SHAPE["rows"] * (SHAPE["src_len"] + SHAPE["tgt_len"])
    analytic = analytic_train_flops(**SHAPE)

    ceilings = []
    with tempfile.TemporaryDirectory() as workdir:
        xf, mm = XformerStep(workdir), MatmulsOnly()
        tf = None if args.no_torch else TorchStep(args.threads)
        fused = TorchStep(args.threads, fused_adam=True) if args.torch_fused_adam else None
        compiled = (
            TorchStep(args.threads, fused_adam=True, compiled=True) if args.torch_compile else None
        )
        sides = {
            "xformer": xf,
            "pytorch": tf,
            "pytorch fused Adam": fused,
            COMPILED: compiled,
            "matmuls only": mm,
        }
        sides = {name: side for name, side in sides.items() if side is not None}
        if tf is not None:  # the same model on both sides, or the comparison means nothing
            ours = sum(int(x.size) for x in jax.tree.leaves(xf.state["params"]))
            theirs = sum(p.numel() for p in tf.model.parameters())
            if ours != theirs:
                raise SystemExit(f"parameters: xformer {ours:,} against PyTorch {theirs:,}")
        for side in sides.values():
            side.run(args.warmup)
        reserve_heap(args.heap_reserve_gib)
        for r in range(args.warmup_rounds):
            grown = {k: f for k, (_, f) in interleaved_round(sides, args.steps).items() if f}
            matmul_gflops(repeats=1)
            print(f"untimed round {r + 1}: page faults {grown or 'none'}", flush=True)
        times = {name: [] for name in sides}
        faults = {name: [] for name in sides}
        for r in range(args.rounds):
            for name, (seconds, minor_faults) in interleaved_round(sides, args.steps).items():
                times[name].append(seconds / args.steps)
                faults[name].append(minor_faults)
            ceilings.append(matmul_gflops(repeats=3))
            line = " | ".join(f"{k} {tokens / v[-1]:,.0f} tok/s" for k, v in times.items())
            grown = ", ".join(f"{k} {v[-1]}" for k, v in faults.items() if v[-1])
            print(
                f"round {r + 1}/{args.rounds}: {line} | ceiling {ceilings[-1]:.1f}"
                + (f" | page faults: {grown}" if grown else ""),
                flush=True,
            )
        profile = profile_step(xf, args.profile_steps, args.profile_top) if args.profile else {}

    ceiling = statistics.median(ceilings or [matmul_gflops()])
    result = {
        "command": command,
        "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"({len(os.sched_getaffinity(0))} usable), jax {jax.__version__} {jax.devices()[0]}",
        "pytorch": None if tf is None else tf.version,
        "torch_threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),  # xformer/malloc_tuning.py
        "load_average_1_5_15min": os.getloadavg(),  # other processes sharing the cores
        "tokens_per_step": tokens,
        "xla_gflop_per_step": xf.flops / 1e9,
        "analytic_gflop_per_step": analytic / 1e9,
        "matmul_ceiling_gflops": ceilings,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "warmup_rounds": args.warmup_rounds,
        "heap_reserve_gib": args.heap_reserve_gib,
        "step_seconds": times,
        "minor_page_faults": faults,  # during each timed run: the heap still growing
        "sides": {},
    }
    for name, ts in times.items():
        if not ts:
            continue
        t = statistics.median(ts)
        result["sides"][name] = {
            "tokens_per_s": tokens / t,
            "step_ms": 1e3 * t,
            "analytic_gflops": analytic / t / 1e9,
            "xla_gflops": xf.flops / t / 1e9 if name == "xformer" else None,
            "ceiling_fraction": analytic / t / 1e9 / ceiling,
        }
    if times.get("pytorch"):
        result["ratio_of_medians"] = statistics.median(times["pytorch"]) / statistics.median(
            times["xformer"]
        )
        result["median_round_ratio"] = statistics.median(
            p / x for x, p in zip(times["xformer"], times["pytorch"], strict=True)
        )
    for side, (key, _) in OTHER_TORCH_SIDES.items():
        if times.get(side):
            result[key] = statistics.median(times[side]) / statistics.median(times["xformer"])
    result["profile"] = profile

    print(
        f"\n{command}\n{result['device']}; PyTorch {result['pytorch']}, {args.threads} threads, "
        f"OMP_WAIT_POLICY={result['omp_wait_policy'] or '(default)'}, "
        f"GLIBC_TUNABLES={result['glibc_tunables'] or '(unset)'}"
    )
    print("load average (1, 5, 15 min): " + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    print(
        f"{tokens} tokens/step; XLA cost analysis {xf.flops / 1e9:.1f} GFLOP/step, "
        f"analytic {analytic / 1e9:.1f} GFLOP/step; matmul ceiling "
        + " / ".join(f"{c:.0f}" for c in ceilings)
        + " GFLOP/s (one per round)"
    )
    print(
        "\n| | tokens/s | step ms | GFLOP/s (analytic) | GFLOP/s (XLA) | "
        f"analytic / ceiling {ceiling:.0f} |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in result["sides"].items():
        xla = f"{s['xla_gflops']:.1f}" if s["xla_gflops"] else "-"
        print(
            f"| {name} | {s['tokens_per_s']:,.0f} | {s['step_ms']:.0f} | "
            f"{s['analytic_gflops']:.1f} | {xla} | {s['ceiling_fraction']:.2f} |"
        )
    if times.get("pytorch"):
        print(
            f"\nxformer / PyTorch tokens/s: {result['ratio_of_medians']:.2f}x (medians), "
            f"{result['median_round_ratio']:.2f}x (median of per-round ratios)"
        )
    for key, label in OTHER_TORCH_SIDES.values():
        if key in result:
            print(f"xformer / PyTorch {label}: {result[key]:.2f}x (medians)")
    if profile:
        print_profile(profile)
    print("\n" + json.dumps(result))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
