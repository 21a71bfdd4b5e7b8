"""EAGLE-3 drafting: a learned one-layer head (`models.eagle`) drafts the tree from the target's features.

Every verify pass exports the target's features (the residual stream entering the head's three
feature layers) for its rows (`capture`). After acceptance the drafter keeps the accepted path's
rows (`after_verify`); the next draft starts by catching the head up on them: row d of the path, at
position first + d, pairs the target's features there with the token emitted after it, and the head
writes its own KV at those slots (rejected rows of the last draft are overwritten, as in the target's
cache). The catch-up row of the last emitted token gives the depth-1 drafts; each later depth runs the
head once over that depth's nodes, their input the parent's output state in place of the target's
features (the training-time test of EAGLE-3), at the slots of the target's tree shifted one back
(the head's tree root is the catch-up's last row), seeing the head's committed cache and their
ancestors.

A node's children are the head's top-b draft tokens, or b draws without replacement when sampling,
after the sampling rules' processing over the draft vocabulary less top-p (`SpecConfig.draft_rules`);
q, zero outside the draft vocabulary, is what they were drawn from, so verification's exact rejection
sampling keeps the output the target's.
With `SpecConfig.draw_mode` "top" (eagle's default on a tree; a chain draws) they are the top-b
tokens when sampling too, verified as one-hot candidates (no q).
The head's weights travel in params["eagle"]; its cache in the model's cache (`KVCache.head`), filled
over the prompt at prefill (`engine.prefill_chunk`).

With `SpecConfig.head_context` "selected" the head attends a selection of its cache instead of all of
it: the verify pass also collects vegas's scores (rows 0 and the last), and after each verification
the top layer's scores pick the head's slots before the verified root (K as vegas's budget); the
catch-up and every draft depth attend those slots plus the tail from the root on (the path and the
tree). At long context the head's read of its whole cache is its largest; only the drafts change.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels as kernels
from jaxspec.decoding.drafters.base import Drafter, DraftRows, Selection
from jaxspec.decoding.drafters.vegas import first_and_last
from jaxspec.decoding.sampling import expand, split_rows
from jaxspec.models import eagle
from jaxspec.models.kvcache import KVCache
from pallas_kernels.verify_attention import mask_scores


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PathRows:
    """The last verification's accepted path, for the next draft's catch-up."""

    features: jax.Array  # [B, depth + 1, 3 Ht]: the target's features at path row d (position first + d)
    first: jax.Array  # [B] the path's first position (the verified root's)
    num_accepted: jax.Array  # [B] rows 0 .. num_accepted are the path's
    selection: Selection | None  # the head's context with head_context "selected" (one layer), else None


class Eagle(Drafter):
    uses_model = False

    def capture(self) -> tuple[int, ...]:
        return self.spec.eagle.feature_layers

    def collect(self, num_rows: int) -> kernels.Collect | None:
        """Vegas's scores (rows 0 and the last) when the head attends a selection."""
        if not self.spec.selects_head_context:
            return None
        return kernels.Collect(rows=first_and_last(num_rows), metric=self.spec.metric, reduce_rows=True)

    def init(self, cache: KVCache, prompt_len: jax.Array) -> PathRows:
        if cache.head is None:
            raise ValueError("an eagle run needs the head's cache: prefill with the spec's head (engine.prefill_cache)")
        B = prompt_len.shape[0]
        width = 3 * self.spec.eagle.target_hidden_size
        zeros = jnp.zeros((B,), jnp.int32)
        selection = Selection(jnp.zeros((1, B, 1, self.k_max), jnp.int32), zeros, zeros) if self.spec.selects_head_context else None
        return PathRows(jnp.zeros((B, self.spec.shape.depth + 1, width), cache.k.dtype), zeros, zeros, selection)

    def after_verify(self, state, budget, scores, cache, first_pos, num_accepted, path):
        """`scores` are the verified rows' features [B, rows, 3 Ht] (with a selected context, (scores,
        features)); the path's rows are kept (a one-row verification's padded to the tree's depth + 1)
        and the selection is taken over the slots before the root (the root's on are the tail)."""
        selection = None
        if self.spec.selects_head_context:
            top, scores = scores[0][-1:], scores[1]
            selection = self.select(budget, mask_scores(top, first_pos - 1), first_pos - 1)
        rows = jnp.take_along_axis(scores, path[:, :, None], axis=1)
        pad = state.features.shape[1] - rows.shape[1]
        rows = jnp.pad(rows, ((0, 0), (0, pad), (0, 0))).astype(state.features.dtype)
        return PathRows(rows, first_pos, num_accepted, selection)

    def context(self, selection: Selection | None, rows: DraftRows, positions: jax.Array):
        """The head's attention for `rows` at RoPE `positions` [B, n]: causal over its cache (tree rows:
        the committed cache and their ancestors; within its window, `eagle.attention`), or the
        `selection` plus the tail from the last verified root, which reaches over the accepted path and
        the tree (depth + rows slots)."""
        if selection is None:
            return eagle.attention(self.spec.eagle, rows.slots, positions, self.spec.backend, tree=rows.mask)
        tree = self.spec.shape
        return self.sparse_attend(selection.idx, selection.n_idx, selection.tail_start, rows, tree.depth + tree.rows,
                                  scale=self.spec.eagle.head_dim**-0.5)[0]

    def draft(self, params, tokens, length, done, cache, state: PathRows, key, rules):
        """Catch-up on the accepted path, then the tree, depth by depth (see the module docstring)."""
        ecfg, tree, backend = self.spec.eagle, self.spec.shape, self.spec.backend
        rules = self.spec.draft_rules(rules)
        head = params["eagle"]
        B, live = length.shape[0], ~done
        path = jnp.arange(state.features.shape[1], dtype=jnp.int32)
        positions = state.first[:, None] + path
        emitted = jnp.take_along_axis(tokens, jnp.minimum(positions + 1, tokens.shape[1] - 1), axis=1)
        valid = (path[None, :] <= state.num_accepted[:, None]) & live[:, None]
        catch_up = DraftRows(state.first, jnp.int32(0), path, None, chain=True)  # row d at slot first + d, causal
        out, head_cache = eagle.feature_forward(head, ecfg, params, self.cfg, emitted, state.features, positions, valid,
                                                cache.head, backend, self.context(state.selection, catch_up, positions))
        root = jnp.take_along_axis(out, state.num_accepted[:, None, None], axis=1)  # [B, 1, H]: the last emitted token's

        first = jnp.where(done, 0, length - 2)  # the head's root slot: the catch-up's last row
        pending = jnp.take_along_axis(tokens, (length - 1)[:, None], axis=1)[:, 0]
        draft_tokens = jnp.zeros((B, tree.rows), jnp.int32).at[:, 0].set(pending)
        draft_probs = None if rules.greedy else jnp.zeros((B, tree.rows, ecfg.draft_vocab_size), jnp.float32)
        states = jnp.zeros((B, tree.rows, root.shape[-1]), root.dtype).at[:, :1].set(root)
        keys = split_rows(key, tree.depth)
        for depth in range(tree.depth):
            rows = tree.parents_at(depth)
            if depth:  # the nodes of this depth through the head, each on its parent's output state
                nodes = DraftRows(first, jnp.int32(depth), jnp.asarray(rows), jnp.asarray(tree.ancestors[rows]), tree.is_chain)
                embeds = eagle.token_embeds(head, params, self.cfg, draft_tokens[:, rows])
                at = jnp.broadcast_to(nodes.position[:, None], (B, len(rows)))
                out, head_cache = eagle.head_forward(
                    head, ecfg, embeds, states[:, tree.parent[rows]], at, jnp.broadcast_to(live[:, None], at.shape),
                    head_cache, self.context(state.selection, nodes, at), slots=nodes.slots, backend=backend)
                states = states.at[:, rows].set(out)
            logits = eagle.draft_logits(head, ecfg, params, self.cfg, states[:, rows], backend)
            kids = tree.kids(rows)  # a node's missing children: dropped
            children, q = expand(keys[depth], logits, kids.shape[1], rules, backend)
            draft_tokens = draft_tokens.at[:, kids].set(eagle.to_target_ids(head["d2t"], children), mode="drop")
            if q is not None:
                draft_probs = draft_probs.at[:, rows].set(q)
        # q over the target vocabulary in one scatter for the whole tree, not one a depth
        probs = None if rules.greedy else eagle.to_target_probs(head["d2t"], draft_probs, self.cfg.vocab_size)
        return draft_tokens, probs, dataclasses.replace(cache, head=head_cache), state
