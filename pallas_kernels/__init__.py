"""The kernel backend switch: each kernel as a jnp reference ("reference") or a Pallas-Triton
kernel ("pallas"). On a CPU default backend the Pallas kernels run in interpret mode, so tests
exercise the kernel code without a GPU.
"""
import functools

import jax.numpy as jnp

from pallas_kernels._common import interpret_default
from pallas_kernels.nsa_compressed import (
    nsa_compressed_pallas,
    nsa_compressed_reference,
    radix_topk,
    select_blocks,
)
from pallas_kernels.nsa_grouped import auto_group, nsa_grouped_pallas, nsa_grouped_reference, nsa_tree_compressed
from pallas_kernels.nsa_selected import nsa_selected_pallas, nsa_selected_reference
from pallas_kernels.nsa_tree import tree_paths
from pallas_kernels.sparse_attention import (
    sparse_attention_pallas,
    sparse_attention_reference,
)
from pallas_kernels.moe import moe_experts_pallas, moe_experts_reference
from pallas_kernels.moe import supported as moe_supported
from pallas_kernels.quest_pages import QUEST_PAGE, quest_pages_pallas, quest_pages_reference
from pallas_kernels.residual_norm import residual_norm_pallas, residual_norm_reference
from pallas_kernels.router import MAX_EXPERTS as ROUTE_MAX_EXPERTS
from pallas_kernels.router import route_pallas, route_reference
from pallas_kernels.rope_write import MAX_PALLAS_ROWS as EPILOGUE_ROWS  # rope_write and residual_norm alike
from pallas_kernels.rope_write import rope_write_pallas, rope_write_reference, supported as rope_write_supported
from pallas_kernels.row_matmul import MAX_ROWS as ROW_MATMUL_ROWS
from pallas_kernels.row_matmul import epilogue_splits, row_matmul_pallas, row_matmul_reference
from pallas_kernels.row_matmul import supported as row_matmul_supported  # noqa: F401 (the switch below)
from pallas_kernels.top_p import top_p_threshold_pallas, top_p_threshold_reference
from pallas_kernels.topk import select_topk_pallas, select_topk_reference
from pallas_kernels.verify_attention import (
    Collect,
    TreeMask,
    verify_attention_pallas,
    verify_attention_reference,
)

BACKENDS = ("reference", "pallas")
# Selections of up to this many scores in all run lax.top_k, one XLA kernel against the radix
# select's ~10 passes of fixed cost; longer ones (vegas's rows, Qwen3-8B's [36, 1, 32K]) take the
# radix kernel (bench/NOTES.md, "the planner's table found again").
TOPK_XLA_MAX = 1 << 20
# Quest's fused page choice runs one program per (row, KV head), each streaming its row of bounds:
# it beats XLA's scores + lax.top_k once its programs fill the GPU, or at any batch when its rows are
# short (SmolLM2's), but not over Qwen3-8B's long rows at small batches (bench/NOTES.md, "Quest's
# fused page choice").
QUEST_FUSED_MIN_PROGRAMS = 128
QUEST_FUSED_MAX_ROW = 1 << 15  # page-bound elements a row: below this the kernel runs at any batch
# Exact layer matrices under this many elements go to the row kernel at decode row counts (one row
# block): XLA runs small ones as multiply + reduce fusions or padded cuBLAS gemms. That covers
# SmolLM2's and a 1.2B Llama's q/k/v and o, and Qwen3-30B-A3B's (2048 x 5120, 4096 x 2048: its step
# -6%); gpt-oss-20b's (o 4096 x 2880, q/k/v 2880 x 5120) lost 2.5% and stay with XLA, as do larger
# ones (bench/NOTES.md, "small exact matrices through the row kernel", "which exact matrices the row
# kernel takes").
ROW_MATMUL_EXACT_ELEMENTS = 11 << 20

__all__ = ["BACKENDS", "Collect", "TreeMask", "moe_experts", "moe_route", "nsa_compressed_attention",
           "nsa_selected_attention", "nsa_tree_attention", "quest_pages", "residual_norm", "rope_write",
           "row_matmul", "row_matmul_partials", "row_matmul_reads_exact", "select_topk", "sparse_attention",
           "top_p_threshold", "verify_attention"]


def _is_pallas(backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}: expected one of {BACKENDS}")
    return backend == "pallas"


def row_matmul(x, values, scale, out_dtype=None, *, layer=None, backend: str = "reference"):
    """x [M, K] @ a matrix: exact (scale None), int8 per column or packed int4 per group
    (pallas_kernels/row_matmul.py); with `layer`, layer `layer` of stacked values and scale, read in
    place. The Pallas kernel covers block-divisible shapes (every 64 rows read the matrix once); other
    products run the reference."""
    if _is_pallas(backend) and row_matmul_supported(values, scale):
        return row_matmul_pallas(x, values, scale, out_dtype, layer=layer, interpret=interpret_default())
    if layer is not None:
        values, scale = values[layer], None if scale is None else scale[layer]
    return row_matmul_reference(x, values, scale, out_dtype)


def row_matmul_partials(x, values, scale, *, layer=None, backend: str = "reference"):
    """row_matmul's product before its last steps: (sums [S, R, N] float32, column scales [E, N] or
    None), the product being sum over S of sums[:, :M], times the scales at `layer` (rope_write takes
    it so; the reference's S is 1, scaled already). The Pallas kernel's shapes as row_matmul's; an
    exact matrix's splits are capped for the epilogue that sums them (row_matmul.epilogue_splits)."""
    if _is_pallas(backend) and row_matmul_supported(values, scale):
        max_splits = epilogue_splits(values.shape[-1]) if scale is None else None
        return row_matmul_pallas(x, values, scale, layer=layer, interpret=interpret_default(), max_splits=max_splits,
                                 reduce=False)
    if layer is not None:
        values, scale = values[layer], None if scale is None else scale[layer]
    return row_matmul_reference(x, values, scale, jnp.float32)[None], None


def row_matmul_reads_exact(values, rows: int, backend: str) -> bool:
    """Whether a product of `rows` rows with the exact stacked matrix values [L, K, N] runs the row
    kernel (ROW_MATMUL_EXACT_ELEMENTS): the decoder then reads that matrix in place at its layer."""
    return (_is_pallas(backend) and rows <= ROW_MATMUL_ROWS and values.shape[-2] * values.shape[-1] < ROW_MATMUL_EXACT_ELEMENTS
            and row_matmul_supported(values, None))


def moe_experts(x, expert_ids, expert_weights, w_gate_up, w_down, layer, *, b_gate_up=None, b_down=None,
                activation: str = "silu", backend: str = "reference"):
    """float32 [T, D]: a mixture-of-experts layer's routed experts for rows x [T, D], each row through
    its experts expert_ids [T, k] (distinct within a row; -1 drops an assignment: another device's
    expert under expert parallelism) weighted by expert_weights [T, k] and summed
    (pallas_kernels/moe.py defines the products and the activations, "silu" or "gpt_oss"). The stacks
    w_gate_up [L, E, D, 2F] (gate columns, then up), w_down [L, E, F, D] and the optional biases
    b_gate_up [L, E, 2F], b_down [L, E, D] are read in place at `layer`; either stack may be an
    `MXFP4` one (gpt-oss's packed experts, decoded in the kernel's registers). The Pallas kernel reads each
    routed expert's weights once and the others not at all (XLA's grouped product reads far more at
    decode row counts); it covers D and F that are multiples of 16, others run the reference."""
    options = dict(b_gate_up=b_gate_up, b_down=b_down, activation=activation)
    if _is_pallas(backend) and moe_supported(w_gate_up, w_down):
        return moe_experts_pallas(x, expert_ids, expert_weights, w_gate_up, w_down, layer,
                                  interpret=interpret_default(), **options)
    return moe_experts_reference(x, expert_ids, expert_weights, w_gate_up, w_down, layer, **options)


def moe_route(logits, k: int, rule: str, norm: bool, bias=None, layer=None, *, backend: str = "reference"):
    """(expert ids [N, k] int32, weights [N, k] float32): an MoE router's choice from its float32 logits
    [N, E] plus, if given, the bias stack [L, E] at `layer` (read in place), by `rule`
    (pallas_kernels/router.py), the top k in one kernel; more than ROUTE_MAX_EXPERTS experts run the
    reference."""
    if _is_pallas(backend) and logits.shape[-1] <= ROUTE_MAX_EXPERTS:
        return route_pallas(logits, k, rule, norm, bias, layer, interpret=interpret_default())
    return route_reference(logits, k, rule, norm, bias, layer)


def rope_write(sums, positions, write_slots, k_pool, v_pool, entry, layer, inv_freq, *, num_heads: int,
               rope_scale: float, eps: float, page_size: int, scale=None, bias=None, q_norm=None, k_norm=None,
               backend: str = "reference"):
    """A layer's q/k/v product `sums` [S, R, N] (partial sums of rows b*T + t; times `scale` [E, N]
    at `entry` if given) to q [B, T, Hq, Dh] and the pools [L, Hkv, N, Dh] with k and v of layer
    `layer` written at pool slots write_slots [B, T] (`KVCache.slots`: a token past its row's end
    writes into the null page of `page_size` slots): bias, qk-norm, RoPE at positions [B, T]
    (pallas_kernels/rope_write.py). The Pallas kernel covers T <= 64 and head dims whose half is a power
    of two; prefill chunks run the reference (XLA), which is cheap next to their products."""
    options = dict(num_heads=num_heads, rope_scale=rope_scale, eps=eps, scale=scale, bias=bias,
                   q_norm=q_norm, k_norm=k_norm)
    if _is_pallas(backend) and rope_write_supported(k_pool.shape[-1]) and positions.shape[1] <= EPILOGUE_ROWS:
        return rope_write_pallas(sums, positions, write_slots, k_pool, v_pool, entry, layer, inv_freq,
                                 interpret=interpret_default(), **options)
    return rope_write_reference(sums, positions, write_slots, k_pool, v_pool, entry, layer, inv_freq,
                                page_size=page_size, **options)


def residual_norm(x, sums, weight, entry, *, eps: float, scale=None, backend: str = "reference"):
    """(x + the product `sums` [S, R, D] (rows b*T + t; times `scale` [E, D] at `entry`), its RMSNorm
    with weight[entry]) for x [B, T, D] (pallas_kernels/residual_norm.py). The Pallas kernel covers
    T <= 64, as rope_write; prefill chunks run the reference."""
    B, T, D = x.shape
    if _is_pallas(backend) and T <= EPILOGUE_ROWS:
        x, h = residual_norm_pallas(x.reshape(B * T, D), sums, weight, entry, eps=eps, scale=scale,
                                    interpret=interpret_default())
    else:
        x, h = residual_norm_reference(x.reshape(B * T, D), sums, weight, entry, eps=eps, scale=scale)
    return x.reshape(B, T, D), h.reshape(B, T, D)


def verify_attention(q, k_pool, v_pool, pages, layer, q_pos, *, page_size: int, scale: float,
                     collect: Collect | None = None, tree: TreeMask | None = None, sinks=None, lo=None,
                     backend: str = "reference"):
    """q [B, T, Hq, Dh] against layer `layer` of the cache's pools [L, Hkv, N, Dh] through the page
    table pages [B, R] of page_size slots a page (pallas_kernels/paging.py); row (b, t) sees slots
    <= q_pos[b, t] (and, with a draft tree's mask, of the tree's rows only its ancestors; with lo
    [B, T], none below lo[b, t]: a sliding window). sinks [L, Hq] (read at `layer`): each head's sink
    logit joins its softmax's denominator, in the lse and the collected weights too. Returns
    out [B, T, Hq, Dh] (q.dtype), lse [B, T, Hq] fp32, and the selection scores asked for by
    `collect` (None without it). The Pallas kernel covers T <= 64; larger T run the reference."""
    options = dict(page_size=page_size, scale=scale, collect=collect, tree=tree, sinks=sinks, lo=lo)
    if _is_pallas(backend):
        return verify_attention_pallas(q, k_pool, v_pool, pages, layer, q_pos, interpret=interpret_default(),
                                       **options)
    return verify_attention_reference(q, k_pool, v_pool, pages, layer, q_pos, **options)


def sparse_attention(q, k_pool, v_pool, pages, layer, idx, n_idx, tail_start, q_slot, *, page_size: int,
                     scale: float, tail_capacity: int, tree: TreeMask | None = None, sinks=None, lo=None,
                     skew: float = 1.0, backend: str = "reference"):
    """q [B, T, Hq, Dh] over logical slots idx[b, s, :n_idx[b]] (idx [B, 1 or Hkv, K], or a stack of
    them [L, B, 1 or Hkv, K] read at `layer`; shared by the rows)
    plus the tail tail_start[b] .. q_slot[b, t] of layer `layer` of the pools [L, Hkv, N, Dh] through
    the page table pages [B, R] (with a draft tree's
    mask, of the tree's slots only the row's ancestors; with lo [B, T], of both parts no slot below
    lo[b, t]: a sliding window). sinks [L, Hq] (read at `layer`): each head's sink logit joins its
    softmax's denominator. Returns out [B, T, Hq, Dh] (q.dtype).
    `skew`: how far a row's slots may exceed the rows' mean (the kernel's split count; a
    shared budget's balance)."""
    args = (q, k_pool, v_pool, pages, layer, idx, n_idx, tail_start, q_slot)
    options = dict(page_size=page_size, scale=scale, tail_capacity=tail_capacity, tree=tree, sinks=sinks, lo=lo)
    if _is_pallas(backend):
        return sparse_attention_pallas(*args, skew=skew, interpret=interpret_default(), **options)
    return sparse_attention_reference(*args, **options)


def quest_pages(q, kmin, kmax, pages, layer, last_page, k, k_max: int, *, page_size: int, backend: str = "reference"):
    """Quest's logical page ids [B, Hkv, k_max] for queries q [B, T, Hq, Dh] from the page bounds of
    layer `layer` (pools [L, Hkv, N / 16, Dh] under the cache's page table pages [B, R] of page_size
    slots a page, read in place): the first k[b] are the top-scoring pages below last_page[b]
    (pallas_kernels/quest_pages.py defines the score); the rest are any pages. The fused kernel runs
    where its programs fill the GPU or its rows are short; elsewhere XLA does."""
    B, H = pages.shape[0], kmin.shape[1]
    P, Dh = pages.shape[1] * page_size // QUEST_PAGE, kmin.shape[3]
    args = (q, kmin, kmax, pages, layer, last_page, k, k_max)
    if _is_pallas(backend) and (B * H >= QUEST_FUSED_MIN_PROGRAMS or P * Dh <= QUEST_FUSED_MAX_ROW):
        return quest_pages_pallas(*args, page_size=page_size, interpret=interpret_default())
    return quest_pages_reference(*args, page_size=page_size)


def select_topk(scores, k_max: int, k, *, backend: str = "reference"):
    """idx [..., k_max] int32: the first k (per row, 1 <= k <= k_max) entries are the slots of the
    k largest scores [..., S] (-inf: invalid; fewer if fewer are finite); the rest are any slots.
    The radix kernel runs selections of more than TOPK_XLA_MAX scores; smaller ones (quest's pages)
    go to lax.top_k, one XLA kernel against the radix select's ~10 passes."""
    if _is_pallas(backend) and scores.size > TOPK_XLA_MAX:
        return select_topk_pallas(scores, k_max, k, interpret=interpret_default())
    return select_topk_reference(scores, k_max, k)


def top_p_threshold(logits, inv_temperature, top_p, *, backend: str = "reference"):
    """float32 [R]: the nucleus threshold of each row of logits [R, V] after tempering by
    inv_temperature (a scalar or [R]) at top_p (a scalar or [R]) (pallas_kernels/top_p.py defines
    it: sort-free, ties kept)."""
    if _is_pallas(backend):
        return top_p_threshold_pallas(logits, inv_temperature, top_p, interpret=interpret_default())
    return top_p_threshold_reference(logits, inv_temperature, top_p)


def _nsa_pallas(backend: str, head_dim: int, block_size: int) -> bool:
    """The NSA Pallas kernels tile head_dim and block_size (powers of two >= 16, as NSA-1B's and
    every NSA shape here); other shapes run the reference on any backend."""
    fits = all(n >= 16 and n & (n - 1) == 0 for n in (head_dim, block_size))
    return _is_pallas(backend) and fits


def nsa_compressed_attention(q, k_cmp, v_cmp, pages, layer, q_pos, *, page_size: int, block_size: int,
                             block_counts: int, rule: str, scale: float, backend: str = "reference"):
    """NSA's compressed branch for q [B, T, Hq, Dh] against layer `layer` of the compressed pools
    k_cmp/v_cmp [L, Hkv, N / block_size, Dh] through the page table pages [B, R]. Returns o_cmp
    [B, T, Hq, Dh] (q.dtype), the block importance weights [B, T, Hkv, NB] float32 (0 where not
    visible) and the selected blocks [B, T, Hkv, block_counts] int32 (-1: none, else logical). The
    Pallas kernels cover T <= 64 (larger T run the reference); the Pallas backend ranks the blocks
    with the radix select."""
    topk = None
    if _nsa_pallas(backend, q.shape[-1], block_size):
        o, weights = nsa_compressed_pallas(q, k_cmp, v_cmp, pages, layer, q_pos, page_size=page_size,
                                           block_size=block_size, scale=scale, interpret=interpret_default())
        topk = functools.partial(radix_topk, interpret=interpret_default())
    else:
        o, weights = nsa_compressed_reference(q, k_cmp, v_cmp, pages, layer, q_pos, page_size=page_size,
                                              block_size=block_size, scale=scale)
    idx = select_blocks(weights, q_pos, block_size=block_size, block_counts=block_counts, rule=rule, topk=topk)
    return o, weights, idx


def nsa_selected_attention(q, k_pool, v_pool, pages, layer, q_pos, idx, o_cmp, gates, *, page_size: int,
                           block_size: int, window: int, scale: float, backend: str = "reference"):
    """NSA's selected-block and window branches over the pools k_pool/v_pool [L, Hkv, N, Dh] through
    pages [B, R], gated together with o_cmp: the layer's attention output [B, T, Hq, Dh] (q.dtype).
    idx [B, T, Hkv, S] (logical blocks) from `nsa_compressed_attention`, gates [B, T, Hq, 3] after
    the sigmoid. The Pallas kernel covers T <= 16; larger T run the reference."""
    options = dict(page_size=page_size, block_size=block_size, window=window, scale=scale)
    if _nsa_pallas(backend, q.shape[-1], block_size):
        return nsa_selected_pallas(q, k_pool, v_pool, pages, layer, q_pos, idx, o_cmp, gates,
                                   interpret=interpret_default(), **options)
    return nsa_selected_reference(q, k_pool, v_pool, pages, layer, q_pos, idx, o_cmp, gates, **options)


def nsa_tree_attention(q, k_pool, v_pool, k_cmp, v_cmp, pages, layer, first, ancestors, gates, idx=None, *,
                       page_size: int, group: int, shared: bool, block_size: int, block_counts: int, window: int,
                       rule: str, scale: float, backend: str = "reference"):
    """NSA attention of a draft tree's rows (slot first + t, position first + depth(t); ancestors
    [T, T] static) over the pools and compressed pools through pages [B, R], each over its
    root-to-node path, in groups of `group` adjacent rows (SSV; `shared`: one representative row's
    blocks per group; 0: `auto_group`'s choice for this shape). Returns (out [B, T, Hq, Dh], importance
    weights [B, T, Hkv, NB] or None, positions [B, T], selected blocks [B, T, Hkv, S]).

    idx None (a refresh layer): the compressed branch, then the selection (the radix select on the
    Pallas backend); idx given (a reuse layer): no compressed branch, weights None. The Pallas
    kernel covers T <= 64; other shapes run the reference."""
    group = group or auto_group(q.shape[0], q.shape[1], k_pool.shape[1], shared)
    pallas = _nsa_pallas(backend, q.shape[-1], block_size)
    o_cmp = weights = None
    if idx is None:
        compressed, topk = nsa_compressed_reference, None
        if pallas:
            compressed = functools.partial(nsa_compressed_pallas, interpret=interpret_default())
            topk = functools.partial(radix_topk, interpret=interpret_default())
        o_cmp, weights, q_pos = nsa_tree_compressed(q, k_pool, v_pool, k_cmp, v_cmp, pages, layer, first, ancestors,
                                                    page_size=page_size, block_size=block_size, scale=scale,
                                                    compressed=compressed)
        idx = select_blocks(weights, q_pos, block_size=block_size, block_counts=block_counts, rule=rule, topk=topk)
    else:
        q_pos = (first[:, None] + jnp.asarray(tree_paths(ancestors)[0])).astype(jnp.int32)
    options = dict(page_size=page_size, group=group, shared=shared, block_size=block_size, window=window,
                   scale=scale)
    if pallas:
        out = nsa_grouped_pallas(q, k_pool, v_pool, pages, layer, first, ancestors, idx, o_cmp, gates,
                                 interpret=interpret_default(), **options)
    else:
        out = nsa_grouped_reference(q, k_pool, v_pool, pages, layer, first, ancestors, idx, o_cmp, gates, **options)
    return out, weights, q_pos, idx
