"""The KV cache: one stacked array per keys and values, [L, B, Hkv, S, Dh], donated through the loop.

Slots are absolute token positions. A slot is readable once written; which slots are valid is decided
by lengths alone (attention masks keys after the query position), so rejected draft tokens need no
clean-up: verification overwrites them, or they fall beyond the row's length.

NSA models also keep the compressed keys/values of every block of `block_size` slots,
k_cmp/v_cmp [L, B, Hkv, S / block_size, Dh]: the mean of the block's post-RoPE keys (values). Every
write recomputes the blocks it touched from the slots, so a block's entry always equals the mean of
what its slots last held; a query only reads blocks that end at or before its own position, whose
slots are all correct by then (committed, or written by earlier rows of the same pass). A block that
completes inside a verification window is therefore seen by the later rows of that window, and one
that held rejected drafts is recomputed by the pass that rewrites them.

A run that drafts with an EAGLE-3 head keeps the head's one-layer cache in `head`, so it travels with
the model's through prefill, admission and batch surgery; nothing else here reads or moves it (the
head rewrites its accepted rows itself: `decoding.drafters.eagle`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig

SLOT_ALIGN = 128  # cache slots are padded to a multiple of this (kernel block sizes divide it)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array
    v: jax.Array
    k_cmp: jax.Array | None = None  # NSA only
    v_cmp: jax.Array | None = None
    head: KVCache | None = None  # an EAGLE-3 draft head's own one-layer cache, at the same slots (models.eagle)

    @property
    def num_slots(self) -> int:
        return self.k.shape[3]

    @property
    def block_size(self) -> int:
        """Slots per compressed block (NSA caches only)."""
        return self.num_slots // self.k_cmp.shape[3]

    def written(self, layer: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        """This cache with `k`, `v` (the whole [L, B, Hkv, S, Dh] arrays, `kernels.rope_write`'s) in
        which layer `layer` now holds new entries at slots `positions` [B, T] (past the end: none).

        Positions of a row are consecutive (padding, if any, at the end); an NSA cache then recomputes
        the compressed blocks those slots fall in. (The nodes of one depth of a DFS draft tree are not
        consecutive: their blocks are recomputed by the verification pass, which writes every tree
        slot, before any NSA attention reads them; draft forwards read no compressed blocks.)
        """
        cache = dataclasses.replace(self, k=k, v=v)
        return cache if self.k_cmp is None else cache._refresh_blocks(layer, positions[:, 0], positions.shape[1])

    def move(self, src: jax.Array, dst: jax.Array) -> KVCache:
        """Copies slots src [B, n] to slots dst [B, n] (consecutive) in every layer; an NSA cache then
        recomputes the compressed blocks of dst (a draft tree's accepted path moving into place)."""
        rows = jnp.arange(src.shape[0])[:, None]
        moved = lambda x: x.at[:, rows, :, dst].set(x[:, rows, :, src])
        cache = dataclasses.replace(self, k=moved(self.k), v=moved(self.v))
        if self.k_cmp is None:
            return cache
        refresh = lambda layer, c: c._refresh_blocks(layer, dst[:, 0], dst.shape[1])
        return jax.lax.fori_loop(0, self.k.shape[0], refresh, cache)

    def _refresh_blocks(self, layer: jax.Array, first: jax.Array, num_rows: int) -> KVCache:
        """Recomputes the compressed entries of the blocks holding slots first[b] .. first[b] + num_rows - 1."""
        bs, num_blocks = self.block_size, self.k_cmp.shape[3]
        count = min((num_rows - 1) // bs + 2, num_blocks)
        blocks = first[:, None] // bs + jnp.arange(count, dtype=jnp.int32)  # [B, n]; past the end: dropped
        slots = jnp.minimum(blocks[..., None] * bs + jnp.arange(bs, dtype=jnp.int32), self.num_slots - 1)
        rows = jnp.arange(first.shape[0])[:, None, None]

        def pooled(cache):  # [L, B, Hkv, S, Dh] -> [B, n, Hkv, Dh]: means of the blocks' slots
            x = cache[layer, rows, :, slots]  # one gather: [B, n, bs, Hkv, Dh]
            return jnp.mean(x.astype(jnp.float32), axis=2)

        at = (layer, jnp.arange(first.shape[0])[:, None], slice(None), blocks)
        k_cmp = self.k_cmp.at[at].set(pooled(self.k).astype(self.k_cmp.dtype), mode="drop")
        v_cmp = self.v_cmp.at[at].set(pooled(self.v).astype(self.v_cmp.dtype), mode="drop")
        return dataclasses.replace(self, k_cmp=k_cmp, v_cmp=v_cmp)


def cache_slots(length: int) -> int:
    return -(-length // SLOT_ALIGN) * SLOT_ALIGN


def cache_shape(cfg: ModelConfig, batch: int, length: int) -> tuple[int, ...]:
    return (cfg.num_layers, batch, cfg.num_kv_heads, cache_slots(length), cfg.head_dim)


def compressed_shape(cfg: ModelConfig, batch: int, length: int) -> tuple[int, ...]:
    L, B, H, S, D = cache_shape(cfg, batch, length)
    return (L, B, H, S // cfg.nsa.block_size, D)


def cache_bytes(cfg: ModelConfig, batch: int, length: int) -> int:
    """Device bytes of `init_cache(cfg, batch, length)` (keys and values, compressed ones included)."""
    shapes = [cache_shape(cfg, batch, length)] + ([compressed_shape(cfg, batch, length)] if cfg.nsa else [])
    return sum(2 * math.prod(s) for s in shapes) * jnp.dtype(cfg.dtype).itemsize


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
    """An empty cache with room for `length` positions (rounded up to SLOT_ALIGN)."""
    dtype = jnp.dtype(cfg.dtype)
    zeros = lambda shape: jnp.zeros(shape, dtype)
    shape = cache_shape(cfg, batch, length)
    if cfg.nsa is None:
        return KVCache(zeros(shape), zeros(shape))
    cmp_shape = compressed_shape(cfg, batch, length)
    return KVCache(zeros(shape), zeros(shape), zeros(cmp_shape), zeros(cmp_shape))
