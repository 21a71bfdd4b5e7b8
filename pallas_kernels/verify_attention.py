"""Verify attention: T new query rows per sequence against the whole KV cache of one layer.

The cache is a paged pool [L, Hkv, N, Dh] read through the page table pages [B, R]
(`pallas_kernels.paging`); slots below are a row's logical slots (its token positions), R * page_size
of them.

Returns the attention output, the per-row log-sum-exp, and (optionally) the per-key selection scores
that the KV-selection drafters need, collected in the same pass over the cache.

Query (b, t) sees cache slots j <= q_pos[b, t]; the new rows' keys are already in the cache, so this
is also the causal mask among the new rows. A draft tree (`TreeMask`) narrows that: its rows sit at
slots first[b] + t, and row t sees a slot j >= first[b] only if row j - first[b] is t or one of its
ancestors. With a chain's mask (every earlier row an ancestor) that is the causal mask again.
Optionally a row sees no slot below lo[b, t] (a sliding window), and each head's sink logit joins its
softmax's denominator (gpt-oss's attention sinks: a key of value 0, in the returned lse too).

The Pallas kernel covers T <= 64 (a draft tree's largest verify) in row blocks of GQA-packed rows
(`_common.row_blocks`: T <= 16 is one block); larger T (prefill chunks) run the reference.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paging
from pallas_kernels._common import (
    MIN_TILE,
    PAGED_STAGES,
    array_module,
    compiler_params,
    init_carry,
    matmul_precision,
    merged,
    next_pow2,
    num_splits,
    pack_rows,
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

MAX_PALLAS_ROWS = 64
MAX_TREE_ROWS = 64  # two 32-bit words of ancestor bits per row
BLOCK_K = 64
METRICS = ("weight", "logit")


@dataclasses.dataclass(frozen=True)
class Collect:
    """Which verify rows become per-key selection scores, and how.

    rows: sorted distinct indices into T. metric "weight": exp(scale*q.k - lse_row), 0 where the
    row cannot see the key (key > q_pos of the row, or below its lo); "logit": scale*q.k, unmasked,
    so that its mean over rows and heads is one dot product with the mean query. Scores are means
    over all Hq heads. reduce_rows=True also averages the rows -> [B, S], -inf where row rows[0]
    cannot see (past its q_pos, below its lo); False keeps one score row per collected row
    -> [B, R, S], -inf where row rows[i] cannot see. With rising positions (every live sequence) the
    two metrics see the same keys.
    """
    rows: tuple[int, ...]
    metric: str
    reduce_rows: bool

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"Collect.metric must be one of {METRICS}, got {self.metric!r}")
        rows = tuple(self.rows)
        if not rows or rows != tuple(sorted(set(rows))) or rows[0] < 0:
            raise ValueError(f"Collect.rows must be sorted distinct indices >= 0, got {rows}")
        object.__setattr__(self, "rows", rows)


@dataclasses.dataclass(frozen=True)
class TreeMask:
    """A draft tree's attention mask over its own slots.

    first [B] int32: the slot of tree row 0 (the root); tree row j sits at slot first + j.
    ancestors [T, R] bool, NumPy or traced: query row t may see tree row j iff ancestors[t, j]. R is
    every row of the tree (<= 64, parents first); T = R when verifying the whole tree, fewer when
    drafting the rows of one depth.
    """
    first: jax.Array
    ancestors: np.ndarray | jax.Array

    def __post_init__(self):
        if self.ancestors.ndim != 2 or self.ancestors.shape[1] > MAX_TREE_ROWS:
            raise ValueError(f"ancestors must be [T, R <= {MAX_TREE_ROWS}], "
                             f"got {self.ancestors.shape}")

    def visible(self, slots, t):
        """slots [..., S] seen by rows t [...] (the ancestor part only; slots before first: True)."""
        R = self.ancestors.shape[1]
        rel = slots - self.first.reshape(self.first.shape + (1,) * (slots.ndim - 1))
        anc = jnp.asarray(self.ancestors)[t[..., None], jnp.clip(rel, 0, R - 1)]
        return (rel < 0) | ((rel < R) & anc)

    def row_bits(self):
        """[T, 2] int32, the kernels' form: bit k of word w of row t is ancestors[t, 32*w + k]
        (bit 31 is the sign bit: the sum of distinct powers of two wraps to the same bits). NumPy
        ancestors give NumPy words."""
        xp = array_module(self.ancestors)
        bits = xp.pad(xp.asarray(self.ancestors, np.int32), ((0, 0), (0, MAX_TREE_ROWS - self.ancestors.shape[1])))
        bits = bits.reshape(-1, 2, 32) << xp.arange(32, dtype=np.int32)
        return bits.sum(axis=2, dtype=np.int32)


def ancestor_visible(rel, lo, hi):
    """`TreeMask.visible` in a kernel: rel [rows, block] slot - first; lo, hi [rows]: the rows' two
    words of `TreeMask.row_bits`."""
    word = jnp.where(rel < 32, lo[:, None], hi[:, None])
    bit = (word >> (jnp.clip(rel, 0, MAX_TREE_ROWS - 1) & 31)) & 1
    return (rel < 0) | ((rel < MAX_TREE_ROWS) & (bit == 1))


def tree_words(tree: TreeMask, G: int, n_blocks: int, rows: int, tile: int):
    """The kernels' per-row tree inputs: first [B] and packed ancestor words [2, n_blocks, tile].
    A static tree (NumPy ancestors: every verification pass) packs in NumPy into a constant; traced,
    the packing would run as a kernel before every layer's call."""
    words = tree.row_bits().T  # [2, T]
    xp = array_module(words)
    words = pack_rows(xp.broadcast_to(words[:, :, None], words.shape + (G,)), n_blocks, rows, tile)
    return tree.first.astype(jnp.int32), words


def option_inputs(sinks, lo):
    """(in_specs, args): the kernels' inputs for the options given (None: no input at all)."""
    args = [x for x in (sinks, None if lo is None else lo.astype(jnp.int32)) if x is not None]
    return [pl.no_block_spec] * len(args), args


def _check(q, k_pool, v_pool, pages, page_size, q_pos, collect, tree, sinks, lo):
    B, T, Hq, Dh = q.shape
    L, Hkv, N, Dk = k_pool.shape
    paging.check_page_size(page_size)
    if (Dk != Dh or v_pool.shape != k_pool.shape or Hq % Hkv or N % page_size or pages.ndim != 2
            or pages.shape[0] != B):
        raise ValueError(f"shapes do not match: q {q.shape}, k_pool {k_pool.shape}, "
                         f"v_pool {v_pool.shape}, pages {pages.shape} of {page_size} slots")
    if q_pos.shape != (B, T):
        raise ValueError(f"q_pos must be [B, T] = {(B, T)}, got {q_pos.shape}")
    check_options(sinks, lo, L, Hq, B, T)
    if collect is not None and collect.rows[-1] >= T:
        raise ValueError(f"Collect.rows {collect.rows} out of range for T={T}")
    if tree is not None and tree.ancestors.shape[0] != T:
        raise ValueError(f"TreeMask.ancestors must have T={T} rows, got {tree.ancestors.shape}")


def check_options(sinks, lo, L: int, Hq: int, B: int, T: int):
    """The attention kernels' optional sinks [L, Hq] and lower bounds lo [B, T]."""
    if sinks is not None and sinks.shape != (L, Hq):
        raise ValueError(f"sinks must be [L, Hq] = {(L, Hq)}, got {sinks.shape}")
    if lo is not None and lo.shape != (B, T):
        raise ValueError(f"lo must be [B, T] = {(B, T)}, got {lo.shape}")


def seen_slots(S: int, pos, lo=None):
    """[..., S] bool: the slots j with lo <= j <= pos, for pos and lo [...] (lo None: from slot 0)."""
    slots = jnp.arange(S)
    seen = slots <= pos[..., None]
    return seen if lo is None else seen & (slots >= lo[..., None])


def mask_scores(scores, pos, lo=None):
    """-inf at slots j > pos (and j < lo): scores [..., S], pos and lo [...]."""
    return jnp.where(seen_slots(scores.shape[-1], pos, lo), scores, -jnp.inf)


def collected_scores(logits, lse, pos, lo, collect: Collect):
    """Selection scores from the collected rows' logits [B, Hkv, R, G, S], lse [B, Hkv, R, G], pos and
    lo (or None) [B, R].

    Logits outside the output mask may be garbage (even NaN): they are masked, never used.
    """
    if collect.metric == "weight":
        visible = seen_slots(logits.shape[-1], pos, lo)[:, None, :, None, :]
        logits = jnp.where(visible, jnp.exp(logits - lse[..., None]), 0.0)
    per_row = logits.mean(axis=(1, 3))
    if collect.reduce_rows:
        return mask_scores(per_row.mean(axis=1), pos[:, 0], None if lo is None else lo[:, 0])
    return mask_scores(per_row, pos, lo)


def verify_attention_reference(q, k_pool, v_pool, pages, layer, q_pos, *, page_size: int, scale: float,
                               collect: Collect | None = None, tree: TreeMask | None = None,
                               sinks=None, lo=None):
    """Plain jnp: any T. Gathers the rows' slots of the layer and materialises [B, Hq, T, S] fp32
    logits (fine for tests and prefill chunks)."""
    _check(q, k_pool, v_pool, pages, page_size, q_pos, collect, tree, sinks, lo)
    B, T, Hq, Dh = q.shape
    Hkv, S = k_pool.shape[1], pages.shape[1] * page_size
    G = Hq // Hkv
    precision = matmul_precision(q.dtype)
    k = paging.layer_view(k_pool, layer, pages, page_size)
    v = paging.layer_view(v_pool, layer, pages, page_size)
    q5 = jnp.moveaxis(q.reshape(B, T, Hkv, G, Dh), 2, 1)
    logits = jnp.einsum("bktgd,bksd->bktgs", q5, k, precision=precision,
                        preferred_element_type=jnp.float32) * scale
    visible = seen_slots(S, q_pos, lo)[:, None, :, None, :]
    if tree is not None:
        slots = jnp.broadcast_to(jnp.arange(S), (B, T, S))
        seen = tree.visible(slots, jnp.broadcast_to(jnp.arange(T), (B, T)))  # [B, T, S]
        visible = visible & seen[:, None, :, None, :]
    p, lse = softmax_weights(jnp.where(visible, logits, -jnp.inf), sinks, layer)
    out = jnp.einsum("bktgs,bksd->bktgd", p.astype(v.dtype), v, precision=precision,
                     preferred_element_type=jnp.float32)
    scores = None
    if collect is not None:
        rows = np.asarray(collect.rows)
        scores = collected_scores(logits[:, :, rows], lse[:, :, rows], q_pos[:, rows],
                                  None if lo is None else lo[:, rows], collect)
    out = jnp.moveaxis(out, 1, 2).reshape(B, T, Hq, Dh).astype(q.dtype)
    return out, jnp.moveaxis(lse, 1, 2).reshape(B, T, Hq), scores


def _verify_kernel(layer_ref, q_pos_ref, q_ref, k_ref, v_ref, pages_ref, *refs,
                   scale, block_k, page_size, n_splits, rows, G, T, tile, picked, n_collect, collect_rows,
                   tree, sinks, window):
    """Program (b, kv head h, row block r, split): the split's share of the key blocks up to the
    last slot any row of the block (or any collected row, `picked`) can see (never past the table's
    last), and with lower bounds (`window`) from the first such slot. Split 0 starts its rows'
    softmax with their heads' sinks. Each key block lies in one page: read at its pool slot.

    With collection, a second small tile of query rows (qc: the row block's share of the collected
    rows, `collect_rows` of them) is multiplied with every key block and its scaled logits are
    stored: no masking, no reduction in the loop.
    """
    b, h, r, split = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    if tree:
        first_ref, words_ref, *refs = refs
    if sinks:
        sinks_ref, *refs = refs
    if window:
        lo_ref, *refs = refs
    if n_collect:
        qc_ref, o_ref, lse_ref, scores_ref = refs
        qc = qc_ref[...]
        c_rows = jnp.arange(qc.shape[0])
        c_first = r * collect_rows
        c_real = ((c_rows < collect_rows) & (c_first + c_rows < n_collect))[:, None]
    else:
        o_ref, lse_ref = refs
    layer, q = layer_ref[0], tile_queries(q_ref, b, h, r, rows, G, tile, T)
    pos = tile_positions(q_pos_ref, b, r, rows, G, tile)
    if tree:
        first, lo_word, hi_word = first_ref[b], words_ref[0], words_ref[1]
    end = jnp.max(pos)
    for row in picked:  # static: each block reads keys up to every collected row's too
        end = jnp.maximum(end, q_pos_ref[b, row])
    n_blocks = jnp.minimum((end + block_k) // block_k, pages_ref.shape[1] * page_size // block_k)
    if window:  # blocks below every row's lower bound (and every collected row's) are never read
        row_lo = tile_positions(lo_ref, b, r, rows, G, tile, fill=jnp.iinfo(jnp.int32).max)
        begin = jnp.min(row_lo)
        for row in picked:
            begin = jnp.minimum(begin, lo_ref[b, row])
        begin = jnp.maximum(begin, 0) // block_k
        lo, hi = split_range(split, n_splits, n_blocks - begin)
        lo, hi = begin + lo, begin + hi
    else:
        lo, hi = split_range(split, n_splits, n_blocks)

    def body(i, carry):
        start = pl.multiple_of(i * block_k, block_k)
        slot = pl.multiple_of(paging.pool_slot(pages_ref, b, start, page_size), block_k)
        k = k_ref[layer, h, pl.ds(slot, block_k), :]
        v = v_ref[layer, h, pl.ds(slot, block_k), :]
        logits = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        if n_collect:
            collected = jnp.dot(qc, k.T, preferred_element_type=jnp.float32) * scale
            plgpu.store(scores_ref.at[b, h, pl.ds(c_first, qc.shape[0]), pl.ds(start, block_k)],
                        collected.astype(scores_ref.dtype), mask=c_real)
        slots = start + jnp.arange(block_k)[None, :]
        visible = slots <= pos[:, None]
        if window:
            visible = visible & (slots >= row_lo[:, None])
        if tree:
            visible = visible & ancestor_visible(slots - first, lo_word, hi_word)
        return softmax_step(carry, logits, visible, v)

    sink = tile_sinks(sinks_ref, layer, h, G, tile, split) if sinks else None
    carry = lax.fori_loop(lo, hi, body, init_carry(q.shape[0], q.shape[1], sink))
    store_split(o_ref, lse_ref, carry, rows * G)


def _collect_tile(q5, collect: Collect):
    """The query rows whose logits the kernel stores, [B, Hkv, n, Dh].

    weight: every collected (row, head) as row r*G + g. logit: the rows' queries summed over the
    heads of the KV head (and over the rows when reduce_rows), as the kernel's dot is linear.
    """
    B, _, Hkv, _, Dh = q5.shape
    qc = jnp.moveaxis(q5[:, np.asarray(collect.rows)], 2, 1)         # [B, Hkv, R, G, Dh]
    if collect.metric == "weight":
        return qc.reshape(B, Hkv, -1, Dh)
    qc = qc.astype(jnp.float32).sum(axis=(2, 3) if collect.reduce_rows else 3)
    return qc.reshape(B, Hkv, -1, Dh).astype(q5.dtype)


def verify_attention_pallas(q, k_pool, v_pool, pages, layer, q_pos, *, page_size: int, scale: float,
                            collect: Collect | None = None, tree: TreeMask | None = None,
                            sinks=None, lo=None, interpret: bool = False, block_k: int = BLOCK_K,
                            n_splits: int | None = None):
    """Pallas-Triton kernel for T <= 64 (decode, chain and tree verification); larger T use the
    reference.

    Grid (B, Hkv, row blocks, n_splits): a row block is up to 16 query rows (more when G < 4) with
    the G heads of one KV head, packed as row t*G + g; split-K over the keys the block can see
    (blocks past its max q_pos are never read), the splits' log-sum-exp merge in one more kernel
    (_common.merged). Collected rows are shared out evenly over the row blocks, and each block then
    reads keys up to the largest collected q_pos too (and from the smallest collected lo). Sinks join
    split 0's online softmax as a key of value 0 (`_common.init_carry`), so the merged output and lse
    count each once. Head dim must be a power of two >= 16; block_k must divide the page size.
    """
    _check(q, k_pool, v_pool, pages, page_size, q_pos, collect, tree, sinks, lo)
    B, T, Hq, Dh = q.shape
    if T > MAX_PALLAS_ROWS:
        return verify_attention_reference(q, k_pool, v_pool, pages, layer, q_pos, page_size=page_size,
                                          scale=scale, collect=collect, tree=tree, sinks=sinks, lo=lo)
    Hkv, S = k_pool.shape[1], pages.shape[1] * page_size
    G = Hq // Hkv
    if Dh != next_pow2(Dh) or Dh < MIN_TILE:
        raise ValueError(f"the Pallas verify kernel needs a power-of-two head dim >= 16, got {Dh}")
    if page_size % block_k:
        raise ValueError(f"page size {page_size} must be a multiple of block_k={block_k}")
    n_blocks, rows, tile = row_blocks(T, G)
    n_splits = n_splits or num_splits(B * Hkv * n_blocks, S // block_k)
    q_pos = q_pos.astype(jnp.int32)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)

    in_specs = [pl.no_block_spec] * 6
    args = [layer, q_pos, q.reshape(B, T * Hq, Dh), k_pool, v_pool, pages.astype(jnp.int32)]
    if tree is not None:  # without a tree no mask inputs at all (zeros would cost a kernel per layer)
        first, words = tree_words(tree, G, n_blocks, rows, tile)
        in_specs += [pl.no_block_spec, pl.BlockSpec((2, None, tile), lambda b, h, r, s: (0, r, 0))]
        args += [first, words]
    specs, extra = option_inputs(sinks, lo)
    in_specs, args = in_specs + specs, args + extra
    out_specs, out_shape = split_outputs(B, Hkv, n_blocks, n_splits, rows * G, Dh, q.dtype)
    n_collect = collect_rows = 0
    if collect is not None:
        qc = _collect_tile(q.reshape(B, T, Hkv, G, Dh), collect)
        n_collect = qc.shape[2]
        collect_rows = -(-n_collect // n_blocks)
        qc_tile = next_pow2(max(collect_rows, MIN_TILE))
        qc = pack_rows(qc.reshape(B * Hkv, n_collect, 1, Dh), n_blocks, collect_rows, qc_tile)
        in_specs.append(pl.BlockSpec((None, None, None, qc_tile, Dh),
                                     lambda b, h, r, s: (b, h, r, 0, 0)))
        args.append(qc.reshape(B, Hkv, n_blocks, qc_tile, Dh))
        out_specs.append(pl.no_block_spec)
        dtype = q.dtype if collect.metric == "weight" else jnp.float32
        out_shape.append(jax.ShapeDtypeStruct((B, Hkv, n_collect, S), dtype))

    kernel = functools.partial(_verify_kernel, scale=scale, block_k=block_k, page_size=page_size,
                               n_splits=n_splits, rows=rows, G=G, T=T, tile=tile,
                               picked=() if collect is None else collect.rows,
                               n_collect=n_collect, collect_rows=collect_rows, tree=tree is not None,
                               sinks=sinks is not None, window=lo is not None)
    outs = pl.pallas_call(kernel, grid=(B, Hkv, n_blocks, n_splits), in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape,
                          compiler_params=compiler_params(PAGED_STAGES), interpret=interpret,
                          name="verify_attention")(*args)
    out, lse = merged(outs[0], outs[1], T, G, q.dtype, interpret)    # [B, T, Hq, Dh], [B, T, Hq]
    scores = None
    if collect is not None:
        picked = np.asarray(collect.rows)
        pos_c, lo_c = q_pos[:, picked], None if lo is None else lo[:, picked]
        if collect.metric == "weight":
            raw = outs[2].reshape(B, Hkv, len(picked), G, S).astype(jnp.float32)
            lse_c = jnp.moveaxis(lse.reshape(B, T, Hkv, G)[:, picked], 2, 1)
            scores = collected_scores(raw, lse_c, pos_c, lo_c, collect)
        elif collect.reduce_rows:
            mean = outs[2].sum(axis=1) / (Hq * len(picked))
            scores = mask_scores(mean[:, 0], pos_c[:, 0], None if lo is None else lo_c[:, 0])
        else:
            scores = mask_scores(outs[2].sum(axis=1) / Hq, pos_c, lo_c)
    return out, lse, scores
