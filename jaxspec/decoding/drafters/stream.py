"""StreamingLLM / MagicDec: 16 sink tokens plus the most recent page-aligned window.

Recomputed at every draft step from the position alone; positions keep their original values.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxspec.decoding.drafters.base import Drafter
from jaxspec.decoding.spec import PAGE

SINKS = 16


class Stream(Drafter):
    def attend(self, state, budget, rows):
        context = rows.position + 1
        k = self.count(budget, context)
        # The window is whole pages plus the current partial page; it always holds the query itself,
        # and it reaches back to the root, so every tree node sees its ancestors (dense while the root
        # is among the sinks).
        dense = (k >= context) | (rows.first < SINKS)
        window = jnp.maximum(k - SINKS, PAGE)
        window_start = jnp.minimum(jnp.maximum(-(-(context - window) // PAGE) * PAGE, SINKS), rows.first)
        n_idx = jnp.where(dense, 0, SINKS)
        tail_start = jnp.where(dense, 0, window_start)
        idx = jnp.broadcast_to(jnp.arange(SINKS, dtype=jnp.int32), (rows.first.shape[0], 1, SINKS))  # every layer
        return self.sparse_attend(idx, n_idx, tail_start, rows, tail_capacity=self.k_max + PAGE + self.spec.shape.rows)
