"""Transformer-XL on Penn Treebank (word level), sized for 60 minutes on a 2-core CPU.

    python train.py --config=configs/ptb_xl.py --workdir=workdirs/ptb_xl
    python eval.py --workdir=workdirs/ptb_xl --split=test
    python eval.py --workdir=workdirs/ptb_xl --split=test --mem_len=140 --clamp_len=139

Segments of 70 tokens attend over a memory of 70 cached states per layer during training; the
evaluation memory can be longer than the training one. See README.md for the perplexity.
"""

from xformer.config import lm_base_config


def get_config():
    c = lm_base_config("ptb")
    c.model.d_model = 256
    c.model.num_heads = 4
    c.model.num_decoder_layers = 4
    c.model.d_ff = 1024
    c.model.dropout = 0.3
    c.model.attention_dropout = 0.1
    c.model.relu_dropout = 0.3
    c.model.mem_len = 70

    c.data.segment_length = 70

    c.train.batch_size = 32
    c.train.num_steps = 3000  # the cosine ends within 60 min on one core (bench runs two models)
    c.train.max_train_seconds = 3600.0
    c.train.learning_rate = 1e-3
    c.train.warmup_steps = 400

    c.eval.segment_length = 70
    c.eval.mem_len = 70
    return c
