"""Verification-guided selection: Vegas (rows 0 and gamma), all_rows, and last_accepted.

The verification pass already computes every key's attention score. These policies keep the scores
of some verify rows (inside the attention kernel), average them over query heads (and rows), and pick
the top-K slots per layer, shared by all KV heads. Drafting attends those slots plus every slot after
the selection's prefix (the tail).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels as kernels
from jaxspec.decoding.drafters.base import Drafter


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Selection:
    idx: jax.Array  # [L, B, 1, k_max] selected slots per layer (first n_idx valid)
    n_idx: jax.Array  # [B]
    tail_start: jax.Array  # [B] first slot after the selection's prefix


class Vegas(Drafter):
    """Scores of verify row 0 (the previous bonus token) and row gamma (the last draft)."""

    reduce_rows = True

    def rows(self, num_rows: int) -> tuple[int, ...]:
        return (0, num_rows - 1) if num_rows > 1 else (0,)

    def collect(self, num_rows: int) -> kernels.Collect:
        return kernels.Collect(rows=self.rows(num_rows), metric=self.spec.metric, reduce_rows=self.reduce_rows)

    def init(self, cache, prompt_len):
        L, B = cache.k.shape[:2]
        zeros = jnp.zeros((B,), jnp.int32)
        return Selection(jnp.zeros((L, B, 1, self.k_max), jnp.int32), zeros, zeros)

    def after_verify(self, state, budget, scores, cache, first_pos, num_accepted):
        return self.select(budget, scores, first_pos)

    def select(self, budget, scores: jax.Array, last: jax.Array) -> Selection:
        """Top-K of `scores` [L, B, S] over candidate slots [0, last]; later slots are -inf already."""
        k = self.count(budget, last + 1)
        idx = kernels.select_topk(scores, self.k_max, k[None, :], backend=self.spec.backend)
        return Selection(idx[:, :, None, :], k, last + 1)

    def attend(self, state, budget, q_pos):
        # After a verification at row-0 position p the tail starts at p + 1; the next iteration drafts
        # up to p + 2 * gamma, so the tail never holds more than 2 * gamma slots.
        return self.sparse_attend(state.idx, state.n_idx, state.tail_start, q_pos, tail_capacity=2 * self.spec.gamma)


class AllRows(Vegas):
    """Scores averaged over all gamma + 1 verify rows."""

    def rows(self, num_rows: int) -> tuple[int, ...]:
        return tuple(range(num_rows))


class LastAccepted(Vegas):
    """Scores of the last accepted token's row only, chosen after acceptance."""

    reduce_rows = False

    def rows(self, num_rows: int) -> tuple[int, ...]:
        return tuple(range(num_rows))

    def after_verify(self, state, budget, scores, cache, first_pos, num_accepted):
        row = jnp.broadcast_to(num_accepted[None, :, None, None], (scores.shape[0], scores.shape[1], 1, 1))
        return self.select(budget, jnp.take_along_axis(scores, row, axis=2)[:, :, 0], first_pos + num_accepted)
