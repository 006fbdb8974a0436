"""Sweep: positional schemes for the PTB language model, with and without a memory.

Six points of `configs/ptb_xl.py:short` (750 steps, about 8 minutes each on the 2-core CPU):
Transformer-XL recurrence (memory 70) under the XL relative scheme, RoPE, the T5 bias, ALiBi and
no positions, and the memoryless vanilla model with sinusoidal positions. They run one after the
other in <workdir>/<point>; re-running skips finished points and resumes the rest:

    python train.py --sweep=configs/sweeps/ptb_positional.py --workdir=workdirs/ptb_pos --dry_run
    python train.py --sweep=configs/sweeps/ptb_positional.py --workdir=workdirs/ptb_pos
    python eval.py --compare='workdirs/ptb_pos/*'

The dry run prints each point's train.py and eval.py command lines (for a shell or a cluster
scheduler). The comparison writes compare.md, compare.csv and compare.png into the sweep dir.
"""

from xformer import sweep

BASE = "configs/ptb_xl.py:short"  # relative to the repo root


def get_sweep():
    with_memory = sweep.grid("model.positional", ["relative", "rope", "t5_bias", "alibi", "none"])
    vanilla = [{"model.positional": "sinusoidal", "model.mem_len": 0, "eval.mem_len": 0}]
    return with_memory + vanilla
