"""Paged pools for the kernel tests: contiguous caches [L, B, Hkv, S, Dh] scattered into a pool whose
other pages (the null page included) are poisoned, so a kernel that reads a slot it should not, or
through the wrong page, gets values far from the reference's."""
import jax.numpy as jnp
import numpy as np

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
