"""Verify attention: T new query rows per sequence against the whole KV cache of one layer.

Returns the attention output, the per-row log-sum-exp, and (optionally) the per-key selection scores
that the KV-selection drafters need, collected in the same pass over the cache (DESIGN.md 4, 5.1).

Query (b, t) sees cache slots j <= q_pos[b, t]; the new rows' keys are already in the cache, so this
is also the causal mask among the new rows.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (MIN_TILE, compiler_params, init_carry, matmul_precision,
                                    merge_splits, next_pow2, num_splits, softmax_step,
                                    split_range, store_split)

# The Pallas kernel packs all G*T rows of a KV head in one tile; larger T (prefill chunks) use the
# reference.
MAX_PALLAS_ROWS = 16
BLOCK_K = 128
METRICS = ("weight", "logit")


@dataclasses.dataclass(frozen=True)
class Collect:
    """Which verify rows become per-key selection scores, and how.

    rows: sorted distinct indices into T. metric "weight": exp(scale*q.k - lse_row), "logit":
    scale*q.k. Scores are means over all Hq heads; a (row, key) pair the row cannot see
    (key > q_pos of the row) contributes 0. reduce_rows=True also averages the rows -> [B, S],
    -inf past q_pos[b, rows[0]]; False keeps one score row per collected row -> [B, R, S],
    -inf past q_pos[b, rows[i]].
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


def _check(q, k_cache, v_cache, q_pos, collect):
    B, T, Hq, Dh = q.shape
    L, Bk, Hkv, S, Dk = k_cache.shape
    if (Bk, Dk) != (B, Dh) or v_cache.shape != k_cache.shape or Hq % Hkv:
        raise ValueError(f"shapes do not match: q {q.shape}, k_cache {k_cache.shape}, "
                         f"v_cache {v_cache.shape}")
    if q_pos.shape != (B, T):
        raise ValueError(f"q_pos must be [B, T] = {(B, T)}, got {q_pos.shape}")
    if collect is not None and collect.rows[-1] >= T:
        raise ValueError(f"Collect.rows {collect.rows} out of range for T={T}")


def mask_scores(scores, pos):
    """-inf at slots j > pos: scores [..., S], pos [...]."""
    return jnp.where(jnp.arange(scores.shape[-1]) <= pos[..., None], scores, -jnp.inf)


def collected_scores(logits, lse, pos, collect: Collect):
    """Selection scores from the collected rows' logits [B, Hkv, R, G, S], lse [B, Hkv, R, G], pos [B, R].

    Logits at keys a row cannot see may be garbage (even NaN): they are masked, never used.
    """
    visible = jnp.arange(logits.shape[-1]) <= pos[:, None, :, None, None]
    metric = jnp.exp(logits - lse[..., None]) if collect.metric == "weight" else logits
    per_row = jnp.where(visible, metric, 0.0).mean(axis=(1, 3))
    if collect.reduce_rows:
        return mask_scores(per_row.mean(axis=1), pos[:, 0])
    return mask_scores(per_row, pos)


def verify_attention_reference(q, k_cache, v_cache, layer, q_pos, *, scale: float,
                               collect: Collect | None = None):
    """Plain jnp: any T. Materialises [B, Hq, T, S] fp32 logits (fine for tests and prefill chunks)."""
    _check(q, k_cache, v_cache, q_pos, collect)
    B, T, Hq, Dh = q.shape
    Hkv, S = k_cache.shape[2], k_cache.shape[3]
    G = Hq // Hkv
    precision = matmul_precision(q.dtype)
    k = lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False)
    v = lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False)
    q5 = jnp.moveaxis(q.reshape(B, T, Hkv, G, Dh), 2, 1)
    logits = jnp.einsum("bktgd,bksd->bktgs", q5, k, precision=precision,
                        preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(S) <= q_pos[:, None, :, None, None]
    masked = jnp.where(visible, logits, -jnp.inf)
    lse = jax.nn.logsumexp(masked, axis=-1)
    p = jnp.exp(masked - lse[..., None]).astype(v.dtype)
    out = jnp.einsum("bktgs,bksd->bktgd", p, v, precision=precision,
                     preferred_element_type=jnp.float32)
    scores = None
    if collect is not None:
        rows = np.asarray(collect.rows)
        scores = collected_scores(logits[:, :, rows], lse[:, :, rows], q_pos[:, rows], collect)
    out = jnp.moveaxis(out, 1, 2).reshape(B, T, Hq, Dh).astype(q.dtype)
    return out, jnp.moveaxis(lse, 1, 2).reshape(B, T, Hq), scores


def _collect_block(qc, cpos, k, start, scores_ref, b, h, *, scale, collect, n_rows, groups):
    """Collects one key block for the collected rows: a second small dot on their own tile.

    Tile row i is (r, g) = divmod(i, Gp); padding rows have cpos = -1, so they see no key.
    """
    block_k = k.shape[0]
    groups_p = next_pow2(groups)
    rows_p = qc.shape[0] // groups_p
    logits = jnp.dot(qc, k.T, preferred_element_type=jnp.float32) * scale
    block = pl.ds(start, block_k)
    if collect.metric == "weight":
        real = ((jnp.arange(rows_p) < n_rows)[:, None, None]
                & (jnp.arange(groups_p) < groups)[None, :, None])
        plgpu.store(scores_ref.at[b, h, pl.ds(0, rows_p), pl.ds(0, groups_p), block],
                    logits.reshape(rows_p, groups_p, block_k).astype(scores_ref.dtype), mask=real)
        return
    visible = start + jnp.arange(block_k)[None, :] <= cpos[:, None]
    logits = jnp.where(visible, logits, 0.0)
    if collect.reduce_rows:
        scores_ref[b, h, block] = logits.sum(axis=0)
        return
    per_row = logits.reshape(rows_p, groups_p, block_k).sum(axis=1)
    plgpu.store(scores_ref.at[b, h, pl.ds(0, rows_p), block], per_row,
                mask=(jnp.arange(rows_p) < n_rows)[:, None])


def _verify_kernel(layer_ref, pos_ref, q_ref, k_ref, v_ref, *refs, scale, block_k, n_splits,
                   rows, collect, n_collect, groups):
    """Program (b, kv head h, split): the split's share of the key blocks that any row can see."""
    if collect is None:
        o_ref, lse_ref = refs
    else:
        cpos_ref, qc_ref, o_ref, lse_ref, scores_ref = refs
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    pos, q = pos_ref[...], q_ref[...]
    if collect is not None:
        cpos, qc = cpos_ref[...], qc_ref[...]
    n_blocks = (jnp.max(pos) + block_k) // block_k
    lo, hi = split_range(split, n_splits, n_blocks)

    def body(i, carry):
        start = pl.multiple_of(i * block_k, block_k)
        k = k_ref[layer, b, h, pl.ds(start, block_k), :]
        v = v_ref[layer, b, h, pl.ds(start, block_k), :]
        logits = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        if collect is not None:
            _collect_block(qc, cpos, k, start, scores_ref, b, h, scale=scale, collect=collect,
                           n_rows=n_collect, groups=groups)
        visible = start + jnp.arange(block_k)[None, :] <= pos[:, None]
        return softmax_step(carry, logits, visible, v)

    carry = lax.fori_loop(lo, hi, body, init_carry(q.shape[0], q.shape[1]))
    store_split(o_ref, lse_ref, carry, rows)


def _pack_rows(x, tile: int, fill):
    """[B, X, Hkv, G, ...] -> [B, Hkv, tile, ...]: row x*G + g, padded with `fill` up to tile rows."""
    B, X, Hkv, G = x.shape[:4]
    x = jnp.moveaxis(x, 2, 1).reshape(B, Hkv, X * G, *x.shape[4:])
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, tile - X * G)
    return jnp.pad(x, pad, constant_values=fill)


def _collect_tile(q5, q_pos, collect: Collect):
    """The collected rows' queries as [B, Hkv, Rp*Gp, Dh] and their positions as [B, Rp*Gp] (-1: padding)."""
    B, T, Hkv, G, Dh = q5.shape
    R = len(collect.rows)
    groups_p = next_pow2(G)
    rows_p = max(next_pow2(R), MIN_TILE // groups_p)
    qc = jnp.moveaxis(q5[:, np.asarray(collect.rows)], 2, 1)
    qc = jnp.pad(qc, ((0, 0), (0, 0), (0, rows_p - R), (0, groups_p - G), (0, 0)))
    cpos = jnp.broadcast_to(q_pos[:, np.asarray(collect.rows), None], (B, R, G))
    cpos = jnp.pad(cpos, ((0, 0), (0, rows_p - R), (0, groups_p - G)), constant_values=-1)
    return qc.reshape(B, Hkv, rows_p * groups_p, Dh), cpos.reshape(B, rows_p * groups_p)


def verify_attention_pallas(q, k_cache, v_cache, layer, q_pos, *, scale: float,
                            collect: Collect | None = None, interpret: bool = False,
                            block_k: int = BLOCK_K, n_splits: int | None = None):
    """Pallas-Triton kernel for T <= 16 (decode and verification); larger T use the reference.

    Grid (B, Hkv, n_splits): GQA-packed rows of one KV head per tile, split-K over the visible keys
    (blocks past the tile's max(q_pos) are never read), log-sum-exp merge of the splits in XLA.
    Head dim must be a power of two >= 16.
    """
    _check(q, k_cache, v_cache, q_pos, collect)
    B, T, Hq, Dh = q.shape
    if T > MAX_PALLAS_ROWS:
        return verify_attention_reference(q, k_cache, v_cache, layer, q_pos, scale=scale,
                                          collect=collect)
    Hkv, S = k_cache.shape[2], k_cache.shape[3]
    G = Hq // Hkv
    if Dh != next_pow2(Dh) or Dh < MIN_TILE:
        raise ValueError(f"the Pallas verify kernel needs a power-of-two head dim >= 16, got {Dh}")
    block_k = min(block_k, S)
    if S % block_k:
        raise ValueError(f"cache length {S} must be a multiple of block_k={block_k}")
    n_rows = T * G
    tile = next_pow2(max(n_rows, MIN_TILE))
    n_splits = n_splits or num_splits(B * Hkv, S // block_k)
    q5 = q.reshape(B, T, Hkv, G, Dh)
    q_tile = _pack_rows(q5, tile, 0)
    row_pos = jnp.pad(jnp.repeat(q_pos.astype(jnp.int32), G, axis=1), ((0, 0), (0, tile - n_rows)),
                      constant_values=-1)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)

    in_specs = [pl.no_block_spec,
                pl.BlockSpec((None, tile), lambda b, h, s: (b, 0)),
                pl.BlockSpec((None, None, tile, Dh), lambda b, h, s: (b, h, 0, 0)),
                pl.no_block_spec, pl.no_block_spec]
    out_specs = [pl.BlockSpec((None, None, None, n_rows, Dh), lambda b, h, s: (b, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, n_rows), lambda b, h, s: (b, h, s, 0))]
    out_shape = [jax.ShapeDtypeStruct((B, Hkv, n_splits, n_rows, Dh), jnp.float32),
                 jax.ShapeDtypeStruct((B, Hkv, n_splits, n_rows), jnp.float32)]
    args = [layer, row_pos, q_tile, k_cache, v_cache]
    R = 0
    if collect is not None:
        R = len(collect.rows)
        qc, cpos = _collect_tile(q5, q_pos.astype(jnp.int32), collect)
        in_specs += [pl.BlockSpec((None, cpos.shape[1]), lambda b, h, s: (b, 0)),
                     pl.BlockSpec((None, None, qc.shape[2], Dh), lambda b, h, s: (b, h, 0, 0))]
        args += [cpos, qc]
        out_specs.append(pl.no_block_spec)
        if collect.metric == "weight":
            out_shape.append(jax.ShapeDtypeStruct((B, Hkv, R, G, S), q.dtype))
        elif collect.reduce_rows:
            out_shape.append(jax.ShapeDtypeStruct((B, Hkv, S), jnp.float32))
        else:
            out_shape.append(jax.ShapeDtypeStruct((B, Hkv, R, S), jnp.float32))

    kernel = functools.partial(_verify_kernel, scale=scale, block_k=block_k, n_splits=n_splits,
                               rows=n_rows, collect=collect, n_collect=R, groups=G)
    outs = pl.pallas_call(kernel, grid=(B, Hkv, n_splits), in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape,
                          compiler_params=compiler_params(tile), interpret=interpret,
                          name="verify_attention")(*args)
    out, lse = merge_splits(outs[0], outs[1])
    scores = None
    if collect is not None:
        rows = np.asarray(collect.rows)
        pos_c = q_pos[:, rows]
        if collect.metric == "weight":
            lse_c = lse.reshape(B, Hkv, T, G)[:, :, rows]
            scores = collected_scores(outs[2].astype(jnp.float32), lse_c, pos_c, collect)
        elif collect.reduce_rows:
            scores = mask_scores(outs[2].sum(axis=1) / (R * Hq), pos_c[:, 0])
        else:
            scores = mask_scores(outs[2].sum(axis=1) / Hq, pos_c)
    out = jnp.moveaxis(out.reshape(B, Hkv, T, G, Dh), 1, 2).reshape(B, T, Hq, Dh)
    lse = jnp.moveaxis(lse.reshape(B, Hkv, T, G), 1, 2).reshape(B, T, Hq)
    return out.astype(q.dtype), lse, scores
