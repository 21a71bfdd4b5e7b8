"""N-gram lookup (prompt lookup decoding): no model, continue earlier matches of the suffix.

Every earlier position where the last n tokens occurred (n from max_n down to min_n) proposes the
tokens that followed it. A chain continues the best match: the longest n, then the most recent. A
draft tree takes the best M matches (M = its leaf count, at most MAX_MATCHES) as a trie: a node's
children are the distinct next tokens of the matches that agree with the node's path, best match
first; a node with fewer distinct continuations than children repeats its first one (such a sibling
is never accepted twice). Proposals have no probabilities: verification uses q = one-hot.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.drafters.base import Drafter
from jaxspec.decoding.tree import TreeShape

MAX_MATCHES = 16


class Ngram(Drafter):
    uses_model = False

    def propose(self, tokens: jax.Array, length: jax.Array, tree: TreeShape) -> jax.Array:
        """Tree tokens [B, rows] (row 0: the pending token) from the committed tokens [B, N]
        (first `length` [B] valid)."""
        B = tokens.shape[0]
        num_matches = min(math.prod(tree.branching), MAX_MATCHES)
        conts, found = self.continuations(tokens, length, num_matches, tree.depth)  # [B, M, D], [B, M]
        pending = jnp.take_along_axis(tokens, (length - 1)[:, None], axis=1)[:, 0]
        out = jnp.broadcast_to(pending[:, None], (B, tree.rows))
        members = {0: found}  # row -> [B, M]: the matches that agree with the row's path
        for d in range(tree.depth):
            nxt = conts[:, :, d]
            for parent in tree.rows_at(d):
                taken = jnp.zeros_like(found)  # matches whose next token a sibling already took
                first_token = None
                for kid in tree.children[parent][: tree.branching[d]]:
                    left = members[parent] & ~taken
                    has = left.any(axis=1)
                    token = jnp.take_along_axis(nxt, jnp.argmax(left, axis=1)[:, None], axis=1)[:, 0]
                    if first_token is None:
                        first_token = jnp.where(has, token, pending)
                    token = jnp.where(has, token, first_token)
                    same = nxt == token[:, None]
                    members[int(kid)] = members[parent] & same & has[:, None]
                    taken |= same
                    out = out.at[:, kid].set(token)
        return out

    def continuations(self, tokens, length, num_matches: int, depth: int):
        """The best `num_matches` continuation starts (longest n first, then most recent) and the
        `depth` tokens after each: (tokens [B, M, depth], found [B, M])."""
        B, N = tokens.shape
        slots = jnp.arange(N, dtype=jnp.int32)
        best_n = jnp.zeros((B, N), jnp.int32)  # longest n whose match continues at slot s
        for n in range(self.spec.ngram_min, self.spec.ngram_max + 1):
            # A window [j, j + n) matches the suffix and has a committed continuation at j + n.
            match = slots[None, :] + n < length[:, None]
            for t in range(n):
                suffix_token = jnp.take_along_axis(tokens, jnp.maximum(length - n + t, 0)[:, None], axis=1)
                shifted = jnp.pad(tokens[:, t:], ((0, 0), (0, t)), constant_values=-1)
                match &= shifted == suffix_token
            match &= (length >= n + 1)[:, None]
            at_start = jnp.pad(match, ((0, 0), (n, 0)))[:, :N]  # indexed by the continuation start j + n
            best_n = jnp.where(at_start, n, best_n)
        rank = jnp.where(best_n > 0, best_n * N + slots, -1)
        top, start = jax.lax.top_k(rank, num_matches)
        last = (length - 1)[:, None, None]
        source = jnp.minimum(start[:, :, None] + np.arange(depth), last)
        conts = jnp.take_along_axis(tokens, source.reshape(B, -1), axis=1).reshape(B, num_matches, depth)
        return conts, top >= 0
