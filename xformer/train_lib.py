"""The training loop: jit-compiled data-parallel steps, metrics, evaluation, checkpoints."""

import functools
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from xformer import experiment as experiment_lib
from xformer.bleu import bleu_report
from xformer.data.pipeline import (
    EncodedPairs,
    bucket_length,
    packed_train_dataset,
    pad_rows,
    sorted_batches,
)
from xformer.data.tokenizer import BOS_ID
from xformer.data.translation import split_text
from xformer.experiment import Experiment
from xformer.losses import cross_entropy
from xformer.metric_writer import MetricWriter
from xformer.optim import learning_rate_schedule
from xformer.translate import Translator

MODEL_INPUTS = ("src", "tgt_in", "src_segments", "tgt_segments", "src_positions", "tgt_positions")


def _loss_terms(model, batch, label_smoothing):
    logits = model(*(batch[k] for k in MODEL_INPUTS))
    weights = (batch["tgt_segments"] > 0).astype(jnp.float32)
    loss_sum, nll_sum = cross_entropy(logits, batch["tgt_out"], weights, label_smoothing)
    return loss_sum, nll_sum, weights.sum()


def train_step(exp: Experiment, state: dict, rest: nnx.State, batch: dict) -> tuple[dict, dict]:
    """One optimizer step on a packed batch. Dropout keys derive from (seed, step)."""
    t = exp.config.train
    key = jax.random.fold_in(jax.random.key(t.seed), state["step"])

    model = nnx.merge(exp.train_graphdef, state["params"], rest)
    nnx.reseed(model, dropout=key)

    def loss_fn(model):
        loss_sum, nll_sum, ntok = _loss_terms(model, batch, t.label_smoothing)
        return loss_sum / jnp.maximum(ntok, 1.0), (loss_sum, nll_sum, ntok)

    # nnx.grad differentiates with respect to the nnx.Param variables only.
    grads, (loss_sum, nll_sum, ntok) = nnx.grad(loss_fn, has_aux=True)(model)
    updates, opt_state = exp.tx.update(grads, state["opt_state"], state["params"])
    new_state = {
        "step": state["step"] + 1,
        "params": optax.apply_updates(state["params"], updates),
        "opt_state": opt_state,
    }
    metrics = {
        "loss_sum": loss_sum,
        "nll_sum": nll_sum,
        "tokens": ntok,
        "src_tokens": (batch["src_segments"] > 0).sum().astype(jnp.float32),
        "grad_norm": optax.tree_utils.tree_norm(grads),
    }
    return new_state, metrics


def eval_step(exp: Experiment, params: nnx.State, rest: nnx.State, batch: dict) -> dict:
    model = nnx.merge(exp.eval_graphdef, params, rest)
    _, nll_sum, ntok = _loss_terms(model, batch, 0.0)
    return {"nll_sum": nll_sum, "tokens": ntok}


def padded_batches(pairs: EncodedPairs, batch_size: int) -> list[dict[str, np.ndarray]]:
    """Every pair exactly once, in fixed-size batches of similar length (no length filter)."""
    batches = []
    for idx in sorted_batches(
        [max(len(s), len(t)) for s, t in zip(pairs.src, pairs.tgt, strict=True)], batch_size
    ):
        length = bucket_length(max(max(len(pairs.src[i]), len(pairs.tgt[i])) for i in idx))
        tgt_out = pad_rows([pairs.tgt[i] for i in idx], length, batch_size)
        tgt_in = np.concatenate([np.full((batch_size, 1), BOS_ID, np.int32), tgt_out[:, :-1]], 1)
        segments = (tgt_out > 0).astype(np.int32)
        positions = np.broadcast_to(np.arange(length, dtype=np.int32), tgt_out.shape)
        src = pad_rows([pairs.src[i] for i in idx], length, batch_size)
        batches.append(
            {
                "src": src,
                "src_segments": (src > 0).astype(np.int32),
                "src_positions": positions,
                "tgt_in": tgt_in,
                "tgt_out": tgt_out,
                "tgt_segments": segments,
                "tgt_positions": positions,
            }
        )
    return batches


def _format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


class Evaluator:
    """Validation NLL/perplexity over every pair of a split, and BLEU of its translations."""

    def __init__(self, exp: Experiment, split: str):
        c = exp.config
        self.exp, self.split = exp, split
        self.src_lines, self.ref_lines = split_text(c, split)
        pairs = EncodedPairs.from_text(self.src_lines, self.ref_lines, exp.src_tok, exp.tgt_tok)
        self.batches = padded_batches(pairs, c.eval.batch_size)
        self._eval_step = jax.jit(functools.partial(eval_step, exp))
        self.translator = Translator(
            exp.eval_graphdef,
            exp.model_cfg,
            exp.src_tok,
            exp.tgt_tok,
            beam_size=c.eval.beam_size,
            length_penalty=c.eval.length_penalty,
            max_decode_extra=c.eval.max_decode_extra,
            batch_size=c.eval.batch_size,
            mesh=exp.mesh,
        )

    def loss(self, params, rest) -> dict:
        totals = None
        for batch in self.batches:
            out = self._eval_step(params, rest, jax.device_put(batch, self.exp.batch_sharding))
            totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
        nll = float(totals["nll_sum"] / totals["tokens"])
        return {"nll": nll, "perplexity": float(np.exp(nll))}

    def bleu(self, params, rest, num_sentences: int = 0) -> tuple[dict, list[str]]:
        n = num_sentences or len(self.src_lines)
        hyps = self.translator.translate(params, rest, self.src_lines[:n])
        report = bleu_report(hyps, self.ref_lines[:n], self.exp.config.data.target_lang)
        return report.as_dict(), hyps


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Train (resuming from the workdir's last checkpoint) and return final validation metrics."""
    exp = experiment_lib.setup(config, workdir)
    experiment_lib.save_config(config, workdir)
    t = config.train
    writer = MetricWriter(workdir, enabled=jax.process_index() == 0)

    src, tgt = split_text(config, config.data.train_split)
    pairs = EncodedPairs.from_text(src, tgt, exp.src_tok, exp.tgt_tok)
    local_batch = t.batch_size // jax.process_count()
    dataset = packed_train_dataset(
        pairs,
        batch_size=local_batch,
        max_length=config.data.max_train_length,
        seed=t.seed,
        num_packing_bins=config.data.num_packing_bins,
    )
    data_iter = iter(dataset)

    state = exp.init_state()
    if exp.checkpointer.latest_step() is not None:
        state, data_state = exp.checkpointer.restore(state)
        data_iter.set_state(data_state)
        logging.info("resumed from step %d", int(state["step"]))
    step = int(state["step"])
    evaluator = Evaluator(exp, config.data.eval_split)
    rest = jax.device_put(exp.rest, exp.replicated)

    def global_batch(batch):
        return jax.make_array_from_process_local_data(exp.batch_sharding, batch)

    jit_step = jax.jit(functools.partial(train_step, exp), donate_argnums=0)
    first = global_batch(next(data_iter))
    compiled = jit_step.lower(state, rest, first).compile()
    flops = (compiled.cost_analysis() or {}).get("flops", 0.0)
    logging.info("train step: %.2f GFLOP per step (XLA cost analysis)", flops / 1e9)
    lr_fn = learning_rate_schedule(t)

    start_time, start_step = time.time(), step
    interval_start, pending = time.time(), []
    batch, last_metrics = first, {}
    while step < t.num_steps:
        state, metrics = compiled(state, rest, batch)
        pending.append(metrics)
        step += 1
        elapsed = time.time() - start_time
        out_of_time = t.max_train_seconds and elapsed >= t.max_train_seconds
        done = step >= t.num_steps or out_of_time
        checkpoint_due = step % t.checkpoint_every == 0 or done
        if checkpoint_due:  # the position after the batches consumed by steps 1..step
            data_state = data_iter.get_state()
        if not done:
            batch = global_batch(next(data_iter))  # host work overlaps the async device step

        if step % t.log_every == 0 or done:
            sums = jax.tree.map(lambda *xs: float(np.sum(xs)), *pending)
            dt = time.time() - interval_start
            steps_per_s = len(pending) / dt
            rate = (step - start_step) / elapsed
            remaining = (t.num_steps - step) / rate
            if t.max_train_seconds:
                remaining = min(remaining, t.max_train_seconds - elapsed)
            last_metrics = {
                "loss": sums["loss_sum"] / sums["tokens"],
                "nll": sums["nll_sum"] / sums["tokens"],
                "perplexity": float(np.exp(sums["nll_sum"] / sums["tokens"])),
                "grad_norm": sums["grad_norm"] / len(pending),
                "learning_rate": float(lr_fn(step)),
                "steps_per_s": steps_per_s,
                "tokens_per_s": (sums["tokens"] + sums["src_tokens"]) / dt,
                "target_tokens_per_s": sums["tokens"] / dt,
                "gflop_per_s": flops * steps_per_s / 1e9,
            }
            writer.write(step, last_metrics, prefix="train/")
            logging.info(
                "step %d/%d | loss %.3f | ppl %.1f | lr %.2e | %.2f steps/s | %.0f tok/s | "
                "%.1f GFLOP/s | ETA %s",
                step,
                t.num_steps,
                last_metrics["loss"],
                last_metrics["perplexity"],
                last_metrics["learning_rate"],
                steps_per_s,
                last_metrics["tokens_per_s"],
                last_metrics["gflop_per_s"],
                _format_eta(remaining),
            )
            interval_start, pending = time.time(), []

        if checkpoint_due:
            exp.checkpointer.save(step, state, data_state)
        if step % t.eval_every == 0 or done:
            eval_start = time.time()
            val = evaluator.loss(state["params"], rest)
            bleu, hyps = evaluator.bleu(state["params"], rest, config.eval.bleu_sentences)
            val.update(bleu=bleu["sacrebleu"], lc_tok_bleu=bleu["lc_tok_bleu"])
            writer.write(step, val, prefix=f"{config.data.eval_split}/")
            writer.write_text(step, "samples", "\n\n".join(hyps[:5]))
            logging.info(
                "eval %s at step %d: nll %.3f | ppl %.2f | BLEU %.2f | lc-tok BLEU %.2f (%.0fs)",
                config.data.eval_split,
                step,
                val["nll"],
                val["perplexity"],
                val["bleu"],
                val["lc_tok_bleu"],
                time.time() - eval_start,
            )
            last_metrics = {**last_metrics, **{f"val_{k}": v for k, v in val.items()}}
            interval_start += time.time() - eval_start  # keep eval time out of steps/s
        if done:
            break
    exp.checkpointer.wait()
    writer.close()
    return {"step": step, **last_metrics}
