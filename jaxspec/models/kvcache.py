"""The KV cache: a pool of fixed-size pages per keys and values, [L, Hkv, N, Dh], and a page table
[B, R] mapping each row's token positions to pool slots (`pallas_kernels.paging`), donated through the
loop. A batch's cache outside a server gives each row its own consecutive pages; a server's pool is
shared by its rows, which it grows a page at a time (`serving.pages`).

Slots are absolute token positions of a row (logical slots; the table finds them in the pool). A slot
is readable once written; which slots are valid is decided by lengths alone (attention masks keys
after the query position), so rejected draft tokens need no clean-up: verification overwrites them,
or they fall beyond the row's length.

NSA models also keep the compressed keys/values of every block of `block_size` slots, k_cmp/v_cmp
[L, Hkv, N / block_size, Dh] through the same table: the mean of the block's post-RoPE keys (values).
Every write recomputes the blocks it touched from the slots, so a block's entry always equals the mean
of what its slots last held; a query only reads blocks that end at or before its own position, whose
slots are all correct by then (committed, or written by earlier rows of the same pass). A block that
completes inside a verification window is therefore seen by the later rows of that window, and one
that held rejected drafts is recomputed by the pass that rewrites them.

A run that drafts with an EAGLE-3 head keeps the head's one-layer cache in `head`, under the same page
table, so it travels with the model's through prefill, admission and batch surgery; nothing else here
reads or moves it (the head rewrites its accepted rows itself: `decoding.drafters.eagle`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from pallas_kernels import paging
from pallas_kernels.paging import DEFAULT_PAGE_SIZE, NULL_PAGE  # noqa: F401 (the cache's names for them)

SLOT_ALIGN = 128  # cache slots are padded to a multiple of this (kernel block sizes divide it)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, Hkv, N, Dh] pool
    v: jax.Array
    pages: jax.Array  # [B, R] int32 page table
    k_cmp: jax.Array | None = None  # NSA only: [L, Hkv, N / block_size, Dh]
    v_cmp: jax.Array | None = None
    head: KVCache | None = None  # an EAGLE-3 draft head's own one-layer cache, same table (models.eagle)
    page_size: int = dataclasses.field(default=DEFAULT_PAGE_SIZE, metadata=dict(static=True))

    @property
    def num_slots(self) -> int:
        """Logical slots a row: positions at or past this are not written."""
        return self.pages.shape[1] * self.page_size

    @property
    def num_pages(self) -> int:
        return self.k.shape[2] // self.page_size

    @property
    def block_size(self) -> int:
        """Slots per compressed block (NSA caches only)."""
        return self.k.shape[2] // self.k_cmp.shape[2]

    def slots(self, positions: jax.Array) -> jax.Array:
        """Pool slots of logical slots [B, ...] (past the table: the null page)."""
        return paging.physical(self.pages, positions, self.page_size)

    def view(self, layer) -> tuple[jax.Array, jax.Array]:
        """Layer `layer`'s keys and values as rows [B, Hkv, S, Dh] (a gather: references and tests)."""
        return (paging.layer_view(self.k, layer, self.pages, self.page_size),
                paging.layer_view(self.v, layer, self.pages, self.page_size))

    def with_pages(self, pages: jax.Array) -> KVCache:
        """This pool under another page table (the head's cache too)."""
        head = None if self.head is None else dataclasses.replace(self.head, pages=pages)
        return dataclasses.replace(self, pages=pages, head=head)

    def written(self, layer: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        """This cache with pools `k`, `v` (`kernels.rope_write`'s) in which layer `layer` now holds new
        entries at logical slots `positions` [B, T] (past the end: none).

        Positions of a row are consecutive (padding, if any, at the end); an NSA cache then recomputes
        the compressed blocks those slots fall in. (The nodes of one depth of a DFS draft tree are not
        consecutive: their blocks are recomputed by the verification pass, which writes every tree
        slot, before any NSA attention reads them; draft forwards read no compressed blocks.)
        """
        cache = dataclasses.replace(self, k=k, v=v)
        return cache if self.k_cmp is None else cache._refresh_blocks(layer, positions[:, 0], positions.shape[1])

    def move(self, src: jax.Array, dst: jax.Array) -> KVCache:
        """Copies logical slots src [B, n] to slots dst [B, n] (consecutive) in every layer; an NSA cache
        then recomputes the compressed blocks of dst (a draft tree's accepted path moving into place)."""
        to, at = self.slots(dst), self.slots(src)
        to = paging.scatter_slots(to, self.page_size, self.k.shape[2])  # a slot past the table: dropped
        moved = lambda x: x.at[:, :, to].set(x[:, :, at], mode="drop")
        cache = dataclasses.replace(self, k=moved(self.k), v=moved(self.v))
        if self.k_cmp is None:
            return cache
        refresh = lambda layer, c: c._refresh_blocks(layer, dst[:, 0], dst.shape[1])
        return jax.lax.fori_loop(0, self.k.shape[0], refresh, cache)

    def _refresh_blocks(self, layer: jax.Array, first: jax.Array, num_rows: int) -> KVCache:
        """Recomputes the compressed entries of the blocks holding slots first[b] .. first[b] + num_rows - 1."""
        bs = self.block_size
        num_blocks = self.num_slots // bs
        count = min((num_rows - 1) // bs + 2, num_blocks)
        blocks = first[:, None] // bs + jnp.arange(count, dtype=jnp.int32)  # [B, n] logical blocks
        inside = blocks < num_blocks
        slots = self.slots(jnp.where(inside, blocks, 0)[..., None] * bs + jnp.arange(bs, dtype=jnp.int32))

        def pooled(pool):  # [L, Hkv, N, Dh] -> [B, n, Hkv, Dh]: means of the blocks' slots
            x = jax.lax.dynamic_index_in_dim(pool, layer, 0, keepdims=False)[:, slots]  # [Hkv, B, n, bs, Dh]
            return jnp.moveaxis(jnp.mean(x.astype(jnp.float32), axis=3), 0, 2)

        # a block past the table is dropped: its entry goes to the pool's end, out of bounds
        entry = jnp.where(inside, self.slots(blocks * bs) // bs, self.k_cmp.shape[2])
        at = (layer, slice(None), entry)  # the set's shape [B, n, Hkv, Dh]: the indexed axes first
        k_cmp = self.k_cmp.at[at].set(pooled(self.k).astype(self.k_cmp.dtype), mode="drop")
        v_cmp = self.v_cmp.at[at].set(pooled(self.v).astype(self.v_cmp.dtype), mode="drop")
        return dataclasses.replace(self, k_cmp=k_cmp, v_cmp=v_cmp)


def cache_slots(length: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """Logical slots a row needs for `length` positions: whole pages (and SLOT_ALIGN)."""
    align = math.lcm(SLOT_ALIGN, page_size)
    return -(-length // align) * align


def pool_shape(cfg: ModelConfig, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE) -> tuple[int, ...]:
    return (cfg.num_layers, cfg.num_kv_heads, num_pages * page_size, cfg.head_dim)


def page_bytes(cfg: ModelConfig, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """Device bytes of one page of every layer (keys and values, compressed ones included)."""
    per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (1 + (1 / cfg.nsa.block_size if cfg.nsa else 0))
    return int(per_slot * page_size) * jnp.dtype(cfg.dtype).itemsize


def cache_bytes(cfg: ModelConfig, batch: int, length: int, page_size: int = DEFAULT_PAGE_SIZE) -> int:
    """Device bytes of `init_cache(cfg, batch, length)` (keys and values, compressed ones included)."""
    return (batch * cache_slots(length, page_size) // page_size + 1) * page_bytes(cfg, page_size)


def init_pool(cfg: ModelConfig, pages: jax.Array, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE) -> KVCache:
    """An empty pool of `num_pages` pages (the null page included) under page table `pages` [B, R]."""
    paging.check_page_size(page_size, cfg.nsa.block_size if cfg.nsa else None)
    dtype = jnp.dtype(cfg.dtype)
    shape = pool_shape(cfg, num_pages, page_size)
    zeros = lambda shape: jnp.zeros(shape, dtype)
    pages = jnp.asarray(pages, jnp.int32)
    if cfg.nsa is None:
        return KVCache(zeros(shape), zeros(shape), pages, page_size=page_size)
    L, H, N, D = shape
    cmp_shape = (L, H, N // cfg.nsa.block_size, D)
    return KVCache(zeros(shape), zeros(shape), pages, zeros(cmp_shape), zeros(cmp_shape), page_size=page_size)


def init_cache(cfg: ModelConfig, batch: int, length: int, page_size: int = DEFAULT_PAGE_SIZE) -> KVCache:
    """An empty cache with room for `length` positions a row (rounded up to whole pages), each row on
    its own consecutive pages."""
    R = cache_slots(length, page_size) // page_size
    return init_pool(cfg, paging.contiguous_pages(batch, R), batch * R + 1, page_size)
