"""WMT14 En->De with the base Transformer of Vaswani et al. (2017), for accelerators.

    python train.py --config=configs/wmt14_ende.py --workdir=workdirs/wmt14_ende
    python eval.py --workdir=workdirs/wmt14_ende --split=test  # newstest2014

Reads TFDS `wmt14_translate/de-en` (downloaded and prepared by TFDS on first use; needs internet
and tens of GB of disk). Paper settings: d_model 512, 8 heads, 6+6 layers, d_ff 2048, dropout
0.1, label smoothing 0.1, Adam(0.9, 0.98, 1e-9) with 4000 warm-up steps and the rsqrt schedule,
~25k source + 25k target tokens per step (96 packed rows of 256), 100k steps, beam 4, alpha 0.6.
The paper reports 27.3 BLEU on newstest2014 for this model, tokenized BLEU with compound
splitting; eval.py's detokenized sacreBLEU and lowercased tokenized BLEU are not that metric, so
compare them with it only loosely.

Where it differs from the paper: a 32,000-piece SentencePiece (unigram) vocabulary shared by
both languages, not 37k BPE merges (60.5M parameters, not ~65M); train.learning_rate is the
schedule's peak, d_model^-0.5 x warmup^-0.5 written out for 512 and 4000, so a run that
changes model.d_model or train.warmup_steps keeps that peak unless it sets learning_rate too;
checkpoints every 5,000 steps, so `eval.py --average_last=5` averages steps 80k-100k where the
paper averaged 5 checkpoints 10 minutes apart (set train.checkpoint_every for that).
"""

from xformer.config import base_config


def get_config():
    c = base_config()
    c.model.d_model = 512
    c.model.num_heads = 8
    c.model.num_encoder_layers = 6
    c.model.num_decoder_layers = 6
    c.model.d_ff = 2048
    c.model.dropout = 0.1
    c.model.max_len = 512  # sizes the table of positional='learned' only

    c.data.dataset = "wmt14_translate/de-en"
    c.data.source_lang = "en"
    c.data.target_lang = "de"
    c.data.train_split = "train"
    c.data.eval_split = "validation"  # newstest2013
    c.data.test_split = "test"  # newstest2014
    c.data.vocab_size = 32_000
    c.data.max_train_length = 256

    c.train.batch_size = 96
    c.train.num_steps = 100_000
    c.train.learning_rate = 512**-0.5 * 4000**-0.5  # the paper's peak, ~7e-4
    c.train.warmup_steps = 4000
    c.train.eval_every = 5000
    c.train.checkpoint_every = 5000
    c.train.keep_checkpoints = 5

    c.eval.batch_size = 128
    c.eval.beam_size = 4
    c.eval.length_penalty = 0.6
    c.eval.bleu_sentences = 1000  # in-training BLEU on part of newstest2013
    return c
