"""NSA attention in the decoder: the three gated branches over the KV cache and its compressed blocks.

The layer's q/k/v (post-RoPE) and gates come from the shared decoder (`decoder.forward`); the cache
write already refreshed the compressed blocks (`kvcache.KVCache.write`). Each query row is exact on
its own: its own compressed view, selection and window, so verifying T rows equals T decode steps.

Score-collecting drafters (vegas, all_rows, last_accepted) on an NSA target collect what NSA's own
pass computes instead of a full attention row: a slot's score is the compressed softmax weight of its
block (averaged over query heads, and over the collected rows as on dense models); slots of the
query's not yet complete block score 1 (above any weight), so the most recent tokens are kept first.

Draft trees (a `TreeMask`): each row attends its root-to-node path as a chain
(`pallas_kernels.nsa_tree`, the reference path for now), and its collected scores are laid out by
slot like a dense verify row's: a tree slot takes the score of its position if it is on the row's
path (so they move with the accepted path's keys, as on dense models).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

import pallas_kernels as kernels
from pallas_kernels.nsa_compressed import visible_blocks
from pallas_kernels.nsa_tree import nsa_tree_reference
from pallas_kernels.verify_attention import mask_scores
from jaxspec.models.config import ModelConfig


def attend_fn(cfg: ModelConfig, q_pos, backend: str, collect: kernels.Collect | None = None, tree=None):
    """The decoder's `attend` for NSA layers at query positions q_pos [B, T] (see decoder.AttendFn);
    with a draft tree's mask, q_pos are the rows' slots."""
    nsa = cfg.nsa
    scale = cfg.head_dim**-0.5
    if tree is not None:
        return _tree_attend_fn(cfg, tree, collect)

    def attend(layer, q, cache, _, gates):
        o_cmp, weights, idx = kernels.nsa_compressed_attention(
            q, cache.k_cmp, cache.v_cmp, layer, q_pos, block_size=nsa.block_size, block_counts=nsa.block_counts,
            rule=nsa.topk_rule, scale=scale, backend=backend,
        )
        out = kernels.nsa_selected_attention(
            q, cache.k, cache.v, layer, q_pos, idx, o_cmp, gates, block_size=nsa.block_size,
            window=nsa.window_size, scale=scale, backend=backend,
        )
        scores = None if collect is None else collected_scores(weights, q_pos, collect, cfg.group_size, cache.num_slots)
        return out, scores

    return attend


def _tree_attend_fn(cfg: ModelConfig, tree: kernels.TreeMask, collect: kernels.Collect | None):
    nsa = cfg.nsa

    def attend(layer, q, cache, _, gates):
        out, weights, q_pos = nsa_tree_reference(
            q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, layer, tree.first, tree.ancestors, gates,
            block_size=nsa.block_size, block_counts=nsa.block_counts, window=nsa.window_size,
            rule=nsa.topk_rule, scale=cfg.head_dim**-0.5,
        )
        if collect is None:
            return out, None
        # Position-indexed scores -> slot-indexed: tree slot first + r holds row r's position,
        # visible to row t iff r is on t's path.
        T, S = q.shape[1], cache.num_slots
        slots = jnp.arange(S)
        rel = slots - tree.first[:, None]  # [B, S]
        in_tree = (rel >= 0) & (rel < T)
        r = jnp.clip(rel, 0, T - 1)
        position = jnp.where(in_tree, jnp.take_along_axis(q_pos, r, axis=1), slots)
        rows = np.asarray(collect.rows)
        seen = jnp.where(in_tree[:, None], jnp.asarray(tree.ancestors)[rows][:, r].transpose(1, 0, 2), True)  # [B, R, S]
        by_position = collected_scores(weights, q_pos, dataclasses.replace(collect, reduce_rows=False), cfg.group_size, S)
        by_slot = jnp.take_along_axis(by_position, jnp.broadcast_to(position[:, None], by_position.shape), axis=-1)
        slot_pos = tree.first[:, None] + rows  # the collected rows' own slots
        by_slot = mask_scores(jnp.where(seen, by_slot, 0.0), slot_pos)
        if collect.reduce_rows:
            return out, mask_scores(by_slot.mean(axis=1), slot_pos[:, 0])
        return out, by_slot

    return attend


def collected_scores(weights, q_pos, collect: kernels.Collect, group: int, num_slots: int):
    """Per-slot selection scores ([B, S], or [B, R, S] without reduce_rows) in the format of the dense
    verify kernel's collection, from the rows' block weights [B, T, Hkv, NB]."""
    rows = np.asarray(collect.rows)
    w, pos = weights[:, rows], q_pos[:, rows]  # [B, R, Hkv, NB], [B, R]
    NB = w.shape[-1]
    block_size = num_slots // NB
    per_block = w.mean(axis=2) / group  # mean over query heads of each head's softmax weight
    per_slot = jnp.repeat(jnp.where(visible_blocks(NB, block_size, pos), per_block, 1.0), block_size, axis=-1)
    per_slot = jnp.where(jnp.arange(num_slots) <= pos[..., None], per_slot, 0.0)
    if collect.reduce_rows:
        return mask_scores(per_slot.mean(axis=1), pos[:, 0])
    return mask_scores(per_slot, pos)
