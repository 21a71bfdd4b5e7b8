"""Quest's page choice in one kernel: score every page from its key bounds and keep the top k.

A page's score for the queries q [B, T, Hq, Dh] of a KV head is sum_d max(q_d * kmax_d, q_d * kmin_d)
summed over the T rows and the G query heads of the group, which is q+ . kmax - q- . kmin with q+ and
q- the positive and negative parts of those sums (kmax >= kmin). Pages at or past last_page[b] are not
candidates. The result is the page ids [B, Hkv, k_max]: the first min(k[b], #candidates) entries are
the pages of the k[b] largest scores, in any order; the rest are arbitrary pages in [0, P).

The bounds live in pools [L, Hkv, N / 16, Dh] beside the KV pool [L, Hkv, N, Dh] and share its page
table pages [B, R] (`paging`): a cache page of page_size slots holds page_size / 16 quest pages, so row
b's quest page j (its logical id, P = R * page_size / 16 of them) is pool entry
pages[b, j // (page_size / 16)] * (page_size / 16) + j % (page_size / 16). Page ids in and out are
logical.

The reference scores the pages with an XLA einsum and takes lax.top_k. The Pallas kernel does both in
one program per (b, KV head): it writes the row's scores to a scratch row (L2-resident), then runs
topk.py's radix select over it (8 passes of 16 candidates, a count, a compaction) without leaving the
program, so a layer's choice is one kernel rather than two score fusions and a sort. The bounds are
read at the layer in place from their pools (a slice of a stack inside the layer scan would be copied
before a custom call).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paging
from pallas_kernels._common import next_pow2
from pallas_kernels.topk import (DIGIT_BITS, RADIX, candidate_counts, load_keys, next_prefix, prefix_key,
                                 select_topk_reference, store_ranked)

QUEST_PAGE = 16  # slots whose key bounds one entry keeps (jaxspec's page-granular drafters' page): P / 16 a cache page
CHUNK = 512  # scores a step of each search pass
SCORE_ELEMENTS = 8192  # bound elements a step of the scoring loads (64 pages at Dh 128): no spills


def _check(q, kmin, kmax, pages, last_page, k, k_max, page_size):
    """The rows' logical page count P."""
    B, _, Hq, Dh = q.shape
    _, H, N, Db = kmin.shape
    paging.check_page_size(page_size)
    per_page = page_size // QUEST_PAGE
    if kmax.shape != kmin.shape or Db != Dh or Hq % H or N % per_page or pages.ndim != 2 or pages.shape[0] != B:
        raise ValueError(f"shapes do not match: q {q.shape}, kmin {kmin.shape}, kmax {kmax.shape}, "
                         f"pages {pages.shape} (page size {page_size})")
    P = pages.shape[1] * per_page
    if last_page.shape != (B,) or k.shape != (B,):
        raise ValueError(f"last_page and k must be [B] = [{B}], got {last_page.shape}, {k.shape}")
    if not 1 <= k_max <= P:
        raise ValueError(f"k_max must be in [1, P={P}], got {k_max}")
    return P


def _query_parts(q, H: int):
    """(q+, q-) [B, Hkv, Dh] float32: the positive and negative parts summed over rows and the group."""
    B, T, Hq, Dh = q.shape
    qg = q.astype(jnp.float32).reshape(B, T, H, Hq // H, Dh)
    return jnp.maximum(qg, 0).sum((1, 3)), jnp.maximum(-qg, 0).sum((1, 3))


def quest_pages_reference(q, kmin, kmax, pages, layer, last_page, k, k_max: int, *, page_size: int):
    """Einsum scores over the rows' view of the bound pools, masked past last_page, then lax.top_k."""
    P = _check(q, kmin, kmax, pages, last_page, k, k_max, page_size)
    pos_q, neg_q = _query_parts(q, kmin.shape[1])
    lo, hi = (paging.layer_view(b, layer, pages, page_size // QUEST_PAGE).astype(jnp.float32) for b in (kmin, kmax))
    scores = jnp.einsum("bhd,bhpd->bhp", pos_q, hi) - jnp.einsum("bhd,bhpd->bhp", neg_q, lo)
    scores = jnp.where(jnp.arange(P) < last_page[:, None, None], scores, -jnp.inf)
    return select_topk_reference(scores, k_max, k)


def _kernel(layer_ref, last_ref, k_ref, pos_ref, neg_ref, pages_ref, kmin_ref, kmax_ref, idx_ref, scores_ref, *,
            per_page: int, chunk: int, score_chunk: int, k_max: int, barrier: bool):
    b, h = pl.program_id(0), pl.program_id(1)
    layer, last, k = layer_ref[0], last_ref[b], k_ref[b]
    P = pages_ref.shape[1] * per_page
    n_chunks = scores_ref.shape[2] // chunk
    pos, neg = pos_ref[b, h, :], neg_ref[b, h, :]

    def score(c, _):
        """A step's pages gathered through the table (whole bound rows; pages past P read the row's last
        entry, and are no candidates)."""
        pages = c * score_chunk + jnp.arange(score_chunk)
        entry = paging.pool_slot(pages_ref, b, jnp.minimum(pages, P - 1), per_page)
        lo, hi = (ref[layer, h, entry, :].astype(jnp.float32) for ref in (kmin_ref, kmax_ref))
        s = (hi * pos[None, :]).sum(axis=1) - (lo * neg[None, :]).sum(axis=1)
        scores_ref[b, h, pl.ds(c * score_chunk, score_chunk)] = jnp.where(pages < last, s, -jnp.inf)
        return 0

    lax.fori_loop(0, scores_ref.shape[2] // score_chunk, score, 0)
    if barrier:  # the scores, written by all the program's threads, are read back by others
        plgpu.debug_barrier()

    prefix = jnp.int32(0)  # known high bits of the k-th largest key, unsigned pattern
    for shift in range(32 - DIGIT_BITS, -1, -DIGIT_BITS):
        def count(c, total, prefix=prefix, shift=shift):
            _, valid, key = load_keys(scores_ref, (b, h), c, chunk, P)
            return total + candidate_counts(prefix, shift, valid, key)

        prefix = next_prefix(prefix, shift, lax.fori_loop(0, n_chunks, count, jnp.zeros((RADIX,), jnp.int32)), k)
    tau = prefix_key(prefix)

    def above(c, total):
        _, valid, key = load_keys(scores_ref, (b, h), c, chunk, P)
        return total + (valid & (key > tau)).astype(jnp.int32).sum()

    n_above = lax.fori_loop(0, n_chunks, above, jnp.int32(0))
    need = k - n_above

    def compact(c, seen):
        above_seen, tie_seen = seen
        pages, valid, key = load_keys(scores_ref, (b, h), c, chunk, P)
        above, tie = store_ranked(idx_ref, (b, h), pages, valid, key, tau, above_seen, tie_seen, n_above, need, k_max)
        return above_seen + above, tie_seen + tie

    lax.fori_loop(0, n_chunks, compact, (jnp.int32(0), jnp.int32(0)))


def quest_pages_pallas(q, kmin, kmax, pages, layer, last_page, k, k_max: int, *, page_size: int,
                       interpret: bool = False, chunk: int = CHUNK):
    """One Pallas-Triton program per (b, KV head): scores (the bounds gathered through the page
    table), radix select and compaction."""
    P = _check(q, kmin, kmax, pages, last_page, k, k_max, page_size)
    B, H = q.shape[0], kmin.shape[1]
    pos_q, neg_q = _query_parts(q, H)
    chunk = min(chunk, next_pow2(P))
    score_chunk = min(chunk, max(16, SCORE_ELEMENTS // kmin.shape[3]))
    k = jnp.clip(jnp.asarray(k, jnp.int32), 1, k_max)
    kernel = functools.partial(_kernel, per_page=page_size // QUEST_PAGE, chunk=chunk, score_chunk=score_chunk,
                               k_max=k_max, barrier=not interpret)
    idx, _ = pl.pallas_call(
        kernel, grid=(B, H), in_specs=[pl.no_block_spec] * 8, out_specs=[pl.no_block_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((B, H, k_max + 1), jnp.int32),
                   jax.ShapeDtypeStruct((B, H, pl.cdiv(P, chunk) * chunk), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="quest_pages",
    )(jnp.asarray(layer, jnp.int32).reshape(1), jnp.asarray(last_page, jnp.int32), k, pos_q, neg_q,
      jnp.asarray(pages, jnp.int32), kmin, kmax)
    return jnp.where(jnp.arange(k_max) < k[:, None, None], idx[..., :k_max], 0)
