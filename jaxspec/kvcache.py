"""The KV cache: one stacked array per keys and values, [L, B, Hkv, S, Dh], donated through the loop.

Slots are absolute token positions. A slot is readable once written; which slots are valid is decided
by lengths alone (attention masks keys after the query position), so rejected draft tokens need no
clean-up: verification overwrites them, or they fall beyond the row's length.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig

SLOT_ALIGN = 128  # cache slots are padded to a multiple of this (kernel block sizes divide it)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array
    v: jax.Array

    @property
    def num_slots(self) -> int:
        return self.k.shape[3]

    def write(self, layer: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        """Writes k, v [B, T, Hkv, Dh] of `layer` at slots `positions` [B, T]; out-of-range slots are dropped."""
        B = positions.shape[0]
        rows = jnp.arange(B)[:, None]
        new_k = self.k.at[layer, rows, :, positions].set(k.astype(self.k.dtype), mode="drop")
        new_v = self.v.at[layer, rows, :, positions].set(v.astype(self.v.dtype), mode="drop")
        return KVCache(new_k, new_v)


def cache_slots(length: int) -> int:
    return -(-length // SLOT_ALIGN) * SLOT_ALIGN


def cache_shape(cfg: ModelConfig, batch: int, length: int) -> tuple[int, ...]:
    return (cfg.num_layers, batch, cfg.num_kv_heads, cache_slots(length), cfg.head_dim)


def cache_bytes(cfg: ModelConfig, batch: int, length: int) -> int:
    """Device bytes of `init_cache(cfg, batch, length)` (keys and values)."""
    return 2 * math.prod(cache_shape(cfg, batch, length)) * jnp.dtype(cfg.dtype).itemsize


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
    """An empty cache with room for `length` positions (rounded up to SLOT_ALIGN)."""
    shape = cache_shape(cfg, batch, length)
    dtype = jnp.dtype(cfg.dtype)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
