"""Top-k selection of KV slots: idx [..., k_max] of the k largest scores per row (DESIGN.md 5.3).

The first min(k, #finite scores) entries of a row are the slots of its largest scores, in any order;
the rest are arbitrary slots in [0, S). -inf marks invalid slots; scores must not be NaN.

Fast path: radix select. Float scores map to int32 keys with the same order; four passes of an
8-bit histogram over the key bits (restricted to keys that match the digits found so far) pin down
the k-th largest key tau exactly; a compaction pass then writes the slots with key > tau and as
many slots with key == tau as still fit. One Pallas program per row; the row is re-read from L2 by
each pass.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import next_pow2

# 1024 scores per step with eight warps: no register spills (ptxas, sm_90); 2048 spill heavily.
CHUNK = 1024
DIGIT_BITS = 8
_INT32_MIN = -(2 ** 31)


def _check(scores, k_max):
    if not 1 <= k_max <= scores.shape[-1]:
        raise ValueError(f"k_max must be in [1, S={scores.shape[-1]}], got {k_max}")


def select_topk_reference(scores, k_max: int, k):
    """lax.top_k: sorted, so its first k entries are the top k whatever k is."""
    _check(scores, k_max)
    del k
    return lax.top_k(scores, k_max)[1].astype(jnp.int32)


def _sortable(x):
    """float32 -> int32 with the same order (negative floats: flip the magnitude bits)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _histogram(digit, active):
    """256-bin histogram of 8-bit digits as a [16, 16] one-hot product (on the tensor cores)."""
    hi = jnp.where(active, digit >> 4, 16)
    bins = jnp.arange(16)
    one_hi = (hi[:, None] == bins[None, :]).astype(jnp.bfloat16)
    one_lo = ((digit & 15)[:, None] == bins[None, :]).astype(jnp.bfloat16)
    counts = lax.dot_general(one_hi, one_lo, (((0,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return counts.reshape(256)


def _topk_kernel(k_ref, scores_ref, idx_ref, *, k_max, chunk):
    """Program = one row: four histogram passes find tau, one pass compacts, one pass fills."""
    row = pl.program_id(0)
    S = scores_ref.shape[1]
    k = jnp.clip(k_ref[row], 1, k_max)
    n_chunks = pl.cdiv(S, chunk)

    def load_keys(c):
        slots = c * chunk + jnp.arange(chunk)
        valid = slots < S
        x = plgpu.load(scores_ref.at[row, pl.ds(c * chunk, chunk)], mask=valid, other=-jnp.inf)
        return slots, valid, _sortable(x)

    # prefix: the high digits of tau (as unsigned bits) found so far; need: how many keys equal to
    # that prefix are still to be taken.
    prefix, need = jnp.int32(0), k
    for shift in range(32 - DIGIT_BITS, -1, -DIGIT_BITS):
        def count(c, hist, shift=shift, prefix=prefix):
            _, valid, key = load_keys(c)
            bits = key ^ _INT32_MIN
            active = valid
            if shift + DIGIT_BITS < 32:
                active &= lax.shift_right_logical(bits, shift + DIGIT_BITS) == prefix
            digit = lax.shift_right_logical(bits, shift) & 255
            return hist + _histogram(digit, active)

        hist = lax.fori_loop(0, n_chunks, count, jnp.zeros((256,), jnp.float32))
        hist = hist.astype(jnp.int32)
        at_least = hist.sum() - jnp.cumsum(hist) + hist        # keys with digit >= d
        digit = jnp.sum((at_least >= need).astype(jnp.int32)) - 1
        need -= jnp.sum(jnp.where(jnp.arange(256) > digit, hist, 0))
        prefix = (prefix << DIGIT_BITS) | digit
    tau = prefix ^ _INT32_MIN
    n_above = k - need

    # Masked-off lanes scatter to column k_max, which the caller slices away.
    def compact(c, seen):
        above_seen, tie_seen = seen
        slots, valid, key = load_keys(c)
        above = valid & (key > tau)
        tie = valid & (key == tau)
        above_rank = above_seen + jnp.cumsum(above.astype(jnp.int32))
        tie_rank = tie_seen + jnp.cumsum(tie.astype(jnp.int32))
        take_tie = tie & (tie_rank <= need)
        pos = jnp.where(above, above_rank - 1, n_above + tie_rank - 1)
        pos = jnp.where(above | take_tie, pos, k_max)
        plgpu.store(idx_ref.at[row, pos], slots, mask=above | take_tie)
        return above_seen + above.sum(dtype=jnp.int32), tie_seen + tie.sum(dtype=jnp.int32)

    lax.fori_loop(0, n_chunks, compact, (jnp.int32(0), jnp.int32(0)))

    fill = min(chunk, next_pow2(k_max))

    def pad(c, carry):
        cols = c * fill + jnp.arange(fill)
        plgpu.store(idx_ref.at[row, pl.ds(c * fill, fill)], jnp.zeros((fill,), jnp.int32),
                    mask=(cols >= k) & (cols < k_max))
        return carry

    lax.fori_loop(k // fill, pl.cdiv(k_max, fill), pad, 0)


def select_topk_pallas(scores, k_max: int, k, *, interpret: bool = False, chunk: int = CHUNK):
    """Radix select in one Pallas-Triton program per row; set-equal to lax.top_k up to ties."""
    _check(scores, k_max)
    lead, S = scores.shape[:-1], scores.shape[-1]
    rows = scores.reshape(-1, S).astype(jnp.float32)
    k_rows = jnp.broadcast_to(jnp.asarray(k, jnp.int32), lead).reshape(-1)
    chunk = min(chunk, next_pow2(S))
    idx = pl.pallas_call(
        functools.partial(_topk_kernel, k_max=k_max, chunk=chunk),
        grid=(rows.shape[0],),
        in_specs=[pl.no_block_spec, pl.no_block_spec],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((rows.shape[0], k_max + 1), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=1),
        interpret=interpret, name="select_topk",
    )(k_rows, rows)
    return idx[:, :k_max].reshape(*lead, k_max)
