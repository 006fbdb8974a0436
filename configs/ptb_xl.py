"""Transformer-XL on Penn Treebank (word level): 5,500 steps, about 60 minutes on the 2-core CPU
reference machine (README.md).

    python train.py --config=configs/ptb_xl.py --workdir=workdirs/ptb_xl
    python eval.py --workdir=workdirs/ptb_xl --split=test
    python eval.py --workdir=workdirs/ptb_xl --split=test --mem_len=140 --clamp_len=139

Segments of 70 tokens attend over a memory of 70 cached states per layer during training; the
evaluation memory can be longer than the training one. Variants (`--config=configs/ptb_xl.py:
vanilla`, joined by commas):
- vanilla: a memoryless baseline of the same size, in the spirit of the paper's vanilla model
  (Al-Rfou et al. 2018, which adds learned positions at every layer and auxiliary losses): here
  sinusoidal positions at the input only and no memory, for 6,600 steps, about as many as fit
  in those 60 minutes (56.5 measured; memoryless steps are ~1.2x faster); evaluate it with
  `--sliding_stride=1` too;
- rope, t5_bias, alibi, none: recurrence with another positional scheme;
- short: 750 steps (about 8 minutes) for sweeps.
See README.md for the perplexities.
"""

from xformer.config import lm_base_config, with_variant

VARIANTS = {
    "vanilla": {
        "model.positional": "sinusoidal",
        "model.mem_len": 0,
        "train.num_steps": 6600,
    },
    **{name: {"model.positional": name} for name in ("rope", "t5_bias", "alibi", "none")},
    # Equal updates for every point of a sweep, whatever its speed (max_train_seconds is a guard).
    # The full config's 400-step warm-up: 100 steps to 1.5e-3 left XL at the unigram plateau.
    "short": {
        "train.num_steps": 750,
        "train.max_train_seconds": 1200.0,
        "train.eval_every": 150,  # validation takes ~6 s: a curve for the comparison plot
    },
}


def get_config(variant: str = ""):
    c = lm_base_config("ptb")
    c.model.d_model = 256
    c.model.num_heads = 4
    c.model.num_decoder_layers = 4
    c.model.d_ff = 1024
    c.model.dropout = 0.2
    c.model.attention_dropout = 0.1
    c.model.relu_dropout = 0.2
    c.model.mem_len = 70

    c.data.segment_length = 70

    c.train.batch_size = 32
    c.train.num_steps = 5500  # ~60 min on the reference machine; the cosine ends here
    c.train.max_train_seconds = 0.0  # no time limit (set one as a guard)
    c.train.learning_rate = 1.5e-3
    c.train.warmup_steps = 400
    return with_variant(c, variant, VARIANTS)
