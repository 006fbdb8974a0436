"""Sweep: the three positional schemes that led the Multi30k sweep (XL relative, RoPE, ALiBi),
each with three seeds, for means and standard deviations over seeds.

Nine points of `configs/multi30k_ende.py:short` (600 steps each), run as the Multi30k
positional sweep is; `eval.py --compare` groups the seeds of each scheme ("Over seeds"):

    python train.py --sweep=configs/sweeps/multi30k_positional_seeds.py --workdir=workdirs/seeds
    python train.py --sweep=configs/sweeps/multi30k_positional_seeds.py --workdir=workdirs/seeds \
        --dry_run
    python eval.py --compare='workdirs/seeds/*'
"""

from xformer import sweep

BASE = "configs/multi30k_ende.py:short"  # relative to the repo root


def get_sweep():
    return sweep.seeds(sweep.grid("model.positional", ["relative", "rope", "alibi"]), [0, 1, 2])
