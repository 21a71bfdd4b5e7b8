"""NSA attention for the rows of a draft tree: each row attends exactly as if its root-to-node path
were the next tokens after the committed cache (reference, any T; nsa_grouped's SSV kernel is
the fast path).

Tree row t sits at slot first + t and at position first + depth(t); on its path the key at position
first + j (j <= depth(t)) is that of its ancestor of depth j. NSA's blocks, selection and window are
positional, so every key read goes through the row's position -> slot map, and the compressed blocks
holding tree positions are recomputed per row from its path (the cache's entries there mix siblings).
"""
import jax.numpy as jnp
import numpy as np

from pallas_kernels import paging
from pallas_kernels.nsa_compressed import nsa_compressed_rows, select_blocks
from pallas_kernels.nsa_selected import nsa_selected_reference


def tree_paths(ancestors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(depth [T], paths [T, D + 1]): each row's depth and its ancestor row at every depth (rows past
    its depth repeat itself; they are never read). Parents precede children in the rows' order."""
    ancestors = np.asarray(ancestors, bool)
    depth = ancestors.sum(axis=1) - 1
    paths = np.zeros((len(depth), depth.max() + 1), np.int32)
    for t in range(len(depth)):
        rows = np.flatnonzero(ancestors[t])
        paths[t] = np.concatenate([rows, np.full(paths.shape[1] - len(rows), t)])
    return depth.astype(np.int32), paths


def path_slot_map(first, paths: np.ndarray):
    """positions [B, T, ...] -> the slots holding them on each row's path."""
    D = paths.shape[1] - 1

    def slot_of(pos):
        shape = (pos.shape[0], pos.shape[1]) + (1,) * (pos.ndim - 2)
        start = first.reshape((-1,) + (1,) * (pos.ndim - 1))
        rel = pos - start
        rows = jnp.arange(pos.shape[1]).reshape((1, -1) + (1,) * (pos.ndim - 2))
        on_path = start + jnp.asarray(paths)[jnp.broadcast_to(rows, shape), jnp.clip(rel, 0, D)]
        return jnp.where(rel < 0, pos, on_path)

    return slot_of


def nsa_tree_reference(q, k_pool, v_pool, k_cmp, v_cmp, pages, layer, first, ancestors, gates, *, page_size: int,
                       block_size: int, block_counts: int, window: int, rule: str, scale: float):
    """q [B, T, Hq, Dh] of the tree rows (slots first + t), the pools [L, Hkv, N, Dh] holding their
    keys and k_cmp/v_cmp [L, Hkv, N / block_size, Dh], both through pages [B, R]; ancestors [T, T]
    (static), gates [B, T, Hq, 3]. Returns (out [B, T, Hq, Dh], importance weights [B, T, Hkv, NB],
    positions [B, T])."""
    B, T, Hq, Dh = q.shape
    depth, paths = tree_paths(ancestors)
    q_pos = first[:, None] + jnp.asarray(depth)
    slot_of = path_slot_map(first, paths)
    entries = page_size // block_size
    NB = pages.shape[1] * entries

    # Each row's compressed view: the blocks from the root's block on hold path keys.
    m = min((paths.shape[1] - 1) // block_size + 2, NB)
    blocks = jnp.minimum(first[:, None] // block_size + jnp.arange(m), NB - 1)  # [B, m]
    pos = blocks[:, None, :, None] * block_size + jnp.arange(block_size)  # [B, 1, m, bs]
    slots = slot_of(jnp.broadcast_to(pos, (B, T, m, block_size)))
    b = jnp.arange(B)[:, None, None, None]

    def view(pool, cmp):  # [B, T, Hkv, NB, Dh]: the shared blocks, the path's blocks recomputed
        x = paging.layer_view(pool, layer, pages, page_size)  # [B, Hkv, S, Dh]
        Hkv = x.shape[1]
        means = jnp.mean(jnp.moveaxis(x, 1, 2)[b, slots].astype(jnp.float32), axis=3)  # [B, T, m, Hkv, Dh]
        shared = jnp.broadcast_to(paging.layer_view(cmp, layer, pages, entries)[:, None], (B, T, Hkv, NB, Dh))
        rows = jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], slice(None), blocks[:, None, :]
        return shared.at[rows].set(means.astype(cmp.dtype)).reshape(B * T, Hkv, NB, Dh)

    o_cmp, weights = nsa_compressed_rows(q.reshape(B * T, 1, Hq, Dh), view(k_pool, k_cmp), view(v_pool, v_cmp),
                                         q_pos.reshape(B * T, 1), block_size=block_size, scale=scale)
    o_cmp, weights = o_cmp.reshape(B, T, Hq, Dh), weights.reshape(B, T, -1, NB)
    idx = select_blocks(weights, q_pos, block_size=block_size, block_counts=block_counts, rule=rule)
    out = nsa_selected_reference(q, k_pool, v_pool, pages, layer, q_pos, idx, o_cmp, gates, page_size=page_size,
                                 block_size=block_size, window=window, scale=scale, slot_of=slot_of)
    return out, weights, q_pos
