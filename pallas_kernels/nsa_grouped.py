"""SSV grouped NSA verification of a draft tree's rows (docs/architecture.md, "NSA and SSV"): the fast path of
`nsa_tree.nsa_tree_reference`, which stays the oracle.

Tree row t sits at slot first + t and position p_t = first + depth(t) and attends its root-to-node
path as if it were the next tokens (nsa_tree): a key at position first + j (j <= depth(t)) is its
ancestor of depth j, at slot first + (that ancestor's row).
- `nsa_tree_compressed`: every row's compressed branch and block importance. Blocks complete before
  `first` are committed and the same for every row (nsa_compressed's kernels); only the blocks
  holding tree positions differ (per-row extra keys).
- `group_schedule`: rows in groups of `group` adjacent rows of the flattened order; per (sequence,
  KV head, group) the union of the rows' selected blocks and which rows select each.
- `nsa_grouped_reference` / `nsa_grouped_pallas`: the selected and sliding-window branches and the
  gates. A row's selected branch: committed keys (slots < first) of its blocks, plus the ancestors
  whose positions lie in its blocks; its window: committed slots [p_t - w + 1, first) plus the
  ancestors at positions > p_t - w.

Exact groups (shared=False) give each row its own selection: the output is the oracle's. A shared
index gives the whole group one representative row's blocks: fewer blocks to load, but it changes
the target's attention (a precision class). The representative is the group's first
row: in BFS order the group's shallowest row (in DFS order a later row of another subtree may be
shallower), so each of its blocks ends at or before every group row's position and no block is
spent on a row that cannot see it; a deeper row's newest keys, which its own forced block would
hold, stay covered by its window when w >= block_size.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paging
from pallas_kernels._common import (
    MIN_TILE,
    init_carry,
    matmul_precision,
    next_pow2,
    softmax_step,
    tile_compiler_params,
    tile_row_blocks,
)
from pallas_kernels.nsa_compressed import MAX_TILE_ELEMS, nsa_compressed_reference
from pallas_kernels.nsa_selected import BLOCK_K, _attend
from pallas_kernels.nsa_tree import path_slot_map, tree_paths

MAX_PALLAS_ROWS = 64   # two 32-bit words of tree-key bits per row
MAX_GROUP = 32         # one 32-bit membership word per union block
SHARED_GROUP = 8       # a shared index's group when none is asked for (the precision class as calibrated)
GRID_PROGRAMS = 256    # the programs `auto_group` keeps: two waves on a 132-SM H100 / H200
_NO_BLOCK = np.iinfo(np.int32).max
_PAD_POS = 1 << 30     # padding rows' position: above every window


def nsa_tree_compressed(q, k_pool, v_pool, k_cmp, v_cmp, pages, layer, first, ancestors, *, page_size: int,
                        block_size: int, scale: float, compressed=nsa_compressed_reference):
    """q [B, T, Hq, Dh] of the tree rows, the pools [L, Hkv, N, Dh] and k_cmp/v_cmp
    [L, Hkv, N / block_size, Dh] through pages [B, R], first [B], ancestors [T, T] (static). Returns
    o_cmp [B, T, Hq, Dh] (q.dtype), importance weights [B, T, Hkv, NB] float32 and the rows'
    positions q_pos [B, T] int32: nsa_tree_reference's.

    The shared blocks, (c + 1) * bs <= first, come from k_cmp through `compressed`
    (nsa_compressed_reference or nsa_compressed_pallas) as if every row stood at first - 1 (the
    same blocks visible to all); each row's path blocks (from first // bs on, complete for the row:
    at most D // bs + 1), recomputed as means of its path keys, join its softmax as that function's
    extra keys, and their weights are added back at their block columns.
    """
    B, T = q.shape[:2]
    bs = block_size
    NB = pages.shape[1] * page_size // bs
    depth, paths = tree_paths(ancestors)
    q_pos = (first[:, None] + jnp.asarray(depth)).astype(jnp.int32)
    own = first // bs                                                       # first block holding tree keys
    P = min((paths.shape[1] - 1) // bs + 1, NB)
    blocks = own[:, None] + jnp.arange(P)                                   # [B, P]
    on_path = ((blocks[:, None] + 1) * bs - 1 <= q_pos[:, :, None]) & (blocks[:, None] < NB)  # [B, T, P]
    pos = jnp.broadcast_to(blocks[:, None, :, None] * bs + jnp.arange(bs), (B, T, P, bs))
    slots = jnp.clip(path_slot_map(first, paths)(pos), 0, NB * bs - 1)
    b = jnp.arange(B)[:, None, None, None]

    def path_means(pool):  # [B, T, P, Hkv, Dh], rounded to k_cmp's dtype as nsa_tree_reference's
        x = jnp.moveaxis(paging.layer_view(pool, layer, pages, page_size), 1, 2)
        return jnp.mean(x[b, slots].astype(jnp.float32), axis=3).astype(k_cmp.dtype)

    shared_pos = jnp.broadcast_to(own[:, None] * bs - 1, (B, T))
    o, weights = compressed(q, k_cmp, v_cmp, pages, layer, shared_pos, page_size=page_size, block_size=bs,
                            scale=scale, extra=(path_means(k_pool), path_means(v_pool), on_path))
    Hkv = weights.shape[2]
    cols = jnp.broadcast_to(jnp.minimum(blocks, NB - 1)[:, None, None, :], (B, T, Hkv, P))
    rows = jnp.arange(T)[None, :, None, None], jnp.arange(Hkv)[None, None, :, None]
    return o, weights[..., :NB].at[b, rows[0], rows[1], cols].add(weights[..., NB:]), q_pos


class GroupSchedule(NamedTuple):
    """What the rows of each group read. NG groups of g rows (rows past T are padding, selecting
    nothing); U = g * S for exact groups, S for a shared index."""

    row_idx: jax.Array        # [B, T, Hkv, S] the blocks each row attends: its own, or its representative's
    blocks: jax.Array         # [B, Hkv, NG, U] the union of the group's row_idx, ascending, then -1
    count: jax.Array          # [B, Hkv, NG] valid entries of blocks
    member: jax.Array         # [B, Hkv, NG, U, g] bool: group row i attends blocks[u]
    tree_selected: jax.Array  # [B, T, Hkv, T] bool: row t's blocks hold tree key r's position first + depth(r)


def auto_group(batch: int, rows: int, kv_heads: int, shared: bool) -> int:
    """The group of `--group 0` (the default): for exact groups, the largest of 8, 4, 2 whose grid
    (batch x kv_heads x groups) still has GRID_PROGRAMS programs, else 1. A program walks its group's
    union of blocks serially, so few programs leave the GPU idle (1 x 7K and 8 x 7K, a 5-row chain
    on NSA SmolLM2, H200: group 1 verifies 20% faster than 8), while with programs to spare a group
    loads each shared block once (batch 8, 63 rows, H100: group 4 1.6x faster than 1, 1.3x than
    8). Exact groups give every row its own result, so the choice changes time only. A shared index
    changes the attention with the group: it keeps SHARED_GROUP."""
    if shared:
        return SHARED_GROUP
    return next((g for g in (8, 4, 2) if batch * kv_heads * -(-rows // g) >= GRID_PROGRAMS), 1)


def group_schedule(idx, first, depth, *, group: int, shared: bool, block_size: int) -> GroupSchedule:
    """idx [B, T, Hkv, S] selected blocks (-1: none; a row's blocks distinct, as select_blocks
    returns), first [B], depth [T] (static). Groups are rows [n*g, (n+1)*g) with g = min(group, T);
    with `shared` every row takes its group's first row's blocks."""
    B, T, Hkv, S = idx.shape
    g = min(group, T)
    NG = -(-T // g)
    row_idx = idx[:, np.arange(T) // g * g] if shared else idx
    grouped = jnp.pad(row_idx, ((0, 0), (0, NG * g - T), (0, 0), (0, 0)), constant_values=-1)
    grouped = jnp.moveaxis(grouped.reshape(B, NG, g, Hkv, S), 3, 1)        # [B, Hkv, NG, g, S]
    candidates = grouped[:, :, :, 0] if shared else grouped.reshape(B, Hkv, NG, g * S)
    s = jnp.sort(jnp.where(candidates < 0, _NO_BLOCK, candidates), axis=-1)
    if g > 1 and not shared:  # one row's blocks are distinct already; a group's rows share some
        repeat = jnp.concatenate([jnp.zeros_like(s[..., :1], bool), s[..., 1:] == s[..., :-1]], axis=-1)
        s = jnp.sort(jnp.where(repeat, _NO_BLOCK, s), axis=-1)
    blocks = jnp.where(s == _NO_BLOCK, -1, s).astype(jnp.int32)
    member = (blocks[..., None, None] == grouped[:, :, :, None]).any(axis=-1) & (blocks >= 0)[..., None]
    tree_blocks = (first[:, None] + jnp.asarray(depth)) // block_size        # [B, T]
    tree_selected = (row_idx[:, :, :, None, :] == tree_blocks[:, None, None, :, None]).any(axis=-1)
    return GroupSchedule(row_idx, blocks, (blocks >= 0).sum(axis=-1, dtype=jnp.int32), member, tree_selected)


def nsa_grouped_reference(q, k_pool, v_pool, pages, layer, first, ancestors, idx, o_cmp, gates, *, page_size: int,
                          group: int, shared: bool, block_size: int, window: int, scale: float):
    """NSA's selected and window branches for the tree rows, gated with o_cmp: out [B, T, Hq, Dh]
    (q.dtype). q [B, T, Hq, Dh], the pools [L, Hkv, N, Dh] through pages [B, R], first [B],
    ancestors [T, T] (static), idx [B, T, Hkv, S] logical blocks (-1: none), o_cmp [B, T, Hq, Dh]
    or None (a reuse layer: no compressed term), gates [B, T, Hq, 3] after the sigmoid. Plain jnp, any T; float32 math.

    Each group's union blocks are gathered once (committed slots only) and every row reads its own
    blocks out of that buffer in its own idx order, its path keys out of the tree slots; the
    attention is nsa_selected's, so exact groups equal `nsa_selected_reference(...,
    slot_of=path_slot_map(first, paths))` bit for bit.
    """
    B, T, Hq, Dh = q.shape
    k, v = (paging.layer_view(x, layer, pages, page_size) for x in (k_pool, v_pool))
    Hkv = k.shape[1]
    G = Hq // Hkv
    bs = block_size
    depth, paths = tree_paths(ancestors)
    D = paths.shape[1] - 1
    pos = (first[:, None] + jnp.asarray(depth))[:, :, None, None]             # [B, T, 1, 1]
    sched = group_schedule(idx, first, depth, group=group, shared=shared, block_size=bs)
    row_group = np.arange(T) // sched.member.shape[-1]
    union = jnp.moveaxis(sched.blocks[:, :, row_group], 2, 1)                  # [B, T, Hkv, U]
    in_union = jnp.argmax(union[:, :, :, None, :] == sched.row_idx[..., None], axis=-1)  # [B, T, Hkv, S]
    last_committed = jnp.maximum(first - 1, 0)
    committed = jnp.clip(sched.blocks[..., None] * bs + jnp.arange(bs), 0,
                         last_committed[:, None, None, None, None])          # [B, Hkv, NG, U, bs]
    b, t = jnp.arange(B)[:, None, None, None], jnp.arange(T)[None, :, None, None]
    h = jnp.arange(Hkv)[None, None, :, None]
    precision = matmul_precision(q.dtype)
    qg = q.astype(jnp.float32).reshape(B, T, Hkv, G, Dh)

    def from_path(x, positions, committed_keys):
        """Keys [B, T, Hkv, N, Dh] fp32 at positions [B, T, Hkv, N]: the committed ones given, or the
        tree slot of the row's ancestor at that depth."""
        rel = positions - first[:, None, None, None]
        tree_keys = x[b, h, first[:, None, None, None] + jnp.asarray(paths)[t, jnp.clip(rel, 0, D)]]
        return jnp.where((rel < 0)[..., None], committed_keys, tree_keys).astype(jnp.float32)

    def selected_keys(x, positions):
        buffer = x[jnp.arange(B)[:, None, None, None, None], jnp.arange(Hkv)[None, :, None, None, None], committed]
        own = buffer[b, h, jnp.asarray(row_group)[t], in_union]              # [B, T, Hkv, S, bs, Dh]
        return from_path(x, positions, own.reshape(B, T, Hkv, -1, Dh))

    sel = (sched.row_idx[..., None] * bs + jnp.arange(bs)).reshape(B, T, Hkv, -1)
    sel_ok = (jnp.repeat(sched.row_idx, bs, axis=-1) >= 0) & (sel <= pos)
    o_slc = _attend(qg, selected_keys(k, sel), selected_keys(v, sel), sel_ok, scale, precision)
    if window:
        win = jnp.broadcast_to(pos - window + 1 + jnp.arange(window), (B, T, Hkv, window))
        committed_win = jnp.clip(win, 0, last_committed[:, None, None, None])
        o_swa = _attend(qg, from_path(k, win, k[b, h, committed_win]), from_path(v, win, v[b, h, committed_win]),
                        win >= 0, scale, precision)
    else:
        o_swa = jnp.zeros_like(o_slc)
    g = gates.astype(jnp.float32).reshape(B, T, Hkv, G, 3)
    out = g[..., 1:2] * o_slc
    if o_cmp is not None:
        out = g[..., 0:1] * o_cmp.astype(jnp.float32).reshape(B, T, Hkv, G, Dh) + out
    out = out + g[..., 2:3] * o_swa
    return out.reshape(B, T, Hq, Dh).astype(q.dtype)


def _tree_words(mask):
    """mask [..., R <= 64] bool -> [..., 2] int32: bit k of word w is mask[..., 32*w + k] (bit 31,
    the sign bit: the sum of distinct powers of two wraps to the same bits)."""
    bits = jnp.pad(mask.astype(jnp.int32), [(0, 0)] * (mask.ndim - 1) + [(0, MAX_PALLAS_ROWS - mask.shape[-1])])
    bits = bits.reshape(*mask.shape[:-1], 2, 32) << jnp.arange(32, dtype=jnp.int32)
    return bits.sum(axis=-1, dtype=jnp.int32)


def _grouped_kernel(layer_ref, first_ref, count_ref, blocks_ref, member_ref, pos_ref, words_ref, q_ref, *refs,
                    scale, page_size, block_size, window, block_k, block_w, tree_rows, tree_tile, heads, rows,
                    precision):
    """Program (b, kv head h, group n, row block r): the row block's rows x G heads in one tile.

    Selected branch: one pass over the group's union blocks (committed slots only), each tile row
    masked by its row's membership bit; a block no row of the tile attends is masked off the load.
    Then the T tree slots, loaded once for both branches: selected where the row's ancestor lies in
    its blocks, window where the ancestor is within w. Window branch: the committed span from the
    tile's smallest p - w + 1 to first - 1, each row masked to its own window. Loads are masked to
    the keys some row attends, so the others cost no memory traffic. Key steps lie in one page; the
    tree slots, which may straddle pages, are gathered slot by slot.
    """
    *cmp_ref, gates_ref, pages_ref, k_ref, v_ref, o_ref = refs
    b, h, n, r = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    layer, first, pos, q = layer_ref[0], first_ref[b], pos_ref[...], q_ref[...]
    tile = q.shape[0]
    real = jnp.arange(tile) < rows
    shift = jnp.minimum(lax.div(jnp.arange(tile), heads), 31)     # the tile row's row in the row block

    def attend(carry, start, n_keys, load, ok):  # n_keys from logical slot start (n_keys-aligned)
        slot = pl.multiple_of(paging.pool_slot(pages_ref, b, start, page_size), n_keys)
        k = plgpu.load(k_ref.at[layer, h, pl.ds(slot, n_keys), :], mask=load[:, None], other=0.0)
        v = plgpu.load(v_ref.at[layer, h, pl.ds(slot, n_keys), :], mask=load[:, None], other=0.0)
        logits = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32) * scale
        return softmax_step(carry, logits, ok, v)

    steps = block_size // block_k

    def selected(i, carry):
        u = lax.div(i, steps)                      # jnp's // and % sign fix-ups fail to lower
        word = member_ref[b, h, n, r, u]
        start = pl.multiple_of(blocks_ref[b, h, n, u] * block_size + lax.rem(i, steps) * block_k, block_k)
        load = (start + jnp.arange(block_k) < first) & (word != 0)
        member = real & (((word >> shift) & 1) == 1)
        return attend(carry, start, block_k, load, member[:, None] & load[None, :])

    def normalised(carry):
        o, _, l = carry
        return o / jnp.where(l > 0, l, 1.0)[:, None]

    carry = lax.fori_loop(0, count_ref[b, h, n] * steps, selected, init_carry(tile, q.shape[1]))

    rel = jnp.arange(tree_tile)
    in_tree = rel < tree_rows
    tree_slot = paging.pool_slot(pages_ref, b, first + jnp.where(in_tree, rel, 0), page_size)
    k_tree = jnp.where(in_tree[:, None], k_ref[layer, h, tree_slot, :], 0.0)
    v_tree = jnp.where(in_tree[:, None], v_ref[layer, h, tree_slot, :], 0.0)
    tree_logits = jnp.dot(q, k_tree.T, precision=precision, preferred_element_type=jnp.float32) * scale

    def tree_bits(w):  # [tile, tree_tile] bool from the rows' words w and w + 1 of `words_ref`
        word = jnp.where(rel[None, :] < 32, words_ref[w, :][:, None], words_ref[w + 1, :][:, None])
        return ((word >> (rel[None, :] & 31)) & 1) == 1

    out = gates_ref[1, :][:, None] * normalised(softmax_step(carry, tree_logits, tree_bits(0), v_tree))
    if cmp_ref:
        out += gates_ref[0, :][:, None] * cmp_ref[0][...].astype(jnp.float32)
    if window:
        carry = softmax_step(init_carry(tile, q.shape[1]), tree_logits, tree_bits(2), v_tree)
        lo = jnp.maximum(jnp.min(pos) - window + 1, 0)

        def windowed(i, carry):
            start = pl.multiple_of(i * block_w, block_w)
            slots = start + jnp.arange(block_w)
            load = (slots >= lo) & (slots < first)
            return attend(carry, start, block_w, load, load[None, :] & (slots[None, :] > pos[:, None] - window))

        carry = lax.fori_loop(lax.div(lo, block_w), lax.div(first + block_w - 1, block_w), windowed, carry)
        out += gates_ref[2, :][:, None] * normalised(carry)
    plgpu.store(o_ref.at[pl.ds(0, tile)], out.astype(o_ref.dtype), mask=real[:, None])


def nsa_grouped_pallas(q, k_pool, v_pool, pages, layer, first, ancestors, idx, o_cmp, gates, *, page_size: int,
                       group: int, shared: bool, block_size: int, window: int, scale: float, interpret: bool = False,
                       max_tile: int | None = None):
    """Pallas-Triton kernel for T <= 64 rows and groups of up to 32 rows (else the reference): same
    result as `nsa_grouped_reference`.

    Grid (B, Hkv, groups, row blocks): a program holds its rows' G heads in one tile (row i*G + g,
    padded to a power of two >= 16) and loops over the group's union (count steps: padding costs
    nothing). A group whose tile would exceed max_tile elements (default: half of nsa_compressed's,
    as the gated sum and a branch's accumulator are both live) splits its rows over row blocks, each
    loading only the blocks its rows attend. group=1 is each row its own program (Lai-style).
    block_size and the head dim must be powers of two >= 16; the key steps must divide page_size.
    Float32 inputs get full fp32 logits; the p.v products are `softmax_step`'s (TF32 on a GPU).
    """
    B, T, Hq, Dh = q.shape
    g = min(group, T)
    if T > MAX_PALLAS_ROWS or g > MAX_GROUP:
        return nsa_grouped_reference(q, k_pool, v_pool, pages, layer, first, ancestors, idx, o_cmp, gates,
                                     page_size=page_size, group=group, shared=shared, block_size=block_size,
                                     window=window, scale=scale)
    for name, size in (("head dim", Dh), ("block_size", block_size)):
        if size != next_pow2(size) or size < MIN_TILE:
            raise ValueError(f"the Pallas NSA kernels need a power-of-two {name} >= 16, got {size}")
    Hkv = k_pool.shape[1]
    G = Hq // Hkv
    depth, _ = tree_paths(ancestors)
    sched = group_schedule(idx, first, depth, group=group, shared=shared, block_size=block_size)
    NG = sched.blocks.shape[2]
    max_tile = max_tile or MAX_TILE_ELEMS // q.dtype.itemsize
    per, R = tile_row_blocks(g, G, Dh, max_tile)
    tile = next_pow2(max(per * G, MIN_TILE))
    block_k = min(BLOCK_K * 2 // k_pool.dtype.itemsize, block_size)
    block_w = min(BLOCK_K * 2 // k_pool.dtype.itemsize, next_pow2(max(window, MIN_TILE)))
    if page_size % max(block_k, block_w):
        raise ValueError(f"the NSA key steps ({block_k}, {block_w}) must divide the page size {page_size}")

    def pack(x, fill=0):
        """[B, T, Hkv, G, ...] -> [B, Hkv, NG, R, tile, ...]: group n, row block r holds rows
        n*g + r*per + i as tile rows i*G + head; padding rows are `fill`."""
        rest = [(0, 0)] * (x.ndim - 2)
        x = jnp.pad(x, [(0, 0), (0, NG * g - T)] + rest, constant_values=fill).reshape(B, NG, g, *x.shape[2:])
        x = jnp.pad(x, [(0, 0), (0, 0), (0, R * per - g)] + rest, constant_values=fill)
        x = jnp.moveaxis(x.reshape(B, NG, R, per, *x.shape[3:]), 4, 1)
        x = x.reshape(*x.shape[:4], per * G, *x.shape[6:])
        return jnp.pad(x, [(0, 0)] * 4 + [(0, tile - per * G)] + rest[2:], constant_values=fill)

    by_head = lambda x: jnp.broadcast_to(x[:, :, :, None], x.shape[:3] + (G,) + x.shape[3:])
    q_pos = jnp.broadcast_to((first[:, None] + jnp.asarray(depth))[:, :, None, None], (B, T, 1, G))
    row_pos = pack(q_pos.astype(jnp.int32), _PAD_POS)[:, 0]                      # [B, NG, R, tile]
    member = jnp.pad(sched.member, [(0, 0)] * 4 + [(0, R * per - g)]).reshape(*sched.member.shape[:4], R, per)
    member = jnp.moveaxis((member.astype(jnp.int32) << jnp.arange(per, dtype=jnp.int32)).sum(-1, dtype=jnp.int32), 4, 3)
    in_window = np.asarray(ancestors, bool) & (depth[None, :] > depth[:, None] - window)
    words = jnp.concatenate([_tree_words(sched.tree_selected & np.asarray(ancestors, bool)[:, None]),
                             jnp.broadcast_to(_tree_words(jnp.asarray(in_window))[:, None], (B, T, Hkv, 2))], -1)
    words = jnp.swapaxes(pack(by_head(words)), 4, 5)                            # [B, Hkv, NG, R, 4, tile]
    gates_tile = jnp.swapaxes(pack(gates.astype(jnp.float32).reshape(B, T, Hkv, G, 3)), 4, 5)
    row_tiles = [pack(q.reshape(B, T, Hkv, G, Dh))]
    if o_cmp is not None:
        row_tiles.append(pack(o_cmp.reshape(B, T, Hkv, G, Dh)))

    blocked = lambda *shape: pl.BlockSpec((None,) * 4 + shape, lambda b, h, n, r: (b, h, n, r) + (0,) * len(shape))
    kernel = functools.partial(
        _grouped_kernel, scale=scale, page_size=page_size, block_size=block_size, window=window, block_k=block_k,
        block_w=block_w, tree_rows=T, tree_tile=next_pow2(max(T, MIN_TILE)), heads=G, rows=per * G,
        precision=matmul_precision(q.dtype))
    out = pl.pallas_call(
        kernel, grid=(B, Hkv, NG, R),
        in_specs=[pl.no_block_spec] * 5
        + [pl.BlockSpec((None, None, None, tile), lambda b, h, n, r: (b, n, r, 0)), blocked(4, tile)]
        + [blocked(tile, Dh)] * len(row_tiles) + [blocked(3, tile)] + [pl.no_block_spec] * 3,
        out_specs=blocked(per * G, Dh),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, NG, R, per * G, Dh), q.dtype),
        compiler_params=tile_compiler_params(tile * Dh, max_tile), interpret=interpret, name="nsa_grouped",
    )(jnp.asarray(layer, jnp.int32).reshape(1), first.astype(jnp.int32), sched.count, sched.blocks, member,
      row_pos, words, *row_tiles, gates_tile, pages, k_pool, v_pool)
    out = out.reshape(B, Hkv, NG, R * per, G, Dh)[:, :, :, :g].reshape(B, Hkv, NG * g, G, Dh)[:, :, :T]
    return jnp.moveaxis(out, 1, 2).reshape(B, T, Hq, Dh)
