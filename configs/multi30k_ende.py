"""Multi30k En->De with a small post-LN Transformer sized for a 2-core CPU (the main job).

    python train.py --config=configs/multi30k_ende.py --workdir=workdirs/multi30k_ende
    python eval.py --workdir=workdirs/multi30k_ende --split=test_2016_flickr

Trains a joint 8k SentencePiece vocabulary on the training split, then the model for 5,300
steps: a budget in steps, so the result does not depend on the machine's speed. On a fast 2-core
machine of the README's reference kind that took 37 minutes (2026-12-02); one with a third of its
matmul ceiling ran 3,000 steps in 54 minutes (about 1.5 hours for all). README.md gives the BLEU
it reaches and the BLEU by step, for a run limited in time with
`--config.train.max_train_seconds=3600`.

Variants (`--config=configs/multi30k_ende.py:rope,short`): a positional scheme for both
stacks (learned, relative, rope, t5_bias, alibi, none; the default is sinusoidal); local
attention (`local`: sliding windows of 8 tokens in the encoder, 8 in the decoder); `short`:
600 steps (about 8 minutes) for sweeps.
"""

from xformer.config import base_config, with_variant

VARIANTS = {
    **{
        name: {"model.positional": name}
        for name in ("learned", "relative", "rope", "t5_bias", "alibi", "none")
    },
    "local": {
        "model.encoder_mask": "sliding_window",
        "model.decoder_mask": "sliding_window",
        "model.attention_window": 8,
    },
    # 600 steps (~8 minutes at 1.3 steps/s) with a cosine schedule that ends: every point of a
    # sweep gets the same number of updates, whatever its speed.
    "short": {
        "train.num_steps": 600,
        "train.schedule": "cosine",
        "train.warmup_steps": 150,
        "train.max_train_seconds": 1200.0,
        "train.eval_every": 300,
    },
}


def get_config(variant: str = ""):
    c = base_config()
    c.model.d_model = 256
    c.model.num_heads = 4
    c.model.num_encoder_layers = 3
    c.model.num_decoder_layers = 3
    c.model.d_ff = 1024
    c.model.dropout = 0.2
    c.model.attention_dropout = 0.1
    c.model.relu_dropout = 0.1

    c.data.vocab_size = 8000
    c.data.max_train_length = 64

    c.train.batch_size = 32  # packed rows of 64 tokens: ~1.9k target tokens per step
    c.train.num_steps = 5300  # the steps the reference machine ran in 60 minutes
    c.train.max_train_seconds = 0.0  # no time limit (set one as a guard)
    c.train.learning_rate = 1e-3
    c.train.warmup_steps = 800
    c.train.eval_every = 1500
    c.train.checkpoint_every = 1000

    c.eval.batch_size = 100
    c.eval.beam_size = 4
    return with_variant(c, variant, VARIANTS)
