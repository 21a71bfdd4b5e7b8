"""From a layer's q/k/v product to its attention inputs in one kernel: sum the product's K splits
(and apply int8's column scales), add the bias, RMS-normalise q and k per head (qk_norm models),
rotate them (RoPE), write k and v into the KV cache's pools [L, Hkv, N, Dh] in place (at pool slots
the caller maps through its page table, `pallas_kernels.paging`), and return q.

Why a kernel: XLA ran these as five to seven kernels a layer in every decode step (q's rotation,
and for each of k and v the cache entry read back and a select before the in-place update, which
it keeps because a scatter's slot might be out of bounds; Qwen3's qk-norm statistics two more), each
a launch's fixed cost however little it does (bench/NOTES.md, "the q/k/v epilogue in one kernel").

The product arrives as `sums` [S, R, N]: S partial sums (row_matmul's K splits; S = 1 for
XLA's product) of R >= B*T rows, row b*T + t for token t of sequence b; the columns are q (Hq heads),
k and v (Hkv heads each), then anything else (NSA's gates), which this kernel does not read. The
rule of the product (row_matmul.product_rows): (sum over S, times `scale`'s column scales if
given) rounded to the model dtype, plus the bias, as the model computes a product's output.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paging
from pallas_kernels._common import next_pow2
from pallas_kernels.row_matmul import product_rows

MAX_PALLAS_ROWS = 64  # decode-side forwards (draft steps, verifications, trees); prefill chunks run the reference


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as HF computes it: statistics in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, scale: float) -> jax.Array:
    """Rotate-half RoPE (HF layout) at absolute positions [B, T]; x is [B, T, H, Dh]."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, Dh/2]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def split_sum(sums_ref, scale_ref, entry, row, cols, mask=None):
    """product_rows's rule inside a kernel, before the cast: row `row`, columns `cols` of the
    product, summed over its splits in float32 in split order, times the column scales at `entry`
    (scale_ref None: none). `mask` leaves columns past the end at 0. Returns [width] float32."""
    load = lambda ref: plgpu.load(ref, mask=mask, other=None if mask is None else 0.0)
    acc = 0.0
    for s in range(sums_ref.shape[0]):
        acc += load(sums_ref.at[jnp.int32(s), row, cols]).astype(jnp.float32)
    if scale_ref is not None:
        acc = acc * load(scale_ref.at[entry, cols])
    return acc


def supported(head_dim: int) -> bool:
    """The kernel rotates a head in two halves: half the head dim must be a power of two."""
    return head_dim % 2 == 0 and head_dim // 2 == next_pow2(head_dim // 2)


def _check(sums, positions, write_slots, k_pool, v_pool, num_heads):
    B, T = positions.shape
    _, Hkv, _, Dh = k_pool.shape
    if (write_slots.shape != (B, T) or v_pool.shape != k_pool.shape or sums.ndim != 3
            or sums.shape[1] < B * T):
        raise ValueError(f"shapes do not match: sums {sums.shape}, positions {positions.shape}, "
                         f"write_slots {write_slots.shape}, k_pool {k_pool.shape}, v_pool {v_pool.shape}")
    if sums.shape[2] < (num_heads + 2 * Hkv) * Dh or num_heads % Hkv:
        raise ValueError(f"sums' {sums.shape[2]} columns cannot hold {num_heads} q and {Hkv} k/v heads of {Dh}")


def rope_write_reference(sums, positions, write_slots, k_pool, v_pool, entry, layer, inv_freq, *,
                         num_heads: int, rope_scale: float, eps: float, page_size: int, scale=None, bias=None,
                         q_norm=None, k_norm=None):
    """Plain jnp. `scale` [E, N] (int8 column scales), `bias` [E, N], `q_norm`/`k_norm` [E, Dh] are
    stacks read at `entry` (the params' layer); the pools' layer is `layer`. k and v of token (b, t)
    go to pool slot write_slots[b, t]; an invalid token's, in the null page (pages of `page_size`
    slots), is dropped (`paging.scatter_slots`). Returns q [B, T, Hq, Dh] and the two pools."""
    _check(sums, positions, write_slots, k_pool, v_pool, num_heads)
    B, T = positions.shape
    Hkv, Dh = k_pool.shape[1], k_pool.shape[3]
    qkv = product_rows(sums, scale, entry, B * T, k_pool.dtype, bias).reshape(B, T, -1)
    q_dim, kv_dim = num_heads * Dh, Hkv * Dh
    q = qkv[..., :q_dim].reshape(B, T, num_heads, Dh)
    k = qkv[..., q_dim:q_dim + kv_dim].reshape(B, T, Hkv, Dh)
    v = qkv[..., q_dim + kv_dim:q_dim + 2 * kv_dim].reshape(B, T, Hkv, Dh)
    if q_norm is not None:
        q = rms_norm(q, q_norm[entry], eps)
        k = rms_norm(k, k_norm[entry], eps)
    q = apply_rope(q, positions, inv_freq, rope_scale)
    k = apply_rope(k, positions, inv_freq, rope_scale)
    slots = paging.scatter_slots(write_slots, page_size, k_pool.shape[2])
    k_pool = k_pool.at[layer, :, slots].set(k.astype(k_pool.dtype), mode="drop")  # [B, T, Hkv, Dh] at [B, T]
    v_pool = v_pool.at[layer, :, slots].set(v.astype(v_pool.dtype), mode="drop")
    return q, k_pool, v_pool


def _kernel(entry_ref, layer_ref, pos_ref, wslots_ref, inv_ref, sums_ref, *refs, T, G, Dh, eps, rope_scale,
            has_scale, has_bias, has_norm):
    """Program (b, kv head h, token t, head j) for token t of row b: q head h * G + j for j < G, k of
    h for j = G and v of h for j = G + 1. One head a program: a serial loop over a group's heads is
    slow for large groups (a 1.2B Llama's 16 q heads a KV head; bench/NOTES.md, "rope_write one
    head a program"). One token a
    program, so that a token's result (its qk-norm's sum order) does not depend on T: a draft step
    (T = 1) and the verification (T > 1) must round alike, or drafts are rejected."""
    refs = list(refs)
    scale_ref = refs.pop(0) if has_scale else None
    bias_ref = refs.pop(0) if has_bias else None
    qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if has_norm else (None, None)
    _, _, q_ref, k_ref, v_ref = refs  # the pools' inputs, then the outputs (the pools aliased)
    b, h, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    entry, layer = entry_ref[0], layer_ref[0]
    Hq, Hkv, half = q_ref.shape[2], k_ref.shape[1], Dh // 2
    dtype = k_ref.dtype
    row = b * T + t

    def column(start, width):
        """Columns start .. start + width of the product, as the model rounds them: [1, width]."""
        cols = pl.ds(start, width)
        x = split_sum(sums_ref, scale_ref, entry, row, cols)[None, :].astype(dtype)
        return x + bias_ref[entry, cols][None, :] if has_bias else x

    def head(start, norm_ref):
        """A q or k head at column `start`: normalised (qk_norm) and rotated, in two halves."""
        x1, x2 = column(start, half), column(start + half, half)
        if has_norm:
            f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
            inv_rms = jax.lax.rsqrt((jnp.sum(f1 * f1, axis=1) + jnp.sum(f2 * f2, axis=1)) / Dh + eps)[:, None]
            x1 = norm_ref[entry, pl.ds(0, half)][None, :] * (f1 * inv_rms).astype(dtype)
            x2 = norm_ref[entry, pl.ds(half, half)][None, :] * (f2 * inv_rms).astype(dtype)
        angles = pos_ref[b, t].astype(jnp.float32) * inv_ref[...][None, :]  # [1, Dh/2]
        cos, sin = jnp.cos(angles) * rope_scale, jnp.sin(angles) * rope_scale
        f1, f2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
        return (f1 * cos - f2 * sin).astype(dtype), (f2 * cos + f1 * sin).astype(dtype)

    @pl.when(j < G)
    def _():
        o1, o2 = head((h * G + j) * Dh, qn_ref)
        q_ref[b, pl.ds(t, 1), h * G + j, pl.ds(0, half)] = o1
        q_ref[b, pl.ds(t, 1), h * G + j, pl.ds(half, half)] = o2

    @pl.when(j == G)
    def _():
        k1, k2 = head((Hq + h) * Dh, kn_ref)
        slot = pl.ds(wslots_ref[b, t], 1)
        k_ref[layer, h, slot, pl.ds(0, half)] = k1
        k_ref[layer, h, slot, pl.ds(half, half)] = k2

    @pl.when(j == G + 1)
    def _():
        v_ref[layer, h, pl.ds(wslots_ref[b, t], 1), pl.ds(0, Dh)] = column((Hq + Hkv + h) * Dh, Dh)


def rope_write_pallas(sums, positions, write_slots, k_pool, v_pool, entry, layer, inv_freq, *,
                      num_heads: int, rope_scale: float, eps: float, scale=None, bias=None,
                      q_norm=None, k_norm=None, interpret: bool = False):
    """Pallas-Triton kernel: grid (B, Hkv, T, G + 2), the pools updated in place (aliased to the
    outputs). Head dim must be even, and half of it a power of two."""
    _check(sums, positions, write_slots, k_pool, v_pool, num_heads)
    B, T = positions.shape
    Hkv, Dh = k_pool.shape[1], k_pool.shape[3]
    if not supported(Dh):
        raise ValueError(f"the Pallas rope_write kernel needs half the head dim a power of two, got {Dh}")
    scalar = lambda x: jnp.asarray(x, jnp.int32).reshape(1)
    optional = [x for x in (scale, bias, q_norm, k_norm) if x is not None]
    args = [scalar(entry), scalar(layer), positions.astype(jnp.int32), write_slots.astype(jnp.int32),
            jnp.asarray(inv_freq, jnp.float32), sums, *optional, k_pool, v_pool]
    n_in = len(args)
    G = num_heads // Hkv
    kernel = functools.partial(_kernel, T=T, G=G, Dh=Dh, eps=eps, rope_scale=rope_scale,
                               has_scale=scale is not None, has_bias=bias is not None, has_norm=q_norm is not None)
    return pl.pallas_call(
        kernel, grid=(B, Hkv, T, G + 2),
        in_specs=[pl.no_block_spec] * n_in,
        out_specs=[pl.no_block_spec] * 3,
        out_shape=[jax.ShapeDtypeStruct((B, T, num_heads, Dh), k_pool.dtype),
                   jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
                   jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)],
        input_output_aliases={n_in - 2: 1, n_in - 1: 2},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="rope_write",
    )(*args)
