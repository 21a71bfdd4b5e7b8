"""A draft head's top tokens in one kernel: its final RMSNorm, its LM head and each column block's picks.

An EAGLE-3 head's greedy drafts at a node are the b largest logits of its LM head (b <= 5 children).
XLA ran that as the norm, the product's kernel, the sum of the product's K splits and one reduction
per pick over the whole draft vocabulary: 5-8 kernels of fixed cost at every draft depth, most of a
one-row draft stage's time (bench/NOTES.md, "the draft stage's kernels"). Here each program norms its
rows, multiplies them by a block of the LM head's columns over all of K and keeps the block's b
largest; one lax.top_k over the blocks' picks (b a block) then gives each row's b. Ties go to the lower
column, lax.top_k's rule: within a block the lowest of equal values is picked first, and the blocks'
picks are listed in column order.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import MIN_TILE, divisor, next_pow2
from pallas_kernels.rope_write import rms_norm

MAX_ROWS = 64  # rows a program (16 at least, tl.dot's smallest): each row block reads the LM head again
BLOCK_N = 64  # LM-head columns a program: SmolLM2's 12,288-token draft vocabulary in 192 programs
BLOCK_K = 64  # K a loop step (a divisor of K)
MAX_PICKS = 8


def supported(x, w, b: int) -> bool:
    """K in whole steps (of at least MIN_TILE), and at most MAX_PICKS picks."""
    return divisor(x.shape[1], BLOCK_K) is not None and 1 <= b <= MAX_PICKS


def lm_head_top_reference(x, norm, w, b: int, *, eps: float):
    """int32 [M, b]: the columns of the b largest of rms_norm(x [M, K], norm [K]) @ w [K, V] (float32
    sums), largest first, ties to the lower column."""
    logits = jnp.dot(rms_norm(x, norm, eps), w, preferred_element_type=jnp.float32)
    return lax.top_k(logits, b)[1].astype(jnp.int32)


def _kernel(x_ref, norm_ref, w_ref, value_ref, index_ref, *, eps: float, b: int, bm: int, bk: int):
    """Program (i, j): rows i * bm.. times columns j * BLOCK_N..; writes their b picks [b, rows]."""
    i, j = pl.program_id(0), pl.program_id(1)
    (M, K), V = x_ref.shape, w_ref.shape[1]
    rows = pl.ds(i * bm, bm)
    real = i * bm + jnp.arange(bm) < M
    cols = j * BLOCK_N + jnp.arange(BLOCK_N)
    inside = cols < V
    x_at = lambda s: plgpu.load(x_ref.at[rows, pl.ds(s * bk, bk)], mask=real[:, None], other=0.0)

    def squares(s, total):
        xf = x_at(s).astype(jnp.float32)
        return total + jnp.sum(xf * xf, axis=1)

    scale = lax.rsqrt(lax.fori_loop(0, K // bk, squares, jnp.zeros((bm,), jnp.float32)) / K + eps)

    def product(s, acc):
        x = x_at(s)
        h = norm_ref[pl.ds(s * bk, bk)][None, :] * (x.astype(jnp.float32) * scale[:, None]).astype(x.dtype)
        w = plgpu.load(w_ref.at[pl.ds(s * bk, bk), pl.ds(j * BLOCK_N, BLOCK_N)], mask=inside[None, :], other=0.0)
        return acc + jnp.dot(h.astype(w.dtype), w, preferred_element_type=jnp.float32)

    logits = lax.fori_loop(0, K // bk, product, jnp.zeros((bm, BLOCK_N), jnp.float32))
    logits = jnp.where(inside[None, :], logits, -jnp.inf)
    for t in range(b):  # the block's largest, its lowest column among equals, then the next
        top = jnp.max(logits, axis=1)
        at = jnp.min(jnp.where(logits == top[:, None], cols[None, :], V + BLOCK_N), axis=1)
        plgpu.store(value_ref.at[jnp.int32(t), rows, j], top, mask=real)
        plgpu.store(index_ref.at[jnp.int32(t), rows, j], at.astype(jnp.int32), mask=real)
        logits = jnp.where(cols[None, :] == at[:, None], -jnp.inf, logits)


def lm_head_top_pallas(x, norm, w, b: int, *, eps: float, interpret: bool = False):
    """Pallas-Triton kernel, grid (row blocks, column blocks), then lax.top_k over the blocks' picks."""
    M, K = x.shape
    bm, blocks = max(MIN_TILE, min(MAX_ROWS, next_pow2(M))), pl.cdiv(w.shape[1], BLOCK_N)
    picks = [jax.ShapeDtypeStruct((b, M, blocks), dtype) for dtype in (jnp.float32, jnp.int32)]
    values, indices = pl.pallas_call(
        functools.partial(_kernel, eps=eps, b=b, bm=bm, bk=divisor(K, BLOCK_K)), grid=(pl.cdiv(M, bm), blocks),
        in_specs=[pl.no_block_spec] * 3, out_specs=[pl.no_block_spec] * 2, out_shape=picks,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=interpret, name="lm_head_top",
    )(x, norm, w)
    in_order = lambda a: jnp.moveaxis(a, 0, -1).reshape(M, blocks * b)  # row-major: column order
    best = lax.top_k(in_order(values), b)[1]
    return jnp.take_along_axis(in_order(indices), best, axis=1)

