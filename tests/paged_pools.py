"""Paged pools for the kernel tests: contiguous caches [L, B, Hkv, S, Dh] scattered into a pool whose
other pages (the null page included) are poisoned, so a kernel that reads a slot it should not, or
through the wrong page, gets values far from the reference's."""
import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_kernels import paging

POISON = 3.0e4  # finite (masked slots are multiplied by zero weights), far from any real key or value


def scatter(caches, page_size: int, seed: int, spare: int = 3):
    """(pools, pages): caches [L, B, Hkv, S, Dh] (each S a multiple of page_size) in a pool of their
    B * S / page_size pages plus the null page and `spare` poisoned ones, rows' pages in a random
    order. Several caches (k and v; NSA's compressed stacks with their own page size) take the same
    table: pass page_size per cache as a tuple."""
    sizes = page_size if isinstance(page_size, tuple) else (page_size,) * len(caches)
    L, B, H, S, D = caches[0].shape
    R = S // sizes[0]
    rng = np.random.default_rng(seed)
    order = 1 + rng.permutation(B * R + spare)[: B * R]  # no row gets the null page
    pages = jnp.asarray(order.reshape(B, R), jnp.int32)
    num_pages = B * R + spare + 1
    pools = []
    for cache, size in zip(caches, sizes):
        L, B, H, S, D = cache.shape
        assert S == R * size, (cache.shape, size)
        pool = jnp.full((L, H, num_pages, size, D), POISON, cache.dtype)
        rows = cache.reshape(L, B, H, R, size, D).transpose(0, 2, 1, 3, 4, 5)  # [L, H, B, R, P, D]
        pool = pool.at[:, :, pages].set(rows)
        pools.append(pool.reshape(L, H, num_pages * size, D))
    return pools, pages


def repeated(cache, rows: int):
    """`rows` copies of a dense model's one-row KVCache (its EAGLE-3 head's too), each row on its own
    consecutive pages: a batch of identical rows prefilled once."""
    P, R = cache.page_size, cache.pages.shape[1]

    def pool(x):  # [L, Hkv, N, Dh] -> the null page, then the row's slots `rows` times
        row = paging.logical_view(x, cache.pages, P)[:, 0]  # [L, Hkv, S, Dh]
        return jnp.concatenate([jnp.zeros_like(row[:, :, :P]), jnp.tile(row, (1, 1, rows, 1))], axis=2)

    head = None if cache.head is None else repeated(cache.head, rows)
    return dataclasses.replace(cache, k=pool(cache.k), v=pool(cache.v), pages=paging.contiguous_pages(rows, R),
                               head=head)
