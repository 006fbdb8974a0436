"""Positional schemes, selected by `model.positional`. A new scheme is one module here with a
`PositionalScheme` subclass (see base.py) plus one entry in SCHEMES."""

import dataclasses
from typing import Any

from xformer.positional.absolute import LearnedPositions, SinusoidalPositions
from xformer.positional.alibi import ALiBi
from xformer.positional.base import PositionalScheme
from xformer.positional.rotary import RotaryPositions
from xformer.positional.t5_bias import T5RelativeBias
from xformer.positional.xl_relative import XLRelativePositions

SCHEMES: dict[str, type[PositionalScheme]] = {
    scheme.name: scheme
    for scheme in (
        PositionalScheme,  # "none"
        SinusoidalPositions,
        LearnedPositions,
        XLRelativePositions,  # "relative": Transformer-XL
        RotaryPositions,  # "rope"
        T5RelativeBias,
        ALiBi,
    )
}


def check_config(cfg: Any) -> None:
    """Raise ValueError naming the model key when cfg.positional cannot serve the model
    dataclass `cfg`, or when cfg sets another scheme's own options."""
    scheme = SCHEMES[cfg.positional]
    scheme.check_config(cfg)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for other in SCHEMES.values():
        changed = [k for k in other.own_options if getattr(cfg, k) != defaults[k]]
        if other is not scheme and changed:
            keys = " and ".join(f"model.{k}" for k in other.own_options)
            verb = "is" if len(other.own_options) == 1 else "are"
            raise ValueError(
                f"{keys} {verb} for model.positional={other.name!r}, not {cfg.positional!r}"
            )
