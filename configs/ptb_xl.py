"""Transformer-XL on Penn Treebank (word level), sized for 60 minutes on a 2-core CPU.

    python train.py --config=configs/ptb_xl.py --workdir=workdirs/ptb_xl
    python eval.py --workdir=workdirs/ptb_xl --split=test --mem_len=280 --clamp_len=200 \
        --same_length

Segments of 70 tokens attend over a memory of 70 cached states per layer during training; the
evaluation memory can be longer than the training one. See README.md for the perplexity.
"""

from xformer.config import base_config


def get_config():
    c = base_config()
    c.model.family = "decoder_only"
    c.model.positional = "relative"
    c.model.d_model = 256
    c.model.num_heads = 4
    c.model.num_decoder_layers = 4
    c.model.d_ff = 1024
    c.model.dropout = 0.3
    c.model.attention_dropout = 0.1
    c.model.relu_dropout = 0.3
    c.model.mem_len = 70

    c.data.dataset = "ptb"
    c.data.train_split = "train"
    c.data.eval_split = "valid"
    c.data.test_split = "test"
    c.data.vocab_size = 0  # every training type: the standard 10k PTB vocabulary
    c.data.segment_length = 70

    c.train.batch_size = 32
    c.train.num_steps = 6000
    c.train.max_train_seconds = 3600.0
    c.train.schedule = "cosine"
    c.train.learning_rate = 1e-3
    c.train.warmup_steps = 400
    c.train.b2 = 0.999
    c.train.eps = 1e-8
    c.train.grad_clip_norm = 0.25
    c.train.label_smoothing = 0.0
    c.train.eval_every = 1000
    c.train.checkpoint_every = 1000

    c.eval.batch_size = 10
    c.eval.segment_length = 70
    c.eval.mem_len = 70
    return c
