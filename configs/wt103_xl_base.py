"""Transformer-XL "standard" on WikiText-103, the paper's 151M-parameter setting (accelerators).

    python train.py --config=configs/wt103_xl_base.py --workdir=workdirs/wt103_xl_base
    python eval.py --workdir=workdirs/wt103_xl_base --split=test --segment_length=64 \
        --mem_len=640 --clamp_len=400 --decoder_mask=same_length

Settings of the paper's PyTorch `run_wt103_base.sh`: 16 layers, d_model 410, 10 heads, d_ff
2100, segments of 150 tokens with 150 cached states, adaptive input and softmax with cutoffs
20k/40k/200k (tied weights; at div_val 1 no cluster has a projection to tie), Adam 2.5e-4
with cosine decay over 200k steps, batch 60, gradient clipping 0.25, dense kernels drawn from
N(0, 0.02). The paper reports 24.0 test perplexity.
"""

from xformer.config import lm_base_config


def get_config():
    c = lm_base_config("wikitext103")
    c.model.d_model = 410
    c.model.num_heads = 10
    c.model.num_decoder_layers = 16
    c.model.d_ff = 2100
    c.model.dropout = 0.1
    c.model.attention_dropout = 0.0
    c.model.relu_dropout = 0.1
    c.model.mem_len = 150
    c.model.init_std = 0.02  # the reference's dense kernels: N(0, 0.02)
    c.model.adaptive_cutoffs = (20000, 40000, 200000)
    c.model.div_val = 1
    c.model.tie_projs = (False, True, True, True)  # as the reference; inert at div_val 1
    # Each tail is scored on 15% of the positions (a Zipf(1.1) stream puts 3-7% of targets in
    # each); a batch with more is scored densely, so the loss is exact either way.
    c.model.adaptive_capacity = 0.15

    c.data.segment_length = 150

    c.train.batch_size = 60
    c.train.num_steps = 200_000
    c.train.learning_rate = 2.5e-4
    c.train.warmup_steps = 0
    c.train.eval_every = 4000
    c.train.checkpoint_every = 4000
    return c
