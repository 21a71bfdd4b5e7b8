"""N-gram lookup (prompt lookup decoding): no model, continue the longest earlier match of the suffix.

For n from max_n down to min_n, the most recent earlier occurrence of the last n tokens proposes the
gamma tokens that followed it. Proposals have no probabilities: verification uses q = one-hot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decoding.drafters.base import Drafter


class Ngram(Drafter):
    uses_model = False

    def propose(self, tokens: jax.Array, length: jax.Array) -> jax.Array:
        """Draft tokens [B, gamma] from the committed tokens [B, N] (first `length` [B] valid)."""
        B, N = tokens.shape
        slots = jnp.arange(N, dtype=jnp.int32)
        start = jnp.full((B,), -1, jnp.int32)  # first continuation slot of the chosen match
        for n in range(self.spec.ngram_max, self.spec.ngram_min - 1, -1):
            # A window [j, j + n) matches the suffix and has a committed continuation at j + n.
            match = slots[None, :] + n < length[:, None]
            for t in range(n):
                suffix_token = jnp.take_along_axis(tokens, jnp.maximum(length - n + t, 0)[:, None], axis=1)
                shifted = jnp.pad(tokens[:, t:], ((0, 0), (0, t)), constant_values=-1)
                match &= shifted == suffix_token
            match &= (length >= n + 1)[:, None]
            latest = jnp.max(jnp.where(match, slots, -1), axis=1)
            start = jnp.where((start < 0) & (latest >= 0), latest + n, start)
        gamma = jnp.arange(self.spec.gamma, dtype=jnp.int32)
        last = (length - 1)[:, None]
        source = jnp.where(start[:, None] >= 0, jnp.minimum(start[:, None] + gamma, last), last)
        return jnp.take_along_axis(tokens, source, axis=1)
