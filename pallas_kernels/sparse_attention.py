"""Sparse draft attention: one query row per sequence over a selected subset of the KV cache.

Attends the union of (a) the gathered slots idx[b, s, :n_idx[b]] (s: one shared set, Hs == 1, or
one per KV head, Hs == Hkv) and (b) the contiguous tail tail_start[b] .. q_pos[b] (DESIGN.md 4, 5.2).
The caller guarantees the gathered slots are distinct and below tail_start, so nothing is counted
twice, and that the tail holds at most `tail_capacity` slots.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    MIN_TILE,
    compiler_params,
    init_carry,
    matmul_precision,
    merge_splits,
    next_pow2,
    num_splits,
    pad_rows,
    softmax_step,
    split_range,
    store_split,
)

BLOCK_K = 64


def _check(q, k_cache, v_cache, idx, n_idx, tail_start, q_pos):
    B, Hq, Dh = q.shape
    _, Bk, Hkv, _, Dk = k_cache.shape
    if (Bk, Dk) != (B, Dh) or v_cache.shape != k_cache.shape or Hq % Hkv:
        raise ValueError(f"shapes do not match: q {q.shape}, k_cache {k_cache.shape}, "
                         f"v_cache {v_cache.shape}")
    if idx.ndim != 3 or idx.shape[0] != B or idx.shape[1] not in (1, Hkv):
        raise ValueError(f"idx must be [B, 1 or Hkv, K] = [{B}, 1|{Hkv}, K], got {idx.shape}")
    for name, x in (("n_idx", n_idx), ("tail_start", tail_start), ("q_pos", q_pos)):
        if x.shape != (B,):
            raise ValueError(f"{name} must be [B] = [{B}], got {x.shape}")


def sparse_attention_reference(q, k_cache, v_cache, layer, idx, n_idx, tail_start, q_pos, *,
                               scale: float, tail_capacity: int):
    """Plain jnp: gathers the selected keys and a tail_capacity-long tail window, masks, softmax."""
    _check(q, k_cache, v_cache, idx, n_idx, tail_start, q_pos)
    B, Hq, Dh = q.shape
    Hkv, S = k_cache.shape[2], k_cache.shape[3]
    K = idx.shape[2]
    precision = matmul_precision(q.dtype)
    k = lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False)
    v = lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False)
    tail = tail_start[:, None] + jnp.arange(tail_capacity)
    slots = jnp.concatenate([jnp.broadcast_to(idx, (B, Hkv, K)),
                             jnp.broadcast_to(tail[:, None], (B, Hkv, tail_capacity))], axis=2)
    slots = jnp.clip(slots, 0, S - 1)[..., None]
    visible = jnp.concatenate([jnp.arange(K) < n_idx[:, None], tail <= q_pos[:, None]], axis=1)
    keys = jnp.take_along_axis(k, slots, axis=2)
    values = jnp.take_along_axis(v, slots, axis=2)
    logits = jnp.einsum("bkgd,bknd->bkgn", q.reshape(B, Hkv, Hq // Hkv, Dh), keys,
                        precision=precision, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgn,bknd->bkgd", p, values, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.reshape(B, Hq, Dh).astype(q.dtype)


def _sparse_kernel(layer_ref, n_idx_ref, tail_ref, pos_ref, idx_ref, q_ref, k_ref, v_ref, o_ref,
                   lse_ref, *, scale, block_k, n_splits, groups):
    """Program (b, kv head h, split): its share of the gathered blocks, then of the tail blocks.

    Every block is a token-granular gather (slot vector of block_k rows); slots past the list or
    the tail are clamped into the cache and masked out of the softmax.
    """
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, n_idx, tail_start, q_pos = layer_ref[0], n_idx_ref[b], tail_ref[b], pos_ref[b]
    shared, K = idx_ref.shape[1] == 1, idx_ref.shape[2]
    last_slot = k_ref.shape[3] - 1
    q = q_ref[...]
    n_gather = (n_idx + block_k - 1) // block_k
    n_tail = (jnp.maximum(q_pos - tail_start + 1, 0) + block_k - 1) // block_k
    lo, hi = split_range(split, n_splits, n_gather + n_tail)

    def attend(carry, slots, visible):
        slots = jnp.clip(slots, 0, last_slot)
        k = k_ref[layer, b, h, slots, :]
        v = v_ref[layer, b, h, slots, :]
        logits = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        return softmax_step(carry, logits, visible[None, :], v)

    def gather_block(i, carry):
        j = i * block_k + jnp.arange(block_k)
        slots = idx_ref[b, 0 if shared else h, jnp.minimum(j, K - 1)]
        return attend(carry, slots, j < n_idx)

    def tail_block(i, carry):
        slots = tail_start + i * block_k + jnp.arange(block_k)
        return attend(carry, slots, slots <= q_pos)

    carry = lax.fori_loop(lo, jnp.minimum(hi, n_gather), gather_block,
                          init_carry(q.shape[0], q.shape[1]))
    carry = lax.fori_loop(jnp.maximum(lo, n_gather) - n_gather, hi - n_gather, tail_block, carry)
    store_split(o_ref, lse_ref, carry, groups)


def sparse_attention_pallas(q, k_cache, v_cache, layer, idx, n_idx, tail_start, q_pos, *,
                            scale: float, tail_capacity: int, interpret: bool = False,
                            block_k: int = BLOCK_K, n_splits: int | None = None):
    """Pallas-Triton kernel. Grid (B, Hkv, n_splits): the G query heads of a KV head share each
    gathered K/V block; split-K over the (traced) gathered + tail blocks; lse merge in XLA.

    tail_capacity only sizes the static split count. Head dim must be a power of two >= 16.
    """
    _check(q, k_cache, v_cache, idx, n_idx, tail_start, q_pos)
    B, Hq, Dh = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    if Dh != next_pow2(Dh) or Dh < MIN_TILE:
        raise ValueError(f"the Pallas sparse kernel needs a power-of-two head dim >= 16, got {Dh}")
    max_blocks = pl.cdiv(idx.shape[2], block_k) + pl.cdiv(tail_capacity, block_k)
    n_splits = n_splits or num_splits(B * Hkv, max_blocks)
    q_tile = pad_rows(q.reshape(B, Hkv, G, Dh))
    ints = [jnp.asarray(x, jnp.int32) for x in (n_idx, tail_start, q_pos, idx)]
    kernel = functools.partial(_sparse_kernel, scale=scale, block_k=block_k, n_splits=n_splits,
                               groups=G)
    o_part, lse_part = pl.pallas_call(
        kernel, grid=(B, Hkv, n_splits),
        in_specs=[pl.no_block_spec] * 5
        + [pl.BlockSpec((None, None, q_tile.shape[2], Dh), lambda b, h, s: (b, h, 0, 0)),
           pl.no_block_spec, pl.no_block_spec],
        out_specs=[pl.BlockSpec((None, None, None, G, Dh), lambda b, h, s: (b, h, s, 0, 0)),
                   pl.BlockSpec((None, None, None, G), lambda b, h, s: (b, h, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, n_splits, G, Dh), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hkv, n_splits, G), jnp.float32)],
        compiler_params=compiler_params(), interpret=interpret, name="sparse_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), *ints, q_tile, k_cache, v_cache)
    out, _ = merge_splits(o_part, lse_part)
    return out.reshape(B, Hq, Dh).astype(q.dtype)
