"""NSA attention in the decoder: the three gated branches over the KV cache and its compressed blocks.

The layer's q/k/v (post-RoPE) and gates come from the shared decoder (`decoder.forward`); the cache
write already refreshed the compressed blocks (`kvcache.KVCache.written`). Each query row is exact on
its own: its own compressed view, selection and window, so verifying T rows equals T decode steps.

Score-collecting drafters (vegas, all_rows, last_accepted) on an NSA target collect what NSA's own
pass computes instead of a full attention row: a slot's score is the compressed softmax weight of its
block (averaged over query heads, and over the collected rows as on dense models); slots of the
query's not yet complete block score 1 (above any weight), so the most recent tokens are kept first.

Verification of draft rows (a `Verification`, SSV's grouped verification): the rows (a draft tree, or
a chain as the tree 1, ..., 1) run the grouped kernel (`pallas_kernels.nsa_grouped`): each row
attends its root-to-node path as if it were the next tokens, adjacent rows in groups sharing their
loaded blocks. Exact groups are lossless; a shared index (one representative row's blocks per group)
and reuse layers (the nearest earlier refresh layer's selection, no compressed branch) change the
model's attention and are only used when a precision class asks for them. Collected scores of tree
rows are laid out by slot like a dense verify row's: a tree slot takes the score of its position if it
is on the row's path (so they move with the accepted path's keys, as on dense models).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

import pallas_kernels as kernels
from pallas_kernels.nsa_compressed import visible_blocks
from pallas_kernels.nsa_selected import MAX_PALLAS_ROWS as SELECTED_ROWS  # the rows its decode kernel takes
from pallas_kernels.verify_attention import mask_scores
from jaxspec.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Verification:
    """How a target pass verifies its rows (static): `group` adjacent rows per program (0: by the
    verified shape, `kernels.auto_group`); a group shares its representative row's blocks when
    `shared_index`; `reuse` runs the model's calibrated refresh/reuse schedule
    (NSAConfig.refresh_layers)."""

    group: int = 0
    shared_index: bool = False
    reuse: bool = False


def refresh_mask(cfg: ModelConfig, verification: Verification | None) -> np.ndarray | None:
    """[L] bool: the layers that compute their own selection under `verification`'s schedule (None:
    every layer, no reuse)."""
    if verification is None or not verification.reuse:
        return None
    L = cfg.num_layers
    return cfg.nsa.reuse_source(L) == np.arange(L)


def initial_carry(cfg: ModelConfig, q_pos, num_slots: int, reuse: bool):
    """The layer-to-layer carry of `attend_fn`: under reuse the last refresh layer's (blocks,
    importance weights) [B, T, Hkv, S] and [B, T, Hkv, NB]; () otherwise."""
    if not reuse:
        return ()
    B, T = q_pos.shape
    Hkv, nsa = cfg.num_kv_heads, cfg.nsa
    return (jnp.full((B, T, Hkv, nsa.block_counts), -1, jnp.int32),
            jnp.zeros((B, T, Hkv, num_slots // nsa.block_size), jnp.float32))


def attend_fn(cfg: ModelConfig, q_pos, backend: str, collect: kernels.Collect | None = None, tree=None,
              verification: Verification | None = None, refresh=None):
    """The decoder's `attend` for NSA layers at query positions q_pos [B, T] (see decoder.AttendFn);
    with a draft tree's mask, q_pos are the rows' slots. `verification` marks a target pass over
    draft rows (None: prefill or scoring, rows at consecutive positions). `refresh` [L] bool (may be
    traced; calibration) sets a refresh/reuse schedule; by default the verification's. With a
    schedule the carry is `initial_carry(..., reuse=True)`'s, else ().

    A chain (no tree mask, up to SELECTED_ROWS rows) in exact groups of one row is T decode steps at
    consecutive positions (the cache refreshes the compressed blocks the rows complete before any row
    reads them), so it runs the rows' own attention, the decode step's kernels, rather than the tree
    path's per-path views and group schedule: the group is resolved per layer from the shapes
    (`kernels.auto_group`)."""
    if refresh is None:
        refresh = refresh_mask(cfg, verification)
    rows = q_pos.shape[1]
    if verification is None or rows == 1:
        return _rows_attend_fn(cfg, q_pos, collect, refresh, backend)
    if tree is not None or verification.shared_index or rows > SELECTED_ROWS:
        tree = chain_mask(q_pos) if tree is None else tree
        return _tree_attend_fn(cfg, tree, collect, verification, refresh, backend)
    as_tree = _tree_attend_fn(cfg, chain_mask(q_pos), collect, verification, refresh, backend)
    as_rows = _rows_attend_fn(cfg, q_pos, collect, refresh, backend)

    def attend(layer, q, cache, lx, gates, carry):
        group = verification.group or kernels.auto_group(q.shape[0], rows, cache.k.shape[1], shared=False)
        return (as_rows if group == 1 else as_tree)(layer, q, cache, lx, gates, carry)

    return attend


def chain_mask(q_pos) -> kernels.TreeMask:
    """The tree 1, ..., 1 of a chain whose root is at q_pos[:, 0]."""
    return kernels.TreeMask(q_pos[:, 0], np.tril(np.ones((q_pos.shape[1],) * 2, bool)))


def _rows_attend_fn(cfg: ModelConfig, q_pos, collect: kernels.Collect | None, refresh, backend: str):
    """NSA for rows at their own consecutive positions q_pos [B, T] (prefill, decode, a chain)."""
    nsa = cfg.nsa
    scale = cfg.head_dim**-0.5

    def selection(layer, q, cache):
        return kernels.nsa_compressed_attention(
            q, cache.k_cmp, cache.v_cmp, cache.pages, layer, q_pos, page_size=cache.page_size,
            block_size=nsa.block_size, block_counts=nsa.block_counts, rule=nsa.topk_rule, scale=scale, backend=backend,
        )

    def attend(layer, q, cache, _, gates, carry):
        if refresh is None:
            o_cmp, weights, idx = selection(layer, q, cache)
        else:  # a reuse layer takes the carried selection and drops the compressed branch
            o_cmp, weights, idx = lax.cond(
                jnp.asarray(refresh)[layer], selection, lambda *_: (jnp.zeros_like(q), carry[1], carry[0]), layer, q, cache)
            carry = (idx, weights)
        out = kernels.nsa_selected_attention(
            q, cache.k, cache.v, cache.pages, layer, q_pos, idx, o_cmp, gates, page_size=cache.page_size,
            block_size=nsa.block_size, window=nsa.window_size, scale=scale, backend=backend,
        )
        scores = None if collect is None else collected_scores(weights, q_pos, collect, cfg.group_size, cache.num_slots)
        return out, scores, carry

    return attend


def _tree_attend_fn(cfg: ModelConfig, tree: kernels.TreeMask, collect: kernels.Collect | None,
                    verification: Verification, refresh, backend: str):
    nsa = cfg.nsa
    options = dict(group=verification.group, shared=verification.shared_index, block_size=nsa.block_size,
                   block_counts=nsa.block_counts, window=nsa.window_size, rule=nsa.topk_rule,
                   scale=cfg.head_dim**-0.5, backend=backend)

    def rows_attention(layer, q, cache, gates, idx=None):
        return kernels.nsa_tree_attention(q, cache.k, cache.v, cache.k_cmp, cache.v_cmp, cache.pages, layer,
                                          tree.first, tree.ancestors, gates, idx, page_size=cache.page_size,
                                          **options)

    def attend(layer, q, cache, _, gates, carry):
        if refresh is not None:  # a reuse layer takes the carried selection and skips the compressed branch
            def reused(layer, q, cache, gates):
                out, _, q_pos, _ = rows_attention(layer, q, cache, gates, carry[0])
                return out, carry[1], q_pos, carry[0]

            out, weights, q_pos, idx = lax.cond(
                jnp.asarray(refresh)[layer], rows_attention, reused, layer, q, cache, gates)
            carry = (idx, weights)
        else:
            out, weights, q_pos, _ = rows_attention(layer, q, cache, gates)
        if collect is None:
            return out, None, carry
        return out, _tree_scores(cfg, tree, collect, weights, q_pos, cache.num_slots), carry

    return attend


def _tree_scores(cfg: ModelConfig, tree: kernels.TreeMask, collect: kernels.Collect, weights, q_pos, S: int):
    """Position-indexed scores -> slot-indexed: tree slot first + r holds row r's position, visible to
    row t iff r is on t's path."""
    T = q_pos.shape[1]
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
        return mask_scores(by_slot.mean(axis=1), slot_pos[:, 0])
    return by_slot


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
