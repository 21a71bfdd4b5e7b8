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
REPLAY_CHUNK = 32  # window positions proposed together by `replay` ([chunk, B, N] match tensors a pass)
REPLAY_WIDTH = 256  # positions `replay` proposes ahead of each row before walking them (REPLAY_CHUNK's multiple)


class Ngram(Drafter):
    uses_model = False

    def draft(self, params, tokens, length, done, cache, state, key, rules):
        """Proposals have no probabilities (one-hot q)."""
        return self.propose(tokens, length, self.spec.shape), None, cache, state

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

    def replay(self, tokens: jax.Array, start: jax.Array, end: jax.Array) -> jax.Array:
        """Iterations [B] this chain (gamma = spec.gamma) would have taken to commit each row's
        tokens from `start` to `end` [B] of `tokens` [B, N], committed by any lossless run, without
        running the model. Why it is exact in distribution: a one-hot draft x is accepted iff the
        target's own draw equals x (accepted with probability p(x); on rejection the residual is p
        without x), so verifying drafts against text the target drew is verifying them against fresh
        draws; the planner watches ngram this way while another strategy runs. The proposals at the
        REPLAY_WIDTH positions from where each row stands are made at once (REPLAY_CHUNK a pass),
        walked, and made again from where the walk stopped (an iteration may end past the stretch:
        its drafts were proposed inside it), until every row reaches `end`: one program for windows
        of any length, a device loop step per stretch."""
        gamma, width = self.spec.gamma, REPLAY_WIDTH
        tree = TreeShape.chain(gamma)
        propose = jax.vmap(lambda length: self.propose(tokens, length, tree)[:, 1:], in_axes=1, out_axes=1)
        B = tokens.shape[0]

        def stretch(carry):
            base, iterations = carry
            positions = base[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, W]: a row's length
            chunks = positions.reshape(B, width // REPLAY_CHUNK, REPLAY_CHUNK).transpose(1, 0, 2)
            drafts = jax.lax.map(propose, chunks).transpose(1, 0, 2, 3).reshape(B, width, gamma)
            cols = positions[:, :, None] + jnp.arange(gamma, dtype=jnp.int32)  # the tokens the drafts stand for
            target = jnp.take_along_axis(tokens, jnp.minimum(cols, tokens.shape[1] - 1).reshape(B, -1), axis=1).reshape(cols.shape)
            accepted = jnp.cumprod((drafts == target) & (cols < end[:, None, None]), axis=2).sum(axis=2)  # [B, W]
            stop = jnp.minimum(end, base + width)
            # The walk from base to stop by binary lifting, not an iteration at a time (a device loop
            # of one small step per iteration waits on the host for every condition): lands[j][i] is
            # where 2^j iterations from positions[i] land, a landing at or past stop kept there.
            lands = [jnp.minimum(positions + accepted + 1, end[:, None])]
            for _ in range(width.bit_length() - 1):
                at = jnp.take_along_axis(lands[-1], jnp.clip(lands[-1] - base[:, None], 0, width - 1), axis=1)
                lands.append(jnp.where(lands[-1] < stop[:, None], at, lands[-1]))
            land = lambda j, length: jnp.take_along_axis(lands[j], jnp.clip(length - base, 0, width - 1)[:, None], axis=1)[:, 0]
            length = base
            for j in reversed(range(len(lands))):  # the most iterations that stay short of stop
                landing = land(j, length)
                go = (length < stop) & (landing < stop)
                length, iterations = jnp.where(go, landing, length), iterations + go * (1 << j)
            running = length < stop  # then one more, to stop or past it
            return jnp.where(running, land(0, length), length), iterations + running

        _, iterations = jax.lax.while_loop(lambda c: jnp.any(c[0] < end), stretch, (start, jnp.zeros_like(start)))
        return iterations

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
