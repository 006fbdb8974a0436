"""A small Transformer-XL on WikiText-2 for a 2-core CPU, with an adaptive softmax over the
33,278-word vocabulary.

    python train.py --config=configs/wikitext2_xl.py --workdir=workdirs/wikitext2_xl
    python eval.py --workdir=workdirs/wikitext2_xl --split=test --mem_len=280 --clamp_len=149 \
        --decoder_mask=same_length

Frequent words (the first 2,000 ids) share the head softmax; rarer words sit in two tail
clusters with 4x and 16x smaller embeddings (div_val 4). Trains for 5,000 steps (its time on
the 2-core CPU is not measured yet).
"""

from xformer.config import lm_base_config


def get_config():
    c = lm_base_config("wikitext2")
    c.model.d_model = 256
    c.model.num_heads = 4
    c.model.num_decoder_layers = 4
    c.model.d_ff = 1024
    c.model.dropout = 0.3
    c.model.attention_dropout = 0.1
    c.model.relu_dropout = 0.3
    c.model.mem_len = 75
    c.model.adaptive_cutoffs = (2000, 10000)
    c.model.div_val = 4
    c.model.tie_projs = (False, True, True)
    # Tail targets are 15.6% and 7.1% of WikiText-2's tokens (at most 18% and 9% in any batch):
    # each tail is scored on 20% of the positions; a batch with more is scored densely.
    c.model.adaptive_capacity = 0.2

    c.data.segment_length = 75

    c.train.batch_size = 32
    c.train.num_steps = 5000
    c.train.max_train_seconds = 0.0  # no time limit (set one as a guard)
    c.train.learning_rate = 1e-3
    c.train.warmup_steps = 400
    return c
