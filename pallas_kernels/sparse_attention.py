"""Sparse draft attention: T query rows per sequence over a selected subset of the KV cache.

Row (b, t) attends the union of (a) the gathered slots idx[b, s, :n_idx[b]] (s: one shared set,
Hs == 1, or one per KV head, Hs == Hkv), shared by the T rows (idx may be a layer stack
[L, B, Hs, K], read at the layer in place: a slice of a stack inside the layer scan would be copied
before the kernel), and (b) the tail slots
tail_start[b] .. q_slot[b, t]. A chain drafts one row per step (T = 1); a draft
tree drafts the T nodes of one depth in one step, and its `TreeMask` narrows the tail to the slots
before the root and the row's own ancestors. The caller guarantees the gathered slots are distinct
and below tail_start, so nothing is counted twice, and that the tail holds at most `tail_capacity`
slots. Optionally a row sees no slot below lo[b, t] (a sliding window: gathered or tail), and each
head's sink logit joins its softmax's denominator (gpt-oss's attention sinks: a key of value 0).

The Pallas kernel packs the T rows with their G heads into row blocks as verify attention does
(`_common.row_blocks`): every program gathers the selected keys once for its whole row block.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import paging
from pallas_kernels.verify_attention import TreeMask, ancestor_visible, check_options, option_inputs, tree_words
from pallas_kernels._common import (
    MIN_TILE,
    compiler_params,
    init_carry,
    matmul_precision,
    merged,
    next_pow2,
    num_splits,
    row_blocks,
    softmax_step,
    softmax_weights,
    split_outputs,
    split_range,
    store_split,
    tile_positions,
    tile_queries,
    tile_sinks,
)

BLOCK_K = 64


def _check(q, k_pool, v_pool, pages, idx, n_idx, tail_start, q_slot, tree, sinks, lo, page_size):
    B, T, Hq, Dh = q.shape
    L, Hkv, N, Dk = k_pool.shape
    paging.check_page_size(page_size)
    if Dk != Dh or v_pool.shape != k_pool.shape or Hq % Hkv or N % page_size or pages.ndim != 2 or pages.shape[0] != B:
        raise ValueError(f"shapes do not match: q {q.shape}, k_pool {k_pool.shape}, v_pool {v_pool.shape}, "
                         f"pages {pages.shape} (page size {page_size})")
    if idx.ndim not in (3, 4) or idx.shape[-3] != B or idx.shape[-2] not in (1, Hkv):
        raise ValueError(f"idx must be [(L,) B, 1 or Hkv, K] = [(L,) {B}, 1|{Hkv}, K], got {idx.shape}")
    for name, x in (("n_idx", n_idx), ("tail_start", tail_start)):
        if x.shape != (B,):
            raise ValueError(f"{name} must be [B] = [{B}], got {x.shape}")
    if q_slot.shape != (B, T):
        raise ValueError(f"q_slot must be [B, T] = {(B, T)}, got {q_slot.shape}")
    check_options(sinks, lo, L, Hq, B, T)
    if tree is not None and tree.ancestors.shape[0] != T:
        raise ValueError(f"TreeMask.ancestors must have T={T} rows, got {tree.ancestors.shape}")


def sparse_attention_reference(q, k_pool, v_pool, pages, layer, idx, n_idx, tail_start, q_slot, *,
                               page_size: int, scale: float, tail_capacity: int, tree: TreeMask | None = None,
                               sinks=None, lo=None):
    """Plain jnp: gathers the selected keys and a tail_capacity-long tail window from the rows' view of
    the pool, masks, softmax."""
    _check(q, k_pool, v_pool, pages, idx, n_idx, tail_start, q_slot, tree, sinks, lo, page_size)
    B, T, Hq, Dh = q.shape
    Hkv, S = k_pool.shape[1], pages.shape[1] * page_size
    G, K = Hq // Hkv, idx.shape[-1]
    precision = matmul_precision(q.dtype)
    k = paging.layer_view(k_pool, layer, pages, page_size)
    v = paging.layer_view(v_pool, layer, pages, page_size)
    idx = lax.dynamic_index_in_dim(idx, layer, 0, keepdims=False) if idx.ndim == 4 else idx
    tail = tail_start[:, None] + jnp.arange(tail_capacity)  # [B, C]
    slots = jnp.concatenate([jnp.broadcast_to(idx, (B, Hkv, K)),
                             jnp.broadcast_to(tail[:, None], (B, Hkv, tail_capacity))], axis=2)
    if lo is not None:  # [B, Hkv, T, K + C]: a gathered slot's bound differs by KV head
        above = slots[:, :, None, :] >= lo[:, None, :, None]
    slots = jnp.clip(slots, 0, S - 1)[..., None]
    tail_seen = tail[:, None, :] <= q_slot[..., None]  # [B, T, C]
    if tree is not None:
        tail_seen &= tree.visible(jnp.broadcast_to(tail[:, None, :], tail_seen.shape),
                                  jnp.broadcast_to(jnp.arange(T), (B, T)))
    gathered = jnp.broadcast_to((jnp.arange(K) < n_idx[:, None])[:, None, :], (B, T, K))
    visible = jnp.concatenate([gathered, tail_seen], axis=2)[:, None]  # [B, 1, T, K + C]
    if lo is not None:
        visible = visible & above
    keys = jnp.take_along_axis(k, slots, axis=2)
    values = jnp.take_along_axis(v, slots, axis=2)
    q5 = jnp.moveaxis(q.reshape(B, T, Hkv, G, Dh), 2, 1)  # [B, Hkv, T, G, Dh]
    logits = jnp.einsum("bktgd,bknd->bktgn", q5, keys,
                        precision=precision, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(visible[:, :, :, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1) if sinks is None else softmax_weights(logits, sinks, layer)[0]
    p = p.astype(v.dtype)
    out = jnp.einsum("bktgn,bknd->bktgd", p, values, precision=precision,
                     preferred_element_type=jnp.float32)
    return jnp.moveaxis(out, 1, 2).reshape(B, T, Hq, Dh).astype(q.dtype)


def _sparse_kernel(layer_ref, n_idx_ref, tail_ref, idx_ref, q_slot_ref, pages_ref, q_ref, k_ref, v_ref, *refs,
                   scale, block_k, page_size, n_splits, rows, G, T, tile, tree, stacked, sinks, window):
    """Program (b, kv head h, row block r, split): its share of the gathered blocks (seen by every
    row) followed by the tail blocks up to the block's last q_slot (each row up to its own, and with
    a tree only over its ancestors). With lower bounds (`window`) each row sees no slot below its
    own, and the tail starts at the block's lowest. Split 0 starts its rows' softmax with their
    heads' sinks.

    Every block is a token-granular gather (slot vector of block_k rows), each logical slot through
    the page table (one lookup for gathered and tail slots alike: fewer registers than a block start
    for the tail). The tail's blocks are aligned to block_k, so each is one run of a page (slots
    before tail_start are masked). Slots past the list or the table are clamped into it and masked
    out of the softmax.
    """
    b, h, r, split = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    layer, n_idx, tail_start = layer_ref[0], n_idx_ref[b], tail_ref[b]
    idx_layer = layer if stacked else 0  # idx is one layer's [1, B, Hs, K] or the stack
    shared, K = idx_ref.shape[2] == 1, idx_ref.shape[3]
    R = pages_ref.shape[1]
    last_slot = R * page_size - 1
    q = tile_queries(q_ref, b, h, r, rows, G, tile, T)
    pos = tile_positions(q_slot_ref, b, r, rows, G, tile)
    if tree:
        first_ref, words_ref, *refs = refs
        first, lo_word, hi_word = first_ref[b], words_ref[0], words_ref[1]
    if sinks:
        sinks_ref, *refs = refs
    if window:
        lo_ref, *refs = refs
        row_lo = tile_positions(lo_ref, b, r, rows, G, tile, fill=jnp.iinfo(jnp.int32).max)
        tail_start = jnp.maximum(tail_start, jnp.min(row_lo))
    o_ref, lse_ref = refs
    tail_first = tail_start // block_k * block_k
    n_gather = (n_idx + block_k - 1) // block_k
    n_tail = jnp.where(jnp.max(pos) >= tail_start, (jnp.max(pos) - tail_first + block_k) // block_k, 0)
    lo, hi = split_range(split, n_splits, n_gather + n_tail)

    def block(i, carry):
        """Block i: gathered slots while i < n_gather, then the tail's: one loop for both, a little
        faster than a loop each (bench/NOTES.md, "what a gathered row costs")."""
        j = i * block_k + jnp.arange(block_k)
        gathered = idx_ref[idx_layer, b, 0 if shared else h, jnp.minimum(j, K - 1)]
        tail = tail_first + (i - n_gather) * block_k + jnp.arange(block_k)
        in_gather = i < n_gather
        wanted = jnp.where(in_gather, gathered, tail)
        at = jnp.clip(wanted, 0, last_slot)
        slots = paging.pool_slot(pages_ref, b, at, page_size)
        tail_visible = (tail[None, :] >= tail_start) & (tail[None, :] <= pos[:, None])
        if tree:
            tail_visible = tail_visible & ancestor_visible(tail[None, :] - first, lo_word, hi_word)
        visible = jnp.where(in_gather, (j < n_idx)[None, :], tail_visible)
        if window:
            visible = visible & (wanted[None, :] >= row_lo[:, None])
        k = k_ref[layer, h, slots, :]
        v = v_ref[layer, h, slots, :]
        logits = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        return softmax_step(carry, logits, visible, v)

    sink = tile_sinks(sinks_ref, layer, h, G, tile, split) if sinks else None
    carry = lax.fori_loop(lo, hi, block, init_carry(q.shape[0], q.shape[1], sink))
    store_split(o_ref, lse_ref, carry, rows * G)


def sparse_attention_pallas(q, k_pool, v_pool, pages, layer, idx, n_idx, tail_start, q_slot, *,
                            page_size: int, scale: float, tail_capacity: int, tree: TreeMask | None = None,
                            sinks=None, lo=None, interpret: bool = False, block_k: int = BLOCK_K,
                            n_splits: int | None = None, skew: float = 1.0):
    """Pallas-Triton kernel. Grid (B, Hkv, row blocks, n_splits): a row block is up to 16 query rows
    (more when G < 4) with the G heads of one KV head, packed as row t*G + g, so they share each
    gathered K/V block; split-K over the (traced) gathered + tail blocks, the splits merged by one
    more kernel (_common.merged).

    tail_capacity only sizes the static split count; `skew` is how far a row's gathered and tail
    blocks may exceed the rows' mean (a shared budget's balance), which multiplies it
    (_common.num_splits) when there is more than one row. Sinks join split 0's online softmax as a
    key of value 0 (`_common.init_carry`), so the merge counts each once. Head dim must be a power of
    two >= 16; block_k must divide the page size (a tail block lies in one page).
    """
    _check(q, k_pool, v_pool, pages, idx, n_idx, tail_start, q_slot, tree, sinks, lo, page_size)
    B, T, Hq, Dh = q.shape
    Hkv = k_pool.shape[1]
    G = Hq // Hkv
    if Dh != next_pow2(Dh) or Dh < MIN_TILE:
        raise ValueError(f"the Pallas sparse kernel needs a power-of-two head dim >= 16, got {Dh}")
    if page_size % block_k:
        raise ValueError(f"the key block {block_k} must divide the page size {page_size}")
    n_blocks, rows, tile = row_blocks(T, G)
    # the split count's estimate of the blocks (an aligned-down tail may take one more; it only shifts shares)
    max_blocks = pl.cdiv(idx.shape[-1], block_k) + pl.cdiv(tail_capacity, block_k)
    n_splits = n_splits or num_splits(B * Hkv * n_blocks, max_blocks, skew if B > 1 else 1.0)  # one row: no mean to exceed
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    stacked, idx = idx.ndim == 4, idx if idx.ndim == 4 else idx[None]
    n_idx, tail_start, idx, q_slot = (jnp.asarray(x, jnp.int32) for x in (n_idx, tail_start, idx, q_slot))
    kernel = functools.partial(_sparse_kernel, scale=scale, block_k=block_k, page_size=page_size, n_splits=n_splits,
                               rows=rows, G=G, T=T, tile=tile, tree=tree is not None, stacked=stacked,
                               sinks=sinks is not None, window=lo is not None)
    in_specs = [pl.no_block_spec] * 9
    args = [layer, n_idx, tail_start, idx, q_slot, jnp.asarray(pages, jnp.int32), q.reshape(B, T * Hq, Dh), k_pool,
            v_pool]
    if tree is not None:  # without a tree no mask inputs at all (zeros would cost a kernel per layer)
        first, words = tree_words(tree, G, n_blocks, rows, tile)
        in_specs += [pl.no_block_spec, pl.BlockSpec((2, None, tile), lambda b, h, r, s: (0, r, 0))]
        args += [first, words]
    specs, extra = option_inputs(sinks, lo)
    in_specs, args = in_specs + specs, args + extra
    out_specs, out_shape = split_outputs(B, Hkv, n_blocks, n_splits, rows * G, Dh, q.dtype)
    o_part, lse_part = pl.pallas_call(
        kernel, grid=(B, Hkv, n_blocks, n_splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=compiler_params(), interpret=interpret, name="sparse_attention",
    )(*args)
    return merged(o_part, lse_part, T, G, q.dtype, interpret)[0]
