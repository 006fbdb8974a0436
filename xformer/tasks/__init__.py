"""Model families as tasks: what data, model, loss and evaluation the generic train loop runs.

A task exposes `exp` (the shared Experiment), `train_batches()` (a host-local batch iterator
with get_state/set_state), `init_carry()` (state carried from step to step, e.g. an XL memory:
a flat dict of arrays whose batch-row axes `carry_batch_axes` names, {name: axis}),
`loss_terms(model, batch, carry) -> (loss_sum, sums, carry)` where sums holds "nll_sum",
"tokens" (scored) and "input_tokens", `prepare_evaluation()` (read the validation split before
training) and `evaluate(params, rng_state) -> (metrics, summary line)`.
"""

import jax
import ml_collections

from xformer import config as config_lib


def make_task(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    train_if_missing: bool = True,
    training: bool = True,
    evaluating: bool = True,
):
    """Validate the config (and its batch sizes against the devices: the training batches
    unless `training` is False, as for eval.py, sample.py and average.py; the evaluation
    batches unless `evaluating` is False, as for sample.py and average.py), then build the
    task of its model family."""
    config_lib.validate(config)
    config_lib.check_devices(
        config,
        jax.device_count(),
        jax.process_count(),
        training=training,
        evaluating=evaluating,
    )
    if config.model.family == "decoder_only":
        from xformer.tasks.language_modeling import LanguageModelingTask

        return LanguageModelingTask(config, workdir, train_if_missing=train_if_missing)
    from xformer.tasks.translation import TranslationTask

    return TranslationTask(config, workdir, train_if_missing=train_if_missing)
