"""NSA compressed branch: attention over the compressed blocks, their importance, the top-S selection.

Query (b, t) at position p sees compressed block c iff (c + 1) * block_size - 1 <= p (the block is
complete); with no visible block its output is 0. Importance of block c for a KV head = the
compressed softmax weights of the block summed over the head's G query heads (fla's
`parallel_nsa_topk`). Selection (docs/architecture.md, "NSA and SSV"): the query's own block p // block_size always,
then the most important earlier blocks, by `rule` ("nsa1b" or "exact": see
`jaxspec.models.config.NSAConfig`); fewer than S candidates leave -1 entries.

Extra keys (`extra`): per-row keys that join each row's softmax after the cache's blocks, and whose
weights come back as extra columns: a draft tree row's own path blocks (nsa_grouped), which differ
from row to row and so have no place in the shared k_cmp.

Pallas path (T <= 64 rows): pass 1 streams the compressed blocks through an online softmax, split-K
with a log-sum-exp merge, as the verify kernel does over the cache (the extra keys, computed in XLA,
join the merge as one more split); pass 2 recomputes the logits with the merged lse and writes the
importance weights already summed over each KV head's G query heads. A step's blocks span several
pages (page_size / block_size entries each), so each block is looked up in the page table on its own.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paging
from pallas_kernels._common import (
    MIN_TILE,
    init_carry,
    matmul_precision,
    merge_splits,
    next_pow2,
    num_splits,
    pack_rows,
    softmax_step,
    split_range,
    store_split,
    tile_compiler_params,
    tile_row_blocks,
    unpack_rows,
)
from pallas_kernels.topk import select_topk_pallas

# Up to a draft tree's 64 rows (larger T, prefill's, use the reference); a KV head's G*T rows share
# one tile up to max_tile elements, then split over row blocks.
MAX_PALLAS_ROWS = 64
BLOCK_N = 64                     # compressed blocks per step for 2-byte caches; 32 for 4-byte ones
# Largest tile (rows x head dim) of one program for 2-byte inputs, half that for 4-byte ones: its
# accumulator fits eight warps' registers without spills (ptxas, sm_90); 256 x 128 (G 16, Dh 128,
# T 16) spills even on sixteen warps, so such tiles split their rows over programs.
MAX_TILE_ELEMS = 128 * 128
_TF32_MASK = -(1 << 13)          # keeps the sign, exponent and top 10 mantissa bits of a float32


def visible_blocks(num_blocks: int, block_size: int, q_pos):
    """[..., num_blocks] bool: blocks that end at or before q_pos [...]."""
    return (jnp.arange(num_blocks) + 1) * block_size - 1 <= q_pos[..., None]


def nsa_compressed_reference(q, k_cmp, v_cmp, pages, layer, q_pos, *, page_size: int, block_size: int, scale: float,
                             extra=None):
    """q [B, T, Hq, Dh] against layer `layer` of the compressed pools k_cmp/v_cmp [L, Hkv, N / block_size, Dh]
    through the page table pages [B, R] (`paging`: a page holds page_size / block_size entries).

    Returns o [B, T, Hq, Dh] (q.dtype) and the importance weights [B, T, Hkv, NB] float32, NB =
    R * page_size / block_size (0 where the block is not visible); `nsa_compressed_rows` of the rows'
    blocks."""
    entries = page_size // block_size
    k, v = (paging.layer_view(x, layer, pages, entries) for x in (k_cmp, v_cmp))
    return nsa_compressed_rows(q, k, v, q_pos, block_size=block_size, scale=scale, extra=extra)


def nsa_compressed_rows(q, k, v, q_pos, *, block_size: int, scale: float, extra=None):
    """q [B, T, Hq, Dh] against each row's compressed blocks k/v [B, Hkv, NB, Dh].

    Returns o [B, T, Hq, Dh] (q.dtype) and the importance weights [B, T, Hkv, NB] float32 (0 where
    the block is not visible). With extra = (k_x, v_x [B, T, P, Hkv, Dh], visible_x [B, T, P]), each
    row's P extra keys join its softmax and the weights get P more columns. Plain jnp, any T;
    float32 math.
    """
    B, T, Hq, Dh = q.shape
    Hkv, NB = k.shape[1], k.shape[2]
    G = Hq // Hkv
    precision = matmul_precision(q.dtype)
    visible = visible_blocks(NB, block_size, q_pos)                        # [B, T, NB]
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    v = jnp.where(visible.any(axis=1)[:, None, :, None], v, 0.0)         # unseen blocks may hold anything
    qg = q.astype(jnp.float32).reshape(B, T, Hkv, G, Dh)
    logits = jnp.einsum("btkgd,bknd->btkgn", qg, k, precision=precision) * scale
    masked = jnp.where(visible[:, :, None, None], logits, -jnp.inf)
    if extra is not None:
        masked = jnp.concatenate([masked, _extra_logits(qg, extra, scale, precision)], axis=-1)
    lse = jax.nn.logsumexp(masked, axis=-1, keepdims=True)
    p = jnp.exp(masked - jnp.where(jnp.isfinite(lse), lse, 0.0))         # masked: 0
    o = jnp.einsum("btkgn,bknd->btkgd", p[..., :NB], v, precision=precision)
    if extra is not None:
        o += jnp.einsum("btkgj,btjkd->btkgd", p[..., NB:], extra[1].astype(jnp.float32), precision=precision)
    return o.reshape(B, T, Hq, Dh).astype(q.dtype), p.sum(axis=3)


def _extra_logits(qg, extra, scale, precision):
    """Scaled logits [B, T, Hkv, G, P] fp32 of qg [B, T, Hkv, G, Dh] against the extra keys, -inf
    where not visible."""
    k_x, _, visible_x = extra
    logits = jnp.einsum("btkgd,btjkd->btkgj", qg, k_x.astype(jnp.float32), precision=precision) * scale
    return jnp.where(visible_x[:, :, None, None], logits, -jnp.inf)


def selection_scores(weights, q_pos, block_size: int):
    """The ranking the selection uses: importance for blocks before the query's own block, +inf for
    its own block (forced), -inf after it. weights [B, T, Hkv, NB], q_pos [B, T]."""
    c = jnp.arange(weights.shape[-1])
    own = (q_pos // block_size)[:, :, None, None]
    return jnp.where(c < own, weights, jnp.where(c == own, jnp.inf, -jnp.inf))


def select_blocks(weights, q_pos, *, block_size: int, block_counts: int, rule: str, topk=None):
    """Top-S block indices [B, T, Hkv, S] int32 (-1: none) by `rule` from the importance weights.

    `topk(scores, k) -> (values, indices)` ranks the whole block axis (default `lax.top_k`; the
    Pallas path passes the radix select); the nsa1b rule's per-chunk ranks are small and use lax.top_k.
    """
    topk = topk or lax.top_k
    scores = selection_scores(weights, q_pos, block_size)
    NB = scores.shape[-1]
    S = block_counts
    if rule == "exact" or NB <= block_size:
        vals, idx = topk(scores, min(S, NB))
    else:
        chunk, half = block_size, block_size // 2
        start = (q_pos // block_size // chunk * chunk)[:, :, None, None]  # first block of the own chunk
        c = jnp.arange(NB)
        hist_vals, hist_idx = topk(jnp.where(c < start, scores, -jnp.inf), half)
        in_chunk = jnp.minimum(start + jnp.arange(chunk), NB - 1)
        cur = jnp.where(start + jnp.arange(chunk) < NB, jnp.take_along_axis(scores, in_chunk, axis=-1), -jnp.inf)
        cur_vals, order = lax.top_k(cur, chunk)
        keep = jnp.arange(chunk) < jnp.where(start == 0, chunk, half)  # no history: the whole chunk
        cur_vals = jnp.where(keep, cur_vals, -jnp.inf)
        cand_vals = jnp.concatenate([hist_vals, cur_vals], axis=-1)
        cand_idx = jnp.concatenate([hist_idx, jnp.take_along_axis(in_chunk, order, axis=-1)], axis=-1)
        vals, pick = lax.top_k(cand_vals, min(S, cand_vals.shape[-1]))
        idx = jnp.take_along_axis(cand_idx, pick, axis=-1)
    idx = jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)
    if idx.shape[-1] < S:
        idx = jnp.pad(idx, ((0, 0),) * 3 + ((0, S - idx.shape[-1]),), constant_values=-1)
    return idx


def radix_topk(scores, k: int, *, interpret: bool = False):
    """`topk` for `select_blocks` from the radix select, which returns only the slots (in any order):
    (values, indices) with the values gathered back from the scores."""
    idx = select_topk_pallas(scores, k, k, interpret=interpret)
    return jnp.take_along_axis(scores, idx, axis=-1), idx


def _load_blocks(ref, pages_ref, layer, b, h, start, block_n, limit, entries):
    """Row b's block_n compressed blocks from logical block `start`, each gathered through the page
    table (`entries` a page), zeros at and past `limit` (the tile's visible count, <= NB): blocks no
    row sees are never read (they all read the row's first block, once), and NB need not be a
    multiple of block_n."""
    block = start + jnp.arange(block_n)
    inside = block < limit
    block = jnp.where(inside, block, 0)
    entry = paging.pool_slot(pages_ref, b, block, entries)
    return jnp.where(inside[:, None], ref[layer, h, entry, :], 0.0)


def _tf32_split(x):
    """x = hi + lo, hi exact in TF32 (10-bit mantissa), to which Pallas-Triton rounds fp32 dot inputs."""
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32) & _TF32_MASK, jnp.float32)
    return hi, x - hi


def _dot(a, b):
    """a @ b with fp32 accumulation; fp32 inputs as three TF32 products (hi.hi + hi.lo + lo.hi),
    about fp32-exact: full-fp32 Triton dots run on FMA units and spill at these tiles (ptxas, sm_90)."""
    if a.dtype != jnp.float32:
        return jnp.dot(a, b, preferred_element_type=jnp.float32)
    (a_hi, a_lo), (b_hi, b_lo) = _tf32_split(a), _tf32_split(b)
    return sum(jnp.dot(x, y, preferred_element_type=jnp.float32)
               for x, y in ((a_hi, b_hi), (a_hi, b_lo), (a_lo, b_hi)))


def _compressed_kernel(layer_ref, pos_ref, q_ref, pages_ref, k_ref, v_ref, o_ref, lse_ref, *, scale, block_size,
                       block_n, n_splits, num_blocks, entries):
    """Pass 1, program (b, kv head h, row block, split): the split's share of the blocks any row of
    the tile can see."""
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(3)
    layer, q = layer_ref[0], q_ref[...]
    n_visible = (pos_ref[...] + 1) // block_size                  # padding rows (pos -1): none
    limit = jnp.minimum(jnp.max(n_visible), num_blocks)
    lo, hi = split_range(split, n_splits, (limit + block_n - 1) // block_n)

    def body(i, carry):
        start = pl.multiple_of(i * block_n, block_n)
        k = _load_blocks(k_ref, pages_ref, layer, b, h, start, block_n, limit, entries)
        v = _load_blocks(v_ref, pages_ref, layer, b, h, start, block_n, limit, entries)
        logits = _dot(q, k.T) * scale
        visible = start + jnp.arange(block_n)[None, :] < n_visible[:, None]
        return softmax_step(carry, logits, visible, v)

    carry = lax.fori_loop(lo, hi, body, init_carry(q.shape[0], q.shape[1]))
    store_split(o_ref, lse_ref, carry, q.shape[0])


def _weights_kernel(layer_ref, pos_ref, lse_ref, q_ref, pages_ref, k_ref, w_ref, *, scale, block_size, block_n,
                    n_splits, num_blocks, entries, groups, t_rows, t_block):
    """Pass 2, program (b, kv head h, row block r, split): weights[b, t, h, c] = sum_g exp(logit -
    lse) for the block's rows t = r*t_block + i over the split's share of the visible chunks, and
    zeros over its share of the other chunks (every column is written).

    The sum over the G heads of a row (tile rows i*G .. i*G+G-1) is one fp32 dot with a 0/1
    [t_tile, rows] matrix: G need not be a power of two, as a reshape would need.
    """
    b, h, r, split = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    layer, q, lse = layer_ref[0], q_ref[...], lse_ref[...]
    n_visible = (pos_ref[...] + 1) // block_size
    limit = jnp.minimum(jnp.max(n_visible), num_blocks)
    n_chunks = (limit + block_n - 1) // block_n
    t_tile = next_pow2(max(t_block, MIN_TILE))
    i_row = jnp.arange(t_tile)
    group_sum = (jnp.arange(q.shape[0])[None, :] // groups == i_row[:, None]).astype(jnp.float32)
    real_row = (i_row < t_block) & (r * t_block + i_row < t_rows)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def store(i, w):
        start = pl.multiple_of(i * block_n, block_n)
        inside = real_row[:, None] & (start + jnp.arange(block_n) < num_blocks)[None, :]
        plgpu.store(w_ref.at[b, pl.ds(r * t_block, t_tile), h, pl.ds(start, block_n)], w, mask=inside)

    def body(i, carry):
        start = pl.multiple_of(i * block_n, block_n)
        k = _load_blocks(k_ref, pages_ref, layer, b, h, start, block_n, limit, entries)
        logits = _dot(q, k.T) * scale
        visible = start + jnp.arange(block_n)[None, :] < n_visible[:, None]
        p = jnp.where(visible, jnp.exp(logits - lse[:, None]), 0.0)
        hi, lo = _tf32_split(p)                            # group_sum is TF32-exact: two products
        store(i, jnp.dot(group_sum, hi, preferred_element_type=jnp.float32)
              + jnp.dot(group_sum, lo, preferred_element_type=jnp.float32))
        return carry

    def zeros(i, carry):
        store(n_chunks + i, jnp.zeros((t_tile, block_n), jnp.float32))
        return carry

    lo, hi = split_range(split, n_splits, n_chunks)
    lax.fori_loop(lo, hi, body, 0)
    lo, hi = split_range(split, n_splits, pl.cdiv(num_blocks, block_n) - n_chunks)
    lax.fori_loop(lo, hi, zeros, 0)


def nsa_compressed_pallas(q, k_cmp, v_cmp, pages, layer, q_pos, *, page_size: int, block_size: int, scale: float,
                          extra=None, interpret: bool = False, block_n: int | None = None,
                          n_splits: int | None = None, max_tile: int | None = None):
    """Pallas-Triton kernels for T <= 64 (larger T use the reference): same results as
    `nsa_compressed_reference`, `extra` included.

    Both passes: grid (B, Hkv, R, n_splits), the G heads of t_block rows of a KV head (row i*G + g)
    in one tile padded to a power of two >= 16; R = 1 unless the tile would exceed max_tile elements
    (2-byte inputs: G = 16 at Dh 128 and T > 8); block_n compressed blocks per step. Pass 1 splits the
    chunks any row of the tile can see and merges the splits' (o, lse) in XLA, the extra keys'
    softmax as one more split; pass 2 recomputes the logits against the merged lse (the extra keys'
    weights are XLA's). Each step gathers its blocks through the page table one by one, so block_n
    need not fit in a page; block_size must divide page_size. Head dim must be a power of two >= 16.
    Float32 inputs get about-fp32 logits and weights (`_dot`); the p.v products are
    `softmax_step`'s (TF32 on a GPU).
    """
    B, T, Hq, Dh = q.shape
    if T > MAX_PALLAS_ROWS:
        return nsa_compressed_reference(q, k_cmp, v_cmp, pages, layer, q_pos, page_size=page_size,
                                        block_size=block_size, scale=scale, extra=extra)
    entries = page_size // block_size
    Hkv, NB = k_cmp.shape[1], pages.shape[1] * entries
    G = Hq // Hkv
    if Dh != next_pow2(Dh) or Dh < MIN_TILE:
        raise ValueError(f"the Pallas NSA kernels need a power-of-two head dim >= 16, got {Dh}")
    if page_size % block_size:
        raise ValueError(f"page size {page_size} must be a multiple of the NSA block size {block_size}")
    max_tile = max_tile or MAX_TILE_ELEMS * 2 // q.dtype.itemsize
    t_block, R = tile_row_blocks(T, G, Dh, max_tile)
    block_n = min(block_n or BLOCK_N * 2 // k_cmp.dtype.itemsize, next_pow2(max(NB, MIN_TILE)))
    n_splits = n_splits or num_splits(B * Hkv * R, pl.cdiv(NB, block_n))
    rows = t_block * G
    tile = next_pow2(max(rows, MIN_TILE))

    def tiles(x, fill=0):
        """[B, T, Hkv, G, ...] -> [B, Hkv, R, tile, ...]: row block r holds rows r*t_block + i as
        tile rows i*G + g."""
        y = pack_rows(jnp.moveaxis(x, 2, 1).reshape(B * Hkv, T, *x.shape[3:]), R, t_block, tile, fill)
        return y.reshape(B, Hkv, *y.shape[1:])

    q_tile = tiles(q.reshape(B, T, Hkv, G, Dh))
    row_pos = tiles(jnp.broadcast_to(q_pos.astype(jnp.int32)[:, :, None, None], (B, T, Hkv, G)), -1)[:, 0]
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    grid = (B, Hkv, R, n_splits)
    pos_spec = pl.BlockSpec((None, None, tile), lambda b, h, r, s: (b, r, 0))
    q_spec = pl.BlockSpec((None, None, None, tile, Dh), lambda b, h, r, s: (b, h, r, 0, 0))
    statics = dict(scale=scale, block_size=block_size, block_n=block_n, n_splits=n_splits, num_blocks=NB,
                   entries=entries)
    params = tile_compiler_params(tile * Dh, max_tile)

    o_part, lse_part = pl.pallas_call(
        functools.partial(_compressed_kernel, **statics), grid=grid,
        in_specs=[pl.no_block_spec, pos_spec, q_spec] + [pl.no_block_spec] * 3,
        out_specs=[pl.BlockSpec((None, None, None, None, tile, Dh), lambda b, h, r, s: (b, h, r, s, 0, 0)),
                   pl.BlockSpec((None, None, None, None, tile), lambda b, h, r, s: (b, h, r, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, R, n_splits, tile, Dh), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hkv, R, n_splits, tile), jnp.float32)],
        compiler_params=params, interpret=interpret, name="nsa_compressed",
    )(layer, row_pos, q_tile, pages, k_cmp, v_cmp)
    if extra is not None:
        qg = q.astype(jnp.float32).reshape(B, T, Hkv, G, Dh)
        logits_x = _extra_logits(qg, extra, scale, matmul_precision(q.dtype))     # [B, T, Hkv, G, P]
        lse_x = jax.nn.logsumexp(logits_x, axis=-1)
        p_x = jnp.exp(logits_x - jnp.where(jnp.isfinite(lse_x), lse_x, 0.0)[..., None])
        o_x = jnp.einsum("btkgj,btjkd->btkgd", p_x, extra[1].astype(jnp.float32),
                         precision=matmul_precision(q.dtype))
        o_part = jnp.concatenate([o_part, tiles(o_x)[:, :, :, None]], axis=3)
        lse_part = jnp.concatenate([lse_part, tiles(lse_x, -jnp.inf)[:, :, :, None]], axis=3)
    o, lse = merge_splits(o_part, lse_part)                       # [B, Hkv, R, tile, (Dh)]

    weights = pl.pallas_call(
        functools.partial(_weights_kernel, groups=G, t_rows=T, t_block=t_block, **statics), grid=grid,
        in_specs=[pl.no_block_spec, pos_spec,
                  pl.BlockSpec((None, None, None, tile), lambda b, h, r, s: (b, h, r, 0)), q_spec,
                  pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((B, T, Hkv, NB), jnp.float32),
        compiler_params=params, interpret=interpret, name="nsa_weights",
    )(layer, row_pos, lse, q_tile, pages, k_cmp)
    if extra is not None:
        lse_rows = unpack_rows(lse[:, :, :, :rows], T, G).reshape(B, T, Hkv, G)
        p_x = jnp.exp(logits_x - jnp.where(jnp.isfinite(lse_rows), lse_rows, 0.0)[..., None])
        weights = jnp.concatenate([weights, p_x.sum(axis=3)], axis=-1)
    return unpack_rows(o[:, :, :, :rows], T, G).astype(q.dtype), weights
