"""NSA selected-block and sliding-window branches, and the gated combination of all three.

Query (b, t) at position p of query head h (KV head h // G):
    selected: keys of the blocks idx[b, t, h // G, :] (>= 0) at slots <= p;
    window:   keys at slots [p - window + 1, p] (none when window is 0);
    o = g[..., 0] * o_cmp + g[..., 1] * o_slc + g[..., 2] * o_swa, each branch its own softmax
(fla's `parallel_nsa`). An empty branch contributes 0.

Pallas path (T <= 16 rows): one program per (b, KV head, row t) holds the row's G query heads in one
tile and runs both branches and the gating, so the output is written once. Its key steps divide the
page size, so each lies in one page of the pools.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paging
from pallas_kernels._common import (
    MIN_TILE,
    PAGED_STAGES,
    compiler_params,
    init_carry,
    matmul_precision,
    next_pow2,
    softmax_step,
)

MAX_PALLAS_ROWS = 16
BLOCK_K = 64                     # keys per step for 2-byte caches; 32 for 4-byte ones (shared memory)


def _attend(q, k, v, ok, scale, precision):
    """Softmax attention of q [B, T, Hkv, G, Dh] over gathered k/v [B, T, Hkv, N, Dh] where ok [B, T, Hkv, N]."""
    logits = jnp.einsum("btkgd,btknd->btkgn", q, k, precision=precision) * scale
    logits = jnp.where(ok[:, :, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("btkgn,btknd->btkgd", p, v, precision=precision)
    return o / jnp.where(denom > 0, denom, 1.0)


def nsa_selected_reference(q, k_pool, v_pool, pages, layer, q_pos, idx, o_cmp, gates, *, page_size: int,
                           block_size: int, window: int, scale: float, slot_of=None):
    """q [B, T, Hq, Dh], pools [L, Hkv, N, Dh] through the page table pages [B, R], q_pos [B, T],
    idx [B, T, Hkv, NS] logical block indices (-1: none), o_cmp [B, T, Hq, Dh], gates [B, T, Hq, 3]
    (after the sigmoid). Returns the NSA output [B, T, Hq, Dh] (q.dtype). Plain jnp with gathers,
    any T; float32 math. `slot_of` maps the key positions [B, T, Hkv, N] each row reads to logical
    slots (a draft tree's rows read their own path: `nsa_tree`); by default a key's slot is its
    position."""
    B, T, Hq, Dh = q.shape
    k, v = (paging.layer_view(x, layer, pages, page_size) for x in (k_pool, v_pool))
    Hkv, num_slots = k.shape[1], k.shape[2]
    G = Hq // Hkv
    precision = matmul_precision(q.dtype)
    qg = q.astype(jnp.float32).reshape(B, T, Hkv, G, Dh)
    b = jnp.arange(B)[:, None, None, None]
    h = jnp.arange(Hkv)[None, None, :, None]
    pos = q_pos[:, :, None, None]

    def branch(positions, ok):  # positions [B, T, Hkv, N]
        slots = jnp.clip(positions if slot_of is None else slot_of(positions), 0, num_slots - 1)
        ks, vs = k[b, h, slots].astype(jnp.float32), v[b, h, slots].astype(jnp.float32)
        return _attend(qg, ks, vs, ok, scale, precision)

    sel = (idx[..., None] * block_size + jnp.arange(block_size)).reshape(B, T, Hkv, -1)
    sel_ok = (jnp.repeat(idx, block_size, axis=-1) >= 0) & (sel <= pos)
    o_slc = branch(sel, sel_ok)
    if window:
        win = jnp.broadcast_to(pos - window + 1 + jnp.arange(window), (B, T, Hkv, window))
        o_swa = branch(win, win >= 0)
    else:
        o_swa = jnp.zeros_like(o_slc)
    g = gates.astype(jnp.float32).reshape(B, T, Hkv, G, 3)
    out = g[..., 0:1] * o_cmp.astype(jnp.float32).reshape(B, T, Hkv, G, Dh) + g[..., 1:2] * o_slc + g[..., 2:3] * o_swa
    return out.reshape(B, T, Hq, Dh).astype(q.dtype)


def _selected_kernel(layer_ref, pos_ref, idx_ref, q_ref, o_cmp_ref, gates_ref, pages_ref, k_ref, v_ref, o_ref, *,
                     scale, page_size, block_size, window, block_k, block_w, groups, precision):
    """Program (b, kv head h, row t): the row's selected blocks, then its window, each through its
    own online softmax; o = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa.

    A selected block takes block_size / block_k steps; window steps are block_w-aligned. Keys past
    q_pos, and whole blocks of idx -1, are masked off the loads as well as the softmax, so they
    cost no memory traffic.
    """
    b, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, pos, q = layer_ref[0], pos_ref[b, t], q_ref[...]

    def attend(carry, start, n, ok):  # n keys from logical slot start (n-aligned)
        slot = pl.multiple_of(paging.pool_slot(pages_ref, b, start, page_size), n)
        k = plgpu.load(k_ref.at[layer, h, pl.ds(slot, n), :], mask=ok[:, None], other=0.0)
        v = plgpu.load(v_ref.at[layer, h, pl.ds(slot, n), :], mask=ok[:, None], other=0.0)
        logits = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32) * scale
        return softmax_step(carry, logits, ok[None, :], v)

    steps = block_size // block_k

    def selected(i, carry):
        block = idx_ref[b, t, h, lax.div(i, steps)]   # jnp's // and % sign fix-ups fail to lower
        start = pl.multiple_of(jnp.maximum(block, 0) * block_size + lax.rem(i, steps) * block_k, block_k)
        slots = start + jnp.arange(block_k)
        return attend(carry, start, block_k, (block >= 0) & (slots <= pos))

    def windowed(i, carry):
        start = pl.multiple_of(i * block_w, block_w)
        slots = start + jnp.arange(block_w)
        return attend(carry, start, block_w, (slots > pos - window) & (slots <= pos))

    def normalised(carry):
        o, _, l = carry
        return o / jnp.where(l > 0, l, 1.0)[:, None]

    empty = init_carry(q.shape[0], q.shape[1])
    out = gates_ref[0, :][:, None] * o_cmp_ref[...].astype(jnp.float32)
    out += gates_ref[1, :][:, None] * normalised(lax.fori_loop(0, idx_ref.shape[3] * steps, selected, empty))
    if window:
        first = jnp.maximum(pos - window + 1, 0) // block_w
        out += gates_ref[2, :][:, None] * normalised(lax.fori_loop(first, pos // block_w + 1, windowed, empty))
    tile = q.shape[0]
    plgpu.store(o_ref.at[pl.ds(0, tile)], out.astype(o_ref.dtype), mask=(jnp.arange(tile) < groups)[:, None])


def nsa_selected_pallas(q, k_pool, v_pool, pages, layer, q_pos, idx, o_cmp, gates, *, page_size: int, block_size: int,
                        window: int, scale: float, interpret: bool = False, block_k: int | None = None):
    """Pallas-Triton kernel for T <= 16 (larger T use the reference): same result as
    `nsa_selected_reference`.

    Grid (B, Hkv, T): the G query heads of a (row, KV head) padded to a tile of a power of two >= 16
    rows share every loaded key block: a selected block in steps of min(block_k, block_size) keys,
    the window in steps of min(block_k, window) keys (rounded up to a power of two >= 16).
    block_size and the head dim must be powers of two >= 16; the key steps must divide page_size.
    Float32 inputs get full fp32 logits; the p.v products are `softmax_step`'s (TF32 on a GPU).
    """
    B, T, Hq, Dh = q.shape
    if T > MAX_PALLAS_ROWS:
        return nsa_selected_reference(q, k_pool, v_pool, pages, layer, q_pos, idx, o_cmp, gates, page_size=page_size,
                                      block_size=block_size, window=window, scale=scale)
    Hkv = k_pool.shape[1]
    G = Hq // Hkv
    for name, n in (("head dim", Dh), ("block_size", block_size)):
        if n != next_pow2(n) or n < MIN_TILE:
            raise ValueError(f"the Pallas NSA kernels need a power-of-two {name} >= 16, got {n}")
    block_k = block_k or BLOCK_K * 2 // k_pool.dtype.itemsize
    block_w = min(block_k, next_pow2(max(window, MIN_TILE)))
    block_k = min(block_k, block_size)
    if page_size % max(block_k, block_w):
        raise ValueError(f"the NSA key steps ({block_k}, {block_w}) must divide the page size {page_size}")
    tile = next_pow2(max(G, MIN_TILE))
    heads = ((0, 0),) * 3 + ((0, tile - G), (0, 0))
    q_tile = jnp.pad(q.reshape(B, T, Hkv, G, Dh), heads)
    o_cmp_tile = jnp.pad(o_cmp.reshape(B, T, Hkv, G, Dh), heads)
    gates_tile = jnp.pad(jnp.swapaxes(gates.astype(jnp.float32).reshape(B, T, Hkv, G, 3), 3, 4),
                         ((0, 0),) * 4 + ((0, tile - G),))   # [B, T, Hkv, 3, tile]
    row_spec = pl.BlockSpec((None, None, None, tile, Dh), lambda b, h, t: (b, t, h, 0, 0))
    kernel = functools.partial(_selected_kernel, scale=scale, page_size=page_size, block_size=block_size, window=window,
                               block_k=block_k, block_w=block_w, groups=G, precision=matmul_precision(q.dtype))
    out = pl.pallas_call(
        kernel, grid=(B, Hkv, T),
        in_specs=[pl.no_block_spec] * 3
        + [row_spec, row_spec, pl.BlockSpec((None, None, None, 3, tile), lambda b, h, t: (b, t, h, 0, 0))]
        + [pl.no_block_spec] * 3,
        out_specs=pl.BlockSpec((None, None, None, G, Dh), lambda b, h, t: (b, t, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, T, Hkv, G, Dh), q.dtype),
        compiler_params=compiler_params(PAGED_STAGES), interpret=interpret, name="nsa_selected",
    )(jnp.asarray(layer, jnp.int32).reshape(1), q_pos.astype(jnp.int32), idx.astype(jnp.int32),
      q_tile, o_cmp_tile, gates_tile, pages, k_pool, v_pool)
    return out.reshape(B, T, Hq, Dh)
