"""Verification-guided selection: Vegas (rows 0 and gamma), all_rows, and last_accepted.

The verification pass already computes every key's attention score. These policies keep the scores
of some verify rows (inside the attention kernel), average them over query heads (and rows), and pick
the top-K slots per layer, shared by all KV heads. Drafting attends those slots plus every slot after
the selection's prefix (the tail).

With a draft tree, Vegas's second row is the last row of the flattened tree: in BFS and DFS order a
node of the greatest depth, so it sees the committed cache through the longest drafted context, as
row gamma does in a chain. Its scores are gathered inside the verify pass, before acceptance is known;
choosing the deepest node on the accepted path instead would mean keeping every row's scores, which
is what last_accepted pays for. Vegas and all_rows rank the slots up to the root; last_accepted ranks
up to its accepted row, whose scores move with the path's keys.
"""

from __future__ import annotations

import jax.numpy as jnp

import pallas_kernels as kernels
from jaxspec.decoding.drafters.base import Drafter, Selection
from pallas_kernels.verify_attention import mask_scores


def first_and_last(num_rows: int) -> tuple[int, ...]:
    """Vegas's verify rows of a pass of `num_rows`: row 0 (the previous bonus token) and the last (the
    last draft of a chain, a deepest node of a tree)."""
    return (0, num_rows - 1) if num_rows > 1 else (0,)


class Vegas(Drafter):
    """Scores of verify row 0 (the previous bonus token) and row gamma (the last draft)."""

    reduce_rows = True

    def rows(self, num_rows: int) -> tuple[int, ...]:
        return first_and_last(num_rows)

    def collect(self, num_rows: int) -> kernels.Collect:
        return kernels.Collect(rows=self.rows(num_rows), metric=self.spec.metric, reduce_rows=self.reduce_rows)

    def init(self, cache, prompt_len):
        L, B = cache.k.shape[0], cache.pages.shape[0]
        zeros = jnp.zeros((B,), jnp.int32)
        return Selection(jnp.zeros((L, B, 1, self.k_max), jnp.int32), zeros, zeros)

    def after_verify(self, state, budget, scores, cache, first_pos, num_accepted, path):
        return self.select(budget, scores, first_pos)

    def attend(self, state, budget, rows):
        # After a verification with root slot p the tail starts at p + 1 (at most); each iteration moves
        # the root on by at most depth + 1 (select_every of them before the next selection), and the
        # tree's rows follow the last root.
        tree = self.spec.shape
        reach = (self.spec.select_every - 1) * (tree.depth + 1) + tree.depth + tree.rows
        return self.sparse_attend(state.idx, state.n_idx, state.tail_start, rows, reach)


class AllRows(Vegas):
    """Scores averaged over all gamma + 1 verify rows."""

    def rows(self, num_rows: int) -> tuple[int, ...]:
        return tuple(range(num_rows))


class LastAccepted(Vegas):
    """Scores of the last accepted token's row only, chosen after acceptance."""

    reduce_rows = False

    def rows(self, num_rows: int) -> tuple[int, ...]:
        return tuple(range(num_rows))

    def after_verify(self, state, budget, scores, cache, first_pos, num_accepted, path):
        """Scores of the accepted path's last row, moved with the path's keys: slot first_pos + d takes
        the score of slot first_pos + path[d] (a no-op for chains)."""
        last = first_pos + num_accepted
        L, B = scores.shape[:2]
        row = jnp.take_along_axis(path, num_accepted[:, None], axis=1)[:, 0]
        s = jnp.take_along_axis(scores, jnp.broadcast_to(row[None, :, None, None], (L, B, 1, 1)), axis=2)[:, :, 0]
        if not self.spec.shape.is_chain:
            b = jnp.arange(B)[:, None]
            dst = first_pos[:, None] + jnp.arange(path.shape[1], dtype=jnp.int32)
            s = mask_scores(s.at[:, b, dst].set(s[:, b, first_pos[:, None] + path]), last)
        return self.select(budget, s, last)
