"""A small Transformer-XL on character-level Penn Treebank, scored in bits per character.

    python train.py --config=configs/ptb_char_xl.py --workdir=workdirs/ptb_char_xl
    python eval.py --workdir=workdirs/ptb_char_xl --split=test

The README's 1.758 test bpc is with the training memory of 150; a 450-state memory
(`--mem_len=450 --clamp_len=299 --decoder_mask=same_length`) scored worse on valid there.

The README's run read ../shared/data/ptb_char, whose training file is derived from word-level
PTB by the rule that reproduces the upstream valid and test files (its SOURCE.md); online users
download the upstream files instead.

The 50 symbols are the characters, "_" (word boundary) and <eos> (line end), each one token.
Trains for 1,900 steps (the README's run had a 25-minute limit on one core of the 2-core CPU,
which stopped it at step 1,642).
"""

from xformer.config import lm_base_config


def get_config():
    c = lm_base_config("ptb_char")
    c.model.d_model = 256
    c.model.num_heads = 4
    c.model.num_decoder_layers = 4
    c.model.d_ff = 1024
    c.model.dropout = 0.1
    c.model.attention_dropout = 0.0
    c.model.relu_dropout = 0.1
    c.model.mem_len = 150

    c.data.segment_length = 150

    c.train.batch_size = 16
    c.train.num_steps = 1900
    c.train.max_train_seconds = 0.0  # no time limit (set one as a guard)
    c.train.learning_rate = 1e-3
    c.train.warmup_steps = 200
    c.train.eval_every = 500
    return c
