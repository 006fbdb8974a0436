"""Sweep: every positional scheme in the encoder-decoder Transformer on Multi30k En->De.

Seven points of `configs/multi30k_ende.py:short` (600 steps, about 8 minutes of training each
on the 2-core CPU, then beam search over test_2016_flickr), one per `model.positional`, run one
after the other in <workdir>/<point>; re-running skips finished points and resumes the rest:

    python train.py --sweep=configs/sweeps/multi30k_positional.py \
        --workdir=workdirs/multi30k_pos --dry_run
    python train.py --sweep=configs/sweeps/multi30k_positional.py --workdir=workdirs/multi30k_pos
    python eval.py --compare='workdirs/multi30k_pos/*'
"""

from xformer import sweep

BASE = "configs/multi30k_ende.py:short"  # relative to the repo root


def get_sweep():
    return sweep.grid(
        "model.positional",
        ["sinusoidal", "learned", "relative", "rope", "t5_bias", "alibi", "none"],
    )
