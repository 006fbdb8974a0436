"""Positional schemes, selected by `model.positional`. A new scheme is one module here with a
`PositionalScheme` subclass (see base.py) plus one entry in SCHEMES."""

from xformer.positional.absolute import LearnedPositions, SinusoidalPositions
from xformer.positional.alibi import ALiBi
from xformer.positional.base import PositionalScheme
from xformer.positional.rotary import RotaryPositions
from xformer.positional.t5_bias import T5RelativeBias
from xformer.positional.xl_relative import XLRelativePositions

SCHEMES: dict[str, type[PositionalScheme]] = {
    "none": PositionalScheme,
    "sinusoidal": SinusoidalPositions,
    "learned": LearnedPositions,
    "relative": XLRelativePositions,  # Transformer-XL
    "rope": RotaryPositions,
    "t5_bias": T5RelativeBias,
    "alibi": ALiBi,
}
