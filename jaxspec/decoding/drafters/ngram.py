"""N-gram lookup (prompt lookup decoding): no model, continue earlier matches of the suffix.

Every earlier position where the last n tokens occurred (n from max_n down to min_n) proposes the
tokens that followed it. A chain continues the best match: the longest n, then the most recent. A
draft tree takes the best M matches (M = its leaf count, at most MAX_MATCHES) as a trie: a node's
children are the distinct next tokens of the matches that agree with the node's path, best match
first; a node with fewer distinct continuations than children repeats its first one (such a sibling
is never accepted twice). Proposals have no probabilities: verification uses q = one-hot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.drafters.base import Drafter
from jaxspec.decoding.tree import TreeShape

MAX_MATCHES = 16


class Ngram(Drafter):
    uses_model = False

    def draft(self, params, tokens, length, done, cache, state, key, rules):
        """Proposals have no probabilities (one-hot q)."""
        return self.propose(tokens, length, self.spec.shape), None, cache, state

    def propose(self, tokens: jax.Array, length: jax.Array, tree: TreeShape) -> jax.Array:
        """Tree tokens [B, rows] (row 0: the pending token) from the committed tokens [B, N]
        (first `length` [B] valid)."""
        B = tokens.shape[0]
        num_matches = min(int((tree.children[:, 0] < 0).sum()), MAX_MATCHES)  # one per leaf
        conts, found = self.continuations(tokens, length, num_matches, tree.depth)  # [B, M, D], [B, M]
        pending = jnp.take_along_axis(tokens, (length - 1)[:, None], axis=1)[:, 0]
        out = jnp.broadcast_to(pending[:, None], (B, tree.rows))
        members = {0: found}  # row -> [B, M]: the matches that agree with the row's path
        for d in range(tree.depth):
            nxt = conts[:, :, d]
            for parent in tree.rows_at(d):
                taken = jnp.zeros_like(found)  # matches whose next token a sibling already took
                first_token = None
                for kid in tree.children[parent][tree.children[parent] >= 0]:
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

    def replay(self, tokens: jax.Array, start: jax.Array, end: jax.Array) -> jax.Array:
        """Iterations [B] this chain (gamma = spec.gamma) would have taken to commit each row's
        tokens from `start` to `end` [B] of `tokens` [B, N], committed by any lossless run, without
        running the model. Why it is exact in distribution: a one-hot draft x is accepted iff the
        target's own draw equals x (accepted with probability p(x); on rejection the residual is p
        without x), so verifying drafts against text the target drew is verifying them against fresh
        draws; the planner watches ngram this way while another strategy runs.

        Every position's chain at once, in O(N log N) and no device loop (a watch window's replay
        is time the device does not decode): at length p the chain continues the latest earlier
        occurrence of the longest suffix n-gram, i.e. `previous_occurrence` of the n-gram ending
        at p - 1, and the walk from `start` to `end` is counted by pointer jumping."""
        B, N = tokens.shape
        best = jnp.full((B, N), -1, jnp.int32)  # [B, q]: where the best match of the n-gram ending at q ends
        for n in range(self.spec.ngram_min, self.spec.ngram_max + 1):  # the longest n that matches wins
            previous = previous_occurrence(tokens, n)
            best = jnp.where(previous >= 0, previous, best)
        # at length p (p >= 1) the chain drafts tokens[min(s + k, p - 1)], s one past the match (none:
        # s = p - 1), each checked against the text, [B, N] arrays a draft position (not [B, N, gamma])
        p = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
        match = jnp.take_along_axis(best, jnp.maximum(p - 1, 0), axis=1)
        s = jnp.where(match >= 0, match + 1, p - 1)
        accepted, agreeing = jnp.zeros((B, N), jnp.int32), jnp.ones((B, N), bool)
        for k in range(self.spec.gamma):
            draft = jnp.take_along_axis(tokens, jnp.clip(jnp.minimum(s + k, p - 1), 0, N - 1), axis=1)
            text = jnp.take_along_axis(tokens, jnp.minimum(p + k, N - 1), axis=1)
            agreeing &= (draft == text) & (p + k < end[:, None])
            accepted += agreeing
        # iterations from each length to end, by pointer jumping over lengths 0..N (one at end or past
        # it is done: it jumps to end, which jumps to itself and counts nothing)
        jump = jnp.minimum(jnp.pad(p + accepted + 1, ((0, 0), (0, 1)), constant_values=N), end[:, None])
        steps = (jnp.arange(N + 1, dtype=jnp.int32) < end[:, None]).astype(jnp.int32)
        for _ in range(max(N, 1).bit_length()):
            steps, jump = steps + jnp.take_along_axis(steps, jump, axis=1), jnp.take_along_axis(jump, jump, axis=1)
        return jnp.take_along_axis(steps, start[:, None], axis=1)[:, 0]

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
        rank = jnp.where(best_n > 0, best_n * N + slots, -1)  # distinct where found
        if num_matches == 1:  # a chain: one reduction instead of a top-k (same answer, cheaper on the GPU)
            start = jnp.argmax(rank, axis=1)[:, None]
            top = jnp.take_along_axis(rank, start, axis=1)
        else:
            top, start = jax.lax.top_k(rank, num_matches)
        last = (length - 1)[:, None, None]
        source = jnp.minimum(start[:, :, None] + np.arange(depth), last)
        conts = jnp.take_along_axis(tokens, source.reshape(B, -1), axis=1).reshape(B, num_matches, depth)
        return conts, top >= 0


def previous_occurrence(tokens: jax.Array, n: int) -> jax.Array:
    """[B, N]: for the n-gram ending at each position q (q >= n - 1), the end of its latest earlier
    occurrence, else -1. One sort of the n-grams by their tokens, then position: an occurrence's
    predecessor in that order is its previous one."""
    B, N = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, N))
    grams = [jnp.pad(tokens[:, : N - t], ((0, 0), (t, 0)), constant_values=-1) for t in reversed(range(n))]
    valid = positions >= n - 1
    keys = [jnp.where(valid, g, -1) for g in grams]
    *ordered, at = jax.lax.sort((*keys, positions), dimension=1, num_keys=n + 1)
    same = jnp.ones((B, N - 1), bool)
    for o in ordered:
        same &= o[:, 1:] == o[:, :-1]
    same &= jnp.take_along_axis(valid, at[:, 1:], axis=1)  # a window that starts before the row matches nothing
    previous = jnp.pad(jnp.where(same, at[:, :-1], -1), ((0, 0), (1, 0)), constant_values=-1)
    return jnp.zeros((B, N), jnp.int32).at[jnp.arange(B)[:, None], at].set(previous)
