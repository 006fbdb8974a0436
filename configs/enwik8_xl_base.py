"""Transformer-XL 12-layer on enwik8 (bytes), the paper's 41M-parameter setting (accelerators).

    python train.py --config=configs/enwik8_xl_base.py --workdir=workdirs/enwik8_xl_base
    python eval.py --workdir=workdirs/enwik8_xl_base --split=test --segment_length=80 \
        --mem_len=2100 --clamp_len=820 --decoder_mask=same_length

Settings of the paper's PyTorch `run_enwik8_base.sh`: 12 layers, d_model 512, 8 heads, d_ff
2048, segments of 512 bytes with 512 cached states, Adam 2.5e-4 with cosine decay over 400k
steps, batch 22, gradient clipping 0.25, dense kernels drawn from N(0, 0.02). The paper
reports 1.06 bits per character on test. One deviation: validation during training runs at the
training lengths (eval.* follows model.mem_len and data.segment_length when they are
overridden), where the reference validates on 128-byte segments with 896 cached states (its
`--eval_tgt_len 128`); `eval.segment_length=128` and `eval.mem_len=896` reproduce that.
"""

from xformer.config import lm_base_config


def get_config():
    c = lm_base_config("enwik8")
    c.model.d_model = 512
    c.model.num_heads = 8
    c.model.num_decoder_layers = 12
    c.model.d_ff = 2048
    c.model.dropout = 0.1
    c.model.attention_dropout = 0.0
    c.model.relu_dropout = 0.1
    c.model.mem_len = 512
    c.model.init_std = 0.02  # the reference's dense kernels: N(0, 0.02)

    c.data.segment_length = 512

    c.train.batch_size = 22
    c.train.num_steps = 400_000
    c.train.learning_rate = 2.5e-4
    c.train.warmup_steps = 0
    c.train.eval_every = 4000
    c.train.checkpoint_every = 4000
    return c
