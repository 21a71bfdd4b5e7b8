"""Top-k selection of KV slots: idx [..., k_max] of the k largest scores per row.

The first min(k, #finite scores) entries of a row are the slots of its largest scores, in any order;
the rest are arbitrary slots in [0, S). -inf marks invalid slots; scores must not be NaN.

Fast path: radix select. Float scores map to int32 keys with the same order. The k-th largest key
tau is found 4 bits at a time, from the top: with the higher bits of tau known, a pass counts the
keys >= each of the 16 candidates for the next 4 bits, and tau takes the largest candidate that
still has k keys at or above it (8 passes, one compare per key and candidate, no histogram
scatter). A counting pass and a compaction pass then write the slots with key > tau and as many
slots with key == tau as still fit. Every pass is one Pallas program per (row, chunk of the row),
so a pass fills the GPU whatever the batch; the per-row steps between passes (sum the chunk
counts, pick the digit, chunk offsets) are tiny XLA ops on [rows, 16] or [rows, chunks].
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import float_key, next_pow2

# Scores per program: 2048 is about as fast as 4096 on long rows and keeps more programs in flight
# on short ones (bench/NOTES.md, "Top-k selection").
CHUNK = 2048
DIGIT_BITS = 4
RADIX = 1 << DIGIT_BITS
_INT32_MIN = -(2 ** 31)


def _check(scores, k_max):
    if not 1 <= k_max <= scores.shape[-1]:
        raise ValueError(f"k_max must be in [1, S={scores.shape[-1]}], got {k_max}")


def select_topk_reference(scores, k_max: int, k):
    """lax.top_k: sorted, so its first k entries are the top k whatever k is."""
    _check(scores, k_max)
    del k
    return lax.top_k(scores, k_max)[1].astype(jnp.int32)


def load_keys(scores_ref, row: tuple, chunk_id, chunk: int, size: int):
    """Slots, validity and order-preserving int32 keys of one chunk of the row scores_ref[row] (inside
    a kernel): slots at or past `size` are invalid and load as -inf."""
    slots = chunk_id * chunk + jnp.arange(chunk)
    valid = slots < size
    x = plgpu.load(scores_ref.at[(*row, pl.ds(chunk_id * chunk, chunk))], mask=valid, other=-jnp.inf)
    return slots, valid, float_key(x)


def candidate_counts(prefix, shift: int, valid, key):
    """[RADIX] int32 (inside a kernel): count[c] = number of the valid keys >= the candidate whose
    bits above `shift` are `prefix`, whose next DIGIT_BITS bits are c and whose lower bits are 0
    (unsigned pattern)."""
    candidates = (prefix | (jnp.arange(RADIX) << shift)) ^ _INT32_MIN
    return (valid[:, None] & (key[:, None] >= candidates[None, :])).astype(jnp.int32).sum(axis=0)


def next_prefix(prefix, shift: int, counts, k):
    """The prefix with its next DIGIT_BITS bits: the largest candidate that still has k keys at or above it."""
    return prefix | ((jnp.sum(counts >= k, axis=-1, dtype=jnp.int32) - 1) << shift)


def prefix_key(prefix):
    """The k-th largest key from its settled unsigned pattern."""
    return prefix ^ _INT32_MIN


def store_ranked(idx_ref, row: tuple, slots, valid, key, tau, above_seen, tie_seen, n_above, need, k_max: int):
    """Writes the slots whose keys are above tau at their ranks (after above_seen earlier ones), then
    those equal to tau after n_above while fewer than need (after tie_seen earlier ties), into the row
    idx_ref[row] of k_max + 1 columns: masked-off lanes point at column k_max, which the caller slices
    away. Returns this chunk's (above, tie) counts."""
    above = valid & (key > tau)
    tie = valid & (key == tau)
    above_rank = above_seen + jnp.cumsum(above.astype(jnp.int32))
    tie_rank = tie_seen + jnp.cumsum(tie.astype(jnp.int32))
    write = above | (tie & (tie_rank <= need))
    pos = jnp.where(above, above_rank - 1, n_above + tie_rank - 1)
    plgpu.store(idx_ref.at[(*row, jnp.where(write, pos, k_max))], slots, mask=write)
    return above.astype(jnp.int32).sum(), tie.astype(jnp.int32).sum()


def _candidates_kernel(prefix_ref, scores_ref, count_ref, *, shift, chunk):
    """The chunk's candidate_counts for the row's prefix."""
    row, chunk_id = pl.program_id(0), pl.program_id(1)
    _, valid, key = load_keys(scores_ref, (row,), chunk_id, chunk, scores_ref.shape[1])
    count_ref[...] = candidate_counts(prefix_ref[row], shift, valid, key)


def _count_kernel(tau_ref, scores_ref, count_ref, *, chunk):
    """Per chunk: how many keys are above tau, and how many equal it."""
    row, chunk_id = pl.program_id(0), pl.program_id(1)
    _, valid, key = load_keys(scores_ref, (row,), chunk_id, chunk, scores_ref.shape[1])
    tau = tau_ref[row]
    above = (valid & (key > tau)).astype(jnp.int32).sum()
    tie = (valid & (key == tau)).astype(jnp.int32).sum()
    count_ref[...] = jnp.where(jnp.arange(2) == 0, above, tie)


def _compact_kernel(tau_ref, n_above_ref, need_ref, offset_ref, scores_ref, idx_ref, *, chunk,
                    k_max):
    """The chunk's store_ranked, after the earlier chunks' counts (offsets)."""
    row, chunk_id = pl.program_id(0), pl.program_id(1)
    slots, valid, key = load_keys(scores_ref, (row,), chunk_id, chunk, scores_ref.shape[1])
    offsets = offset_ref[row, chunk_id, :]
    above_seen = jnp.sum(jnp.where(jnp.arange(2) == 0, offsets, 0))
    tie_seen = jnp.sum(jnp.where(jnp.arange(2) == 1, offsets, 0))
    store_ranked(idx_ref, (row,), slots, valid, key, tau_ref[row], above_seen, tie_seen, n_above_ref[row],
                 need_ref[row], k_max)


def select_topk_pallas(scores, k_max: int, k, *, interpret: bool = False, chunk: int = CHUNK):
    """Radix select; set-equal to lax.top_k up to ties. scores [..., S] float32."""
    _check(scores, k_max)
    lead, S = scores.shape[:-1], scores.shape[-1]
    rows = scores.reshape(-1, S).astype(jnp.float32)
    R = rows.shape[0]
    k_rows = jnp.clip(jnp.broadcast_to(jnp.asarray(k, jnp.int32), lead).reshape(-1), 1, k_max)
    chunk = min(chunk, next_pow2(S))
    grid = (R, pl.cdiv(S, chunk))
    params = plgpu.CompilerParams(num_warps=8, num_stages=1)
    call = functools.partial(pl.pallas_call, grid=grid, compiler_params=params,
                             interpret=interpret)
    row_specs = [pl.no_block_spec, pl.no_block_spec]

    prefix = jnp.zeros((R,), jnp.int32)          # known high bits of tau, unsigned pattern
    for shift in range(32 - DIGIT_BITS, -1, -DIGIT_BITS):
        counts = call(functools.partial(_candidates_kernel, shift=shift, chunk=chunk),
                      in_specs=row_specs,
                      out_specs=pl.BlockSpec((None, None, RADIX), lambda r, c: (r, c, 0)),
                      out_shape=jax.ShapeDtypeStruct((*grid, RADIX), jnp.int32),
                      name="topk_candidates")(prefix, rows)
        prefix = next_prefix(prefix, shift, counts.sum(axis=1), k_rows[:, None])
    tau = prefix_key(prefix)

    counts = call(functools.partial(_count_kernel, chunk=chunk), in_specs=row_specs,
                  out_specs=pl.BlockSpec((None, None, 2), lambda r, c: (r, c, 0)),
                  out_shape=jax.ShapeDtypeStruct((*grid, 2), jnp.int32),
                  name="topk_count")(tau, rows)
    offsets = jnp.cumsum(counts, axis=1) - counts                      # exclusive, per chunk
    n_above = counts[:, :, 0].sum(axis=1)
    idx = call(functools.partial(_compact_kernel, chunk=chunk, k_max=k_max),
               in_specs=[pl.no_block_spec] * 5, out_specs=pl.no_block_spec,
               out_shape=jax.ShapeDtypeStruct((R, k_max + 1), jnp.int32),
               name="topk_compact")(tau, n_above, k_rows - n_above, offsets, rows)
    idx = jnp.where(jnp.arange(k_max) < k_rows[:, None], idx[:, :k_max], 0)
    return idx.reshape(*lead, k_max)
