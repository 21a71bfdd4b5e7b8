"""Verify attention: T new query rows per sequence against the whole KV cache of one layer.

Returns the attention output, the per-row log-sum-exp, and (optionally) the per-key selection scores
that the KV-selection drafters need, collected in the same pass over the cache (DESIGN.md 4, 5.1).

Query (b, t) sees cache slots j <= q_pos[b, t]; the new rows' keys are already in the cache, so this
is also the causal mask among the new rows. A draft tree (`TreeMask`) narrows that: its rows sit at
slots first[b] + t, and row t sees a slot j >= first[b] only if row j - first[b] is t or one of its
ancestors. With a chain's mask (every earlier row an ancestor) that is the causal mask again.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

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

# The Pallas kernel packs all G*T rows of a KV head in one tile; larger T (prefill chunks) use the
# reference.
MAX_PALLAS_ROWS = 16
BLOCK_K = 64
METRICS = ("weight", "logit")


@dataclasses.dataclass(frozen=True)
class Collect:
    """Which verify rows become per-key selection scores, and how.

    rows: sorted distinct indices into T. metric "weight": exp(scale*q.k - lse_row), 0 where the
    row cannot see the key (key > q_pos of the row); "logit": scale*q.k, unmasked, so that its
    mean over rows and heads is one dot product with the mean query. Scores are means over all Hq
    heads. reduce_rows=True also averages the rows -> [B, S], -inf past q_pos[b, rows[0]]; False
    keeps one score row per collected row -> [B, R, S], -inf past q_pos[b, rows[i]]. With rising
    positions (every live sequence) the two metrics see the same keys.
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
    """first [B] int32: the slot of row 0 (the root); ancestors [T, T] bool (static, NumPy): row t may
    see row j iff ancestors[t, j]. Rows are in the tree's flattened order (parents first)."""
    first: jax.Array
    ancestors: np.ndarray

    def visible(self, slots, t):
        """slots [..., S] seen by rows t [...] (the ancestor part only; slots before first: True)."""
        rel = slots - self.first.reshape(self.first.shape + (1,) * (slots.ndim - 1))
        anc = jnp.asarray(self.ancestors)[t[..., None], jnp.clip(rel, 0, self.ancestors.shape[1] - 1)]
        return (rel < 0) | ((rel < self.ancestors.shape[1]) & anc)

    def row_bits(self) -> np.ndarray:
        """[T] int32: bit j of row t set iff ancestors[t, j] (the kernel's form; T <= 31)."""
        return (self.ancestors.astype(np.int64) << np.arange(self.ancestors.shape[1])).sum(axis=1).astype(np.int32)


def _check(q, k_cache, v_cache, q_pos, collect):
    B, T, Hq, Dh = q.shape
    _, Bk, Hkv, _, Dk = k_cache.shape
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

    Logits past the output mask may be garbage (even NaN): they are masked, never used.
    """
    if collect.metric == "weight":
        visible = jnp.arange(logits.shape[-1]) <= pos[:, None, :, None, None]
        logits = jnp.where(visible, jnp.exp(logits - lse[..., None]), 0.0)
    per_row = logits.mean(axis=(1, 3))
    if collect.reduce_rows:
        return mask_scores(per_row.mean(axis=1), pos[:, 0])
    return mask_scores(per_row, pos)


def verify_attention_reference(q, k_cache, v_cache, layer, q_pos, *, scale: float,
                               collect: Collect | None = None, tree: TreeMask | None = None):
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
    if tree is not None:
        slots = jnp.broadcast_to(jnp.arange(S), (B, T, S))
        seen = tree.visible(slots, jnp.broadcast_to(jnp.arange(T), (B, T)))  # [B, T, S]
        visible = visible & seen[:, None, :, None, :]
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


def _verify_kernel(layer_ref, pos_ref, first_ref, bits_ref, q_ref, k_ref, v_ref, *refs, scale, block_k,
                   n_splits, rows, n_collect, tree):
    """Program (b, kv head h, split): the split's share of the key blocks that any row can see.

    With collection, a second small tile of query rows (qc) is multiplied with every key block and
    its first n_collect rows of scaled logits are stored: no masking, no reduction in the loop.
    """
    if n_collect:
        qc_ref, o_ref, lse_ref, scores_ref = refs
        qc = qc_ref[...]
    else:
        o_ref, lse_ref = refs
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    pos, q = pos_ref[...], q_ref[...]
    n_blocks = (jnp.max(pos) + block_k) // block_k
    lo, hi = split_range(split, n_splits, n_blocks)

    def body(i, carry):
        start = pl.multiple_of(i * block_k, block_k)
        k = k_ref[layer, b, h, pl.ds(start, block_k), :]
        v = v_ref[layer, b, h, pl.ds(start, block_k), :]
        logits = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        if n_collect:
            collected = jnp.dot(qc, k.T, preferred_element_type=jnp.float32) * scale
            plgpu.store(scores_ref.at[b, h, pl.ds(0, qc.shape[0]), pl.ds(start, block_k)],
                        collected.astype(scores_ref.dtype),
                        mask=(jnp.arange(qc.shape[0]) < n_collect)[:, None])
        slots = start + jnp.arange(block_k)[None, :]
        visible = slots <= pos[:, None]
        if tree:  # ancestor bits of each row over the slots from the root on
            rel = slots - first_ref[...][:, None]
            bit = (bits_ref[...][:, None] >> jnp.clip(rel, 0, 31)) & 1
            visible = visible & ((rel < 0) | ((rel < 32) & (bit == 1)))
        return softmax_step(carry, logits, visible, v)

    carry = lax.fori_loop(lo, hi, body, init_carry(q.shape[0], q.shape[1]))
    store_split(o_ref, lse_ref, carry, rows)


def _collect_tile(q5, collect: Collect):
    """The query rows whose logits the kernel stores, [B, Hkv, rows_p, Dh] with rows_p >= 16.

    weight: every collected (row, head) as row r*G + g. logit: the rows' queries summed over the
    heads of the KV head (and over the rows when reduce_rows), as the kernel's dot is linear.
    """
    B, _, Hkv, _, Dh = q5.shape
    qc = jnp.moveaxis(q5[:, np.asarray(collect.rows)], 2, 1)         # [B, Hkv, R, G, Dh]
    if collect.metric == "weight":
        qc = qc.reshape(B, Hkv, -1, Dh)
    else:
        qc = qc.astype(jnp.float32).sum(axis=(2, 3) if collect.reduce_rows else 3)
        qc = qc.reshape(B, Hkv, -1, Dh).astype(q5.dtype)
    return pad_rows(qc), qc.shape[2]


def verify_attention_pallas(q, k_cache, v_cache, layer, q_pos, *, scale: float,
                            collect: Collect | None = None, tree: TreeMask | None = None,
                            interpret: bool = False, block_k: int = BLOCK_K, n_splits: int | None = None):
    """Pallas-Triton kernel for T <= 16 (decode and verification); larger T use the reference.

    Grid (B, Hkv, n_splits): GQA-packed rows of one KV head per tile, split-K over the visible keys
    (blocks past the tile's max(q_pos) are never read), log-sum-exp merge of the splits in XLA.
    Head dim must be a power of two >= 16.
    """
    _check(q, k_cache, v_cache, q_pos, collect)
    B, T, Hq, Dh = q.shape
    if T > MAX_PALLAS_ROWS:
        return verify_attention_reference(q, k_cache, v_cache, layer, q_pos, scale=scale,
                                          collect=collect, tree=tree)
    Hkv, S = k_cache.shape[2], k_cache.shape[3]
    G = Hq // Hkv
    if Dh != next_pow2(Dh) or Dh < MIN_TILE:
        raise ValueError(f"the Pallas verify kernel needs a power-of-two head dim >= 16, got {Dh}")
    block_k = min(block_k, S)
    if S % block_k:
        raise ValueError(f"cache length {S} must be a multiple of block_k={block_k}")
    n_rows = T * G
    n_splits = n_splits or num_splits(B * Hkv, S // block_k)
    q5 = q.reshape(B, T, Hkv, G, Dh)
    q_tile = pad_rows(jnp.moveaxis(q5, 2, 1).reshape(B, Hkv, n_rows, Dh))   # row t*G + g
    tile = q_tile.shape[2]
    row_pos = jnp.pad(jnp.repeat(q_pos.astype(jnp.int32), G, axis=1), ((0, 0), (0, tile - n_rows)),
                      constant_values=-1)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    row_spec = pl.BlockSpec((None, tile), lambda b, h, s: (b, 0))
    if tree is None:
        row_first = jnp.zeros((B, tile), jnp.int32)
        row_bits = jnp.zeros((B, tile), jnp.int32)
    else:
        row_first = jnp.broadcast_to(tree.first.astype(jnp.int32)[:, None], (B, tile))
        bits = np.pad(np.repeat(tree.row_bits(), G), (0, tile - n_rows))
        row_bits = jnp.broadcast_to(jnp.asarray(bits), (B, tile))

    in_specs = [pl.no_block_spec, row_spec, row_spec, row_spec,
                pl.BlockSpec((None, None, tile, Dh), lambda b, h, s: (b, h, 0, 0)),
                pl.no_block_spec, pl.no_block_spec]
    out_specs = [pl.BlockSpec((None, None, None, n_rows, Dh), lambda b, h, s: (b, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, n_rows), lambda b, h, s: (b, h, s, 0))]
    out_shape = [jax.ShapeDtypeStruct((B, Hkv, n_splits, n_rows, Dh), jnp.float32),
                 jax.ShapeDtypeStruct((B, Hkv, n_splits, n_rows), jnp.float32)]
    args = [layer, row_pos, row_first, row_bits, q_tile, k_cache, v_cache]
    n_collect = 0
    if collect is not None:
        qc, n_collect = _collect_tile(q5, collect)
        in_specs.append(pl.BlockSpec((None, None, qc.shape[2], Dh), lambda b, h, s: (b, h, 0, 0)))
        args.append(qc)
        out_specs.append(pl.no_block_spec)
        dtype = q.dtype if collect.metric == "weight" else jnp.float32
        out_shape.append(jax.ShapeDtypeStruct((B, Hkv, n_collect, S), dtype))

    kernel = functools.partial(_verify_kernel, scale=scale, block_k=block_k, n_splits=n_splits,
                               rows=n_rows, n_collect=n_collect, tree=tree is not None)
    outs = pl.pallas_call(kernel, grid=(B, Hkv, n_splits), in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape,
                          compiler_params=compiler_params(), interpret=interpret,
                          name="verify_attention")(*args)
    out, lse = merge_splits(outs[0], outs[1])
    scores = None
    if collect is not None:
        rows = np.asarray(collect.rows)
        pos_c = q_pos[:, rows]
        if collect.metric == "weight":
            raw = outs[2].reshape(B, Hkv, len(rows), G, S).astype(jnp.float32)
            scores = collected_scores(raw, lse.reshape(B, Hkv, T, G)[:, :, rows], pos_c, collect)
        else:
            mean = outs[2].sum(axis=1) / (Hq * (len(rows) if collect.reduce_rows else 1))
            scores = mask_scores(mean[:, 0] if collect.reduce_rows else mean,
                                 pos_c[:, 0] if collect.reduce_rows else pos_c)
    out = jnp.moveaxis(out.reshape(B, Hkv, T, G, Dh), 1, 2).reshape(B, T, Hq, Dh)
    lse = jnp.moveaxis(lse.reshape(B, Hkv, T, G), 1, 2).reshape(B, T, Hq)
    return out.astype(q.dtype), lse, scores
