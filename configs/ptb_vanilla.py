"""The vanilla decoder-only baseline for configs/ptb_xl.py: same size and training budget,
absolute sinusoidal positions, no memory (each 70-token segment is modelled on its own).

    python train.py --config=configs/ptb_vanilla.py --workdir=workdirs/ptb_vanilla
    python eval.py --workdir=workdirs/ptb_vanilla --split=test
    python eval.py --workdir=workdirs/ptb_vanilla --split=test --sliding_stride=1

The second evaluation slides a 70-token window one token at a time (Al-Rfou et al.), so
every prediction sees a full window of context, at one forward pass per token.
"""

import importlib.util
import os


def _xl_config():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ptb_xl.py")
    spec = importlib.util.spec_from_file_location("ptb_xl", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def get_config():
    c = _xl_config()
    c.model.positional = "sinusoidal"
    c.model.mem_len = 0
    c.eval.mem_len = 0
    c.train.num_steps = 3500  # memoryless steps are faster: the same 60 minutes on one core
    return c
