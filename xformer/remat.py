"""Rematerialisation (activation checkpointing) of each layer in training: `model.remat`.

Backpropagation keeps every layer's intermediate activations from the forward pass. With
`model.remat` a layer keeps less and recomputes the rest in the backward pass, trading compute
for memory:

- "none": keep everything (no recomputation).
- "full": keep only each layer's input; the backward pass runs each layer's forward again
  (about one more forward pass of the layers: ~4/3 the step's FLOPs).
- "dots": keep the outputs of the layer's matmuls without batch dimensions (the dense layers'
  projections and FFN products); recompute the cheap elementwise work, LayerNorms, softmaxes
  and attention scores.

The recomputed forward draws the same dropout masks (the layer's RNG state goes in and comes
out of the checkpointed function), so gradients equal those of "none" up to float rounding.
"""

import functools
from collections.abc import Callable

import jax
from flax import nnx

from xformer.sharding import constrain_rows

POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def apply_layer(
    layer: nnx.Module, call: Callable[[nnx.Module, jax.Array], jax.Array], x: jax.Array, remat: str
) -> jax.Array:
    """call(layer, x), under jax.checkpoint with the policy named `remat` (POLICIES).

    `call` may close over other arrays (masks, positions, memory, encoder states): they are kept
    as they are. The layer's state (its parameters and RNG counters) is passed through, and the
    layer is updated with the state the call leaves (dropout advances its RNG counter).
    """
    if remat not in POLICIES:
        raise ValueError(f"model.remat={remat!r} not in {tuple(POLICIES)}")
    x = constrain_rows(x)
    if POLICIES[remat] is None:
        return constrain_rows(call(layer, x))
    graphdef, state = nnx.split(layer)

    @functools.partial(jax.checkpoint, policy=POLICIES[remat])
    def run(state, x):
        module = nnx.merge(graphdef, state)
        return call(module, x), nnx.state(module)

    y, state = run(state, x)
    nnx.update(layer, state)
    return constrain_rows(y)
