"""Where the queries and keys of one attention call sit in their sequence.

Query i is at position q_start + i and key j at k_start + j. Positional schemes and masks see
only these index positions; packed rows restart positions per example, but index distances
equal within-example distances, and cross-example pairs are masked anyway.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Layout:
    q_len: int
    k_len: int
    q_start: int | jax.Array = 0  # traced during incremental decoding
    k_start: int | jax.Array = 0
    causal: bool = True  # False: keys after a query matter (encoders)

    @classmethod
    def with_memory(cls, q_len: int, mem_len: int, causal: bool = True) -> "Layout":
        """A segment whose keys are [memory ; segment]: queries are the last q_len keys."""
        return cls(q_len, mem_len + q_len, q_start=mem_len, causal=causal)

    def distances(self) -> jax.Array:
        """Query position minus key position, [Lq, Lk] int32."""
        return self.query_positions()[:, None] - self.key_positions()[None, :]

    def query_positions(self) -> jax.Array:
        return self.q_start + jnp.arange(self.q_len, dtype=jnp.int32)

    def key_positions(self) -> jax.Array:
        return self.k_start + jnp.arange(self.k_len, dtype=jnp.int32)
